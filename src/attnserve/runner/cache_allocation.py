"""Sizing and allocating the KV cache tensors, and binding them to the model's layers.

The number of blocks comes from a memory budget (CUDA: ``gpu_memory_utilization`` of the
device's total memory, less what is in use after the weights and less the activations the
profiling pass measured, as vLLM counts it; CPU: ``kv_cache_memory`` GiB or a share of free
memory) or from ``num_gpu_blocks_override``. Every cache entry gets one tensor of ``num_blocks`` pages, so a
block id costs the sum of the entries' pages: the same arithmetic ``inspect`` reports.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from attnserve.config import CacheConfig
from attnserve.kvcache.groups import KVCacheGroup, KVCacheLayout
from attnserve.kvcache.spec import (
    FullAttentionSpec,
    IndexerCacheSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    StreamingSpec,
)
from attnserve.kvcache.state import StateCache

__all__ = ["allocate_kv_cache", "allocate_state_cache", "determine_num_blocks", "device_budget_bytes",
           "host_available_bytes",
           "torch_cache_dtype"]

logger = logging.getLogger(__name__)
GIB = 1024**3
_CPU_DEFAULT_SHARE = 0.1
_CPU_DEFAULT_CAP = 4 * GIB
_UNPROFILED_ACTIVATIONS = 512 * 1024**2  # CUDA, when no profiling pass ran (tensor parallel)


def torch_cache_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8": torch.float8_e4m3fn}[name]


def host_available_bytes() -> int:
    """Host memory available now (``MemAvailable``; 8 GiB where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def device_budget_bytes(cache: CacheConfig, device: torch.device, activation_bytes: int | None = None) -> int:
    """The bytes the KV cache and state slots may take: ``kv_cache_memory``, or (CUDA)
    ``gpu_memory_utilization`` of the device less what is in use and less the activations
    (``activation_bytes`` as profiled, else a fixed guess). Not for CPU without
    ``kv_cache_memory`` (its default budget depends on what the batch limits need)."""
    if cache.kv_cache_memory is not None:
        return int(cache.kv_cache_memory * GIB)
    if device.type != "cuda":
        raise ValueError("a CPU KV budget without kv_cache_memory follows the batch limits: see determine_num_blocks")
    free, total = torch.cuda.mem_get_info(device)
    activations = _UNPROFILED_ACTIVATIONS if activation_bytes is None else activation_bytes
    return int(total * cache.gpu_memory_utilization) - (total - free) - activations


def determine_num_blocks(layout: KVCacheLayout, cache: CacheConfig, device: torch.device,
                         needed_bytes: int, reserved_bytes: int = 0, per_block: int | None = None,
                         activation_bytes: int | None = None) -> int:
    """Blocks in the pool (the null block included).

    Args:
        needed_bytes: what ``max_num_seqs`` sequences of ``max_model_len`` tokens would use; the
            CPU default budget never exceeds it, so tiny models do not allocate gigabytes.
        reserved_bytes: taken from the budget first (state slots, staging buffers).
        per_block: device bytes of one block id (default: every entry's page; less when some
            entries live in host memory).
        activation_bytes: CUDA: the peak the profiling pass measured above the weights.
    """
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = layout.bytes_per_block if per_block is None else per_block
    if cache.kv_cache_memory is not None or device.type == "cuda":
        budget = device_budget_bytes(cache, device, activation_bytes)
        if cache.kv_cache_memory is None and budget < per_block + reserved_bytes:
            free, total = torch.cuda.mem_get_info(device)
            activations = _UNPROFILED_ACTIVATIONS if activation_bytes is None else activation_bytes
            raise ValueError(
                f"gpu_memory_utilization={cache.gpu_memory_utilization} of {total / GIB:.1f} GiB leaves no room for "
                f"the KV cache: {(total - free) / GIB:.2f} GiB are in use (weights, CUDA context, other "
                f"processes) and the largest step needs {activations / GIB:.2f} GiB of activations; raise "
                f"gpu_memory_utilization, lower max_num_batched_tokens, or free the device")
    else:
        budget = min(int(host_available_bytes() * _CPU_DEFAULT_SHARE), _CPU_DEFAULT_CAP,
                     needed_bytes + reserved_bytes)
    budget -= reserved_bytes  # state slots (and staging buffers) come out of the same budget
    num_blocks = budget // per_block + 1
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget ({(budget + reserved_bytes) / GIB:.3f} GiB, of which "
                         f"{reserved_bytes / GIB:.3f} GiB reserved for state slots or staging) holds no block of "
                         f"{per_block} bytes; raise kv_cache_memory or gpu_memory_utilization")
    return num_blocks


def _alloc(spec: KVCacheSpec, num_blocks: int, device: torch.device, pin_memory: bool = False):
    """One entry's paged tensors, zeroed: backends read whole blocks and mask what lies past a
    sequence's end, and masked never-written memory could hold NaN bit patterns (0 * NaN)."""
    if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, StreamingSpec)):
        dtype = torch_cache_dtype(spec.dtype)
        k = torch.zeros(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=dtype, device=device)
        v = torch.zeros(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size_v, dtype=dtype, device=device)
        return k, v
    if isinstance(spec, (MLAAttentionSpec, IndexerCacheSpec)):
        # fp8 rows are raw bytes in their documented layout; other dtypes are plain values
        width = spec.bytes_per_token if spec.dtype == "fp8" else spec.bytes_per_token // spec.dtype_bytes
        dtype = torch.uint8 if spec.dtype == "fp8" else torch_cache_dtype(spec.dtype)
        return torch.zeros(num_blocks, spec.block_size, width, dtype=dtype, device=device, pin_memory=pin_memory)
    raise NotImplementedError(f"no paged allocator for {type(spec).__name__}")


