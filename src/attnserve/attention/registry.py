"""Backend names -> capabilities and lazy implementations; selection with a manual override.

Selection walks the platform's priority list for a layer kind and takes the first backend
whose validation returns no reasons. A backend named by the user that does not fit is a hard
error listing every reason. Implementations are imported only when selected, so a backend
built on a missing library costs nothing and says "library ... is not installed".
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from attnserve import env
from attnserve.arch import LayerKind
from attnserve.attention.backend import AttentionBackend, BackendRequest, Capabilities
from attnserve.platforms.base import Platform

__all__ = [
    "BackendEntry",
    "BackendSelectionError",
    "Selection",
    "get_entry",
    "is_implemented",
    "list_backends",
    "override_for",
    "rank_backends",
    "load_backend",
    "register",
    "select_backend",
    "validate",
]


class BackendSelectionError(ValueError):
    def __init__(self, message: str, reasons: tuple[str, ...] = ()):
        super().__init__(message if not reasons else message + ":\n  - " + "\n  - ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True, slots=True)
class BackendEntry:
    name: str
    capabilities: Capabilities
    impl: str | None  # "module:Class"; a module that does not exist yet means "not implemented"
    description: str = ""
    # the kernel operations (attention/kernels.py) a step of each kind launches: "decode" and
    # "prefill"; a mixed step launches both lists
    operations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def operations_for(self, step_kind: str) -> tuple[str, ...]:
        """The operations a step of ``step_kind`` (decode, prefill, mixed) launches, in order."""
        if step_kind == "mixed":
            return tuple(dict.fromkeys((*self.operations.get("decode", ()), *self.operations.get("prefill", ()))))
        if step_kind not in ("decode", "prefill"):
            raise ValueError(f"step kind must be decode, prefill or mixed, got {step_kind!r}")
        return tuple(self.operations.get(step_kind, ()))


@dataclass(frozen=True, slots=True)
class Selection:
    name: str
    passed_over: tuple[tuple[str, tuple[str, ...]], ...] = ()  # higher-priority names and why
    forced: bool = False


_REGISTRY: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> None:
    if entry.name in _REGISTRY:
        raise ValueError(f"backend {entry.name} is registered twice")
    if entry.name != entry.name.upper():
        raise ValueError(f"backend names are upper-case, got {entry.name}")
    _REGISTRY[entry.name] = entry


def list_backends() -> tuple[BackendEntry, ...]:
    return tuple(_REGISTRY.values())


def get_entry(name: str) -> BackendEntry:
    entry = _REGISTRY.get(name.upper())
    if entry is None:
        raise BackendSelectionError(f"unknown attention backend '{name}' (known: {', '.join(sorted(_REGISTRY))})")
    return entry


def load_backend(name: str) -> type[AttentionBackend]:
    entry = get_entry(name)
    if not is_implemented(entry):
        raise BackendSelectionError(f"backend {entry.name} is not implemented yet")
    module, _, cls = entry.impl.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ImportError(f"backend {entry.name} needs {', '.join(entry.capabilities.requires) or module}: {e}") from e


def _fmt_cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def validate(entry: BackendEntry, req: BackendRequest, platform: Platform) -> list[str]:
    """Every reason ``entry`` cannot serve ``req`` on ``platform``; empty when it fits."""
    caps = entry.capabilities
    reasons: list[str] = []
    if req.kind not in caps.layer_kinds:
        kinds = ", ".join(sorted(k.value for k in caps.layer_kinds))
        reasons.append(f"does not handle {req.kind.value} layers (handles {kinds})")
    # Triton kernels also run on CPU tensors under the interpreter (tests, debugging)
    interpreted = platform.name == "cpu" and "triton" in caps.requires and env.triton_interpret()
    if platform.name not in caps.platforms and not interpreted:
        reasons.append(f"runs on {', '.join(caps.platforms)}, not on {platform.name}")
    elif platform.name in caps.platforms:
        min_cc = caps.platforms[platform.name]
        cc = platform.compute_capability
        if min_cc is not None and cc is not None and cc < min_cc:
            reasons.append(f"needs compute capability >= {_fmt_cc(min_cc)}, the device has {_fmt_cc(cc)}")
    if req.dtype not in caps.dtypes:
        reasons.append(f"does not support dtype {req.dtype} (supports {', '.join(sorted(caps.dtypes))})")
    if req.kv_cache_dtype not in caps.kv_cache_dtypes:
        reasons.append(f"does not support kv_cache_dtype {req.kv_cache_dtype} "
                       f"(supports {', '.join(sorted(caps.kv_cache_dtypes))})")
    if caps.head_sizes is not None and req.head_size not in caps.head_sizes:
        sizes = ", ".join(str(s) for s in sorted(caps.head_sizes))
        reasons.append(f"does not support head size {req.head_size} (supports {sizes})")
    if req.block_size % caps.block_size_multiple:
        reasons.append(f"needs a block size that is a multiple of {caps.block_size_multiple}, got {req.block_size}")
    for feature in sorted(req.features - caps.features):
        reasons.append(f"does not support {feature.replace('_', ' ')}")
    for module in caps.requires:
        if importlib.util.find_spec(module) is None:
            reasons.append(f"library '{module}' is not installed")
    if not is_implemented(entry):
        reasons.append("not implemented yet in this version of attnserve")
    return reasons


def is_implemented(entry: BackendEntry) -> bool:
    """True when the entry's implementation module exists (it is not imported here)."""
    if entry.impl is None:
        return False
    module = entry.impl.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def override_for(override: str | None, kind: LayerKind, model_kinds: Collection[LayerKind]) -> str | None:
    """The user's ``attention_backend`` where it applies to layers of ``kind``, else None.

    A backend of state layers only (TRITON_GDN, ...) applies to the layers it handles when the
    model has some; any other name applies to every attention layer (and fails there when it
    cannot run them), so a choice that fits no layer of the model is an error, not ignored.
    """
    if not override:
        return None
    handled = get_entry(override).capabilities.layer_kinds
    if all(k.is_state for k in handled) and not handled.isdisjoint(model_kinds):
        return override if kind in handled else None
    return override if kind.is_attention else None


