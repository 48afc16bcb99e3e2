"""Wiring an engine together from its config: model, tokenizer, backends, KV cache, runner.

The order matters and is the same on every platform: read the architecture, pick the device,
take the engine's plan (``engine/plan.py``: dtypes, cache groups, one backend per group, bytes
per block), load those backends, build the model and load its weights, (CUDA) run the
profiling pass, size the block pool from the memory left, allocate and bind the caches. This
file groups nothing and selects no backend: it allocates what the plan says.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from platform import machine as host_machine

import torch

from attnserve import env
from attnserve.arch import ModelArch, load_hf_config, read_arch
from attnserve.attention.backend import AttentionBackend
from attnserve.attention.kernels import model_kernels
from attnserve.attention.registry import load_backend
from attnserve.config import EngineConfig
from attnserve.engine.batch_limits import BatchLimits, resolve_batch_limits
from attnserve.engine.plan import EnginePlan, plan_engine, prepare_kernels, with_block_size
from attnserve.engine.profile_run import profile_step
from attnserve.engine.tensor_parallel import WorkerGroup, receive_config
from attnserve.kvcache.groups import KVCacheGroup
from attnserve.kvcache.manager import KVCacheManager
from attnserve.kvcache.offload import DiskTier, HostTier, OffloadManager
from attnserve.kvcache.spec import CachePolicy
from attnserve.kvcache.state import StatePool
from attnserve.layers.moe import FusedExperts
from attnserve.models.quantized import QuantScheme, check_quantization_option, dequantized_weights
from attnserve.models.registry import get_model_class
from attnserve.models.weights import check_finite_weights, dummy_init, iter_safetensors
from attnserve.platforms import Platform, current_platform, get_platform
from attnserve.runner.cache_allocation import (
    GIB,
    allocate_kv_cache,
    allocate_state_cache,
    determine_num_blocks,
    device_budget_bytes,
    host_available_bytes,
)
from attnserve.runner.host_latents import (
    HostLatentPlan,
    check_host_latents,
    plan_host_latents,
    wrap_backends,
)
from attnserve.runner.model_runner import ModelRunner
from attnserve.runner.offload_io import OffloadIO
from attnserve.runner.parallel import (
    ParallelState,
    check_supported,
    min_over_ranks,
    shard_model,
)
from attnserve.runner.worker import serve_steps, step_group

__all__ = ["EngineParts", "build_engine_parts", "check_memory_budgets", "model_identity", "resolve_model_dir"]

logger = logging.getLogger(__name__)

_PROFILED_DEVICES = ("cuda",)  # the profiling pass runs where memory is sized by utilization
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_identity(config: EngineConfig, model_dir: Path, plan: EnginePlan, device: torch.device, blob: int) -> str:
    """What must agree for two engines to share disk tier blocks: everything that changes a
    block's bytes. The model (its resolved directory, where a hub id's snapshot path names its
    commit, and the name, size and time of each file in it, so weights replaced in place are
    another model; the seed of random weights); the dtypes, resolved; the attention backend of
    every group and the kernel variant of every operation (the model's own included: a layer's
    K/V comes out of every kernel before it); the device kind (CUDA: its name and compute
    capability; CPU: the machine) and CUDA graphs; the block size, the blob layout, tensor
    parallelism, StreamingLLM and host-resident latents; and torch's version, whose kernels may
    round differently. Engines that differ in any of these name their files differently and
    never read each other's."""
    files = []
    for f in sorted(model_dir.iterdir()):
        with contextlib.suppress(OSError):
            st = f.stat()
            files.append((f.name, st.st_size, st.st_mtime_ns))
    m, c = config.model, config.cache
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        hardware = (torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                    getattr(torch.version, "hip", None))
    else:
        hardware = (host_machine(),)
    kernels = tuple((g.backend.name, tuple(sorted(g.kernel_names().items()))) for g in plan.groups)
    return repr((("model", str(model_dir.resolve()), tuple(files), m.load_format,
                  m.seed if m.load_format == "dummy" else None),
                 ("dtypes", plan.dtype, plan.kv_cache_dtype, c.indexer_cache_dtype, c.mamba_ssm_cache_dtype),
                 ("kernels", kernels, tuple(sorted(plan.model_kernel_names().items()))),
                 ("device", plan.platform.name, device.type, hardware, m.enforce_eager),
                 ("layout", plan.block_size, blob, plan.tensor_parallel_size, (c.streaming_sinks, c.streaming_window),
                  config.offload.kv_offload_sparse_latents),
                 ("torch", torch.__version__)))


