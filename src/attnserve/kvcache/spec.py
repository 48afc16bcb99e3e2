"""KV cache specs: what one layer keeps per token (or per sequence) and how many bytes that is.

Each cache-owning layer declares one spec per thing it caches (a sparse-MLA layer declares its
latent rows and its indexer keys). Specs are frozen and comparable: layers with equal specs
can share a block table. This file knows bytes and shapes, not models or requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "CACHE_DTYPE_BYTES",
    "CachePolicy",
    "FP8_MLA_TILE",
    "FullAttentionSpec",
    "IndexerCacheSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "StreamingSpec",
    "resolve_cache_dtype",
]

# Storage dtypes of cache entries; "fp8" is float8 e4m3 with scales kept beside the values.
CACHE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_KV_CACHE_DTYPE_ALIASES = {"auto": None, "fp8": "fp8", "fp8_e4m3": "fp8", "bfloat16": "bfloat16",
                           "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
                           "float32": "float32", "fp32": "float32", "float": "float32"}
FP8_MLA_TILE = 128  # the FP8 MLA latent keeps one fp32 scale per 128 values


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """``auto`` means the model's dtype; every other name maps to a storage dtype."""
    key = str(kv_cache_dtype).lower()
    if key not in _KV_CACHE_DTYPE_ALIASES:
        raise ValueError(f"unknown kv_cache_dtype '{kv_cache_dtype}' "
                         f"(choose from auto, fp8, bfloat16, float16, float32)")
    resolved = _KV_CACHE_DTYPE_ALIASES[key] or model_dtype
    if resolved not in CACHE_DTYPE_BYTES:
        raise ValueError(f"model dtype '{model_dtype}' cannot be a cache dtype")
    return resolved


class CachePolicy(str, Enum):
    """How a group's block table evolves as its requests advance (one manager each,
    ``kvcache/policies.py``); state layers keep a slot per sequence instead of blocks."""

    FULL = "full"  # every block, for the whole sequence
    SLIDING = "sliding"  # blocks that fall out of the window are dropped
    STREAMING = "streaming"  # StreamingLLM: the sink blocks and the window
    STATE = "state"  # a fixed-size state per sequence, no block table


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Base of every spec. ``bytes_per_token`` is per layer; 0 for per-sequence state."""

    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.dtype not in CACHE_DTYPE_BYTES:
            raise ValueError(f"unknown cache dtype '{self.dtype}'")

    @property
    def dtype_bytes(self) -> int:
        return CACHE_DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_sequence(self) -> int:
        """Fixed bytes per running sequence (state layers); 0 for per-token caches."""
        return 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of ``block_size`` tokens (state: one sequence's state)."""
        return self.block_size * self.bytes_per_token

    @property
    def policy(self) -> CachePolicy:
        """Which block-table policy serves this spec."""
        return CachePolicy.FULL


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 1
    head_size_v: int = 1

    @property
    def bytes_per_token(self) -> int:
        # K and V per KV head; fp8 keeps one scale per layer, not per token.
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 1
    head_size_v: int = 1
    sliding_window: int = 1

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def policy(self) -> CachePolicy:
        return CachePolicy.SLIDING

    def max_blocks_per_sequence(self) -> int:
        """Blocks a sequence needs at most: the window, plus one block it may straddle."""
        return math.ceil((self.sliding_window - 1) / self.block_size) + 1


@dataclass(frozen=True, slots=True)
class StreamingSpec(KVCacheSpec):
    """StreamingLLM: a sequence keeps its first ``sinks`` tokens and its last ``window``."""

    num_kv_heads: int = 1
    head_size: int = 1
    head_size_v: int = 1
    sinks: int = 4
    window: int = 1

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def policy(self) -> CachePolicy:
        return CachePolicy.STREAMING

    def max_blocks_per_sequence(self) -> int:
        """Sink blocks, plus the window and the block it may straddle."""
        return math.ceil(self.sinks / self.block_size) + math.ceil((self.window - 1) / self.block_size) + 1


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(KVCacheSpec):
    """One latent row per token: ``c_kv`` (after its norm) then ``k_pe`` (after RoPE).

    fp8 is the 656-byte layout of DeepSeek-V3.2/FlashMLA: ``kv_lora_rank`` e4m3 values, one fp32
    power-of-two scale per 128 of them, then ``qk_rope_head_dim`` bf16 RoPE values.
    """

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    @property
    def bytes_per_token(self) -> int:
        if self.dtype == "fp8":
            tiles = math.ceil(self.kv_lora_rank / FP8_MLA_TILE)
            return self.kv_lora_rank + 4 * tiles + 2 * self.qk_rope_head_dim
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class IndexerCacheSpec(KVCacheSpec):
    """The DSA indexer key per token: ``head_dim`` values, or in fp8 e4m3 plus one fp32 scale."""

    head_dim: int = 128

    @property
    def bytes_per_token(self) -> int:
        if self.dtype == "fp8":
            return self.head_dim + 4
        return self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class StateSpec(KVCacheSpec):
    """Fixed-size per-sequence state of a state layer (Gated DeltaNet, Mamba, lightning, KDA).

    ``dtype`` is the conv-state dtype; the recurrent state has its own (fp32 by default).
    """

    conv_shapes: tuple[tuple[int, ...], ...] = ()
    recurrent_shapes: tuple[tuple[int, ...], ...] = ()
    recurrent_dtype: str = "float32"

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def bytes_per_sequence(self) -> int:
        conv = sum(math.prod(s) for s in self.conv_shapes) * self.dtype_bytes
        rec = sum(math.prod(s) for s in self.recurrent_shapes) * CACHE_DTYPE_BYTES[self.recurrent_dtype]
        return conv + rec

    @property
    def page_size_bytes(self) -> int:
        return self.bytes_per_sequence

    @property
    def policy(self) -> CachePolicy:
        return CachePolicy.STATE