def select_backend(req: BackendRequest, platform: Platform, override: str | None = None) -> Selection:
    """The backend for one layer group: the user's choice if it fits, else the first that fits.

    Raises:
        BackendSelectionError: the named backend does not fit (with every reason), or none does.
    """
    if override:
        entry = get_entry(override)
        reasons = validate(entry, req, platform)
        if reasons:
            raise BackendSelectionError(
                f"attention backend {entry.name} cannot run {req.kind.value} layers "
                f"(head size {req.head_size}, {req.dtype}, kv cache {req.kv_cache_dtype}) on {platform.label}",
                tuple(reasons))
        return Selection(entry.name, forced=True)
    passed: list[tuple[str, tuple[str, ...]]] = []
    for name, reasons in rank_backends(req, platform):
        if not reasons:
            return Selection(name, tuple(passed))
        passed.append((name, reasons))
    details = tuple(f"{n}: {'; '.join(r)}" for n, r in passed) or (f"no backend is listed for {req.kind.value}",)
    raise BackendSelectionError(f"no attention backend can run {req.kind.value} layers on {platform.label}", details)


def rank_backends(req: BackendRequest, platform: Platform) -> list[tuple[str, tuple[str, ...]]]:
    """The platform's backends for ``req.kind`` in priority order, each with why it does not fit."""
    return [(name, tuple(validate(get_entry(name), req, platform))) for name in platform.backend_priority(req.kind)]


# --- the table --------------------------------------------------------------------------
_FLOAT = frozenset({"float32", "bfloat16", "float16"})
_HALF = frozenset({"bfloat16", "float16"})
_ALL_FEATURES = frozenset({"sliding_window", "alibi", "sinks", "softcap"})
_STANDARD = frozenset({LayerKind.FULL, LayerKind.SLIDING})
_ANY = {"cpu": None, "cuda": None, "rocm": None}
_GPU = {"cuda": (8, 0), "rocm": None}