def _build_offload(config: EngineConfig, plan: EnginePlan, groups: list[KVCacheGroup], caches: dict,
                   state_caches: list, device: torch.device, model_dir: Path):
    """The offload tier and manager when ``kv_offloading_size`` is set, else (None, None)."""
    off = config.offload
    if off.kv_offloading_size is None:
        return None, None
    if not config.cache.enable_prefix_caching:
        raise ValueError("KV offloading keeps prefix blocks by their hash: it needs enable_prefix_caching")
    if any(g.policy not in (CachePolicy.FULL, CachePolicy.SLIDING) for g in groups):
        raise ValueError("KV offloading keeps full and sliding-window groups; this model has "
                         f"{sorted({g.policy.value for g in groups})} groups")
    io = OffloadIO(groups, caches, state_caches, device)
    blob = max([io.block_bytes(g) for g in range(len(groups))] + [io.state_bytes()])
    capacity = int(off.kv_offloading_size * 1024**3) // blob
    if off.kv_offloading_backend == "disk":
        if not off.kv_offloading_dir:
            raise ValueError("kv_offloading_backend 'disk' needs kv_offloading_dir, the directory to keep blocks in")
        tier = DiskTier(capacity, blob, off.kv_offloading_dir, pin_memory=device.type == "cuda",
                        namespace=model_identity(config, model_dir, plan, device, blob))
    else:
        tier = HostTier(capacity, blob, pin_memory=device.type == "cuda")
    manager = OffloadManager(tier, len(groups), groups[0].block_size, has_state=bool(state_caches),
                             windows=[g.window if g.policy is CachePolicy.SLIDING else None for g in groups])
    logger.info("KV offloading: %s tier of %d blocks of %d bytes", off.kv_offloading_backend, capacity, blob)
    return manager, io


@dataclass
class EngineParts:
    arch: ModelArch
    model_dir: Path
    tokenizer: object
    tokenizer_dir: Path  # where ``tokenizer`` was loaded from (a server's frontend loads it too)
    max_model_len: int
    device: torch.device
    dtype: str
    platform: Platform
    groups: list[KVCacheGroup]
    backend_names: list[str]
    num_blocks: int
    kv_manager: KVCacheManager
    runner: ModelRunner
    plan: EnginePlan  # what the groups, backends and bytes above were taken from
    config: EngineConfig  # the one given, its batch limits resolved (what the engine runs with)
    batch_limits: BatchLimits  # those limits, each with why it has its value
    workers: WorkerGroup | None = None  # tensor parallel, rank 0: the ranks it started


def resolve_model_dir(model: str, revision: str | None = None, *, weights: bool = True) -> Path:
    """The directory of a model: a local directory, a model shipped with the package, or a
    Hugging Face hub id (``org/name``, at ``revision``) from the local cache or downloaded
    (``hub.py``; ``weights`` False fetches no safetensors)."""
    from attnserve.hub import is_hub_id, resolve_hub_model
    from attnserve.presets import resolve_model_preset

    path = Path(model).expanduser()
    if path.is_dir():
        return path
    preset = resolve_model_preset(model)
    if preset is not None:
        return preset
    if is_hub_id(model):
        return resolve_hub_model(model, revision, weights=weights)
    raise FileNotFoundError(f"model '{model}' is neither a directory with a config.json nor a Hugging Face "
                            f"model id (org/name)")


