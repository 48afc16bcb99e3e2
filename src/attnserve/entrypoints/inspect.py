"""``attnserve inspect``: a model's mechanism, KV memory and backend choice, without weights.

Reads the ``config.json``, asks ``engine/plan.py`` for the engine's plan (the cache groups, the
backend of every layer with the reasons for the ones passed over, the kernel variant of every
operation a decode, prefill or mixed step launches with the reasons for the ones passed over,
the bytes per token and per sequence) and renders it as a table, as JSON, or as a plot of KV
memory against context length. It groups nothing and selects no backend itself: what it shows is what the engine
builds with the same options on the same platform. Two memory questions: ``--memory GiB`` (a
KV-cache budget: how many tokens and sequences it holds) and ``--device-memory GiB`` (a whole
device: its ``gpu_memory_utilization`` share less the weights, computed from the config with
``weight_footprint.py``, is what the KV cache gets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnserve.arch import LayerKind, MLADims, ModelArch, load_hf_config, read_arch
from attnserve.config import USAGE_CONTEXTS, EngineConfig, SchedulerConfig
from attnserve.engine.batch_limits import LARGE_GPU_GIB, BatchLimits, resolve_batch_limits
from attnserve.engine.plan import EnginePlan, plan_engine
from attnserve.platforms import Platform
from attnserve.presets import resolve_config_path

if TYPE_CHECKING:
    from attnserve.entrypoints.weight_footprint import WeightFootprint

__all__ = ["DeviceFit", "InspectReport", "KernelRow", "LayerGroupRow", "build_report", "parse_gib", "plot_kv_memory"]

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class LayerGroupRow:
    kind: str
    num_layers: int
    layer_ids: tuple[int, ...]
    bytes_per_token_per_layer: int
    components: tuple[tuple[str, int], ...]  # (latent, 656), (indexer, 132) ...
    state_bytes_per_sequence_per_layer: int
    window: int | None
    backend: str
    passed_over: tuple[tuple[str, tuple[str, ...]], ...]
    offload: str


@dataclass(frozen=True, slots=True)
class KernelRow:
    """The kernel choices of one backend over some layers (or of the model's own operations)."""

    kind: str  # a layer kind, or "model"
    layer_ids: tuple[int, ...]
    backend: str  # or "model"
    # (operation, chosen variant, the step kinds that launch it, passed over: (name, reasons)...)
    choices: tuple[tuple[str, str, tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]], ...]
    errors: tuple[str, ...] = ()  # operations no variant serves

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "layers": list(self.layer_ids), "backend": self.backend,
                "operations": [{"op": op, "variant": variant, "steps": list(steps),
                                "passed_over": {n: list(rs) for n, rs in passed}}
                               for op, variant, steps, passed in self.choices],
                "errors": list(self.errors)}


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """A whole device: what is left for the KV cache once the weights are loaded."""

    memory_bytes: int
    gpu_memory_utilization: float
    weights: WeightFootprint

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.gpu_memory_utilization)

    def kv_bytes(self, weight_bytes: int | None = None) -> int:
        """Bytes left for the KV cache after ``weight_bytes`` (default: as the engine loads them)."""
        weight_bytes = self.weights.loaded_bytes if weight_bytes is None else weight_bytes
        return max(self.usable_bytes - weight_bytes, 0)

    @property
    def weights_fit(self) -> bool:
        return self.weights.loaded_bytes < self.usable_bytes


