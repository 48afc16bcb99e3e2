"""Mixture-of-experts decoders of the Llama shape: mixtral, qwen3_moe and glm4_moe.

Each is Llama's pre-norm decoder (``LlamaAttention`` from ``models/llama.py``: fused QKV, RoPE,
paged attention) with the MLP of some layers replaced by a block from ``layers/moe.py``:
- mixtral: every layer a ``SparseMoE`` (softmax, top-k, renormalised); the checkpoint calls the
  block ``block_sparse_moe`` and its experts ``w1``/``w3``/``w2``; sliding window if configured.
- qwen3_moe: q/k RMSNorm; a ``SparseMoE`` (``norm_topk_prob``) where ``decoder_sparse_step`` and
  ``mlp_only_layers`` put one, a dense SwiGLU MLP elsewhere.
- glm4_moe: partial rotary (``partial_rotary_factor`` 0.5), q/k/v bias, optional q/k RMSNorm
  (``use_qk_norm``); a ``DeepseekMoE`` (sigmoid scores + correction bias, grouped ``noaux_tc``
  choice, shared expert, routed scaling) from layer ``first_k_dense_replace`` on. The MTP layers
  the checkpoint stores past ``num_hidden_layers`` are skipped.

It is not: qwen2_moe (a sigmoid-gated shared expert), MTP speculative decoding, quantised
expert kernels (fp8 checkpoints are dequantised as they are read: ``models/quantized.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.moe import DeepseekMoE, FusedExperts, GatedMLP, SparseMoE
from attnserve.layers.norm import RMSNorm
from attnserve.models.llama import LlamaAttention, LlamaOptions
from attnserve.models.weights import load_named_weights

__all__ = ["MoEFamilyOptions", "MoEForCausalLM", "rename_decoder_weight"]

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.*)$")


@dataclass(frozen=True, slots=True)
class MoEFamilyOptions:
    attn: LlamaOptions
    mlp_prefix: str = "mlp"  # the MLP's checkpoint name: "mlp" or Mixtral's "block_sparse_moe"
    deepseek_moe: bool = False  # DeepseekMoE (fp32 router, shared experts) instead of SparseMoE
    dense_intermediate: int = 0  # the SwiGLU MLP of non-MoE layers

    @classmethod
    def from_arch(cls, arch: ModelArch) -> MoEFamilyOptions:
        c = arch.hf_config
        mt = arch.model_type
        eps, act = c.get("rms_norm_eps", 1e-6), c.get("hidden_act", "silu")
        bias = bool(c.get("attention_bias", False))
        dense = int(c.get("intermediate_size") or 0)
        if mt == "mixtral":
            return cls(LlamaOptions(norm_eps=eps, act=act), mlp_prefix="block_sparse_moe")
        if mt == "qwen3_moe":
            attn = LlamaOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_eps=eps, act=act)
            return cls(attn, dense_intermediate=dense)
        if mt == "glm4_moe":
            qk_norm = bool(c.get("use_qk_norm", False))
            attn = LlamaOptions(qkv_bias=bias, o_bias=False, qk_norm=qk_norm, norm_eps=eps, act=act)
            return cls(attn, deepseek_moe=True, dense_intermediate=dense)
        raise ValueError(f"model_type '{mt}' is not a family of moe_families.py")


def _mlp(arch: ModelArch, spec: LayerSpec, opts: MoEFamilyOptions) -> nn.Module:
    if not spec.moe:
        return GatedMLP(arch.hidden_size, opts.dense_intermediate, opts.attn.act)
    if opts.deepseek_moe:
        return DeepseekMoE(arch)
    moe = arch.moe
    experts = FusedExperts(
        moe.num_experts, arch.hidden_size, moe.intermediate_size, act=opts.attn.act
    )
    return SparseMoE(moe, experts)


class MoEDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec, opts: MoEFamilyOptions):
        super().__init__()
        self.self_attn = LlamaAttention(arch, spec, opts.attn)
        self.mlp = _mlp(arch, spec, opts)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=opts.attn.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=opts.attn.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MoEForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.opts = MoEFamilyOptions.from_arch(arch)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(arch, s, self.opts) for s in arch.layers)
        self.norm = RMSNorm(arch.hidden_size, eps=self.opts.attn.norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights) -> None:
        def rename(name: str):
            return rename_decoder_weight(self, name, self.opts.mlp_prefix)

        load_named_weights(self, weights, rename)


def rename_decoder_weight(model: nn.Module, name: str, mlp_prefix: str = "mlp"):
    """A checkpoint name -> (parameter name, shard) of a Llama-shaped decoder whose layers have
    ``self_attn`` (a ``LlamaAttention``) and ``mlp`` (any block with a static ``rename``).

    Skips rotary buffers, a tied ``lm_head`` and layers past ``num_layers`` (MTP modules).
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight":
        return None if model.arch.tie_word_embeddings else name
    m = _LAYER_NAME.match(name)
    if m is None:
        return name
    i, rest = int(m.group(1)), m.group(2)
    if i >= model.arch.num_layers:
        return None
    prefix = f"layers.{i}."
    for proj, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        if rest.startswith(f"self_attn.{proj}."):
            return prefix + rest.replace(proj, "qkv_proj"), shard
    if rest.startswith(mlp_prefix + "."):
        target = model.layers[i].mlp.rename(rest[len(mlp_prefix) + 1 :])
        if isinstance(target, tuple):
            return prefix + "mlp." + target[0], target[1]
        return None if target is None else prefix + "mlp." + target
    return prefix + rest