def _device_and_platform(config: EngineConfig) -> tuple[torch.device, Platform]:
    if config.model.device:
        device = torch.device(config.model.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device '{config.model.device}' was asked for, but CUDA is not available here")
        name = "cpu" if device.type == "cpu" else ("rocm" if getattr(torch.version, "hip", None) else "cuda")
        return device, get_platform(name)
    platform = current_platform()
    return torch.device("cuda" if platform.device_type == "cuda" else "cpu"), platform


def _start_parallel(config: EngineConfig, arch: ModelArch, parallel: ParallelState | None
                    ) -> tuple[ParallelState | None, WorkerGroup | None]:
    """This process's rank and, on rank 0, the workers it started; (None, None) for one rank."""
    if config.parallel.tensor_parallel_size == 1:
        return None, None
    if parallel is not None:  # a worker: rank 0 started it
        return parallel, None
    if config.offload.kv_offloading_size is not None:
        raise ValueError("KV offloading is not supported with tensor_parallel_size > 1 yet")
    check_supported(arch, get_model_class(arch), config.parallel.tensor_parallel_size)
    workers = WorkerGroup.start(config, run_worker)
    return workers.parallel, workers


def run_worker(parallel: ParallelState) -> None:
    """A rank > 0 after joining the group: build its shard like rank 0, then serve its steps
    until rank 0 stops it (``runner/worker.serve_steps``)."""
    group = step_group()
    config = receive_config(group, parallel.rank)
    runner = build_engine_parts(config, parallel).runner
    logger.info("tensor-parallel rank %d of %d ready on %s", parallel.rank, parallel.world_size, runner.device)
    serve_steps(runner, group)


def build_engine_parts(config: EngineConfig, parallel: ParallelState | None = None) -> EngineParts:
    """Everything an engine (or a tensor-parallel rank) runs with.

    Args:
        parallel: a tensor-parallel worker's rank (``run_worker``); None on rank 0, which
            starts the other ranks itself when ``tensor_parallel_size`` > 1.
    """
    model_dir = resolve_model_dir(config.model.model, config.model.revision,
                                  weights=config.model.load_format != "dummy")
    if config.model.revision is not None and parallel is None and Path(config.model.model).expanduser().is_dir():
        # a revision picks a hub snapshot; a local directory or shipped preset is what it is
        logger.warning("revision '%s' is ignored: %s is a local directory, not a hub model id",
                       config.model.revision, model_dir)
    arch = read_arch(load_hf_config(model_dir), use_mla=not env.mla_disabled())
    if config.model.load_format != "dummy":  # an unsupported checkpoint format fails before any weight is read
        QuantScheme.from_config(arch.quantization_config)
        check_quantization_option(config.model.quantization, arch.quantization_config)
    check_host_latents(config, arch)
    parallel, workers = _start_parallel(config, arch, parallel)
    try:
        return _build_parts(config, model_dir, arch, parallel, workers)
    except BaseException:
        if workers is not None:  # do not leave the other ranks waiting in a collective
            workers.abort()
        raise


def _build_parts(config: EngineConfig, model_dir: Path, arch: ModelArch, parallel: ParallelState | None,
                 workers: WorkerGroup | None) -> EngineParts:
    from attnserve.tokenizer import load_tokenizer

    device, platform = _device_and_platform(config)
    if device.type == "cuda":  # an engine deleted before this one: its cycles collected, its cached
        gc.collect()  # blocks handed back, so the memory this engine measures as free is all there is
        torch.cuda.empty_cache()
    config = with_block_size(config, arch, platform)  # every later reader sees the resolved size
    # each rank caches its own heads (tensor parallelism); the pool has as many blocks on every rank
    plan = prepare_kernels(plan_engine(arch, config, platform), config)  # the CPU extension builds here
    logger.info("dtype %s: %s", plan.dtype, plan.dtype_reason)
    check_memory_budgets(config, plan, device)  # before the weights load
    max_len = plan.max_model_len
    # every rank resolves the limits the same way (the same defaults; the caps agree by min_over_ranks)
    limits = resolve_batch_limits(config.scheduler, device.type, _device_memory(device), config.usage_context,
                                  max_len)
    config = replace(config, scheduler=limits.apply(config.scheduler))
    if arch.max_position_embeddings and config.model.max_model_len and max_len > arch.derived_max_model_len:
        logger.warning("max_model_len %d exceeds the %d the model is configured for (max_position_embeddings, "
                       "RoPE scaling applied)", max_len, arch.derived_max_model_len)
    try:
        tokenizer_dir = resolve_model_dir(config.model.tokenizer, weights=False) if config.model.tokenizer else model_dir
    except FileNotFoundError as e:  # the message says "model": name the option
        raise FileNotFoundError(f"tokenizer: {e}") from None
    tokenizer = load_tokenizer(tokenizer_dir)
    groups = list(plan.layout.groups)  # the paged groups; state layers get slots instead
    backend_names = plan.backend_names  # raises when a group has no backend, or needs several
    # each with the kernel variants the plan chose for its group (raises when an operation has none)
    backends: list[AttentionBackend] = [load_backend(n)(config.cache.block_size, g.kernel_names())
                                        for n, g in zip(backend_names, plan.groups)]
    host_latents = plan_host_latents(config, arch, plan.layout, max_len,
                                     config.scheduler.max_num_seqs)  # None unless kv_offload_sparse_latents
    backends = wrap_backends(host_latents, groups, backends, device)

    start = time.perf_counter()
    with model_kernels(plan.model_kernel_names()):  # the dense and MoE layers read their variants
        model = _build_model(arch, model_dir, config, device, _TORCH_DTYPES[plan.dtype])
    _log_weights(config, arch, model_dir, model, time.perf_counter() - start)
    if parallel is not None:  # every rank loaded the whole checkpoint: keep this rank's shard
        shard_model(model, parallel)
    num_blocks, state_pool, limits = _size_cache(plan, config, limits, model, backends, device, parallel,
                                                 host_latents)
    config = replace(config, scheduler=limits.apply(config.scheduler))
    kv = KVCacheManager(groups, num_blocks, config.cache.enable_prefix_caching, state_pool)
    one_seq = kv.num_blocks_for_tokens(max_len)
    if one_seq > num_blocks - 1:
        raise ValueError(f"the KV cache holds {num_blocks - 1} blocks of {config.cache.block_size} tokens, "
                         f"but one sequence of max_model_len={max_len} needs {one_seq}; lower max_model_len "
                         f"or give the cache more memory")
    state_groups = list(plan.state_groups)
    state_layers = frozenset(e.layer for g in state_groups for e in g.entries)
    caches = allocate_kv_cache(model, plan.layout, num_blocks, device, backends, state_layers,
                               host_entries=host_latents.entries if host_latents else frozenset())
    state_caches = allocate_state_cache(model, state_groups, state_pool.num_slots, device, backends) \
        if state_pool is not None else []
    offload, offload_io = _build_offload(config, plan, groups, caches, state_caches, device, model_dir)
    graphs = not config.model.enforce_eager and parallel is None
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if graphs and device.type == "cuda" and not all(m.graph_safe(device) for m in experts):
        # the PyTorch expert loop sizes its slices on the host (a sync) that a graph cannot
        # replay; the Triton kernels (SwiGLU, GPT-OSS's clamp) do not
        logger.info("CUDA graphs off: the MoE activation '%s' has no grouped kernel",
                    next(m for m in experts if not m.graph_safe(device)).act)
        graphs = False
    runner = ModelRunner(model, arch, groups, backends, device, max_model_len=max_len,
                         max_num_seqs=config.scheduler.max_num_seqs,
                         cuda_graphs=graphs,
                         state_caches=state_caches, offload=offload, offload_io=offload_io,
                         broadcaster=workers.broadcaster if workers is not None else None)
    return EngineParts(arch=arch, model_dir=model_dir, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                       max_model_len=max_len, device=device,
                       dtype=plan.dtype, platform=platform, groups=groups, backend_names=backend_names,
                       num_blocks=num_blocks, kv_manager=kv, runner=runner, plan=plan, config=config,
                       batch_limits=limits, workers=workers)


def check_memory_budgets(config: EngineConfig, plan: EnginePlan, device: torch.device) -> None:
    """Refuse, by the option's name, a KV cache or host offload budget larger than the memory
    that would hold it (the device's total; on the CPU, and for the host tier, the host memory
    available now), instead of failing in an allocation later."""
    cache, off = config.cache, config.offload
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).total_memory
        where = f"the {limit / GIB:.1f} GiB of {device}"
    else:
        limit = host_available_bytes()
        where = f"the {limit / GIB:.1f} GiB of host memory available"
    kv = None
    if cache.kv_cache_memory is not None:
        kv = int(cache.kv_cache_memory * GIB)
        if kv > limit:
            raise ValueError(f"kv_cache_memory is {cache.kv_cache_memory:g} GiB, more than {where}")
    if cache.num_gpu_blocks_override is not None:
        kv = cache.num_gpu_blocks_override * plan.bytes_per_block
        if kv > limit:
            raise ValueError(f"num_gpu_blocks_override={cache.num_gpu_blocks_override} blocks of "
                             f"{plan.bytes_per_block} bytes are {kv / GIB:.3g} GiB, more than {where}")
    if off.kv_offloading_size is not None and off.kv_offloading_backend == "host":
        host = host_available_bytes() - ((kv or 0) if device.type == "cpu" else 0)
        if off.kv_offloading_size * GIB > host:
            raise ValueError(f"kv_offloading_size is {off.kv_offloading_size:g} GiB of host memory, but only "
                             f"{max(host, 0) / GIB:.1f} GiB is available"
                             f"{' beside the KV cache' if kv and device.type == 'cpu' else ''}")