def _entry(name: str, impl: str | None, description: str, ops: Mapping[str, tuple[str, ...]] | None = None,
           **caps) -> BackendEntry:
    return BackendEntry(name=name, impl=impl, description=description, capabilities=Capabilities(**caps),
                        operations=ops or {})


def _ops(decode: tuple[str, ...], prefill: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return {"decode": decode, "prefill": prefill}


_ATTN_OPS = _ops(("attention.decode",), ("attention.prefill",))
_SPARSE_OPS = _ops(("indexer.decode", "indexer.topk_decode", "mla.sparse"),
                   ("indexer.prefill", "indexer.topk_prefill", "mla.sparse"))


def _state_ops(mech: str) -> dict[str, tuple[str, ...]]:
    return _ops((f"{mech}.decode",), (f"{mech}.prefill",))


for _e in (
    _entry("TORCH_SDPA", "attnserve.attention.backends.torch_sdpa:TorchSDPABackend",
           "PyTorch over the paged cache: decodes by the C++ CPU extension where it takes them, else in "
           "length buckets through SDPA; prefills one request at a time through SDPA; any device",
           _ATTN_OPS, layer_kinds=_STANDARD, dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_ANY,
           features=_ALL_FEATURES | {"streaming"}),
    _entry("FLEX_ATTENTION", "attnserve.attention.backends.flex:FlexAttentionBackend",
           "torch FlexAttention over the paged cache, one request at a time", _ATTN_OPS,
           layer_kinds=_STANDARD, dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_ANY,
           features=_ALL_FEATURES),
    _entry("TRITON_ATTN", "attnserve.attention.backends.triton_attn:TritonAttentionBackend",
           "Triton split-KV decode and tiled prefill over the paged cache, K/V written with RoPE fused; "
           "on Hopper the plain causal bf16/fp16 prefill at head 128 by a Gluon kernel", _ATTN_OPS,
           layer_kinds=_STANDARD, dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_GPU,
           features=_ALL_FEATURES, requires=("triton",)),
    _entry("FLASH_ATTN", None, "FlashAttention 2/3 (library)", None,
           layer_kinds=_STANDARD, dtypes=_HALF, kv_cache_dtypes=_HALF, platforms={"cuda": (8, 0)},
           features=frozenset({"sliding_window", "alibi", "softcap"}), block_size_multiple=16,
           head_sizes=frozenset(range(8, 257, 8)), requires=("flash_attn",)),
    _entry("FLASHINFER", None, "FlashInfer paged attention (library)", None,
           layer_kinds=_STANDARD, dtypes=_HALF, kv_cache_dtypes=_HALF | {"fp8"}, platforms={"cuda": (8, 0)},
           features=frozenset({"sliding_window", "softcap", "sinks"}),
           head_sizes=frozenset({64, 128, 256}), requires=("flashinfer",)),
    _entry("TORCH_MLA", "attnserve.attention.backends.torch_mla:TorchMLABackend",
           "MLA in PyTorch: decodes absorbed (MQA over the latent rows), prefills expanded through kv_b_proj",
           _ops(("mla.absorbed",), ("mla.expanded",)),
           layer_kinds=frozenset({LayerKind.MLA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_ANY),
    _entry("TRITON_MLA", "attnserve.attention.backends.triton_mla:TritonMLABackend",
           "MLA: decodes and prefills of up to 128 new tokens absorbed in one launch (Triton, by TMA tiles "
           "from Hopper on, or on Hopper the DeepSeek shape by a Gluon kernel); longer prefills expanded in "
           "PyTorch", _ops(("mla.absorbed",), ("mla.absorbed", "mla.expanded")),
           layer_kinds=frozenset({LayerKind.MLA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("FLASHMLA", None, "FlashMLA dense decode (library, Hopper)", None,
           layer_kinds=frozenset({LayerKind.MLA}), dtypes=_HALF, kv_cache_dtypes=_HALF | {"fp8"},
           platforms={"cuda": (9, 0)}, block_size_multiple=64, requires=("flash_mla",)),
    _entry("TORCH_MLA_SPARSE", "attnserve.attention.backends.torch_mla_sparse:TorchMLASparseBackend",
           "DSA in PyTorch: lightning indexer scores, torch.topk, MQA over the selected latent rows",
           _SPARSE_OPS, layer_kinds=frozenset({LayerKind.SPARSE_MLA}), dtypes=_FLOAT,
           kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_ANY),
    _entry("TRITON_MLA_SPARSE", "attnserve.attention.backends.triton_mla_sparse:TritonMLASparseBackend",
           "DSA: Triton indexer scores (on Hopper fp8 decode scores by a Gluon kernel), radix top-k for "
           "decodes and torch.topk for prefills, sparse MLA over the selected rows (on Hopper the DeepSeek "
           "shape by Gluon kernels, bf16 or fp8 rows)", _SPARSE_OPS,
           layer_kinds=frozenset({LayerKind.SPARSE_MLA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("FLASHMLA_SPARSE", None, "FlashMLA sparse decode and prefill (library, Hopper)", None,
           layer_kinds=frozenset({LayerKind.SPARSE_MLA}), dtypes=_HALF, kv_cache_dtypes=frozenset({"fp8"}),
           platforms={"cuda": (9, 0)}, block_size_multiple=64, requires=("flash_mla",)),
    _entry("TORCH_GDN", "attnserve.attention.state.torch_backends:TorchGDNBackend",
           "Gated DeltaNet in PyTorch: chunked prefill, recurrent decode, short conv", _state_ops("gdn"),
           layer_kinds=frozenset({LayerKind.GDN}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_ANY),
    _entry("TRITON_GDN", "attnserve.attention.state.triton_backends:TritonGDNBackend",
           "Gated DeltaNet in Triton: fused recurrent decode step, chunk-wise (WY) prefill in two launches, "
           "short conv", _state_ops("gdn"),
           layer_kinds=frozenset({LayerKind.GDN}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("TORCH_MAMBA", "attnserve.attention.state.torch_backends:TorchMambaBackend",
           "Mamba selective scan in PyTorch", _state_ops("mamba"), layer_kinds=frozenset({LayerKind.MAMBA}),
           dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_ANY),
    _entry("TRITON_MAMBA", "attnserve.attention.state.triton_backends:TritonMambaBackend",
           "Mamba selective scan in Triton: prefill scan, recurrent decode step, short conv", _state_ops("mamba"),
           layer_kinds=frozenset({LayerKind.MAMBA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("TORCH_LIGHTNING", "attnserve.attention.state.torch_backends:TorchLightningBackend",
           "lightning attention in PyTorch: block prefill, recurrent decode", _state_ops("lightning"),
           layer_kinds=frozenset({LayerKind.LIGHTNING}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_ANY),
    _entry("TRITON_LIGHTNING", "attnserve.attention.state.triton_backends:TritonLightningBackend",
           "lightning attention in Triton: block prefill and recurrent decode step", _state_ops("lightning"),
           layer_kinds=frozenset({LayerKind.LIGHTNING}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("TORCH_KDA", "attnserve.attention.state.torch_backends:TorchKDABackend",
           "Kimi delta attention in PyTorch", _state_ops("kda"), layer_kinds=frozenset({LayerKind.KDA}),
           dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"}, platforms=_ANY),
    _entry("TRITON_KDA", "attnserve.attention.state.triton_backends:TritonKDABackend",
           "Kimi delta attention in Triton: fused recurrent decode step, chunk-wise prefill with per-channel "
           "decay, short convs", _state_ops("kda"),
           layer_kinds=frozenset({LayerKind.KDA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT | {"fp8"},
           platforms=_GPU, requires=("triton",)),
    _entry("TORCH_NSA", "attnserve.attention.backends.torch_nsa:TorchNSABackend",
           "NSA in PyTorch: compressed, selected-block and sliding-window branches over the paged K/V",
           _ops(("nsa.attention",), ("nsa.attention",)),
           layer_kinds=frozenset({LayerKind.NSA}), dtypes=_FLOAT, kv_cache_dtypes=_FLOAT, platforms=_ANY),
):
    register(_e)
