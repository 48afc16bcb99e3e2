"""The engine's plan: model, config and platform -> cache groups, a backend per group, bytes.

``plan_engine`` is pure: no tensors, no allocation, no device query beyond what the
``Platform`` record says. It reads the cache entries of one tensor-parallel rank, groups them
(``kvcache/groups.py``), chooses every layer's backend through ``attention/registry.py`` (with
every reason for the ones passed over), then, for each group, the kernel variant of every
operation its backend launches in a decode, a prefill and a mixed step, and the variants of the
model's own dense and MoE operations (``attention/kernels.py``, with every reason too), and adds
up the bytes a token and a sequence hold. ``prepare_kernels`` runs the chosen variants' prepare
hooks (the CPU extension's build) and plans again where one fails. The
engine (``engine/builder.py``) allocates from the plan and ``attnserve inspect``
(``entrypoints/inspect.py``) renders it; neither groups layers nor selects a backend itself,
so what inspect shows is what the engine runs.

It is not the allocator: how many blocks fit needs the device's memory
(``runner/cache_allocation.py``), and the host-resident latents' staging needs the scheduler
limits (``runner/host_latents.py``). A plan may hold a layer that no backend runs ("none",
with the registry's error): inspect shows it, the engine raises it (``EnginePlan.backend_names``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from attnserve.arch import LayerKind, LayerSpec, ModelArch, shard_arch
from attnserve.attention import kernels
from attnserve.attention.backend import BackendRequest
from attnserve.attention.kernels import STEP_KINDS, KernelChoice, KernelError, KernelProblem
from attnserve.attention.registry import (
    BackendSelectionError,
    get_entry,
    override_for,
    rank_backends,
    select_backend,
)
from attnserve.config import DEFAULT_BLOCK_SIZE, EngineConfig
from attnserve.kvcache.groups import (
    CacheEntry,
    KVCacheGroup,
    KVCacheLayout,
    cache_entries,
    group_entries,
    plan_layout,
    sparse_latent_entries,
)
from attnserve.kvcache.spec import CachePolicy, resolve_cache_dtype
from attnserve.platforms import Platform

__all__ = ["BackendChoice", "EnginePlan", "GroupPlan", "LayerPlan", "StepKernels", "default_block_size",
           "plan_engine", "prepare_kernels", "resolve_dtype", "with_block_size"]

MLA_CUDA_BLOCK_SIZE = 64  # a 64-key tile is one page: the TMA decode kernel's unit (ops/mla/decode_triton_tma)

PassedOver = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """A layer's backend: the one ``attention_backend`` names, or the first on the platform's
    list that fits; "none" when the named one does not fit or nothing does."""

    name: str
    passed_over: PassedOver = ()  # the backends ranked before ``name``, each with every reason
    forced: bool = False  # named by ``attention_backend`` (or the name is not a backend)
    error: str | None = None  # the registry's error when ``name`` is "none"
    error_reasons: tuple[str, ...] = ()

    def raise_error(self) -> None:
        """Raises the registry's BackendSelectionError when this choice has none."""
        if self.error is not None:
            err = BackendSelectionError(self.error)
            err.reasons = self.error_reasons
            raise err


@dataclass(frozen=True, slots=True)
class LayerPlan:
    layer: int
    kind: LayerKind
    backend: BackendChoice


