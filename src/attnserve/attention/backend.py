"""The attention backend contract: ``Capabilities`` + ``build_metadata`` + ``forward``.

A backend declares what it can run (``Capabilities``, kept in the registry table so that
selection never imports optional libraries), builds its metadata once per batch and KV cache
group, and runs ``forward`` per layer. It knows nothing of requests or model families.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnserve.arch import LayerKind

if TYPE_CHECKING:
    import torch

    from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["AttentionBackend", "BackendRequest", "Capabilities", "FEATURES"]

FEATURES = ("sliding_window", "alibi", "sinks", "softcap", "streaming")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can run. ``None`` for head or block sizes means any."""

    layer_kinds: frozenset[LayerKind]
    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[str]
    platforms: Mapping[str, tuple[int, int] | None]  # platform -> minimum compute capability
    features: frozenset[str] = frozenset()
    head_sizes: frozenset[int] | None = None
    block_size_multiple: int = 1
    requires: tuple[str, ...] = ()  # optional Python modules (flash_attn, flashinfer, ...)


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """What one group of layers needs from a backend."""

    kind: LayerKind
    head_size: int
    dtype: str
    kv_cache_dtype: str  # the resolved storage dtype (fp8 or a float dtype)
    block_size: int
    features: frozenset[str] = frozenset()


class AttentionBackend(ABC):
    """One implementation of attention over a paged cache.

    Subclasses set ``name``; their capabilities are the registry entry of that name.
    """

    name: str = ""

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> Any:
        """Turn the step's common metadata into this backend's own, once per batch and group."""

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: Any, metadata: Any) -> torch.Tensor:
        """Write the new tokens' K/V into ``kv_cache`` and attend.

        Args:
            layer: the attention layer (scale, window, ALiBi slopes, sinks, soft-cap, heads).
            q: [num_tokens, num_heads, head_size] queries of the tokens scheduled this step.
            k, v: [num_tokens, num_kv_heads, head_size(_v)] their keys and values.
            kv_cache: this layer's cache tensors.
            metadata: what ``build_metadata`` returned for the layer's group.
        Returns:
            [num_tokens, num_heads, head_size_v] attention output.

        MLA backends take the same call with MLA meanings: ``q`` is [T, H, qk_nope + qk_rope]
        (q_nope, then the rotated q_pe), ``k`` the new latent rows [T, kv_lora_rank + qk_rope]
        (c_kv after its norm, k_pe after RoPE), ``v`` None, and the output [T, H, v_head_dim].
        """
