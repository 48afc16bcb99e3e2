"""DeepSeek-V2/V3 decoders and the families that share them (deepseek_v2, deepseek_v3, kimi_k2,
and the sparse-MLA ones: deepseek_v32, glm_moe_dsa).

Each layer is MLA attention (``layers/mla.py``) and an MLP: a dense SwiGLU MLP for the first
``first_k_dense_replace`` layers (``LayerSpec.moe`` False), DeepSeek MoE after them (routed
experts with softmax greedy / group-limited greedy (V2) or sigmoid noaux_tc with a correction
bias (V3, V3.2, Kimi-K2, GLM-5), plus shared experts; ``layers/moe.py``). Kimi-K2 is
DeepSeek-V3 under its own model type. DeepSeek-V3.2 and GLM-5 are the same decoder with DSA
attention (``LayerKind.SPARSE_MLA``: the lightning indexer selects each token's top-k keys);
the model threads each layer's top-k to the next, so that a GLM-5 "shared" layer reuses the
previous full layer's selection (None before the first sparse layer and for dense MLA).

Not here: the multi-token-prediction layer that V3 / V3.2 / GLM-5 checkpoints carry after the
last layer (its weights are skipped). FP8 block-quantised checkpoints (``weight_scale_inv``)
reach ``load_weights`` already dequantised (``models/quantized.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from attnserve.arch import LayerSpec, ModelArch
from attnserve.layers.mla import MLAAttention
from attnserve.layers.moe import DeepseekMoE, GatedMLP
from attnserve.layers.norm import RMSNorm
from attnserve.models.weights import load_named_weights

__all__ = ["DeepseekForCausalLM"]

_LAYER = re.compile(r"^layers\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: LayerSpec):
        super().__init__()
        c = arch.hf_config
        eps = c.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(arch, spec)
        if spec.moe:
            self.mlp: nn.Module = DeepseekMoE(arch)
        else:
            self.mlp = GatedMLP(
                arch.hidden_size,
                c["intermediate_size"],
                c.get("hidden_act", "silu"),
                bias=bool(c.get("mlp_bias", False)),
            )
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(positions [T], hidden [T, D], previous top-k) -> (hidden [T, D], this layer's top-k)."""
        attn, topk_indices = self.self_attn.forward_with_topk(
            positions, self.input_layernorm(hidden), topk_indices
        )
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), topk_indices


class DeepseekForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(arch, s) for s in arch.layers)
        self.norm = RMSNorm(arch.hidden_size, eps=arch.hf_config.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        topk_indices = None  # [T, index_topk] the previous layer attended over (DSA models)
        for layer in self.layers:
            hidden, topk_indices = layer(positions, hidden, topk_indices)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _rename_layer(self, layer: int, suffix: str):
        """A name under ``layers.{layer}.`` -> parameter suffix, (suffix, shard), or None."""
        if suffix.startswith("mlp."):
            block = DeepseekMoE if self.arch.layers[layer].moe else GatedMLP
            target = block.rename(suffix[len("mlp.") :])
            if target is None or isinstance(target, str):
                return target and "mlp." + target
            return "mlp." + target[0], target[1]
        if hasattr(self.layers[layer].self_attn, "fused_qkv_a_proj"):
            for proj, shard in (("q_a_proj", 0), ("kv_a_proj_with_mqa", 1)):
                if suffix.startswith(f"self_attn.{proj}."):
                    return suffix.replace(proj, "fused_qkv_a_proj"), shard
        return suffix

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str):
            name = name[len("model.") :] if name.startswith("model.") else name
            if "rotary_emb" in name:
                return None
            if name == "lm_head.weight":
                return None if self.arch.tie_word_embeddings else name
            m = _LAYER.match(name)
            if m is None:
                return name
            layer = int(m.group(1))
            if layer >= self.arch.num_layers:
                return None  # the multi-token-prediction layer(s) after the last decoder layer
            target = self._rename_layer(layer, name[m.end() :])
            if target is None or isinstance(target, str):
                return target and m.group(0) + target
            return m.group(0) + target[0], target[1]

        load_named_weights(self, weights, rename)
