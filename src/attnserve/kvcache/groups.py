"""From a ModelArch to cache entries, KV cache groups, and the memory a sequence needs.

Each cache-owning layer declares one entry per thing it caches. Entries whose block tables
follow the same policy (full, a given sliding window, or per-sequence state) form a group. The
byte arithmetic here is shared by ``attnserve inspect`` and by the allocator, so that what
inspect promises is what the engine allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.config import DEFAULT_BLOCK_SIZE, CacheConfig
from attnserve.kvcache.spec import (
    CachePolicy,
    FullAttentionSpec,
    IndexerCacheSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    StreamingSpec,
    resolve_cache_dtype,
)

__all__ = ["CacheEntry", "KVCacheGroup", "KVCacheLayout", "cache_entries", "group_entries", "layer_specs",
           "plan_layout", "sequence_bytes", "sparse_latent_entries"]


@dataclass(frozen=True, slots=True)
class CacheEntry:
    layer: int
    name: str  # kv | latent | indexer | state
    spec: KVCacheSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    group_id: int
    policy: CachePolicy
    window: int | None
    entries: tuple[CacheEntry, ...]

    @property
    def block_size(self) -> int:
        return self.entries[0].spec.block_size

    @property
    def bytes_per_token(self) -> int:
        return sum(e.spec.bytes_per_token for e in self.entries)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id costs in this group: one page in every entry."""
        return sum(e.spec.page_size_bytes for e in self.entries)

    @property
    def bytes_per_sequence_state(self) -> int:
        return sum(e.spec.bytes_per_sequence for e in self.entries)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` holds at most in this group."""
        if self.policy is CachePolicy.STATE:
            return 1
        blocks = math.ceil(num_tokens / self.block_size)
        if self.policy in (CachePolicy.SLIDING, CachePolicy.STREAMING):
            spec = self.entries[0].spec
            assert isinstance(spec, (SlidingWindowSpec, StreamingSpec))
            blocks = min(blocks, spec.max_blocks_per_sequence())
        return blocks

    def bytes_for(self, num_tokens: int) -> int:
        return self.blocks_for(num_tokens) * self.page_size_bytes


def layer_specs(spec: LayerSpec, model_dtype: str, cache: CacheConfig) -> list[tuple[str, KVCacheSpec]]:
    """The cache entries one layer owns, as (name, spec)."""
    kv_dtype = resolve_cache_dtype(cache.kv_cache_dtype, model_dtype)
    # None: the engine resolves it per model and platform first (engine/plan.with_block_size);
    # a direct caller without a platform gets the platform-neutral default
    bs = DEFAULT_BLOCK_SIZE if cache.block_size is None else cache.block_size
    kind = spec.kind
    if cache.streaming_window is not None:
        if kind is not LayerKind.FULL:
            raise ValueError(f"StreamingLLM mode needs full-attention layers; layer {spec.index} is {kind.value}")
        return [("kv", StreamingSpec(block_size=bs, dtype=kv_dtype, num_kv_heads=spec.num_kv_heads,
                                     head_size=spec.head_size, head_size_v=spec.head_size_v,
                                     sinks=cache.streaming_sinks, window=cache.streaming_window))]
    if kind in (LayerKind.FULL, LayerKind.NSA):  # NSA's three branches all read the layer's full K/V
        return [("kv", FullAttentionSpec(block_size=bs, dtype=kv_dtype, num_kv_heads=spec.num_kv_heads,
                                         head_size=spec.head_size, head_size_v=spec.head_size_v))]
    if kind is LayerKind.SLIDING:
        return [("kv", SlidingWindowSpec(block_size=bs, dtype=kv_dtype, num_kv_heads=spec.num_kv_heads,
                                         head_size=spec.head_size, head_size_v=spec.head_size_v,
                                         sliding_window=spec.window))]
    if kind.is_mla:
        assert spec.mla is not None
        if kv_dtype == "fp8" and spec.mla.kv_lora_rank % 128:
            raise ValueError(f"kv_cache_dtype fp8 stores MLA latents in tiles of 128 values; kv_lora_rank "
                             f"{spec.mla.kv_lora_rank} is not a multiple of 128")
        out: list[tuple[str, KVCacheSpec]] = [
            ("latent", MLAAttentionSpec(block_size=bs, dtype=kv_dtype, kv_lora_rank=spec.mla.kv_lora_rank,
                                        qk_rope_head_dim=spec.mla.qk_rope_head_dim))]
        if spec.indexer is not None and spec.indexer.has_cache:
            idx_dtype = cache.indexer_cache_dtype
            if idx_dtype == "auto":
                idx_dtype = "fp8" if kv_dtype == "fp8" else model_dtype
            out.append(("indexer", IndexerCacheSpec(block_size=bs, dtype=resolve_cache_dtype(idx_dtype, model_dtype),
                                                    head_dim=spec.indexer.head_dim)))
        return out
    assert spec.state is not None
    conv_dtype = model_dtype if kv_dtype == "fp8" else kv_dtype
    return [("state", StateSpec(block_size=bs, dtype=conv_dtype, conv_shapes=spec.state.conv,
                                recurrent_shapes=spec.state.recurrent,
                                recurrent_dtype=resolve_cache_dtype(cache.mamba_ssm_cache_dtype, model_dtype)))]


def cache_entries(arch: ModelArch, cache: CacheConfig, model_dtype: str | None = None) -> list[CacheEntry]:
    dtype = model_dtype or arch.dtype
    return [CacheEntry(layer=s.index, name=name, spec=spec)
            for s in arch.layers for name, spec in layer_specs(s, dtype, cache)]


def sparse_latent_entries(arch: ModelArch, entries: list[CacheEntry]) -> list[CacheEntry]:
    """The latent entries of sparse-MLA (DSA) layers: what ``kv_offload_sparse_latents`` keeps in
    host memory (their indexer keys, and every other entry, stay on the device)."""
    return [e for e in entries if e.name == "latent" and arch.layers[e.layer].kind is LayerKind.SPARSE_MLA]


def group_entries(entries: list[CacheEntry]) -> list[KVCacheGroup]:
    """Entries with the same block-table policy (and window) share one group, in layer order."""
    order: list[tuple[CachePolicy, int | None]] = []
    members: dict[tuple[CachePolicy, int | None], list[CacheEntry]] = {}
    for e in entries:
        window = e.spec.sliding_window if isinstance(e.spec, SlidingWindowSpec) else None
        key = (e.spec.policy, window)
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(e)
    return [KVCacheGroup(group_id=i, policy=k[0], window=k[1], entries=tuple(members[k]))
            for i, k in enumerate(order)]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """How groups map onto memory.

    Every block id is one page in each *slot* (a set of tensors). With a single group each entry
    is its own slot. With several groups of the same page shape (sliding plus full layers),
    each group is split into chunks of ``L`` layers (``L`` the smallest group) and slot ``i`` is
    shared by the ``i``-th entry of every chunk, as vLLM's hybrid allocator does: a block id
    taken by one chunk is used only by that chunk's layers, so a sliding-window chunk that
    holds a few blocks per sequence really costs a few blocks.
    """

    groups: tuple[KVCacheGroup, ...]
    slots: tuple[tuple[CacheEntry, ...], ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(max(e.spec.page_size_bytes for e in slot) for slot in self.slots)

    @property
    def bytes_per_token(self) -> int:
        """Per-token bytes over every layer, sliding ones at their full rate."""
        return sum(g.bytes_per_token for g in self.groups)

    def blocks_for(self, num_tokens: int) -> int:
        return sum(g.blocks_for(num_tokens) for g in self.groups)

    def sequence_bytes(self, num_tokens: int) -> int:
        """Bytes one sequence of ``num_tokens`` holds at most (windows applied)."""
        return self.blocks_for(num_tokens) * self.bytes_per_block


def _page_shape(e: CacheEntry) -> tuple | None:
    spec = e.spec
    if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return (spec.block_size, spec.dtype, spec.num_kv_heads, spec.head_size, spec.head_size_v)
    return None


def plan_layout(entries: list[CacheEntry]) -> KVCacheLayout:
    """Group the per-token entries and lay them out (state entries are not paged here)."""
    token = [e for e in entries if e.spec.policy is not CachePolicy.STATE]
    groups = group_entries(token)
    shapes = {_page_shape(e) for e in token}
    if len(groups) <= 1 or len(shapes) != 1 or None in shapes:
        return KVCacheLayout(tuple(groups), tuple((e,) for e in token))
    size = min(len(g.entries) for g in groups)
    chunks: list[KVCacheGroup] = []
    for g in groups:
        for j in range(0, len(g.entries), size):
            chunks.append(KVCacheGroup(len(chunks), g.policy, g.window, g.entries[j:j + size]))
    slots = tuple(tuple(c.entries[i] for c in chunks if i < len(c.entries)) for i in range(size))
    return KVCacheLayout(tuple(chunks), slots)


def sequence_bytes(groups: list[KVCacheGroup], num_tokens: int) -> int:
    """Cache bytes one sequence of ``num_tokens`` holds at most, over every group, each entry
    paying its own pages (the layout of a single group; see ``KVCacheLayout`` for several)."""
    return sum(g.bytes_for(num_tokens) for g in groups)