def _device_memory(device: torch.device) -> int | None:
    """A CUDA device's total memory in bytes; None for the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def _size_cache(plan: EnginePlan, config: EngineConfig, limits: BatchLimits, model: torch.nn.Module,
                backends: list[AttentionBackend], device: torch.device, parallel: ParallelState | None,
                host_latents: HostLatentPlan | None) -> tuple[int, StatePool | None, BatchLimits]:
    """The block pool's size (the null block included), the state slots and the batch limits
    capped by them (defaults only), once the weights are in memory, from what is left."""
    max_len = plan.max_model_len
    limits = _cap_by_state(plan, config, limits, device, parallel)
    config = replace(config, scheduler=limits.apply(config.scheduler))
    per_block = plan.bytes_per_block if host_latents is None else host_latents.device_bytes_per_block
    needed = (config.scheduler.max_num_seqs * plan.layout.blocks_for(max_len) + 1) * per_block
    state_pool, state_bytes = None, 0
    if plan.state_groups:  # one slot per running sequence, and snapshot slots for prefix hits
        wanted = config.cache.num_state_snapshots
        snapshots = config.scheduler.max_num_seqs if wanted is None else wanted
        snapshots = snapshots if config.cache.enable_prefix_caching else 0
        state_pool = StatePool(config.scheduler.max_num_seqs, snapshots)
        state_bytes = state_pool.num_slots * plan.state_bytes_per_sequence
    staging_bytes = 0 if host_latents is None else host_latents.staging_bytes
    activations = None
    if device.type in _PROFILED_DEVICES and parallel is None and host_latents is None:
        # the largest step once on dummy tokens: its activation peak is kept out of the KV
        # budget, and the kernels it launches are compiled now, not in a user's first step
        activations = profile_step(model, plan.arch, plan.layout, list(plan.state_groups), backends, config,
                                   device, max_len, graph_pool=not config.model.enforce_eager)
    num_blocks = determine_num_blocks(plan.layout, config.cache, device, needed, state_bytes + staging_bytes,
                                      per_block, activations)
    if parallel is not None:
        num_blocks = min_over_ranks(num_blocks)
    if host_latents is not None:
        num_blocks = host_latents.host_blocks(num_blocks, plan.layout.blocks_for(max_len), device)
    return num_blocks, state_pool, limits.cap_by_blocks(num_blocks - 1)


def _cap_by_state(plan: EnginePlan, config: EngineConfig, limits: BatchLimits, device: torch.device,
                  parallel: ParallelState | None) -> BatchLimits:
    """A default max_num_seqs capped so that a hybrid model's state slots leave half the GPU's
    budget to the KV blocks (CPU: its default of 128 is left as it is)."""
    cache = config.cache
    if not plan.state_groups or device.type != "cuda" or cache.num_gpu_blocks_override is not None:
        return limits
    per_seq = plan.state_bytes_per_sequence
    fixed = 0 if cache.num_state_snapshots is None or not cache.enable_prefix_caching \
        else cache.num_state_snapshots * per_seq
    snapshots_per_seq = int(cache.num_state_snapshots is None and cache.enable_prefix_caching)
    capped = limits.cap_by_state(device_budget_bytes(cache, device) - fixed, per_seq, snapshots_per_seq)
    if parallel is not None:  # every rank the same
        capped = limits.capped(min_over_ranks(capped.max_num_seqs), "the smallest of the ranks' caps")
    if capped is not limits:
        logger.info("max_num_seqs: %s", capped.seqs_reason)
    return capped


def _build_model(arch: ModelArch, model_dir: Path, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype) -> torch.nn.Module:
    cls = get_model_class(arch)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(arch)
    finally:
        torch.set_default_dtype(previous)
    # Factory calls in __init__ follow the device context unless another library has spoiled
    # torch's cached table of constructors: after transformers' from_pretrained in the same
    # process, torch.linspace (GDN's A_log) builds on the CPU. .to() moves any such straggler.
    model.to(device)
    fmt = config.model.load_format
    if fmt == "auto" and _is_weightless_preset(model_dir):
        logger.warning("%s ships no weights: using seeded random weights", model_dir.name)
        fmt = "dummy"
    if fmt == "dummy":  # random weights: quantisation does not apply
        dummy_init(model, config.model.seed)
        return model.eval()
    weights = iter_safetensors(model_dir)
    scheme = QuantScheme.from_config(arch.quantization_config)
    if scheme is not None:  # dequantised to the model dtype as they are read
        weights = dequantized_weights(weights, scheme, dtype)
    model.load_weights(weights)
    if config.model.check_weights_finite:
        check_finite_weights(model, model_dir)
    return model.eval()


def _log_weights(config: EngineConfig, arch: ModelArch, model_dir: Path, model: torch.nn.Module,
                 seconds: float) -> None:
    """The start-up line of the model's weights: its architecture, where from, their size."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    fmt = config.model.load_format
    random = fmt == "dummy" or (fmt == "auto" and _is_weightless_preset(model_dir))
    where = "" if Path(config.model.model).expanduser().resolve() == model_dir.resolve() else f" from {model_dir}"
    logger.info("weights: %s (%s)%s, %s, %s in %.1f s", config.model.model,
                ", ".join(arch.architectures) or arch.model_type, where,
                f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB",
                "random" if random else "loaded", seconds)


def _is_weightless_preset(model_dir: Path) -> bool:
    from attnserve.presets import MODEL_DIR

    return model_dir.resolve().parent == MODEL_DIR.resolve() and not any(model_dir.glob("*.safetensors"))