def allocate_kv_cache(model: nn.Module, layout: KVCacheLayout, num_blocks: int, device: torch.device,
                      backends: list, state_layers: frozenset[int] = frozenset(),
                      host_entries: frozenset[tuple[int, str]] = frozenset()) -> dict[tuple[int, str], object]:
    """Allocate one set of tensors per slot (its entries alias them) and bind them, with the
    group's backend, to each layer. ``host_entries`` (layer, name) go to host memory, pinned
    when the device is CUDA (host-resident sparse-MLA latents)."""
    caches: dict[tuple[int, str], object] = {}
    layer_group: dict[int, int] = {}
    specs = {(e.layer, e.name): e.spec for slot in layout.slots for e in slot}
    for slot in layout.slots:
        on_host = (slot[0].layer, slot[0].name) in host_entries
        if on_host and len(slot) > 1:
            raise ValueError("host-resident cache entries cannot share their tensors with others")
        tensors = _alloc(slot[0].spec, num_blocks, torch.device("cpu") if on_host else device,
                         pin_memory=on_host and device.type == "cuda")
        for e in slot:
            assert e.spec.page_size_bytes == slot[0].spec.page_size_bytes, "slot members differ in page shape"
            caches[(e.layer, e.name)] = tensors
    for g in layout.groups:
        for e in g.entries:
            layer_group[e.layer] = g.group_id
    for module in model.modules():
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "kv_cache") or layer_id in state_layers:
            continue
        if layer_id not in layer_group:
            raise RuntimeError(f"layer {layer_id} declares a cache but no KV cache group holds it")
        gid = layer_group[layer_id]
        module.group_id = gid
        module.backend = backends[gid]
        # standard layers get their (key_cache, value_cache); others a dict by entry name
        own = {name: t for (lid, name), t in caches.items() if lid == layer_id}
        module.kv_cache = own["kv"] if set(own) == {"kv"} else own
        spec = specs[(layer_id, "kv")] if (layer_id, "kv") in specs else None
        if isinstance(spec, StreamingSpec):
            module.streaming = (spec.sinks, spec.window)
    _bind_rotary_for_streaming(model)
    host = sum(slot[0].spec.page_size_bytes for slot in layout.slots if (slot[0].layer, slot[0].name) in host_entries)
    # usable blocks, as the engine's start-up summary counts them (block 0 is the null block)
    logger.info("KV cache: %s blocks of %d bytes and the null block (%.3f GiB) on %s%s", f"{num_blocks - 1:,}",
                layout.bytes_per_block - host, num_blocks * (layout.bytes_per_block - host) / GIB, device,
                f", and {host} bytes per block ({num_blocks * host / GIB:.3f} GiB) in host memory" if host else "")
    return caches


def _bind_rotary_for_streaming(model: nn.Module) -> None:
    """StreamingLLM re-rotates sink keys: give each streaming attention layer its RoPE."""
    for parent in model.modules():
        attn = getattr(parent, "attn", None)
        if getattr(attn, "streaming", None) is None:
            continue
        rope = getattr(parent, "rotary_emb", None)
        if rope is not None and rope.attention_factor != 1.0:
            raise ValueError("StreamingLLM mode re-rotates sink keys, which needs a RoPE without an "
                             f"attention factor; this model's {rope.cfg.rope_type} RoPE has one")
        attn.rotary_emb = rope
    for module in model.modules():
        if getattr(module, "streaming", None) is not None and not hasattr(module, "rotary_emb"):
            raise ValueError(f"StreamingLLM mode: layer {module.layer_id} has no RoPE module beside it "
                             f"(this model family does not support streaming yet)")


def allocate_state_cache(model: nn.Module, groups: list[KVCacheGroup], num_slots: int, device: torch.device,
                         backends: list) -> list[StateCache]:
    """Allocate each state layer's slot tensors (zeroed; slot 0 is the null slot, scratch for padded graph rows) and bind
    them, with the group's backend, to the layer module (``layer_id`` + ``state_cache``)."""
    by_layer: dict[int, tuple[StateCache, int]] = {}
    for g in groups:
        for e in g.entries:
            spec = e.spec
            assert isinstance(spec, StateSpec)
            conv = tuple(torch.zeros(num_slots, *shape, dtype=torch_cache_dtype(spec.dtype), device=device)
                         for shape in spec.conv_shapes)
            rec = tuple(torch.zeros(num_slots, *shape, dtype=torch_cache_dtype(spec.recurrent_dtype), device=device)
                        for shape in spec.recurrent_shapes)
            by_layer[e.layer] = (StateCache(conv, rec), g.group_id)
    bound = set()
    for module in model.modules():
        layer_id = getattr(module, "layer_id", None)
        if layer_id is None or not hasattr(module, "state_cache"):
            continue
        if layer_id not in by_layer:
            raise RuntimeError(f"layer {layer_id} declares a state cache but its spec has no state")
        cache, gid = by_layer[layer_id]
        module.state_cache, module.group_id, module.backend = cache, gid, backends[gid]
        bound.add(layer_id)
    missing = sorted(set(by_layer) - bound)
    if missing:
        raise RuntimeError(f"state layers {missing} have no module with a state_cache attribute")
    return [c for c, _ in by_layer.values()]