@dataclass(slots=True)
class InspectReport:
    name: str
    arch: ModelArch
    platform: Platform
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    rows: list[LayerGroupRow]
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    bytes_per_sequence: int  # one sequence of max_model_len, windows and states included
    bytes_per_sequence_no_window: int  # the same with every sliding layer at its full rate
    memory_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1  # > 1: every byte figure is one rank's
    # sparse MLA (DSA) only: per token, what stays on the device with --kv-offload-sparse-latents
    # (indexer keys) and what goes to host memory (latent rows); None for other models
    host_latent_bytes_per_token: int | None = None
    device: DeviceFit | None = None  # --device-memory: the whole device's answer
    # the batch limits' platform defaults, per usage context (and per GPU class when the GPU's
    # memory is unknown), as the engine resolves them (engine/batch_limits.py)
    batch_limits: list[tuple[str, BatchLimits]] = field(default_factory=list)
    kernels: list[KernelRow] = field(default_factory=list)  # per backend and layers, then the model's
    disabled_kernels: tuple[str, ...] = ()
    dtype_reason: str = ""  # why this dtype (engine/plan.resolve_dtype: on CPU, the CPU's flags)

    def tokens_in(self, kv_bytes: int) -> int:
        """Tokens whose KV fits in ``kv_bytes`` (sliding layers at their full rate, no state)."""
        return kv_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

    def sequences_in(self, kv_bytes: int) -> int:
        """Sequences of ``max_model_len`` tokens (states included) that fit in ``kv_bytes``."""
        return kv_bytes // self.bytes_per_sequence if self.bytes_per_sequence else 0

    @property
    def device_bytes_per_token_host_latents(self) -> int | None:
        if self.host_latent_bytes_per_token is None:
            return None
        return self.kv_bytes_per_token - self.host_latent_bytes_per_token

    @property
    def max_tokens_host_latents(self) -> int | None:
        """Tokens whose device-resident KV fits in ``memory`` with host-resident latents."""
        device = self.device_bytes_per_token_host_latents
        if self.memory_bytes is None or not device:
            return None
        return self.memory_bytes // device

    @property
    def max_tokens(self) -> int | None:
        """Tokens whose KV fits in ``memory`` (sliding layers at their full rate, no state)."""
        if self.memory_bytes is None:
            return None
        return self.memory_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else None

    @property
    def max_sequences(self) -> int | None:
        """Sequences of ``max_model_len`` tokens that fit at once."""
        if self.memory_bytes is None or not self.bytes_per_sequence:
            return None
        return self.memory_bytes // self.bytes_per_sequence

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.name,
            "model_type": self.arch.model_type,
            "mechanism": self.arch.mechanism.value,
            "attention_mechanism": self.arch.attention_mechanism.value,
            "num_layers": self.arch.num_layers,
            "dtype": self.dtype,
            "dtype_reason": self.dtype_reason,
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": self.block_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "platform": self.platform.name,
            "compute_capability": list(self.platform.compute_capability) if self.platform.compute_capability else None,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "max_model_len": self.max_model_len,
            "bytes_per_sequence": self.bytes_per_sequence,
            "bytes_per_sequence_without_windows": self.bytes_per_sequence_no_window,
            "layer_groups": [
                {"kind": r.kind, "num_layers": r.num_layers, "layers": list(r.layer_ids),
                 "bytes_per_token_per_layer": r.bytes_per_token_per_layer,
                 "components": dict(r.components),
                 "state_bytes_per_sequence_per_layer": r.state_bytes_per_sequence_per_layer,
                 "window": r.window, "backend": r.backend,
                 "passed_over": {n: list(reasons) for n, reasons in r.passed_over},
                 "offload": r.offload}
                for r in self.rows
            ],
            "offloadable": sorted({r.kind for r in self.rows}),
            "kernels": [k.to_json() for k in self.kernels],
            "disabled_kernels": list(self.disabled_kernels),
            "batch_limits": [{"usage_context": usage, "max_num_seqs": b.max_num_seqs,
                              "max_num_batched_tokens": b.max_num_batched_tokens,
                              "max_num_seqs_reason": b.seqs_reason, "max_num_batched_tokens_reason": b.tokens_reason}
                             for usage, b in self.batch_limits],
            "notes": self.notes,
        }
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
            out["max_tokens"] = self.max_tokens
            out["max_sequences"] = self.max_sequences
        if self.device is not None:
            out["device"] = self._device_json(self.device)
        if self.host_latent_bytes_per_token is not None:
            out["sparse_latent_offload"] = {
                "device_bytes_per_token": self.device_bytes_per_token_host_latents,
                "host_bytes_per_token": self.host_latent_bytes_per_token,
                "max_tokens": self.max_tokens_host_latents,
            }
        return out

    def _device_json(self, d: DeviceFit) -> dict[str, Any]:
        w = d.weights
        out = {"memory_bytes": d.memory_bytes, "gpu_memory_utilization": d.gpu_memory_utilization,
               "usable_bytes": d.usable_bytes, "num_parameters": w.num_parameters,
               "weight_dtype": w.dtype, "weight_bytes": w.loaded_bytes,
               "checkpoint_weight_bytes": w.checkpoint_bytes, "quantization": w.quantization,
               "weights_sharded": w.sharded, "weights_fit": d.weights_fit, "kv_cache_bytes": d.kv_bytes(),
               "max_tokens": self.tokens_in(d.kv_bytes()), "max_sequences": self.sequences_in(d.kv_bytes())}
        if w.checkpoint_bytes != w.loaded_bytes:  # as an engine keeping the weights quantised would
            kv = d.kv_bytes(w.checkpoint_bytes)
            out["with_checkpoint_weights"] = {"weights_fit": w.checkpoint_bytes < d.usable_bytes,
                                              "kv_cache_bytes": kv, "max_tokens": self.tokens_in(kv),
                                              "max_sequences": self.sequences_in(kv)}
        return out

    def _render_device(self, d: DeviceFit) -> list[str]:
        w = d.weights
        lines = [f"On a device of {_size(d.memory_bytes)} at gpu_memory_utilization {d.gpu_memory_utilization:g}: "
                 f"{_size(d.usable_bytes)} for the engine"
                 + (" (per rank)" if self.tensor_parallel_size > 1 else "")]
        held = f"weights: {w.num_parameters / 1e9:,.2f}B parameters, {_size(w.loaded_bytes)} in {w.dtype}"
        if w.quantization:
            held += (f" as attnserve holds them (the {w.quantization} checkpoint stores "
                     f"{_size(w.checkpoint_bytes)}; attnserve dequantises it when loading)")
        if not w.sharded:
            held += f" (an even 1/{self.tensor_parallel_size} share: tensor parallelism has no plan for it)"
        lines.append("  " + held)
        if not d.weights_fit:
            lines.append(f"  the weights alone ({_size(w.loaded_bytes)}) do not fit in {_size(d.usable_bytes)}: "
                         "no room for a KV cache")
        else:
            kv = d.kv_bytes()
            lines.append(f"  KV cache: {_size(kv)} after the weights: {_num(self.tokens_in(kv))} tokens; "
                         f"{_num(self.sequences_in(kv))} sequences of {_num(self.max_model_len)} tokens at once")
        if w.checkpoint_bytes != w.loaded_bytes:
            kv = d.kv_bytes(w.checkpoint_bytes)
            lines.append(f"  with the weights kept at their {_size(w.checkpoint_bytes)} (an engine with "
                         f"{w.quantization} kernels): " + (f"{_num(self.tokens_in(kv))} tokens" if kv else
                                                           "they do not fit either"))
        lines.append("  (the engine also keeps room for the largest step's activations and CUDA graphs, "
                     "measured when it starts)")
        return lines

    def render(self) -> str:
        a = self.arch
        lines = [f"{self.name}  ({a.model_type})",
                 f"mechanism {a.mechanism.value}" + (f" (attention layers: {a.attention_mechanism.value})"
                                                     if a.mechanism.value == "HYBRID" else "")
                 + f" · {a.num_layers} layers · dtype {self.dtype} · kv cache {self.kv_cache_dtype}"
                 + f" · block size {self.block_size} · platform {self.platform.label}"
                 + (f" · tensor parallel {self.tensor_parallel_size} (per-rank figures)"
                    if self.tensor_parallel_size > 1 else "")]
        lines += [f"dtype {self.dtype}: {self.dtype_reason}"] if self.dtype_reason else []
        lines.append("")
        header = ("kind", "layers", "B/token/layer", "state B/seq/layer", "window", "backend")
        table = [header] + [
            (r.kind, str(r.num_layers), _components(r),
             _num(r.state_bytes_per_sequence_per_layer) if r.state_bytes_per_sequence_per_layer else "-",
             str(r.window) if r.window else "-", r.backend) for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for i, row in enumerate(table):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += ["", f"KV cache per token: {_num(self.kv_bytes_per_token)} B ({_size(self.kv_bytes_per_token)})"
                  " over all layers (sliding layers counted at their full rate)"]
        if self.state_bytes_per_sequence:
            lines.append(f"State per sequence: {_num(self.state_bytes_per_sequence)} B "
                         f"({_size(self.state_bytes_per_sequence)}), whatever its length")
        line = f"One sequence of {_num(self.max_model_len)} tokens: {_size(self.bytes_per_sequence)}"
        if self.bytes_per_sequence < self.bytes_per_sequence_no_window:
            saved = 1 - self.bytes_per_sequence / self.bytes_per_sequence_no_window
            line += (f" (sliding layers keep only their window: {saved:.0%} less than "
                     f"{_size(self.bytes_per_sequence_no_window)} without)")
        lines.append(line)
        if self.memory_bytes is not None:
            lines.append(f"In {_size(self.memory_bytes)}: {_num(self.max_tokens)} tokens of KV cache; "
                         f"{_num(self.max_sequences)} sequences of {_num(self.max_model_len)} tokens at once")
        if self.device is not None:
            lines += self._render_device(self.device)
        device = self.device_bytes_per_token_host_latents
        if device is not None:
            host = self.host_latent_bytes_per_token or 0
            lines.append(f"With --kv-offload-sparse-latents: {_num(device)} B per token on the device "
                         f"(indexer keys; {self.kv_bytes_per_token / max(device, 1):.1f}x the tokens per "
                         f"device byte), {_num(host)} B of latent rows in host memory")
            if self.max_tokens_host_latents is not None:
                lines.append(f"  in {_size(self.memory_bytes or 0)} of device memory: "
                             f"{_num(self.max_tokens_host_latents)} tokens, with "
                             f"{_size(self.max_tokens_host_latents * host)} of host memory")
        lines += ["", "Backends:"]
        for r in self.rows:
            why = "; ".join(f"{n}: {', '.join(rs)}" for n, rs in r.passed_over)
            lines.append(f"  {r.kind}: {r.backend}" + (f"  (passed over {why})" if why else
                                                          "  (first choice on this platform)"))
        lines += ["", "Kernels (each operation's variant and the steps that launch it; --disabled-kernels "
                      "turns a variant off):"]
        for k in self.kernels:
            layers = f" ({_layer_span(k.layer_ids)})" if k.layer_ids else ""
            lines.append(f"  {k.kind}{layers}, {k.backend}:" if k.backend != "model" else "  the model's own layers:")
            for op, variant, steps, passed in k.choices:
                why = "; ".join(f"{n}: {', '.join(rs)}" for n, rs in passed)
                lines.append(f"    {op} -> {variant} [{', '.join(steps)}]" + (f"  (passed over {why})" if why else ""))
            lines += [f"    error: {e}" for e in k.errors]
        if self.batch_limits:
            lines += ["", "Batch limits (--max-num-seqs, --max-num-batched-tokens override them; the engine caps a "
                          "default max_num_seqs by its state slots and KV blocks, and logs it):"]
            lines += [f"  {b.describe()}" for _, b in self.batch_limits]
        lines += ["", "Offload (what the offload tier can hold):"]
        for r in self.rows:
            lines.append(f"  {r.kind}: {r.offload}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _layer_span(ids: tuple[int, ...]) -> str:
    if len(ids) == 1:
        return f"layer {ids[0]}"
    if list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"layers {ids[0]}-{ids[-1]}"
    return f"{len(ids)} layers"


def _kernel_choices(steps) -> tuple[tuple, tuple[str, ...]]:
    """(operation, variant, step kinds, passed over) per operation, and the errors."""
    order: dict[str, list] = {}
    errors = []
    for kind, choices in steps:
        for c in choices:
            if c.op not in order:
                order[c.op] = [c, []]
                if c.error:
                    errors.append(c.error)
            order[c.op][1].append(kind)
    return tuple((op, c.variant, tuple(kinds), c.passed_over) for op, (c, kinds) in order.items()), tuple(errors)


def _kernel_rows(plan: EnginePlan) -> list[KernelRow]:
    """The plan's kernel choices: one row per layer kind, backend and choices, then the model's."""
    keyed: dict[tuple, list[int]] = {}
    for g in plan.groups:
        if not g.kernels:
            continue
        layers = sorted({e.layer for e in g.group.entries})
        kind = plan.rank_arch.layers[layers[0]].kind.value
        choices, errors = _kernel_choices(g.kernels)
        keyed.setdefault((kind, g.choices[0].name, choices, errors), []).extend(layers)
    rows = [KernelRow(kind, tuple(sorted(set(ids))), backend, choices, errors)
            for (kind, backend, choices, errors), ids in keyed.items()]
    choices, errors = _kernel_choices(plan.model_kernels)
    return rows + [KernelRow("model", (), "model", choices, errors)]


def _num(n: int | None) -> str:
    """A count with thousands separators; 0 (or None: nothing fits) prints as 0, never blank."""
    return f"{n or 0:,}"


def _size(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _components(r: LayerGroupRow) -> str:
    if r.bytes_per_token_per_layer == 0:
        return "-"
    total = _num(r.bytes_per_token_per_layer)
    if len(r.components) > 1:
        return total + " (" + " + ".join(f"{n} {_num(b)}" for n, b in r.components) + ")"
    return total


_OFFLOAD = {"full": "prefix blocks", "sliding": "prefix blocks (a hit loads back only the window before its end)",
            "mla": "latent rows (prefix blocks)", "sparse_mla": "latent rows and indexer keys (prefix blocks)",
            "state": "state snapshots at block boundaries"}


def _rows(plan: EnginePlan) -> list[LayerGroupRow]:
    """The plan's layers, one row per kind, cache, window and backend choice."""
    own: dict[int, list] = {}
    for e in plan.entries:
        own.setdefault(e.layer, []).append(e)
    keyed: dict[tuple, list[int]] = {}
    for spec, layer in zip(plan.rank_arch.layers, plan.layers, strict=True):
        entries = own.get(spec.index, [])
        comps = tuple((e.name, e.spec.bytes_per_token) for e in entries if e.spec.bytes_per_token)
        state = sum(e.spec.bytes_per_sequence for e in entries)
        key = (spec.kind, comps, state, spec.window, layer.backend.name, layer.backend.passed_over)
        keyed.setdefault(key, []).append(spec.index)
    rows = []
    for (kind, comps, state, window, backend, passed_over), ids in keyed.items():
        policy = "state" if kind.is_state else kind.value if kind.is_mla else ("sliding" if window else "full")
        rows.append(LayerGroupRow(kind=kind.value, num_layers=len(ids), layer_ids=tuple(ids),
                                  bytes_per_token_per_layer=sum(b for _, b in comps), components=comps,
                                  state_bytes_per_sequence_per_layer=state, window=window, backend=backend,
                                  passed_over=passed_over, offload=_OFFLOAD[policy]))
    return rows


def _notes(arch: ModelArch, use_mla: bool) -> list[str]:
    notes = []
    if not use_mla and arch.is_mla:
        notes.append("MLA disabled: sparse-MLA layers keep their latent cache")
    if any(s.kind is LayerKind.NSA for s in arch.layers):
        notes.append("NSA layers cache their K/V only (selection, the window and the compressed branch read "
                     "it); TORCH_NSA mean-pools the complete blocks again every step, where caching them "
                     "would add 1/block_size of the K/V")
    notes.append("--kv-offloading-size GiB (host memory) or --kv-offloading-backend disk keeps evicted "
                 "prefix blocks (and state snapshots) for reuse; the offload column says what each holds")
    return notes


def parse_gib(value: str) -> float:
    """A memory size in GiB: ``80``, ``80GiB``, ``80G`` (GiB) or ``80GB`` (10**9 bytes)."""
    text = str(value).strip()
    units = (("gib", 1.0), ("gb", 1e9 / GIB), ("g", 1.0))
    scale = 1.0
    for suffix, factor in units:
        if text.lower().endswith(suffix):
            text, scale = text[: -len(suffix)].strip(), factor
            break
    try:
        gib = float(text) * scale
    except ValueError:
        raise ValueError(f"'{value}' is not a memory size (e.g. 80, 80GiB, 80GB)") from None
    if not gib > 0:
        raise ValueError(f"a memory size must be positive, got '{value}'")
    return gib


def _config_path(model: str, revision: str | None) -> tuple[Path, bool]:
    """(config path, whether it came from the hub): a local or shipped config (``presets``),
    else a Hugging Face model id's ``config.json``, cached or downloaded."""
    from attnserve.hub import is_hub_id, resolve_hub_file

    try:
        return resolve_config_path(model), False
    except FileNotFoundError:
        if not is_hub_id(model):
            raise
    return resolve_hub_file(model, "config.json", revision), True


def build_report(model: str, platform: Platform, *, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 attention_backend: str | None = None, memory_gib: float | None = None,
                 max_model_len: int | None = None, block_size: int | None = None, use_mla: bool = True,
                 tensor_parallel_size: int = 1, device_memory_gib: float | None = None,
                 gpu_memory_utilization: float = 0.9, revision: str | None = None,
                 disabled_kernels: tuple[str, ...] | str = ()) -> InspectReport:
    """The engine's plan for ``model`` with these options, ready to render.

    ``device_memory_gib``: also answer for a whole device of that size: its
    ``gpu_memory_utilization`` share, less the weights (computed from the config), holds the KV
    cache. ``model`` may be a Hugging Face id whose ``config.json`` is cached or downloadable.

    Raises BackendSelectionError when ``attention_backend`` does not fit, with every reason of
    every layer, and ValueError when the heads do not split over ``tensor_parallel_size`` ranks
    (whose per-rank KV bytes, state and sequences the report then gives) or a
    ``disabled_kernels`` entry names no kernel variant."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    path, hub = _config_path(model, revision)
    arch = read_arch(load_hf_config(path), use_mla=use_mla)
    config = EngineConfig.from_kwargs(
        str(path.parent), dtype=dtype, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
        max_model_len=max_model_len or None, block_size=block_size, tensor_parallel_size=tensor_parallel_size,
        disabled_kernels=disabled_kernels)
    plan = plan_engine(arch, config, platform)
    plan.check_forced()
    notes = _notes(arch, use_mla)
    return InspectReport(
        name=model if hub else path.stem.replace("__", "/") if path.name != "config.json" else str(path.parent),
        arch=arch, platform=platform, dtype=plan.dtype, kv_cache_dtype=plan.kv_cache_dtype,
        block_size=plan.block_size, max_model_len=plan.max_model_len, rows=_rows(plan),
        kv_bytes_per_token=plan.kv_bytes_per_token, state_bytes_per_sequence=plan.state_bytes_per_sequence,
        bytes_per_sequence=plan.bytes_per_sequence, bytes_per_sequence_no_window=plan.bytes_per_sequence_no_window,
        memory_bytes=int(memory_gib * GIB) if memory_gib is not None else None, notes=notes,
        tensor_parallel_size=plan.tensor_parallel_size,
        host_latent_bytes_per_token=plan.host_latent_bytes_per_token,
        device=_device_fit(arch, plan, device_memory_gib, gpu_memory_utilization, notes),
        batch_limits=_batch_limits(platform, device_memory_gib, plan.max_model_len),
        kernels=_kernel_rows(plan), disabled_kernels=config.cache.disabled_kernels, dtype_reason=plan.dtype_reason)


def _batch_limits(platform: Platform, device_memory_gib: float | None, max_model_len: int
                  ) -> list[tuple[str, BatchLimits]]:
    """The defaults for each usage context on ``platform``: for a GPU of ``device_memory_gib``,
    else of this machine's GPU, else for both GPU classes."""
    memories: list[int | None] = [None]
    if platform.device_type == "cuda":
        if device_memory_gib is not None:
            memories = [int(device_memory_gib * GIB)]
        else:
            import torch

            here = torch.cuda.is_available() and (platform.name == "rocm") == bool(getattr(torch.version, "hip", None))
            memories = [torch.cuda.get_device_properties(0).total_memory] if here else [LARGE_GPU_GIB * GIB, None]
    return [(usage, resolve_batch_limits(SchedulerConfig(), platform.device_type, memory, usage, max_model_len))
            for memory in memories for usage in USAGE_CONTEXTS]


def _device_fit(arch: ModelArch, plan: EnginePlan, memory_gib: float | None, utilization: float,
                notes: list[str]) -> DeviceFit | None:
    """The whole-device answer; None (with a note) when the weights cannot be counted."""
    if memory_gib is None:
        return None
    from attnserve.entrypoints.weight_footprint import weight_footprint  # builds on the meta device

    try:
        weights = weight_footprint(arch, plan.dtype, plan.tensor_parallel_size)
    except ValueError as e:  # a family attnserve does not build, a quantisation it does not load
        notes.append(f"--device-memory: the weights cannot be counted ({e})")
        return None
    return DeviceFit(int(memory_gib * GIB), utilization, weights)


# --- the plot -----------------------------------------------------------------------------

def _as_variant(arch: ModelArch, variant: str) -> ModelArch | None:
    """The same model with another attention mechanism, for the memory comparison."""
    heads = arch.num_heads
    layers = []
    for s in arch.layers:
        if not s.kind.is_attention:
            layers.append(s)
            continue
        hd, hv = s.head_size, s.head_size_v
        kind = LayerKind.SLIDING if s.window else LayerKind.FULL
        if variant == "MHA":
            layers.append(replace(s, kind=kind, num_kv_heads=s.num_heads, indexer=None))
        elif variant == "GQA":
            if heads <= 8 or heads % 8:
                return None
            layers.append(replace(s, kind=kind, num_kv_heads=8, indexer=None))
        elif variant == "MQA":
            layers.append(replace(s, kind=kind, num_kv_heads=1, indexer=None))
        elif variant == "MLA":
            layers.append(replace(s, kind=LayerKind.MLA, window=None, indexer=None,
                                  mla=MLADims(None, 512, hd, 64, hv)))
        else:
            raise ValueError(variant)
    return replace(arch, layers=tuple(layers))


def plot_kv_memory(report: InspectReport, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'attnserve[plot]'") from e
    arch = report.arch
    config = EngineConfig.from_kwargs(report.name, dtype=report.dtype, kv_cache_dtype=report.kv_cache_dtype,
                                      block_size=report.block_size)
    max_len = max(report.max_model_len, 1024)
    xs = []
    n = 1024
    while n < max_len:
        xs.append(n)
        n *= 2
    xs.append(max_len)
    own = arch.attention_mechanism.value
    curves = {f"as configured ({arch.mechanism.value})": arch}
    for variant in ("MHA", "GQA", "MQA", "MLA"):
        if variant == own or (variant == "MLA" and arch.is_mla):
            continue
        v = _as_variant(arch, variant)
        if v is not None:
            curves[f"as {variant}" + (" (8 KV heads)" if variant == "GQA" else "")] = v
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, a in curves.items():
        plan = plan_engine(a, config, report.platform)  # the bytes only: no backend is asked to fit
        ax.plot(xs, [plan.sequence_bytes(x) / GIB for x in xs], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KV cache per sequence (GiB, {report.kv_cache_dtype})")
    ax.set_title(f"{report.name}: KV memory by attention mechanism")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def dumps(report: InspectReport) -> str:
    return json.dumps(report.to_json(), indent=2)
