"""The facts of one model family that only its model file needs, as frozen dataclasses.

``ModelArch.options`` holds one of these, filled (defaults included) by the family's reader
(``readers_standard.py``, ``readers_mla_state.py``), so a model file reads its bias flags, norm
placement and the like from typed fields. Facts every family has (norm epsilon, activation,
dense MLP width, tying, final soft-cap) are ``ModelArch`` fields instead; per-layer mechanism
constants are ``LayerSpec`` dims. Not here: reading the config (the readers, ``families.py``),
any model code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BloomOptions",
    "DeepNorm",
    "DeepseekOptions",
    "FalconOptions",
    "FamilyOptions",
    "GPT2Options",
    "GemmaOptions",
    "GptOssOptions",
    "LlamaOptions",
    "MPTOptions",
    "MiniMaxOptions",
    "NSAOptions",
    "Qwen3NextOptions",
]


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    """The Llama-shaped layer: llama, mistral, qwen2, qwen3, phi3, starcoder2, and the attention
    of the MoE families (mixtral, qwen3_moe, glm4_moe), whose MLPs are their own."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    gated_mlp: bool = True  # SwiGLU (gate/up/down) or a plain fc -> act -> proj MLP
    layer_norm: bool = False  # LayerNorm with bias instead of RMSNorm


@dataclass(frozen=True, slots=True)
class GemmaOptions:
    attention_bias: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: post-attention norm and pre/post-MLP norms
    qk_norm: bool = False  # Gemma 3


@dataclass(frozen=True, slots=True)
class GptOssOptions:
    attention_bias: bool = True  # q/k/v/o biases
    swiglu_limit: float = 7.0  # the experts' clamped SwiGLU
    swiglu_alpha: float = 1.702


@dataclass(frozen=True, slots=True)
class DeepseekOptions:
    mlp_bias: bool = False  # the dense layers' SwiGLU MLP


@dataclass(frozen=True, slots=True)
class Qwen3NextOptions:
    attention_bias: bool = False  # the gated softmax attention's q/k/v/o biases


@dataclass(frozen=True, slots=True)
class DeepNorm:
    """MiniMax's residual factors of one layer kind: ``alpha * normed + beta * branch``."""

    alpha_attn: float = 1.0
    beta_attn: float = 1.0
    alpha_mlp: float = 1.0
    beta_mlp: float = 1.0


@dataclass(frozen=True, slots=True)
class MiniMaxOptions:
    lightning: DeepNorm  # the factors around lightning layers
    full: DeepNorm  # the factors around softmax layers


@dataclass(frozen=True, slots=True)
class NSAOptions:
    qkv_bias: bool = False


@dataclass(frozen=True, slots=True)
class FalconOptions:
    new_arch: bool  # new_decoder_architecture: GQA, attention and MLP always in parallel
    two_ln: bool  # ln_attn and ln_mlp instead of input_layernorm
    parallel: bool  # attention and MLP read the same input (one residual add)
    bias: bool
    grouped_qkv: bool  # query_key_value rows grouped per KV head (all but multi_query)


@dataclass(frozen=True, slots=True)
class GPT2Options:
    conv1d: bool  # GPT-2: weights stored [in, out]
    per_head_qkv: bool  # GPT-BigCode MHA: c_attn rows [q_h, k_h, v_h] per head


@dataclass(frozen=True, slots=True)
class BloomOptions:
    residual_post_ln: bool = False  # apply_residual_connection_post_layernorm


@dataclass(frozen=True, slots=True)
class MPTOptions:
    bias: bool  # not no_bias: biases on the linears and LayerNorms
    clip_qkv: float | None  # Wqkv's output clamped to [-clip, clip]
    alibi_bias_max: float


FamilyOptions = (
    LlamaOptions
    | GemmaOptions
    | GptOssOptions
    | DeepseekOptions
    | Qwen3NextOptions
    | MiniMaxOptions
    | NSAOptions
    | FalconOptions
    | GPT2Options
    | BloomOptions
    | MPTOptions
)
