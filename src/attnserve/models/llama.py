"""The Llama-style decoder and the families that share it.

llama (Llama 1/2 MHA, Llama 3 GQA), mistral (sliding window), qwen2 (QKV bias), qwen3 (q/k
RMSNorm, head_dim apart from hidden/heads), phi3 (checkpoints with fused qkv and gate_up) and
starcoder2 (LayerNorm with biases, a plain GELU MLP). The differences are ``arch.options``, a
``LlamaOptions`` the family's reader filled; the forward is one code path, with the residual
add fused into the next norm, and at decode sizes on CUDA each RMSNorm fused into the linear
after it and the gated activation into down_proj (``layers/gemv.py``). ``LlamaAttention`` is also the attention of the MoE families,
GPT-OSS, Jamba and MiniMax.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.arch import LayerSpec, LlamaOptions, ModelArch
from attnserve.layers import gemv
from attnserve.layers.attention import Attention
from attnserve.layers.linear import QKVLinear, qkv_rename
from attnserve.layers.moe import GatedMLP
from attnserve.layers.norm import LayerNorm, RMSNorm
from attnserve.layers.rotary import get_rope
from attnserve.models.base import CausalLM, PlainMLP, add_norm, dense_width

__all__ = ["LlamaAttention", "LlamaForCausalLM"]


def _norm(arch: ModelArch, opts: LlamaOptions) -> nn.Module:
    d, eps = arch.hidden_size, arch.norm_eps
    return LayerNorm(d, eps=eps) if opts.layer_norm else RMSNorm(d, eps=eps)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.qkv_proj = QKVLinear(arch.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size,
                                  bias=opts.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_size, arch.hidden_size, bias=opts.o_bias)
        self.q_norm = RMSNorm(spec.head_size, arch.norm_eps) if opts.qk_norm else None
        self.k_norm = RMSNorm(spec.head_size, arch.norm_eps) if opts.qk_norm else None
        self.rotary_emb = get_rope(spec.rope, spec.head_size)
        self.attn = Attention(spec)
        self.small_m_gemv = gemv.enabled()  # decode-sized o_proj through layers/gemv.py

    rename = staticmethod(qkv_rename)  # the checkpoint's q_proj/k_proj/v_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and o_proj from the qkv projection [T, (H + 2 Hkv) D] (the decoder layer
        computes it with the norm before it fused in)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(t, self.num_heads, self.head_size)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_size)  # [T, Hkv, D]
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None
        # q/k norms and RoPE in attn (one kernel with the cache write where the backend fuses them)
        return gemv.linear(self.attn(q, k, v, positions, self.rotary_emb, qk_norm), self.o_proj, self.small_m_gemv)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: LlamaOptions):
        super().__init__()
        d, inter = arch.hidden_size, dense_width(arch)
        self.self_attn = LlamaAttention(arch, spec, opts)
        if opts.gated_mlp:
            self.mlp: nn.Module = GatedMLP(d, inter, arch.hidden_act, bias=opts.mlp_bias)
        else:  # starcoder2's checkpoint names: c_fc, c_proj
            self.mlp = PlainMLP(d, inter, arch.hidden_act, bias=opts.mlp_bias, names=("c_fc", "c_proj"))
        self.input_layernorm = _norm(arch, opts)
        self.post_attention_layernorm = _norm(arch, opts)
        self.small_m_gemv = gemv.enabled()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual adds are fused into the next norm: returns (block output, residual). At
        decode sizes on CUDA each norm also rides in the linear after it, and the gated
        activation in down_proj (``layers/gemv.py``); elsewhere the same modules run apart."""
        attn, mlp, on = self.self_attn, self.mlp, self.small_m_gemv
        qkv, residual = gemv.norm_linear(self.input_layernorm, hidden, residual, attn.qkv_proj, on)
        hidden = attn.attend(positions, qkv)
        if isinstance(mlp, GatedMLP):
            gate_up, residual = gemv.norm_linear(self.post_attention_layernorm, hidden, residual,
                                                 mlp.gate_up_proj, on)
            return mlp.down(gate_up), residual
        hidden, residual = add_norm(self.post_attention_layernorm, hidden, residual)
        return mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch):
        opts = arch.options
        super().__init__(arch, lambda s: LlamaDecoderLayer(arch, s, opts), _norm(arch, opts))

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return add_norm(self.norm, hidden, residual)[0]
