"""The readers of the MLA, sparse and state-layer families: DeepSeek-V2/V3 and Kimi-K2 (MLA),
DeepSeek-V3.2 and GLM-5 (DSA), fla-org's NSA, and the hybrids Qwen3-Next/Qwen3.5 (Gated
DeltaNet), Jamba (Mamba), MiniMax (lightning) and Kimi-Linear (KDA).

Each reader turns one config into its layers (state layers with their mixer's constants), MoE
shape and the facts its model reads (``Built``), with the family's own defaults where the config
leaves a field out. The table that names them is ``arch/families.py``; the standard-attention
families are in ``readers_standard.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attnserve.arch.model_arch import (
    ArchError,
    GDNDims,
    IndexerDims,
    KDADims,
    LayerKind,
    LayerSpec,
    LightningDims,
    MambaDims,
    NSADims,
    RopeConfig,
    StateDims,
)
from attnserve.arch.options import (
    DeepNorm,
    DeepseekOptions,
    MiniMaxOptions,
    NSAOptions,
    Qwen3NextOptions,
)
from attnserve.arch.reader import (
    Built,
    Reader,
    check_types,
    deepseek_moe,
    deepseek_moe_layers,
    mla_layers,
    moe_spec,
    qwen_moe_layers,
    standard_layers,
)

__all__ = ["deepnorm_factors", "deepseek", "dsa", "jamba", "kimi_linear", "minimax", "nsa", "qwen3_next"]


# --- hybrid families ----------------------------------------------------------------------


def deepnorm_factors(config: Mapping[str, Any], lightning: bool) -> tuple[float, float, float, float]:
    """MiniMax's (alpha_attn, beta_attn, alpha_mlp, beta_mlp) of a lightning or a softmax layer,
    under transformers' names (``linear_attn_alpha_factor``, ...) or MiniMax's original ones
    (``layernorm_linear_attention_alpha``, ...); a missing factor is 1."""
    hf, orig = ("linear_attn", "linear_attention") if lightning else ("full_attn", "full_attention")

    def factor(hf_name: str, orig_name: str) -> float:
        value = config.get(hf_name, config.get(orig_name))
        if value is None:
            return 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ArchError(f"minimax: field '{hf_name}' must be a finite number, got {value!r}")
        return float(value)

    return (
        factor(f"{hf}_alpha_factor", f"layernorm_{orig}_alpha"),
        factor(f"{hf}_beta_factor", f"layernorm_{orig}_beta"),
        factor("mlp_alpha_factor", "layernorm_mlp_alpha"),
        factor("mlp_beta_factor", "layernorm_mlp_beta"),
    )


def minimax(r: Reader) -> Built:
    types = r.layer_types()
    if types is None and isinstance(r.cfg.get("attn_type_list"), list):
        types = ["full_attention" if t == 1 else "linear_attention" for t in r.cfg["attn_type_list"]]
    if types is None:
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(r.num_layers)]
    hd = r.head_dim
    rotary = r.int("rotary_dim", default=None)
    attn = standard_layers(r, [None] * r.num_layers, moe_layers=lambda i: True,
                     rope_for=lambda i, w: r.rope(hd, rotary_dim=rotary))
    heads = r.num_heads
    dims = LightningDims(block_size=r.int("block_size", default=256))
    layers = [s if types[i] == "full_attention" else
              LayerSpec(index=i, kind=LayerKind.LIGHTNING, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=StateDims(recurrent=((heads, hd, hd),)), moe=True, mixer=dims)
              for i, s in enumerate(attn)]
    check_types(r, types, {"full_attention", "linear_attention"})
    moe = moe_spec(r, experts=("num_local_experts", "num_experts"), inter=("intermediate_size",))
    opts = MiniMaxOptions(lightning=DeepNorm(*deepnorm_factors(r.cfg, True)),
                          full=DeepNorm(*deepnorm_factors(r.cfg, False)))
    return Built(layers, moe=moe, norm_eps=r.float("rms_norm_eps", default=1e-5),  # MiniMaxConfig: 1e-5
                 hidden_act=r.get("hidden_act", default="silu"), options=opts)


def jamba(r: Reader) -> Built:
    period, offset = r.int("attn_layer_period", default=8), r.int("attn_layer_offset", default=4)
    e_period, e_offset = r.int("expert_layer_period", default=2), r.int("expert_layer_offset", default=1)
    n_exp = r.int("num_experts", default=16)

    def is_moe(i: int) -> bool:
        return n_exp > 1 and i % e_period == e_offset

    attn = standard_layers(r, [None] * r.num_layers, moe_layers=is_moe, rope_for=lambda i, w: None)
    d_inner = r.int("mamba_expand", default=2) * r.hidden_size
    d_conv, d_state = r.int("mamba_d_conv", default=4), r.int("mamba_d_state", default=16)
    state = StateDims(conv=((d_inner, d_conv - 1),), recurrent=((d_inner, d_state),))
    eps = r.float("rms_norm_eps", default=1e-6)
    rank = r.get("mamba_dt_rank", default="auto")
    dims = MambaDims(dt_rank=math.ceil(r.hidden_size / 16) if rank == "auto" else int(rank),
                     conv_bias=r.flag("mamba_conv_bias", True), proj_bias=r.flag("mamba_proj_bias", False),
                     norm_eps=eps)
    layers = [s if i % period == offset else
              LayerSpec(index=i, kind=LayerKind.MAMBA, state=state, moe=is_moe(i), mixer=dims)
              for i, s in enumerate(attn)]
    # Jamba's router keeps the raw top-k softmax weights (no renormalisation)
    moe = moe_spec(r, experts=("num_experts",), inter=("intermediate_size",), norm_topk_prob=False) if n_exp > 1 else None
    return Built(layers, moe=moe, norm_eps=eps, hidden_act=r.get("hidden_act", default="silu"),
                 intermediate_size=r.int("intermediate_size", default=None))


def _gdn_types(r: Reader) -> list[str]:
    types = r.layer_types()
    if types is None:
        interval = r.int("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(r.num_layers)]
    check_types(r, types, {"full_attention", "linear_attention"})
    return types


def qwen3_next(r: Reader) -> Built:
    types = _gdn_types(r)
    hd = r.head_dim
    prf = r.float("partial_rotary_factor", default=None)
    if prf is None:
        prf = float(r.rope_params().get("partial_rotary_factor", 0.25))
    rope = r.rope(hd, rotary_dim=int(hd * prf))
    has_moe = r.int("num_experts", default=0) > 0
    moe_layers = qwen_moe_layers(r) if has_moe else (lambda i: False)
    attn = standard_layers(r, [None] * r.num_layers, moe_layers=moe_layers, rope_for=lambda i, w: rope)
    nk, nv = r.int("linear_num_key_heads"), r.int("linear_num_value_heads")
    dk, dv = r.int("linear_key_head_dim"), r.int("linear_value_head_dim")
    k = r.int("linear_conv_kernel_dim", default=4)
    state = StateDims(conv=((2 * nk * dk + nv * dv, k - 1),), recurrent=((nv, dk, dv),))
    eps = r.float("rms_norm_eps", default=1e-6)
    dims = GDNDims(num_k_heads=nk, conv_kernel=k, norm_eps=eps)
    layers = [s if types[i] == "full_attention" else
              LayerSpec(index=i, kind=LayerKind.GDN, num_heads=nv, head_size=dk, head_size_v=dv,
                        state=state, moe=moe_layers(i), mixer=dims)
              for i, s in enumerate(attn)]
    moe = None
    if has_moe:
        shared = r.int("shared_expert_intermediate_size", default=0)
        moe = moe_spec(r, experts=("num_experts",), num_shared_experts=1 if shared else 0,
                   shared_intermediate_size=shared, norm_topk_prob=bool(r.get("norm_topk_prob", default=True)))
    return Built(layers, moe=moe, norm_eps=eps, hidden_act=r.get("hidden_act", default="silu"),
                 intermediate_size=r.int("intermediate_size", default=None),
                 options=Qwen3NextOptions(attention_bias=r.flag("attention_bias", False)))


def kimi_linear(r: Reader) -> Built:
    lac = r.get("linear_attn_config", default={}) or {}
    types = r.layer_types()
    if types is None:
        if "full_attn_layers" not in lac or "kda_layers" not in lac:
            raise ArchError("kimi_linear: missing 'layer_types' or linear_attn_config.full_attn_layers/kda_layers")
        types = [""] * r.num_layers
        for i in lac["full_attn_layers"]:  # 1-based in the checkpoint
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    check_types(r, types, {"full_attention", "linear_attention"})
    use_rope = r.cfg.get("mla_use_nope") is False  # Kimi-Linear's MLA has no RoPE unless told exactly that
    full_ids = [i for i, t in enumerate(types) if t == "full_attention"]
    mla = mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None, use_rope=use_rope, layer_ids=full_ids)
    heads = lac.get("num_heads", r.int("linear_num_heads", default=r.num_heads))
    hd = lac.get("head_dim", r.int("linear_head_dim", default=r.head_dim))
    k = lac.get("short_conv_kernel_size", r.int("linear_conv_kernel_dim", default=4))
    state = StateDims(conv=((heads * hd, k - 1),) * 3, recurrent=((heads, hd, hd),))
    # KDA's gated norm falls back to 1e-6, the decoder's norms to 1e-5 (KimiLinearConfig's default)
    dims = KDADims(norm_eps=r.float("rms_norm_eps", default=1e-6))
    moe_layers = deepseek_moe_layers(r)
    layers = [mla[i] if i in mla else
              LayerSpec(index=i, kind=LayerKind.KDA, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=state, moe=moe_layers(i), mixer=dims)
              for i in range(r.num_layers)]
    return Built(layers, moe=deepseek_moe(r), norm_eps=r.float("rms_norm_eps", default=1e-5),
                 hidden_act=r.get("hidden_act", default="silu"), intermediate_size=r.int("intermediate_size", default=None))


# --- DeepSeek, DSA, NSA -------------------------------------------------------------------


def _deepseek_facts(r: Reader) -> dict[str, Any]:
    return dict(moe=deepseek_moe(r), norm_eps=r.float("rms_norm_eps", default=1e-6), hidden_act=r.get("hidden_act", default="silu"),
                intermediate_size=r.int("intermediate_size", default=None),
                options=DeepseekOptions(mlp_bias=r.flag("mlp_bias", False)))


def deepseek(r: Reader) -> Built:
    if _plain_attention(r):
        # as vLLM serves such configs: Llama's attention (q/k/v/o projections, hidden / heads per
        # head, RoPE over the whole head, NeoX layout), DeepSeek's MLP and MoE around it
        if r.hidden_size % r.num_heads:
            raise ArchError(f"{r.model_type}: without MLA, hidden_size={r.hidden_size} must split over "
                            f"num_attention_heads={r.num_heads}")
        hd = r.hidden_size // r.num_heads  # vLLM's; the config's head_dim is the RoPE part of MLA
        rope = r.rope(hd)
        layers = standard_layers(r, [None] * r.num_layers, moe_layers=deepseek_moe_layers(r),
                                 rope_for=lambda i, w: rope, head_dim=hd)
        return Built(layers, **_deepseek_facts(r))
    mla = mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None)
    return Built([mla[i] for i in range(r.num_layers)], **_deepseek_facts(r))


def _plain_attention(r: Reader) -> bool:
    """A DeepSeek-V2/V3 config without MLA: ``kv_lora_rank`` null, or ``qk_nope_head_dim`` and
    ``qk_rope_head_dim`` both 0 (or absent). vLLM runs these layers as plain multi-head attention."""
    if "kv_lora_rank" in r.cfg and r.cfg["kv_lora_rank"] is None:
        return True
    return not r.int("qk_nope_head_dim", default=0) and not r.int("qk_rope_head_dim", default=0)


def _indexer_types(r: Reader) -> list[str]:
    types = r.cfg.get("indexer_types")
    if types is None:
        pattern = r.cfg.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        elif r.model_type == "glm_moe_dsa":
            freq = max(r.int("index_topk_freq", default=1), 1)
            offset = r.int("index_skip_topk_offset", default=2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(r.num_layers)]
        else:
            types = ["full"] * r.num_layers
    if len(types) != r.num_layers or set(types) - {"full", "shared"}:
        raise ArchError(f"{r.model_type}: field 'indexer_types' must list 'full' or 'shared' per layer")
    if types[0] == "shared":
        raise ArchError(f"{r.model_type}: indexer_types[0] is 'shared' but no earlier layer runs an indexer")
    return types


def dsa(r: Reader) -> Built:
    types = _indexer_types(r)
    n_heads, head_dim, topk = r.int("index_n_heads"), r.int("index_head_dim"), r.int("index_topk")
    # a missing field means NeoX for DeepSeek; GLM-5 is interleaved (transformers hard-codes it
    # and does not write the field when it saves a glm_moe_dsa config)
    interleaved = bool(r.get("indexer_rope_interleave", default=r.model_type == "glm_moe_dsa"))

    def indexer(i: int) -> IndexerDims:
        return IndexerDims(n_heads=n_heads, head_dim=head_dim, topk=topk, rope_interleaved=interleaved,
                           has_cache=types[i] == "full")

    mla = mla_layers(r, LayerKind.SPARSE_MLA, indexer_for=indexer)
    return Built([mla[i] for i in range(r.num_layers)], **_deepseek_facts(r))


# fla-org's NSAConfig defaults, for configs that leave a field out (an explicit null keeps
# FLA's meaning: num_kv_heads null is one KV head per query head, window_size null no window)
_NSA_DEFAULTS = {"num_kv_heads": 4, "head_dim": 32, "block_size": 64, "block_counts": 16,
                 "window_size": 512, "rope_theta": 10000.0}


def _nsa_int(r: Reader, name: str, minimum: int) -> int:
    value = r.cfg.get(name, _NSA_DEFAULTS.get(name))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArchError(f"nsa: field '{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def nsa(r: Reader) -> Built:
    """fla-org's NSA (``NSAForCausalLM``): every layer is native sparse attention."""
    heads = _nsa_int(r, "num_heads", 1)
    kv = heads if "num_kv_heads" in r.cfg and r.cfg["num_kv_heads"] is None else _nsa_int(r, "num_kv_heads", 1)
    if heads % kv:
        raise ArchError(f"nsa: num_heads={heads} is not divisible by num_kv_heads={kv}")
    hd = _nsa_int(r, "head_dim", 2)
    block_size = _nsa_int(r, "block_size", 1)
    counts = _nsa_int(r, "block_counts", 1)
    if counts < 3:
        raise ArchError(f"nsa: block_counts={counts} is below 3: FLA always keeps 3 blocks (the first, the "
                        f"previous and the current) and breaks the tie among them in its sorting network's "
                        f"order, which attnserve does not reproduce")
    window = r.cfg.get("window_size", _NSA_DEFAULTS["window_size"])
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ArchError(f"nsa: field 'window_size' must be a non-negative integer or null, got {window!r}")
    act = r.cfg.get("hidden_act", "swish")
    if act != "swish":
        raise ArchError(f"nsa: hidden_act '{act}' is not supported (only 'swish', FLA's SwiGLU)")
    if r.cfg.get("attnres_block_size") is not None:
        raise ArchError("nsa: attention residuals (attnres_block_size) are not supported")
    theta = r.cfg.get("rope_theta", _NSA_DEFAULTS["rope_theta"])
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ArchError(f"nsa: field 'rope_theta' must be a positive finite number, got {theta!r}")
    if hd % 2:
        raise ArchError(f"nsa: head_dim={hd} must be even (RoPE rotates the whole head)")
    dims = NSADims(block_size=block_size, block_counts=counts, window=window or None)
    rope = RopeConfig(rotary_dim=hd, theta=float(theta))  # FLA: NeoX half-split over the whole head
    layers = [LayerSpec(index=i, kind=LayerKind.NSA, num_heads=heads, num_kv_heads=kv, head_size=hd,
                        head_size_v=hd, scale=hd ** -0.5, rope=rope, nsa=dims)
              for i in range(r.num_layers)]
    return Built(layers, norm_eps=r.float("norm_eps", default=1e-6), hidden_act=act,
                 intermediate_size=_nsa_intermediate(r), options=NSAOptions(qkv_bias=r.flag("qkv_bias", False)))


def _nsa_intermediate(r: Reader) -> int:
    """``intermediate_size`` when given, else FLA's rule: ``int(hidden_size * hidden_ratio * 2 / 3)``
    rounded up to a multiple of 256 (``hidden_ratio`` 4 when unset)."""
    inter = r.cfg.get("intermediate_size")
    if inter is None:
        ratio = r.cfg.get("hidden_ratio") or 4
        inter = int(r.hidden_size * ratio * 2 / 3)
        inter = 256 * ((inter + 256 - 1) // 256)
    if isinstance(inter, bool) or not isinstance(inter, int) or inter <= 0:
        raise ArchError(f"nsa: intermediate_size must be a positive integer, got {inter!r}")
    return inter
