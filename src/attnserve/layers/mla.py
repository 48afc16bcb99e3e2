"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2): the projections and the latent hand-off.

What this file is: the attention module of an MLA layer. It computes
``q = q_b(RMSNorm(q_a(x)))`` (or ``q_proj(x)`` without a q LoRA), splits each head into
``q_nope | q_pe``, computes the latent ``[c_kv | k_pe] = kv_a_proj_with_mqa(x)``, normalises
``c_kv`` with ``kv_a_layernorm``, rotates ``q_pe`` and ``k_pe`` (interleaved GPT-J pairs for
DeepSeek; YaRN's cos/sin factor included, its softmax correction is ``LayerSpec.scale``), hands
the backend the queries and one latent row per new token, and applies ``o_proj``.

Three modes, fixed by the layer's ``LayerSpec.kind``:

- ``LayerKind.MLA``: this module owns the layer's latent cache (the runner binds ``layer_id``,
  ``kv_cache``, ``backend``, ``group_id`` on it). The backend (``TORCH_MLA``) writes the rows
  and attends; it reads ``kv_b_proj`` through ``w_kv_b`` to expand or absorb.
- ``LayerKind.SPARSE_MLA`` (DSA: DeepSeek-V3.2, GLM-5): the same latent cache, plus the
  lightning indexer (``layers/indexer.py``) fed with the q latent ``c_q``. The backend
  (``TORCH_MLA_SPARSE``) stores the indexer keys, selects each token's top-k positions
  (``select_topk``) and attends over those rows only. A GLM-5 "shared" layer
  (``IndexerDims.has_cache`` False) has no indexer and reuses the previous full layer's top-k,
  which the model threads from layer to layer through ``forward_with_topk``.
- ``LayerKind.FULL`` (``ATTNSERVE_MLA_DISABLE=1``): new tokens' latents are expanded here
  through ``kv_b_proj`` into per-head K ``[k_nope | k_pe]`` and V, and a standard ``Attention``
  layer caches them like any MHA model.

What it is not: no attention or indexer arithmetic (that is the backend's, and
``reference_mla.py`` is the twin), no weight dequantisation of FP8 checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.core.forward_context import get_forward_context
from attnserve.layers.attention import Attention
from attnserve.layers.indexer import Indexer
from attnserve.layers.linear import MergedLinear, Target, fused_rename
from attnserve.layers.norm import RMSNorm
from attnserve.layers.rotary import get_rope

