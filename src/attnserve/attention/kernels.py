"""Kernel variants: one table per operation, one ``pick`` with every passed-over variant's reasons.

A backend says *what* is computed (paged GQA attention, absorbed MLA, sparse MLA, a state
mechanism); a kernel variant says *how*, on a given device: a Triton kernel, a Gluon kernel for
Hopper, the C++ CPU extension, a PyTorch path. The operations a backend launches are named in its
registry entry per step kind (``BackendEntry.kernels``: decode, prefill; a mixed step launches
both lists); each operation's variants are rows of ``VARIANTS`` in priority order, each with the
backends that launch it, the platforms and compute capabilities it runs on, ``takes(problem)``
(the reasons it cannot serve a ``KernelProblem``: shapes, dtypes, features) and its launch.
``pick`` returns the first that fits and every one ranked before it with its reasons, as backend
selection does one level up (``attention/registry.py``).

The engine's plan (``engine/plan.py``) picks once per KV cache group and operation, before the
first step; the builder hands the choice to the backend (``Backend(block_size, kernels)``), which
calls the chosen variant's launch in its hot loop without asking again; ``attnserve inspect``
renders the choice. A backend built without choices (a test, a benchmark) picks the same way on
its first call, from the tensors it sees (``Backend.kernel``). ``disabled_kernels`` (an engine
option) turns variants off by name (``gluon``), operation and name (``mla.absorbed/gluon``) or
technology (``gluon`` matches every Gluon variant); it is read once, here. A variant with a
``prepare`` hook (the CPU extension's build) is prepared by the plan before the engine uses it
(``engine/plan.prepare_kernels``); a failed preparation passes it over like a reason.

Every variant is under ``tests/kernels/test_kernel_variants.py``, which iterates this table:
registering one puts it under the parity test against the PyTorch reference.

What this is not: the kernels (``ops/``), the backends, or the choice of backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import platform as host
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from attnserve import env

__all__ = [
    "OPERATIONS",
    "STEP_KINDS",
    "TECHNOLOGIES",
    "VARIANTS",
    "KernelChoice",
    "KernelError",
    "KernelProblem",
    "KernelVariant",
    "check_disabled",
    "get_variant",
    "model_kernel",
    "model_kernels",
    "pick",
    "pick_prepared",
    "rank",
    "variants_of",
]

STEP_KINDS = ("decode", "prefill", "mixed")
TECHNOLOGIES = ("triton", "gluon", "cpu_ext", "torch")
FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})
HALF_DTYPES = frozenset({"bfloat16", "float16"})

# operation -> what one launch computes (the contract every variant of it keeps)
OPERATIONS: dict[str, str] = {
    "attention.decode": "decode rows (one query token a request) of standard attention over the paged K/V",
    "attention.prefill": "prefill rows (chunks of several tokens, over any cached context) of standard attention",
    "mla.absorbed": "MLA in the absorbed (MQA) form: a query row [W_UK^T q_nope ; q_pe] over its latent rows",
    "mla.expanded": "MLA prefill in the expanded (MHA) form: cached latents through kv_b_proj into per-head K/V",
    "mla.sparse": "sparse MLA (DSA): each absorbed query row over its top-k selected latent rows",
    "indexer.decode": "the DSA indexer's scores of decode rows over the indexer key cache",
    "indexer.prefill": "the DSA indexer's scores of prefill rows over the indexer key cache",
    "indexer.topk_decode": "the top-k keys of each decode row's scores",
    "indexer.topk_prefill": "the top-k keys of each prefill row's scores",
    "nsa.attention": "NSA's compressed, selected-block and sliding-window branches under their gates",
    "gdn.decode": "Gated DeltaNet's recurrent step (decode rows) and its short conv",
    "gdn.prefill": "Gated DeltaNet's chunk-wise prefill and its short conv",
    "kda.decode": "Kimi delta attention's recurrent step (decode rows) and its short convs",
    "kda.prefill": "Kimi delta attention's chunk-wise prefill and its short convs",
    "mamba.decode": "the Mamba-1 selective-scan step (decode rows) and its short conv",
    "mamba.prefill": "the Mamba-1 selective scan over a prefill and its short conv",
    "lightning.decode": "lightning attention's recurrent step (decode rows)",
    "lightning.prefill": "lightning attention block by block over a prefill",
    "dense.small_m": "a decode-sized linear (one row) with the RMSNorm or act-and-mul before it fused in",
    "moe.experts": "the routed experts of a MoE layer over their token-expert pairs",
}


class KernelError(ValueError):
    """No variant of an operation fits (every reason listed), or a name that matches none."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()):
        super().__init__(message if not reasons else message + ":\n  - " + "\n  - ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True, slots=True)
class KernelProblem:
    """The static facts of one operation's launches in one group of layers: what ``takes`` reads.

    Built by the plan from a layer's spec and the engine's config, or by a backend from the
    tensors of its first call; both give the same record for the same layer.
    """

    platform: str  # cpu | cuda | rocm
    capability: tuple[int, int] | None  # CUDA compute capability; None: unknown or not CUDA
    dtype: str  # of the queries / activations
    cache_dtype: str = ""  # of the cache the operation reads: "fp8" or a float dtype
    block_size: int = 0  # tokens a page
    num_heads: int = 0  # query heads of one rank (the indexer's own heads for indexer ops)
    num_kv_heads: int = 0  # 1 for MLA's latent rows
    head_size: int = 0  # q/k (absorbed MLA: kv_lora_rank + rope; the indexer: its head dim)
    head_size_v: int = 0  # v (absorbed MLA: kv_lora_rank)
    features: frozenset[str] = frozenset()  # sliding_window, alibi, sinks, softcap, streaming
    kv_lora_rank: int = 0
    max_rows: int = 0  # most query rows one launch carries (0: not bounded)
    activation: str = ""  # the MoE experts' / dense MLP's activation

    @property
    def interpreted(self) -> bool:
        """Triton kernels run on this platform's tensors through Triton's interpreter."""
        return self.platform == "cpu" and env.triton_interpret()


Takes = Callable[[KernelProblem], list[str]]


def _takes_any(problem: KernelProblem) -> list[str]:
    return []


@dataclass(frozen=True, slots=True)
class KernelVariant:
    """One way to run one operation."""

    op: str  # a key of OPERATIONS
    name: str  # short, lower case, unique within the operation (gluon, triton, torch, ...)
    tech: str  # one of TECHNOLOGIES
    launched_by: frozenset[str]  # backend names (or "model": a layer of the model) that launch it
    # platform -> None (any device of it) or (lowest, highest) compute capability, highest None: no bound
    platforms: Mapping[str, tuple[tuple[int, int], tuple[int, int] | None] | None]
    description: str
    takes: Takes = _takes_any  # reasons it cannot serve a problem its platform allows
    launch: str | None = None  # "module:function" the backend calls; None: the backend's own PyTorch code
    prepare: str | None = None  # "module:function" -> None when ready, else why not (a build, a warm-up)
    requires: tuple[str, ...] = field(default=())  # optional Python modules
    # a Triton variant its launcher also runs on CPU tensors under TRITON_INTERPRET=1 (the
    # backends' kernels, in tests); the model's layers launch theirs on CUDA tensors only
    interpretable: bool = True

    @property
    def key(self) -> str:
        return f"{self.op}/{self.name}"

    def load(self) -> Callable[..., Any]:
        """The launch function (imported here, on first use)."""
        if self.launch is None:
            raise KernelError(f"{self.key} runs inside its backend (no launch function)")
        module, _, fn = self.launch.partition(":")
        return getattr(importlib.import_module(module), fn)

    def run_prepare(self) -> str | None:
        """Build or warm the variant up; None when it is ready, else why it cannot run."""
        if self.prepare is None:
            return None
        module, _, fn = self.prepare.partition(":")
        return getattr(importlib.import_module(module), fn)()


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The variant ``pick`` chose for an operation, and every one ranked before it with why."""

    op: str
    variant: str  # the chosen variant's name; "none" when nothing fits
    passed_over: tuple[tuple[str, tuple[str, ...]], ...] = ()
    error: str | None = None  # why nothing fits, when ``variant`` is "none"

    @property
    def key(self) -> str:
        return f"{self.op}/{self.variant}"

    def get(self) -> KernelVariant:
        """The chosen KernelVariant. Raises: KernelError when nothing fits."""
        if self.error is not None:
            raise KernelError(self.error)
        return get_variant(self.op, self.variant)


def _fmt_cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _platform_reasons(v: KernelVariant, p: KernelProblem) -> list[str]:
    if p.platform not in v.platforms:
        interpretable = v.tech == "triton" and v.interpretable
        if interpretable and p.interpreted:
            return []
        where = ", ".join(v.platforms)
        extra = " (or the CPU under TRITON_INTERPRET=1)" if interpretable else ""
        return [f"runs on {where}{extra}, not on {p.platform}"]
    bounds = v.platforms[p.platform]
    if bounds is None:
        return []
    lo, hi = bounds
    span = f"{_fmt_cc(lo)} or later" if hi is None else f"{_fmt_cc(lo)} to {_fmt_cc(hi)}"
    if p.capability is None:
        return [f"needs compute capability {span}; the device's is not known"]
    if p.capability < lo or (hi is not None and p.capability > hi):
        return [f"needs compute capability {span}, the device has {_fmt_cc(p.capability)}"]
    return []


def _matches(v: KernelVariant, entry: str) -> bool:
    return entry in (v.name, v.tech, v.key)


def check_disabled(disabled: Iterable[str]) -> None:
    """KernelError for a ``disabled_kernels`` entry that names no variant, operation/variant or
    technology of the table."""
    unknown = [e for e in disabled if not any(_matches(v, e) for v in VARIANTS)]
    if unknown:
        known = sorted({v.name for v in VARIANTS} | set(TECHNOLOGIES))
        raise KernelError(f"disabled_kernels names no kernel variant: {', '.join(unknown)} (known names: "
                          f"{', '.join(known)}, or operation/name such as mla.absorbed/gluon)")


def reasons(v: KernelVariant, problem: KernelProblem, disabled: Iterable[str] = ()) -> list[str]:
    """Every reason ``v`` cannot serve ``problem``; empty when it fits."""
    out = [f"turned off by disabled_kernels ({e})" for e in disabled if _matches(v, e)]
    out += _platform_reasons(v, problem)
    out += v.takes(problem)
    for module in v.requires:
        if importlib.util.find_spec(module) is None:
            out.append(f"library '{module}' is not installed")
    return out


def variants_of(op: str, launched_by: str | None = None) -> tuple[KernelVariant, ...]:
    """The variants of ``op`` in priority order (those ``launched_by`` launches, if given)."""
    if op not in OPERATIONS:
        raise KernelError(f"unknown kernel operation '{op}' (known: {', '.join(OPERATIONS)})")
    return tuple(v for v in VARIANTS if v.op == op and (launched_by is None or launched_by in v.launched_by))


def get_variant(op: str, name: str) -> KernelVariant:
    for v in variants_of(op):
        if v.name == name:
            return v
    known = ", ".join(v.name for v in variants_of(op))
    raise KernelError(f"operation {op} has no kernel variant '{name}' (known: {known})")


def rank(op: str, problem: KernelProblem, launched_by: str, disabled: Iterable[str] = (),
         unprepared: Mapping[str, str] | None = None) -> list[tuple[KernelVariant, tuple[str, ...]]]:
    """``launched_by``'s variants of ``op`` in priority order, each with why it does not fit
    (``unprepared``: variant key -> why its preparation failed)."""
    disabled = tuple(disabled)
    out = []
    for v in variants_of(op, launched_by):
        why = reasons(v, problem, disabled)
        if unprepared and v.key in unprepared:
            why.append(unprepared[v.key])
        out.append((v, tuple(why)))
    return out


def pick(op: str, problem: KernelProblem, launched_by: str, disabled: Iterable[str] = (),
         unprepared: Mapping[str, str] | None = None) -> KernelChoice:
    """The first of ``launched_by``'s variants of ``op`` that fits ``problem``; a choice of
    "none" (with every reason) when none does."""
    passed = []
    for v, why in rank(op, problem, launched_by, disabled, unprepared):
        if not why:
            return KernelChoice(op, v.name, tuple(passed))
        passed.append((v.name, why))
    details = tuple(f"{n}: {'; '.join(r)}" for n, r in passed) or (f"{launched_by} launches no variant of {op}",)
    message = f"no kernel variant of {op} fits {launched_by} on {problem.platform}"
    return KernelChoice(op, "none", tuple(passed), error=str(KernelError(message, details)))


def pick_prepared(op: str, problem: KernelProblem, launched_by: str, disabled: Iterable[str] = ()) -> KernelChoice:
    """``pick``, with the chosen variant prepared (built, warmed up); a variant whose preparation
    fails is passed over with its reason and the next one tried.

    Raises:
        KernelError: no variant fits (every reason listed).
    """
    unprepared: dict[str, str] = {}
    while True:
        choice = pick(op, problem, launched_by, disabled, unprepared)
        why = choice.get().run_prepare()  # raises KernelError for "none"
        if why is None:
            return choice
        unprepared[choice.key] = f"not ready: {why}"


# --- the model's own operations (dense, MoE) ---------------------------------------------------
# A layer of the model launches these itself; it learns the plan's choice while it is built.
_model_choices: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "attnserve_model_kernels", default=None)


@contextlib.contextmanager
def model_kernels(choices: Mapping[str, str]) -> Iterator[None]:
    """Within the block (the engine building its model), ``model_kernel(op)`` is ``choices[op]``:
    operation -> the chosen variant's name, from the plan."""
    token = _model_choices.set(dict(choices))
    try:
        yield
    finally:
        _model_choices.reset(token)


def model_kernel(op: str) -> str | None:
    """The plan's variant of a model-level operation while the engine builds its model; None
    outside such a build (a layer built by a test decides by the device it meets)."""
    choices = _model_choices.get()
    return None if choices is None else choices.get(op)


# --- what each variant takes ------------------------------------------------------------------
# Pure functions of the problem: no tensor, no device query (inspect calls them for any platform).

def _plain_attention(p: KernelProblem) -> list[str]:
    return [f"does not support {f.replace('_', ' ')}" for f in sorted(p.features)]


def _same_cache_dtype(p: KernelProblem) -> list[str]:
    if p.cache_dtype != p.dtype:
        return [f"reads a cache of the model dtype only, not {p.cache_dtype} (model {p.dtype})"]
    return []


def _cpu_ext_takes(p: KernelProblem) -> list[str]:
    out = _plain_attention(p) + _same_cache_dtype(p)
    if p.dtype not in FLOAT_DTYPES:
        out.append(f"takes float32, bfloat16 or float16, not {p.dtype}")
    if p.head_size % 8 or p.head_size_v % 8:
        out.append(f"head sizes must be multiples of 8, got {p.head_size} and {p.head_size_v}")
    machine = host.machine().lower()
    if machine not in ("x86_64", "amd64"):
        out.append(f"an x86-64 CPU (AVX2 or AVX-512) only, this one is {machine}")
    return out


GLUON_PREFILL_HEAD, GLUON_PREFILL_MAX_GROUP = 128, 8


def _gluon_prefill_takes(p: KernelProblem) -> list[str]:
    out = _plain_attention(p)
    if p.dtype not in HALF_DTYPES:
        out.append(f"takes bfloat16 or float16, not {p.dtype}")
    out += _same_cache_dtype(p)
    if p.head_size != GLUON_PREFILL_HEAD or p.head_size_v != GLUON_PREFILL_HEAD:
        out.append(f"head size {GLUON_PREFILL_HEAD} only, got {p.head_size} (v {p.head_size_v})")
    if p.num_kv_heads <= 0 or p.num_heads % p.num_kv_heads or not (
            1 <= p.num_heads // p.num_kv_heads <= GLUON_PREFILL_MAX_GROUP):
        out.append(f"1 to {GLUON_PREFILL_MAX_GROUP} query heads a KV head, got {p.num_heads} for {p.num_kv_heads}")
    if p.block_size % 8:
        out.append(f"pages of a multiple of 8 tokens, got {p.block_size}")
    return out


MLA_RANK, MLA_ROPE, MLA_PAGE, MLA_HEADS_PER_PROGRAM, MAX_GRID_Y = 512, 64, 64, 64, 65535


def _deepseek_latent(p: KernelProblem, fp8_cache: bool = False) -> list[str]:
    out = []
    if p.kv_lora_rank != MLA_RANK or p.head_size != MLA_RANK + MLA_ROPE:
        out.append(f"kv_lora_rank {MLA_RANK} with rope {MLA_ROPE} only, got {p.kv_lora_rank} + "
                   f"{p.head_size - p.kv_lora_rank}")
    if p.dtype != "bfloat16":
        out.append(f"bfloat16 queries only, not {p.dtype}")
    want = "fp8" if fp8_cache else "bfloat16"
    if p.cache_dtype != want:
        out.append(f"a {want} latent cache only, not {p.cache_dtype}")
    if p.max_rows > MAX_GRID_Y:
        out.append(f"at most {MAX_GRID_Y} query rows a launch, a step may have {p.max_rows}")
    return out


def _gluon_absorbed_takes(p: KernelProblem) -> list[str]:
    out = _deepseek_latent(p)
    h = p.num_heads
    if not (0 < h < MLA_HEADS_PER_PROGRAM or (h > 0 and h % MLA_HEADS_PER_PROGRAM == 0)):
        out.append(f"heads a multiple of {MLA_HEADS_PER_PROGRAM} or fewer than {MLA_HEADS_PER_PROGRAM}, got {h}")
    if p.block_size != MLA_PAGE:
        out.append(f"pages of {MLA_PAGE} tokens only (one TMA tile), got {p.block_size}")
    return out


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


TMA_TILE = 64  # the key tile of the TMA kernel's config (latent.pick_mla_config at 33+ heads)
_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _tma_absorbed_takes(p: KernelProblem) -> list[str]:
    out = _same_cache_dtype(p)
    if p.dtype not in FLOAT_DTYPES:
        out.append(f"takes a float dtype, not {p.dtype}")
    if not p.interpreted and (p.dtype not in HALF_DTYPES or p.num_heads <= 32):
        # below 33 heads (and in float32) the launch shape has 16/32-key tiles and 16-row
        # programs: their gathered rows were measured as fast, so the TMA form was not built there
        out.append(f"bfloat16 or float16 at more than 32 heads (64-row programs), got {p.num_heads} "
                   f"heads in {p.dtype}")
    if p.block_size % TMA_TILE:
        out.append(f"pages of a multiple of {TMA_TILE} tokens (whole key tiles by TMA), got {p.block_size}")
    rank, rope = p.kv_lora_rank, p.head_size - p.kv_lora_rank
    elem = _ELEM_BYTES.get(p.dtype, 2)
    half = rank // 2
    if rank % 2 or not _pow2_at_least_16(half) or not _pow2_at_least_16(rope) or max(half, rope) > 256 \
            or max(half, rope) * elem > 1024 or (p.head_size * elem) % 16:
        out.append(f"kv_lora_rank / 2 and rope must be powers of two from 16 to 256 (TMA boxes), got "
                   f"{half} and {rope}")
    return out


def _gluon_sparse_takes(p: KernelProblem, fp8: bool) -> list[str]:
    out = _deepseek_latent(p, fp8_cache=fp8)
    if p.num_heads <= 0 or p.num_heads % MLA_HEADS_PER_PROGRAM:
        out.append(f"heads a multiple of {MLA_HEADS_PER_PROGRAM}, got {p.num_heads}")
    return out


INDEXER_HEADS, INDEXER_DIM, INDEXER_PAGE = 64, 128, 64


def _gluon_indexer_takes(p: KernelProblem) -> list[str]:
    out = []
    if p.cache_dtype != "fp8":
        out.append(f"an fp8 indexer cache only (132-byte rows), not {p.cache_dtype}")
    if p.num_heads != INDEXER_HEADS or p.head_size != INDEXER_DIM:
        out.append(f"{INDEXER_HEADS} index heads of {INDEXER_DIM} only, got {p.num_heads} of {p.head_size}")
    if p.block_size != INDEXER_PAGE:
        out.append(f"pages of {INDEXER_PAGE} tokens only, got {p.block_size}")
    return out


def _gemv_takes(p: KernelProblem) -> list[str]:
    return [] if p.dtype in FLOAT_DTYPES else [f"takes a float dtype, not {p.dtype}"]


MOE_KERNEL_ACTS = ("silu", "swiglu_clamped")  # ops/moe/experts_triton.MOE_ACTS


def _moe_triton_takes(p: KernelProblem) -> list[str]:
    if p.activation not in MOE_KERNEL_ACTS:
        return [f"activation {p.activation} has no fused form (has {', '.join(MOE_KERNEL_ACTS)})"]
    return []


# --- the table, per operation in priority order ------------------------------------------------
_ANY = {"cpu": None, "cuda": None, "rocm": None}
_GPU = {"cuda": ((8, 0), None), "rocm": None}
_TMA = {"cuda": ((9, 0), None)}
_HOPPER = {"cuda": ((9, 0), (9, 9))}
_CPU = {"cpu": None}
_SDPA = frozenset({"TORCH_SDPA"})
_FLEX = frozenset({"FLEX_ATTENTION"})
_TRITON_ATTN = frozenset({"TRITON_ATTN"})
_TRITON_MLA = frozenset({"TRITON_MLA"})
_TRITON_SPARSE = frozenset({"TRITON_MLA_SPARSE"})
_TORCH_SPARSE = frozenset({"TORCH_MLA_SPARSE"})
_MODEL = frozenset({"model"})


def _v(op: str, name: str, tech: str, launched_by: frozenset[str], platforms, description: str,
       **kw) -> KernelVariant:
    if tech in ("triton", "gluon"):
        kw.setdefault("requires", ("triton",))
    return KernelVariant(op=op, name=name, tech=tech, launched_by=launched_by, platforms=platforms,
                         description=description, **kw)


def _state(mech: str, label: str, triton_decode: str, triton_prefill: str) -> list[KernelVariant]:
    upper = mech.upper()
    return [
        _v(f"{mech}.decode", "triton", "triton", frozenset({f"TRITON_{upper}"}), _GPU, triton_decode),
        _v(f"{mech}.decode", "torch", "torch", frozenset({f"TORCH_{upper}"}), _ANY,
           f"{label} step in PyTorch (gather, einsums, scatter)"),
        _v(f"{mech}.prefill", "triton", "triton", frozenset({f"TRITON_{upper}"}), _GPU, triton_prefill),
        _v(f"{mech}.prefill", "torch", "torch", frozenset({f"TORCH_{upper}"}), _ANY, f"{label} prefill in PyTorch"),
    ]


VARIANTS: tuple[KernelVariant, ...] = (
    # standard attention
    _v("attention.decode", "triton", "triton", _TRITON_ATTN, _GPU,
       "split-KV decode of unified_attention and its merge launch (ops/attention/paged_triton.py)",
       launch="attnserve.ops.attention.paged_triton:unified_attention"),
    _v("attention.decode", "cpu_ext", "cpu_ext", _SDPA, _CPU,
       "the C++ paged decode extension, reading the pages in place: AVX-512 with bf16 dot products, AVX-512 "
       "or AVX2, the best the CPU runs (ops/cpu/paged_decode.py)",
       takes=_cpu_ext_takes, launch="attnserve.ops.cpu.paged_decode:paged_decode",
       prepare="attnserve.ops.cpu.paged_decode:prepare"),
    _v("attention.decode", "torch", "torch", _SDPA, _ANY,
       "decodes in length buckets, gathered pages, one masked SDPA call a bucket"),
    _v("attention.decode", "flex", "torch", _FLEX, _ANY, "torch FlexAttention one request at a time"),
    _v("attention.prefill", "gluon", "gluon", _TRITON_ATTN, _HOPPER,
       "causal prefill by a TMA loader warp and two consumer warp groups (ops/attention/prefill_gluon.py)",
       takes=_gluon_prefill_takes, launch="attnserve.ops.attention.prefill_gluon:launch_prefill_attention"),
    _v("attention.prefill", "triton", "triton", _TRITON_ATTN, _GPU,
       "tiled prefill of unified_attention (ops/attention/paged_triton.py)",
       launch="attnserve.ops.attention.paged_triton:unified_attention"),
    _v("attention.prefill", "torch", "torch", _SDPA, _ANY,
       "one request at a time: gathered pages, SDPA (causal, or masked over a cached context)"),
    _v("attention.prefill", "flex", "torch", _FLEX, _ANY, "torch FlexAttention one request at a time"),
    # MLA
    _v("mla.absorbed", "gluon", "gluon", _TRITON_MLA, _HOPPER,
       "two warp groups splitting each MMA's N, pages by TMA into two stages (ops/mla/decode_gluon.py)",
       takes=_gluon_absorbed_takes, launch="attnserve.ops.mla.decode_gluon:mla_decode_gluon"),
    _v("mla.absorbed", "triton_tma", "triton", _TRITON_MLA, _TMA,
       "whole-page key tiles by tensor descriptor (ops/mla/decode_triton_tma.py)",
       takes=_tma_absorbed_takes, launch="attnserve.ops.mla.decode_triton_tma:mla_decode_tma"),
    _v("mla.absorbed", "triton_gather", "triton", _TRITON_MLA, _GPU,
       "latent rows gathered by pointer, any page size, model dtype or fp8 rows (ops/mla/decode_triton.py)",
       launch="attnserve.ops.mla.decode_triton:mla_decode"),
    _v("mla.absorbed", "torch", "torch", frozenset({"TORCH_MLA"}), _ANY,
       "gathered latent rows, one masked batched matmul softmax (attention/backends/torch_mla.py)"),
    _v("mla.expanded", "torch", "torch", frozenset({"TORCH_MLA", "TRITON_MLA"}), _ANY,
       "a request's cached latents expanded through kv_b_proj, then SDPA (attention/backends/torch_mla.py)"),
    _v("mla.sparse", "gluon", "gluon", _TRITON_SPARSE, _HOPPER,
       "bf16 rows gathered by 16-byte cp.async, two warp groups (ops/mla/sparse_gluon.py)",
       takes=lambda p: _gluon_sparse_takes(p, fp8=False), launch="attnserve.ops.mla.sparse_gluon:sparse_mla_gluon"),
    _v("mla.sparse", "gluon_fp8", "gluon", _TRITON_SPARSE, _HOPPER,
       "656-byte fp8 rows dequantised in shared memory (ops/mla/sparse_gluon_fp8.py)",
       takes=lambda p: _gluon_sparse_takes(p, fp8=True),
       launch="attnserve.ops.mla.sparse_gluon_fp8:sparse_mla_gluon_fp8"),
    _v("mla.sparse", "triton", "triton", _TRITON_SPARSE, _GPU,
       "selected latent rows gathered by pointer (ops/mla/sparse_triton.py)",
       launch="attnserve.ops.mla.sparse_triton:sparse_mla"),
    _v("mla.sparse", "torch", "torch", _TORCH_SPARSE, _ANY,
       "selected latent rows gathered, masked softmax (attention/backends/torch_mla_sparse.py)"),
    # the DSA indexer
    _v("indexer.decode", "gluon", "gluon", _TRITON_SPARSE, _HOPPER,
       "fp8 keys by whole 8448-byte pages, wgmma e4m3 with keys as M (ops/indexer/logits_gluon.py)",
       takes=_gluon_indexer_takes, launch="attnserve.ops.indexer.logits_gluon:indexer_logits_gluon"),
    _v("indexer.decode", "triton", "triton", _TRITON_SPARSE, _GPU,
       "the streaming kernel: a program walks a chunk of one request's key tiles (ops/indexer/logits_triton.py)",
       launch="attnserve.ops.indexer.logits_triton:indexer_logits"),
    _v("indexer.decode", "torch", "torch", _TORCH_SPARSE, _ANY,
       "gathered key rows, einsum, ReLU, head-weighted sum (attention/backends/torch_mla_sparse.py)"),
    _v("indexer.prefill", "triton", "triton", _TRITON_SPARSE, _GPU,
       "the tiled kernel: tokens x heads as the rows of one dot against a key tile (ops/indexer/logits_triton.py)",
       launch="attnserve.ops.indexer.logits_triton:indexer_logits"),
    _v("indexer.prefill", "torch", "torch", _TORCH_SPARSE, _ANY,
       "gathered key rows, einsum, ReLU, head-weighted sum, query chunks (attention/backends/torch_mla_sparse.py)"),
    _v("indexer.topk_decode", "triton_radix", "triton", _TRITON_SPARSE, _GPU,
       "radix select reading each row only up to its length (ops/indexer/topk_triton.py)",
       launch="attnserve.ops.indexer.topk_triton:topk_rows"),
    _v("indexer.topk_decode", "triton_twopass", "triton", _TRITON_SPARSE, {"cuda": ((8, 0), None)},
       "two reads of each row up to its length: a histogram of group maxima bounds the cut, the keys "
       "above it are collected, a program a row resolves them; topk_rows' result (ops/indexer/topk_twopass.py). "
       "Not yet timed on a GPU: after triton_radix until it is (disabled_kernels=('triton_radix',) picks it)",
       launch="attnserve.ops.indexer.topk_twopass:topk_rows_twopass"),
    _v("indexer.topk_decode", "torch", "torch", _TORCH_SPARSE, _ANY, "torch.topk over the visible keys"),
    _v("indexer.topk_prefill", "torch", "torch", _TRITON_SPARSE | _TORCH_SPARSE, _ANY,
       "torch.topk over full-width rows (faster than the radix select there: H200, 512 rows of 32K, "
       "260 against 470 us)"),
    _v("indexer.topk_prefill", "triton_twopass", "triton", _TRITON_SPARSE, {"cuda": ((8, 0), None)},
       "topk_rows_twopass over each prefill row up to its causal length (position + 1), half a causal "
       "chunk's full-width read (ops/indexer/topk_twopass.py). Not yet timed on a GPU: after torch until it "
       "is (disabled_kernels=('torch',) picks it)",
       launch="attnserve.ops.indexer.topk_twopass:topk_rows_twopass"),
    # NSA
    _v("nsa.attention", "torch", "torch", frozenset({"TORCH_NSA"}), _ANY,
       "the three branches as masked dense attention (attention/backends/torch_nsa.py)"),
    # state layers
    *_state("gdn", "Gated DeltaNet's recurrent",
            "fused decay, delta update and output, each state row read and written once "
            "(ops/state/delta_decode_triton.py); Triton short conv",
            "chunk-wise WY form in two launches (ops/state/delta_prefill_triton.py); Triton short conv"),
    *_state("kda", "Kimi delta attention's recurrent",
            "the delta-rule step with per-key-channel decay (ops/state/delta_decode_triton.py); Triton short convs",
            "chunk-wise WY form with per-key-channel decay (ops/state/delta_prefill_triton.py); Triton short convs"),
    *_state("mamba", "the selective-scan",
            "scan step with skip and gate in one pass (ops/state/decode_triton.py); Triton short conv",
            "the scan token by token in pieces, carried across them (ops/state/prefill_triton.py)"),
    *_state("lightning", "lightning attention's recurrent",
            "decayed state step (ops/state/decode_triton.py)",
            "block by block (ops/state/prefill_triton.py)"),
    # dense and MoE layers of the model
    _v("dense.small_m", "triton_gemv", "triton", _MODEL, {"cuda": ((8, 0), None)},
       "one small-M kernel with the RMSNorm or act-and-mul in its prologue (ops/dense/gemv_triton.py)",
       takes=_gemv_takes, launch="attnserve.ops.dense.gemv_triton:linear", interpretable=False),
    _v("dense.small_m", "torch", "torch", _MODEL, _ANY, "the norm or activation, then cuBLAS / torch's F.linear"),
    _v("moe.experts", "triton", "triton", _MODEL, {"cuda": ((8, 0), None)},
       "two grouped kernels over pairs sorted and padded per expert, no host sync (ops/moe/experts_triton.py)",
       takes=_moe_triton_takes, launch="attnserve.ops.moe.experts_triton:fused_experts", interpretable=False),
    _v("moe.experts", "torch", "torch", _MODEL, _ANY, "a loop over the experts that have tokens (syncs)"),
)


def _check_table() -> None:
    seen = set()
    for v in VARIANTS:
        if v.op not in OPERATIONS or v.tech not in TECHNOLOGIES or v.key in seen:
            raise ValueError(f"bad kernel variant entry {v.key} ({v.tech})")
        seen.add(v.key)


_check_table()
