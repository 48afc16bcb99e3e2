"""The readers of the standard-attention families (MHA, GQA, MQA; windows, ALiBi, sinks): the
Llama-shaped ones and their MoE variants, GPT-OSS, Gemma 1/2/3, GPT-2 and GPT-BigCode, Falcon,
BLOOM and MPT.

Each reader turns one config into its layers, MoE shape and the facts its model reads
(``Built``), with the family's own defaults where the config leaves a field out. The table that
names them is ``arch/families.py``; the MLA, sparse and state-layer families are in
``readers_mla_state.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attnserve.arch.model_arch import ArchError, RopeConfig
from attnserve.arch.options import (
    BloomOptions,
    FalconOptions,
    GemmaOptions,
    GPT2Options,
    GptOssOptions,
    LlamaOptions,
    MPTOptions,
)
from attnserve.arch.reader import (
    Built,
    Reader,
    deepseek_moe,
    deepseek_moe_layers,
    every_layer_window,
    moe_spec,
    pattern_windows,
    qwen_moe_layers,
    qwen_windows,
    standard_layers,
    windows_from_layer_types,
)

__all__ = ["bloom", "falcon", "gemma", "gemma2", "gemma3", "glm4_moe", "gpt2", "gpt_oss", "llama", "mistral",
           "mixtral", "mpt", "qwen", "qwen_moe"]


# --- Llama-shaped families ----------------------------------------------------------------


def _llama_facts(r: Reader) -> dict[str, Any]:
    """llama, mistral, qwen2, qwen3, phi3, starcoder2: biases, q/k norm, the MLP and norm kinds."""
    inter = r.int("intermediate_size", default=None)
    if r.model_type == "starcoder2":  # LayerNorm with biases, a plain GELU MLP; eps 1e-5 by default
        bias = r.flag("use_bias", True)
        opts = LlamaOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bias, gated_mlp=False, layer_norm=True)
        return dict(norm_eps=r.float("norm_epsilon", default=1e-5), intermediate_size=inter, options=opts,
                    hidden_act=r.get("hidden_act", default="gelu_pytorch_tanh"))
    bias = r.flag("attention_bias", False)
    qwen2 = r.model_type == "qwen2"  # q/k/v biases and none on o_proj, whatever attention_bias says
    opts = LlamaOptions(qkv_bias=qwen2 or bias, o_bias=bias and not qwen2, mlp_bias=r.flag("mlp_bias", False),
                        qk_norm=r.model_type == "qwen3")
    return dict(norm_eps=r.float("rms_norm_eps", default=1e-6), hidden_act=r.get("hidden_act", default="silu"),
                intermediate_size=inter, options=opts)


def llama(r: Reader) -> Built:
    windows = windows_from_layer_types(r, r.get("sliding_window", default=None)) or [None] * r.num_layers
    return Built(standard_layers(r, windows), **_llama_facts(r))


def mistral(r: Reader) -> Built:  # also phi3 and starcoder2: a window on every layer if set
    return Built(standard_layers(r, every_layer_window(r)), **_llama_facts(r))


def qwen(r: Reader) -> Built:
    return Built(standard_layers(r, qwen_windows(r)), **_llama_facts(r))


def _moe_facts(r: Reader) -> dict[str, Any]:
    """mixtral, qwen2_moe, qwen3_moe, glm4_moe: Llama's attention; the dense layers' width."""
    bias = r.flag("attention_bias", False)
    options = {
        "mixtral": LlamaOptions(),
        "qwen2_moe": None,  # read for `inspect`; no attnserve model yet
        "qwen3_moe": LlamaOptions(qkv_bias=bias, o_bias=bias, qk_norm=True),
        "glm4_moe": LlamaOptions(qkv_bias=bias, qk_norm=r.flag("use_qk_norm", False)),
    }[r.model_type]
    inter = None if r.model_type == "mixtral" else r.int("intermediate_size", default=0)
    return dict(norm_eps=r.float("rms_norm_eps", default=1e-6), hidden_act=r.get("hidden_act", default="silu"),
                intermediate_size=inter, options=options)


def mixtral(r: Reader) -> Built:
    moe = moe_spec(r, experts=("num_local_experts",), inter=("intermediate_size",))
    return Built(standard_layers(r, every_layer_window(r), moe_layers=lambda i: True), moe=moe, **_moe_facts(r))


def qwen_moe(r: Reader) -> Built:
    shared = r.int("shared_expert_intermediate_size", default=0)
    moe = moe_spec(r, experts=("num_experts", "num_local_experts"), num_shared_experts=1 if shared else 0,
               shared_intermediate_size=shared, norm_topk_prob=bool(r.get("norm_topk_prob", default=False)))
    return Built(standard_layers(r, qwen_windows(r), moe_layers=qwen_moe_layers(r)), moe=moe, **_moe_facts(r))


def glm4_moe(r: Reader) -> Built:
    hd = r.head_dim
    prf = r.float("partial_rotary_factor", default=None)  # transformers 5 nests it in rope_parameters
    if prf is None:
        prf = float(r.rope_params().get("partial_rotary_factor", 0.5))
    rope = r.rope(hd, rotary_dim=int(hd * prf))
    layers = standard_layers(r, [None] * r.num_layers, moe_layers=deepseek_moe_layers(r), rope_for=lambda i, w: rope)
    return Built(layers, moe=deepseek_moe(r), **_moe_facts(r))


def gpt_oss(r: Reader) -> Built:
    moe = moe_spec(r, experts=("num_local_experts", "num_experts"),
               top_k=("num_experts_per_tok", "experts_per_token"), inter=("intermediate_size",))
    opts = GptOssOptions(attention_bias=r.flag("attention_bias", True),
                         swiglu_limit=r.float("swiglu_limit", default=7.0),
                         swiglu_alpha=r.float("swiglu_alpha", default=1.702))
    layers = standard_layers(r, pattern_windows(r, 2), sinks=True, moe_layers=lambda i: True)
    return Built(layers, moe=moe, norm_eps=r.float("rms_norm_eps", default=1e-5),  # GptOssConfig: 1e-5
                 hidden_act=r.get("hidden_act", default="silu"), options=opts)


# --- Gemma --------------------------------------------------------------------------------

# transformers' Gemma 2/3 config defaults, for configs that leave these fields out
_GEMMA_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096}


def _gemma_defaults(r: Reader) -> Reader:
    cfg = dict(r.cfg)
    for key, value in _GEMMA_DEFAULTS.items():
        cfg.setdefault(key, value)
    if r.model_type == "gemma2" and "attn_logit_softcapping" not in cfg:
        cfg["attn_logit_softcapping"] = 50.0  # an explicit null means no cap
    return Reader(r.model_type, cfg)


def _gemma_facts(r: Reader) -> dict[str, Any]:
    c, mt = r.cfg, r.model_type
    if mt == "gemma":  # transformers reads hidden_act and treats the legacy "gelu" as the tanh approximation
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    else:
        act = c.get("hidden_activation") or "gelu_pytorch_tanh"
    # Gemma 2's config class caps the logits at 30 when the field is absent; an explicit null is no cap
    cap = None if mt == "gemma" else c.get("final_logit_softcapping", 30.0 if mt == "gemma2" else None)
    unsupported = None
    if c.get("use_bidirectional_attention"):
        unsupported = f"{mt}: use_bidirectional_attention=true (an embedding model) is not supported"
    opts = GemmaOptions(attention_bias=r.flag("attention_bias", False), sandwich_norms=mt != "gemma",
                        qk_norm=mt == "gemma3_text")
    return dict(norm_eps=r.float("rms_norm_eps", default=1e-6), hidden_act=act, intermediate_size=r.int("intermediate_size", default=None),
                final_softcap=None if cap is None else r.number("final_logit_softcapping", cap), options=opts,
                unsupported=unsupported)


def gemma(r: Reader) -> Built:
    return Built(standard_layers(r, [None] * r.num_layers), **_gemma_facts(r))


def gemma2(r: Reader) -> Built:
    r = _gemma_defaults(r)
    scale = r.float("query_pre_attn_scalar") ** -0.5
    layers = standard_layers(r, pattern_windows(r, 2), scale=scale,
                             softcap=r.float("attn_logit_softcapping", default=None))
    return Built(layers, **_gemma_facts(r))


def gemma3(r: Reader) -> Built:
    r = _gemma_defaults(r)
    hd = r.head_dim
    scale = r.float("query_pre_attn_scalar") ** -0.5
    windows = pattern_windows(r, r.int("sliding_window_pattern", "_sliding_window_pattern", default=6))
    params = r.cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:  # transformers 5 spelling
        local = r.rope(hd, params=r.rope_params("sliding_attention"))
        glob = r.rope(hd, params=r.rope_params("full_attention"))
    else:  # checkpoint spelling: rope_local_base_freq for sliding layers, rope_scaling for full ones
        local = RopeConfig(rotary_dim=hd, theta=r.float("rope_local_base_freq", default=10000.0))
        glob = r.rope(hd)
    layers = standard_layers(r, windows, scale=scale, softcap=r.float("attn_logit_softcapping", default=None),
                             rope_for=lambda i, w: local if w else glob)
    return Built(layers, **_gemma_facts(r))


# --- GPT-2, Falcon, BLOOM, MPT --------------------------------------------------------------


def gpt2(r: Reader) -> Built:
    scale_weights = bool(r.get("scale_attn_weights", default=True))
    hd = r.hidden_size // r.num_heads
    inverse_layer = bool(r.get("scale_attn_by_inverse_layer_idx", default=False))
    multi_query = r.model_type == "gpt_bigcode" and bool(r.get("multi_query", default=True))
    kv = 1 if multi_query else r.num_heads
    layers = standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd,
                             scale=hd ** -0.5 if scale_weights else 1.0, rope_for=lambda i, w: None,
                             layer_scale=(lambda i: 1.0 / (i + 1)) if inverse_layer else None)
    gpt2 = r.model_type == "gpt2"
    unsupported = None
    if r.cfg.get("add_cross_attention"):
        unsupported = f"{r.model_type}: add_cross_attention (encoder-decoder use) is not supported"
    opts = GPT2Options(conv1d=gpt2, per_head_qkv=not gpt2 and not r.cfg.get("multi_query", True))
    return Built(layers, norm_eps=r.float("layer_norm_epsilon", default=1e-5),
                 hidden_act=r.get("activation_function", default="gelu_new" if gpt2 else "gelu_pytorch_tanh"),
                 intermediate_size=r.int("n_inner", default=None) or 4 * r.hidden_size, options=opts,
                 unsupported=unsupported)


def _falcon_options(r: Reader) -> tuple[FalconOptions, str | None]:
    new_arch = r.flag("new_decoder_architecture", False)
    num_ln = r.cfg.get("num_ln_in_parallel_attn")
    if num_ln is None and new_arch:
        num_ln = 2
    parallel = r.flag("parallel_attn", True)
    unsupported = None
    if new_arch and not parallel:
        unsupported = "falcon: new_decoder_architecture requires parallel_attn (as in transformers)"
    opts = FalconOptions(new_arch=new_arch, two_ln=new_arch and num_ln == 2, parallel=new_arch or parallel,
                         bias=r.flag("bias", False), grouped_qkv=new_arch or not r.flag("multi_query", True))
    return opts, unsupported


def falcon(r: Reader) -> Built:
    heads = r.num_heads
    if r.get("new_decoder_architecture", default=False):
        kv = r.int("num_kv_heads", default=heads)
    elif r.get("multi_query", default=True):
        kv = 1
    else:
        kv = heads
    alibi = bool(r.get("alibi", default=False))
    layers = standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=r.hidden_size // heads,
                             alibi=alibi)
    opts, unsupported = _falcon_options(r)
    return Built(layers, norm_eps=r.float("layer_norm_epsilon", default=1e-5),
                 hidden_act=r.get("activation", default="gelu"),
                 intermediate_size=r.int("ffn_hidden_size", default=None) or 4 * r.hidden_size,
                 options=opts, unsupported=unsupported)


def bloom(r: Reader) -> Built:
    layers = standard_layers(r, [None] * r.num_layers, head_dim=r.hidden_size // r.num_heads, alibi=True)
    opts = BloomOptions(residual_post_ln=r.flag("apply_residual_connection_post_layernorm", False))
    return Built(layers, norm_eps=r.float("layer_norm_epsilon", default=1e-5),
                 hidden_act="gelu_pytorch_tanh",  # BLOOM's GELU is the tanh approximation, not configurable
                 intermediate_size=4 * r.hidden_size, options=opts)


def _mpt_facts(r: Reader, attn: Mapping[str, Any]) -> dict[str, Any]:
    unsupported = None
    for flag in ("qk_ln", "prefix_lm"):
        if attn.get(flag):
            unsupported = f"mpt: attn_config.{flag}=true is not supported"
            break
    scale = r.cfg.get("logit_scale")
    if scale == "inv_sqrt_d_model":
        scale = 1.0 / math.sqrt(r.hidden_size)
    clip = attn.get("clip_qkv")
    opts = MPTOptions(bias=not r.cfg.get("no_bias", True),
                      clip_qkv=None if clip is None else r.number("attn_config.clip_qkv", clip),
                      alibi_bias_max=r.number("attn_config.alibi_bias_max", attn.get("alibi_bias_max", 8)))
    return dict(norm_eps=r.float("layer_norm_epsilon", default=1e-5), hidden_act="gelu",  # exact GELU
                intermediate_size=int(r.number("expansion_ratio", r.get("expansion_ratio", default=4)) * r.hidden_size),
                logit_scale=r.number("logit_scale", scale) if scale is not None else None, options=opts,
                unsupported=unsupported)


def mpt(r: Reader) -> Built:
    attn = r.get("attn_config", default={}) or {}
    alibi = bool(attn.get("alibi", True))
    hd = r.hidden_size // r.num_heads
    kv = {"multihead_attention": r.num_heads, "multiquery_attention": 1,
          "grouped_query_attention": attn.get("kv_n_heads", r.num_heads)}.get(attn.get("attn_type",
                                                                               "multihead_attention"))
    if kv is None:
        raise ArchError(f"mpt: unsupported attn_config.attn_type '{attn.get('attn_type')}'")
    scale = attn.get("softmax_scale") or hd ** -0.5
    if not alibi:
        raise ArchError("mpt: attn_config.alibi=false (learned positions) is not supported")
    layers = standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd, scale=scale, alibi=True)
    return Built(layers, **_mpt_facts(r, attn))
