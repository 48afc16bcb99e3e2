"""The DSA lightning indexer of a sparse-MLA layer (DeepSeek-V3.2, GLM-5): its projections.

What this file is: the module that turns a layer's normed hidden state ``x`` [T, D] and the MLA
query latent ``c_q`` [T, q_lora_rank] (after ``q_a_layernorm``, shared with MLA) into what the
indexer scores with:

- queries ``q = wq_b(c_q)`` [T, H_I, D_I];
- one key per token ``k = k_norm(wk(x))`` [T, D_I], ``k_norm`` a LayerNorm with weight and bias
  (eps 1e-6, not RMSNorm);
- RoPE on the first ``qk_rope_head_dim`` dims of both (the rope part comes first, the opposite
  of MLA), with the MLA's frequencies (YaRN included) in the indexer's own layout: half-split
  for DeepSeek-V3.2, interleaved for GLM-5 (``IndexerDims.rope_interleaved``);
- head weights ``weights_proj(x)`` [T, H_I] in float32: the projection is kept in float32
  whatever the model dtype, as transformers keeps it.

What it is not: the key cache, the scores (ReLU-weighted, summed over heads, with the
``H_I^-0.5`` and ``D_I^-0.5`` scalings), the causal mask and top-k belong to the backend
(``TORCH_MLA_SPARSE``; ``attention/reference_mla.indexer_topk`` is the twin). GLM-5 "shared"
layers have no indexer: they reuse the previous full layer's top-k.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.norm import LayerNorm
from attnserve.layers.rotary import get_rope

__all__ = ["Indexer"]

_K_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer: nn.LayerNorm(head_dim, eps=1e-6)


class Indexer(nn.Module):
    """``forward(positions, hidden, q_latent, seq_lens) -> (q [T, H_I, D_I], k [T, D_I],
    weights [T, H_I] float32)``. Parameter names follow the HF checkpoints
    (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``)."""

    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        dims, mla = spec.indexer, spec.mla
        if dims is None or mla is None:
            raise ValueError(f"layer {spec.index}: Indexer needs LayerSpec.indexer and .mla")
        if not mla.q_lora_rank:
            raise ValueError(
                f"layer {spec.index}: the DSA indexer reads the MLA q latent, "
                f"so it needs q_lora_rank"
            )
        if mla.qk_rope_head_dim > dims.head_dim:
            raise ValueError(
                f"layer {spec.index}: index_head_dim {dims.head_dim} is smaller "
                f"than qk_rope_head_dim {mla.qk_rope_head_dim}"
            )
        self.n_heads = dims.n_heads
        self.head_dim = dims.head_dim
        self.topk = dims.topk
        self.wq_b = nn.Linear(mla.q_lora_rank, dims.n_heads * dims.head_dim, bias=False)
        self.wk = nn.Linear(arch.hidden_size, dims.head_dim, bias=False)
        self.k_norm = LayerNorm(dims.head_dim, eps=_K_NORM_EPS)
        self.weights_proj = nn.Linear(
            arch.hidden_size, dims.n_heads, bias=False, dtype=torch.float32
        )
        rope = None if spec.rope is None else replace(spec.rope, interleaved=dims.rope_interleaved)
        self.rotary_emb = get_rope(rope, dims.head_dim)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indexer queries, keys and head weights of the new tokens.

        Args:
            positions: [T] absolute positions.
            hidden: [T, D] the normed hidden state MLA projects from.
            q_latent: [T, q_lora_rank] MLA's ``q_a_layernorm(q_a_proj(x))``.
            seq_lens: [T] per-token sequence lengths for length-dependent RoPE (or None).
        Returns:
            (q [T, H_I, D_I] and k [T, D_I] after RoPE, in the model dtype; the raw head
            weights [T, H_I] in float32).
        """
        t = hidden.shape[0]
        q = self.wq_b(q_latent).view(t, self.n_heads, self.head_dim)  # [T, H_I, D_I]
        k = self.k_norm(self.wk(hidden))  # [T, D_I]
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k.unsqueeze(1), seq_lens)
            k = k.squeeze(1)  # [T, 1, D_I] -> [T, D_I]
        weights = self.weights_proj(hidden.float())  # [T, H_I]
        return q, k, weights