# (step kind, the kernel choices of the operations a step of that kind launches), for decode,
# prefill and mixed steps
StepKernels = tuple[tuple[str, tuple[KernelChoice, ...]], ...]


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A KV cache group (paged, or the state layers' slots), its layers' backend choices and the
    kernel variant of each operation its backend launches."""

    group: KVCacheGroup
    choices: tuple[BackendChoice, ...]  # of its layers, each distinct choice once, in entry order
    kernels: StepKernels = ()  # empty when the group has no single backend

    @property
    def kernel_choices(self) -> dict[str, KernelChoice]:
        """Operation -> its choice, over every step kind."""
        return {c.op: c for _, choices in self.kernels for c in choices}

    def kernel_names(self) -> dict[str, str]:
        """Operation -> the chosen variant's name, as the backend is built with.

        Raises:
            KernelError: an operation that no variant serves (every reason listed).
        """
        for choice in self.kernel_choices.values():
            if choice.error is not None:
                raise KernelError(f"KV cache group {self.group.group_id}: {choice.error}")
        return {op: c.variant for op, c in self.kernel_choices.items()}

    @property
    def backend(self) -> BackendChoice:
        """The group's one backend, as the engine runs it.

        Raises:
            BackendSelectionError: a layer of the group has none (the first, in entry order).
            ValueError: its layers chose different backends.
        """
        for choice in self.choices:
            choice.raise_error()
        names = {c.name for c in self.choices}
        if len(names) != 1:
            raise ValueError(f"KV cache group {self.group.group_id} would need several backends: {sorted(names)}")
        return self.choices[0]


@dataclass(frozen=True, slots=True)
class EnginePlan:
    arch: ModelArch  # as read from config.json
    rank_arch: ModelArch  # one tensor-parallel rank's share (``arch`` itself for one rank)
    platform: Platform
    dtype: str  # the model's
    dtype_reason: str  # why (resolve_dtype)
    kv_cache_dtype: str  # resolved: fp8, or a float dtype
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    entries: tuple[CacheEntry, ...]  # every cache entry of ``rank_arch``, in layer order
    layout: KVCacheLayout  # the paged groups and the slots they share
    state_groups: tuple[KVCacheGroup, ...]  # numbered after the paged groups
    groups: tuple[GroupPlan, ...]  # the paged groups, then the state groups, with backends
    layers: tuple[LayerPlan, ...]  # one per layer of ``rank_arch``
    kv_bytes_per_token: int  # over every layer, sliding ones at their full rate
    state_bytes_per_sequence: int
    bytes_per_sequence: int  # one sequence of max_model_len: paged blocks (windows applied) + state
    bytes_per_sequence_no_window: int  # the same with every sliding layer at its full rate
    host_latent_entries: tuple[CacheEntry, ...]  # sparse-MLA latents (kv_offload_sparse_latents)
    model_kernels: StepKernels = ()  # the model's own dense and MoE operations, per step kind

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs over every paged group (every entry on the device)."""
        return self.layout.bytes_per_block

    @property
    def host_latent_bytes_per_token(self) -> int | None:
        """Per token, the latent rows host-resident latents move to host memory; None without DSA."""
        if not self.host_latent_entries:
            return None
        return sum(e.spec.bytes_per_token for e in self.host_latent_entries)

    def sequence_bytes(self, num_tokens: int) -> int:
        """Bytes one sequence of ``num_tokens`` holds at most: paged blocks (windows applied) + state."""
        return self.layout.sequence_bytes(num_tokens) + self.state_bytes_per_sequence

    @property
    def backend_names(self) -> list[str]:
        """One backend per group, as the engine loads them; raises as ``GroupPlan.backend``."""
        return [g.backend.name for g in self.groups]

    def model_kernel_names(self) -> dict[str, str]:
        """The model's operations -> the chosen variant's name (``kernels.model_kernels``).

        Raises:
            KernelError: an operation that no variant serves.
        """
        out = {}
        for _, choices in self.model_kernels:
            for c in choices:
                if c.error is not None:
                    raise KernelError(c.error)
                out[c.op] = c.variant
        return out

    def check_forced(self) -> None:
        """Raises one BackendSelectionError with the unique errors of every layer the named
        ``attention_backend`` does not fit, in layer order (what ``inspect`` reports)."""
        errors = [lp.backend.error for lp in self.layers if lp.backend.forced and lp.backend.error]
        if errors:
            raise BackendSelectionError("\n".join(dict.fromkeys(errors)))


def default_block_size(arch: ModelArch, platform: Platform) -> int:
    """Tokens per block when the user gives none: 64 for a model with MLA caches on CUDA (the
    dense decode kernel reads a 64-key tile of one page by TMA: 1.2-1.3x the rate of gathered
    rows at 128 heads on the H200), else 16."""
    mla = any(s.kind in (LayerKind.MLA, LayerKind.SPARSE_MLA) for s in arch.layers)
    return MLA_CUDA_BLOCK_SIZE if mla and platform.device_type == "cuda" else DEFAULT_BLOCK_SIZE


def with_block_size(config: EngineConfig, arch: ModelArch, platform: Platform) -> EngineConfig:
    """``config`` with its block size resolved (``default_block_size`` when None)."""
    if config.cache.block_size is not None:
        return config
    return replace(config, cache=replace(config.cache, block_size=default_block_size(arch, platform)))


def resolve_dtype(dtype: str, checkpoint_dtype: str, platform: Platform) -> tuple[str, str]:
    """The model's dtype and why: an explicit ``dtype`` as given; "auto" the checkpoint's dtype,
    but on CPU what the CPU runs fast (``CpuInfo.auto_dtype``: bfloat16 with native bf16 dot
    products, float32 elsewhere)."""
    if dtype != "auto":
        return dtype, f'dtype="{dtype}" as given'
    if platform.device_type == "cpu" and platform.cpu is not None:
        return platform.cpu.auto_dtype(checkpoint_dtype)
    return checkpoint_dtype, f'dtype "auto": the checkpoint\'s dtype on {platform.name}'


def plan_engine(arch: ModelArch, config: EngineConfig, platform: Platform,
                unprepared: Mapping[str, str] | None = None) -> EnginePlan:
    """The plan of ``arch`` served with ``config`` on ``platform``.

    Args:
        unprepared: kernel variant key (``op/name``) -> why its prepare hook failed; such a
            variant is passed over with that reason (``prepare_kernels``).
    Raises:
        ValueError: heads that do not split over ``tensor_parallel_size`` ranks, a cache the
            model's layers cannot have (StreamingLLM on other than full layers, fp8 MLA latents
            of a rank that is not a multiple of 128), or a ``disabled_kernels`` entry that names
            no kernel variant. Backend and kernel errors are kept in the plan, not raised
            (``EnginePlan.backend_names``, ``GroupPlan.kernel_names``, ``EnginePlan.check_forced``).
    """
    kernels.check_disabled(config.cache.disabled_kernels)
    config = with_block_size(config, arch, platform)
    tp = config.parallel.tensor_parallel_size
    rank_arch = shard_arch(arch, tp)
    dtype, dtype_reason = resolve_dtype(config.model.dtype, arch.dtype, platform)
    max_len = config.model.max_model_len or arch.derived_max_model_len
    entries = cache_entries(rank_arch, config.cache, dtype)
    layout = plan_layout(entries)  # the paged groups; state layers get slots instead
    state_entries = [e for e in entries if e.spec.policy is CachePolicy.STATE]
    state_groups = tuple(KVCacheGroup(len(layout.groups) + i, g.policy, g.window, g.entries)
                         for i, g in enumerate(group_entries(state_entries)))
    kv_dtype = resolve_cache_dtype(config.cache.kv_cache_dtype, dtype)
    layers = _choose_backends(rank_arch, config, platform, dtype, kv_dtype)
    all_groups = (*layout.groups, *state_groups)
    state = sum(e.spec.bytes_per_sequence for e in entries)
    facts = _Facts(platform, dtype, config.cache.block_size, config.scheduler.max_num_batched_tokens or 0,
                   tuple(config.cache.disabled_kernels), dict(unprepared or {}),
                   frozenset({"streaming"}) if config.cache.streaming_window else frozenset())
    return EnginePlan(
        arch=arch, rank_arch=rank_arch, platform=platform, dtype=dtype, dtype_reason=dtype_reason,
        kv_cache_dtype=kv_dtype,
        block_size=config.cache.block_size, max_model_len=max_len, tensor_parallel_size=tp,
        entries=tuple(entries), layout=layout, state_groups=state_groups,
        groups=tuple(_group_plan(g, layers, rank_arch, facts) for g in all_groups), layers=layers,
        kv_bytes_per_token=sum(g.bytes_per_token for g in all_groups),
        state_bytes_per_sequence=state,
        bytes_per_sequence=layout.sequence_bytes(max_len) + state,
        bytes_per_sequence_no_window=_full_rate_bytes(layout, max_len) + state,
        host_latent_entries=tuple(sparse_latent_entries(rank_arch, entries)),
        model_kernels=_model_kernels(rank_arch, facts),
    )


def prepare_kernels(plan: EnginePlan, config: EngineConfig) -> EnginePlan:
    """Run the prepare hook of every chosen kernel variant (the CPU decode extension's build)
    and plan again, passing over each variant whose preparation failed with its reason, until
    every chosen one is ready. The builder calls it; ``inspect`` does not (it builds nothing)."""
    unprepared: dict[str, str] = {}
    while True:
        failed = {}
        for group in plan.groups:
            for choice in group.kernel_choices.values():
                if choice.error is None and choice.key not in unprepared:
                    why = choice.get().run_prepare()
                    if why is not None:
                        failed[choice.key] = f"not ready: {why}"
        if not failed:
            return plan
        unprepared.update(failed)
        plan = plan_engine(plan.arch, config, plan.platform, unprepared)


def _choose_backends(arch: ModelArch, config: EngineConfig, platform: Platform, dtype: str,
                     kv_dtype: str) -> tuple[LayerPlan, ...]:
    """Every layer's backend choice; the engine adds the "streaming" feature in StreamingLLM mode."""
    kinds = {s.kind for s in arch.layers}
    extra = frozenset({"streaming"}) if config.cache.streaming_window else frozenset()
    out = []
    for spec in arch.layers:
        req = BackendRequest(kind=spec.kind, head_size=spec.head_size, dtype=dtype, kv_cache_dtype=kv_dtype,
                             block_size=config.cache.block_size, features=spec.features | extra)
        out.append(LayerPlan(spec.index, spec.kind, _choose(spec, req, platform, config.cache.attention_backend,
                                                             kinds)))
    return tuple(out)


def _choose(spec: LayerSpec, req: BackendRequest, platform: Platform, named: str | None,
            kinds: set[LayerKind]) -> BackendChoice:
    """The registry's choice for one layer; an error is kept as "none" with every reason."""
    try:
        override = override_for(named, spec.kind, kinds)
    except BackendSelectionError as e:  # ``named`` is no backend's name
        return BackendChoice("none", forced=True, error=str(e), error_reasons=e.reasons)
    try:
        selection = select_backend(req, platform, override)
    except BackendSelectionError as e:
        passed = () if override else tuple(rank_backends(req, platform))
        return BackendChoice("none", passed, forced=bool(override), error=str(e), error_reasons=e.reasons)
    return BackendChoice(selection.name, selection.passed_over, selection.forced)


@dataclass(frozen=True, slots=True)
class _Facts:
    """What every kernel problem of one plan shares."""

    platform: Platform
    dtype: str
    block_size: int
    max_rows: int
    disabled: tuple[str, ...]
    unprepared: dict[str, str]
    extra_features: frozenset[str]

    def problem(self, **fields) -> KernelProblem:
        return KernelProblem(platform=self.platform.name, capability=self.platform.compute_capability,
                             dtype=self.dtype, block_size=self.block_size, max_rows=self.max_rows, **fields)

    def pick(self, op: str, problem: KernelProblem, launched_by: str) -> KernelChoice:
        return kernels.pick(op, problem, launched_by, self.disabled, self.unprepared)


def _problem(op: str, spec: LayerSpec, entries: dict[str, CacheEntry], facts: _Facts) -> KernelProblem | None:
    """The kernel problem of ``op`` in layer ``spec`` (whose cache entries are ``entries``, by
    name); None when the layer does not launch ``op`` (a GLM-5 layer that reuses the previous
    layer's top-k runs no indexer)."""
    family = op.partition(".")[0]
    if family == "attention":
        kv = entries["kv"].spec
        return facts.problem(cache_dtype=kv.dtype, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                             head_size=spec.head_size, head_size_v=spec.head_size_v,
                             features=spec.features | facts.extra_features)
    if op in ("mla.absorbed", "mla.sparse"):
        mla = spec.mla
        return facts.problem(cache_dtype=entries["latent"].spec.dtype, num_heads=spec.num_heads, num_kv_heads=1,
                             head_size=mla.kv_lora_rank + mla.qk_rope_head_dim, head_size_v=mla.kv_lora_rank,
                             kv_lora_rank=mla.kv_lora_rank)
    if op == "mla.expanded":
        return facts.problem(cache_dtype=entries["latent"].spec.dtype, num_heads=spec.num_heads,
                             num_kv_heads=spec.num_heads, head_size=spec.head_size, head_size_v=spec.head_size_v,
                             kv_lora_rank=spec.mla.kv_lora_rank)
    if family == "indexer":
        if "indexer" not in entries:
            return None
        return facts.problem(cache_dtype=entries["indexer"].spec.dtype, num_heads=spec.indexer.n_heads,
                             num_kv_heads=1, head_size=spec.indexer.head_dim)
    return facts.problem(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                         head_size_v=spec.head_size_v)


def _group_plan(group: KVCacheGroup, layers: tuple[LayerPlan, ...], arch: ModelArch, facts: _Facts) -> GroupPlan:
    choices = tuple(dict.fromkeys(layers[e.layer].backend for e in group.entries))
    names = {c.name for c in choices}
    if len(names) != 1 or "none" in names:
        return GroupPlan(group, choices)
    backend = names.pop()
    entries: dict[int, dict[str, CacheEntry]] = {}
    for e in group.entries:
        entries.setdefault(e.layer, {})[e.name] = e
    by_op = {}
    for op in get_entry(backend).operations_for("mixed"):
        picks = {}
        for layer, named in entries.items():
            problem = _problem(op, arch.layers[layer], named, facts)
            if problem is not None:
                picks.setdefault(problem, facts.pick(op, problem, backend))
        distinct = {c.variant for c in picks.values()}
        if len(distinct) > 1:
            by_op[op] = KernelChoice(op, "none", error=f"the layers of KV cache group {group.group_id} would need "
                                     f"several {op} kernels: {sorted(distinct)}")
        elif picks:
            by_op[op] = next(iter(picks.values()))
    steps = tuple((kind, tuple(by_op[op] for op in get_entry(backend).operations_for(kind) if op in by_op))
                  for kind in STEP_KINDS)
    return GroupPlan(group, choices, steps)


def _model_kernels(arch: ModelArch, facts: _Facts) -> StepKernels:
    """The model's own operations: decode-sized linears, and the routed experts of MoE models."""
    small_m = facts.pick("dense.small_m", facts.problem(), "model")
    moe = ()
    if arch.moe is not None:
        limit = getattr(arch.options, "swiglu_limit", None)  # GPT-OSS's clamped SwiGLU
        act = "swiglu_clamped" if limit is not None else ("silu" if arch.hidden_act in ("silu", "swish")
                                                          else arch.hidden_act)
        moe = (facts.pick("moe.experts", facts.problem(activation=act), "model"),)
    # the small-M kernels serve steps of one row: a decode step of one request
    return (("decode", (small_m, *moe)), ("prefill", moe), ("mixed", moe))


def _full_rate_bytes(layout: KVCacheLayout, num_tokens: int) -> int:
    """One sequence's paged bytes with every sliding layer at its full rate."""
    if not layout.groups:
        return 0
    block = layout.groups[0].block_size
    return -(-num_tokens // block) * block * layout.bytes_per_token