__all__ = ["MLAAttention"]

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """One MLA layer's attention: ``forward(positions [T], hidden [T, D]) -> [T, D]``;
    sparse models use ``forward_with_topk``, which also hands on the layer's top-k.

    Parameter names follow the HF checkpoints, except that with a q LoRA ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` are fused into ``fused_qkv_a_proj`` (shards 0 and 1).
    """

    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        dims = spec.mla
        if dims is None:
            raise ValueError(f"layer {spec.index}: MLAAttention needs LayerSpec.mla")
        bias = dims.attention_bias
        hidden = arch.hidden_size
        self.num_heads = spec.num_heads
        self.q_lora_rank = dims.q_lora_rank
        self.kv_lora_rank = dims.kv_lora_rank
        self.qk_nope_head_dim = dims.qk_nope_head_dim
        self.qk_rope_head_dim = dims.qk_rope_head_dim
        self.qk_head_dim = dims.qk_head_dim
        self.v_head_dim = dims.v_head_dim
        self.scale = spec.scale
        latent = dims.kv_lora_rank + dims.qk_rope_head_dim
        if dims.q_lora_rank:
            self.fused_qkv_a_proj = MergedLinear(hidden, [dims.q_lora_rank, latent], bias=bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(
                dims.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False
            )
        else:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, latent, bias=bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            dims.kv_lora_rank,
            self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
            bias=False,
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = get_rope(spec.rope, dims.qk_rope_head_dim)
        self.use_latent_cache = spec.kind.is_mla
        self.is_sparse = spec.kind is LayerKind.SPARSE_MLA
        self.indexer: Indexer | None = None
        if self.is_sparse and spec.indexer is not None and spec.indexer.has_cache:
            self.indexer = Indexer(arch, spec)
        if self.use_latent_cache:
            # bound by the model runner once the KV cache is allocated
            self.layer_id = spec.index
            self.backend: Any = None
            self.group_id: int = -1
            self.kv_cache: Any = None
        else:
            self.attn = Attention(spec)

    def rename(self, suffix: str) -> Target:
        """Checkpoint ``q_a_proj.*`` / ``kv_a_proj_with_mqa.*`` -> (``fused_qkv_a_proj.*``, 0 / 1)
        when they are fused (with a q LoRA); every other name is this module's own."""
        if not self.q_lora_rank:
            return suffix
        return fused_rename(suffix, "fused_qkv_a_proj", (("q_a_proj", 0), ("kv_a_proj_with_mqa", 1)))

    @property
    def w_kv_b(self) -> torch.Tensor:
        """``kv_b_proj`` as [H, d_nope + d_v, kv_lora_rank]: rows ``[:d_nope]`` are W_UK, the
        rest W_UV (a view, so it always follows the loaded weight)."""
        return self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )

    def _project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """hidden [T, D] -> (c_q [T, q_lora_rank] or None, q [T, H * qk_head_dim],
        latent [T, kv_lora_rank + rope])."""
        if self.q_lora_rank:
            q_c, latent = self.fused_qkv_a_proj(hidden).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q_c = self.q_a_layernorm(q_c)
            return q_c, self.q_b_proj(q_c), latent
        return None, self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden [T, D] -> [T, D] (a GLM-5 shared layer needs
        ``forward_with_topk``)."""
        return self.forward_with_topk(positions, hidden, None)[0]

    def forward_with_topk(
        self, positions: torch.Tensor, hidden: torch.Tensor, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and the top-k indices it attended over.

        Args:
            positions: [T] absolute positions; hidden: [T, D] the normed hidden state.
            topk_indices: [T, K] the previous sparse layer's top-k (used by a layer without an
                indexer, a GLM-5 "shared" layer; ignored by the others).
        Returns:
            (out [T, D], top-k [T, K] int32 absolute positions with -1 for unused slots:
            this layer's own, or the ones it reused; None for a dense MLA layer).
        """
        t = hidden.shape[0]
        q_c, q, latent = self._project(hidden)
        q = q.view(t, self.num_heads, self.qk_head_dim)  # [T, H, d_nope + R]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        ctx = get_forward_context()
        if self.rotary_emb is not None:
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1), ctx.token_seq_lens)
            k_pe = k_pe.squeeze(1)  # [T, 1, R] -> [T, R]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, d_nope + R]
        if self.use_latent_cache:
            rows = torch.cat([c_kv, k_pe], dim=-1)  # [T, kv_lora_rank + R]
            out, topk_indices = self._latent_attention(
                positions, hidden, q_c, q, rows, topk_indices
            )
        else:
            out, topk_indices = self._expanded_attention(q, c_kv, k_pe), None
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim)), topk_indices

    def _latent_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q_c: torch.Tensor | None,
        q: torch.Tensor,
        rows: torch.Tensor,
        topk_indices: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backend over the latent cache: (out [T, H, d_v], top-k or None when dense)."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata[self.group_id]
        if not self.is_sparse:
            return self.backend.forward(self, q, rows, None, self.kv_cache, meta), None
        if self.indexer is not None:
            q_i, k_i, w_i = self.indexer(positions, hidden, q_c, ctx.token_seq_lens)
            topk_indices = self.backend.select_topk(
                q_i, k_i, w_i, self.kv_cache, meta, topk=self.indexer.topk
            )  # [T, index_topk]
        elif topk_indices is None:
            raise ValueError(
                f"sparse MLA layer {self.layer_id} shares the previous layer's "
                f"top-k, but none was given"
            )
        out = self.backend.forward(
            self, q, rows, None, self.kv_cache, meta, topk_indices=topk_indices
        )
        return out, topk_indices

    def _expanded_attention(
        self, q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        """MLA disabled: per-head K = [W_UK c_kv ; k_pe], V = W_UV c_kv into standard attention."""
        t, heads = q.shape[0], self.num_heads
        kv = self.kv_b_proj(c_kv).view(t, heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)  # [T, H, dk]
        return self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
