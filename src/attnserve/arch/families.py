"""Per-family readers of HF configs: how each model type lays out its layers.

``arch.load.read_arch`` dispatches here by ``model_type``. Each builder returns the list of
``LayerSpec`` (one per layer) and the model's ``MoESpec`` (or None). The quirks handled here
are listed in DESIGN.md (ModelArch); each has a test in ``tests/unit/test_arch.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from attnserve.arch.model_arch import (
    ArchError,
    IndexerDims,
    LayerKind,
    LayerSpec,
    MoESpec,
    NSADims,
    RopeConfig,
    StateDims,
)
from attnserve.arch.reader import (
    Reader,
    check_types,
    deepseek_moe,
    deepseek_moe_layers,
    every_layer_window,
    expand_mla,
    mla_layers,
    moe_spec,
    pattern_windows,
    qwen_moe_layers,
    qwen_windows,
    standard_layers,
    windows_from_layer_types,
)

__all__ = ["BUILDERS", "TIED_BY_DEFAULT", "Reader", "expand_mla"]

# Families whose HF config class ties input and output embeddings unless told otherwise.
TIED_BY_DEFAULT = frozenset({"gpt2", "gpt_bigcode", "falcon", "bloom", "mpt", "gemma", "gemma2",
                             "gemma3_text"})

# --- families -----------------------------------------------------------------------------
Built = tuple[list[LayerSpec], MoESpec | None]


def _llama(r: Reader) -> Built:
    windows = windows_from_layer_types(r, r.get("sliding_window", default=None)) or [None] * r.num_layers
    return standard_layers(r, windows), None


def _mistral(r: Reader) -> Built:
    return standard_layers(r, every_layer_window(r)), None


def _mixtral(r: Reader) -> Built:
    moe = moe_spec(r, experts=("num_local_experts",), inter=("intermediate_size",))
    return standard_layers(r, every_layer_window(r), moe_layers=lambda i: True), moe


def _qwen(r: Reader) -> Built:
    return standard_layers(r, qwen_windows(r)), None


def _qwen_moe(r: Reader) -> Built:
    shared = r.int("shared_expert_intermediate_size", default=0)
    moe = moe_spec(r, experts=("num_experts", "num_local_experts"), num_shared_experts=1 if shared else 0,
               shared_intermediate_size=shared, norm_topk_prob=bool(r.get("norm_topk_prob", default=False)))
    return standard_layers(r, qwen_windows(r), moe_layers=qwen_moe_layers(r)), moe


def _phi3(r: Reader) -> Built:
    return standard_layers(r, every_layer_window(r)), None


def _gemma(r: Reader) -> Built:
    return standard_layers(r, [None] * r.num_layers), None


# transformers' Gemma 2/3 config defaults, for configs that leave these fields out
_GEMMA_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096}


def _gemma_defaults(r: Reader) -> Reader:
    cfg = dict(r.cfg)
    for key, value in _GEMMA_DEFAULTS.items():
        cfg.setdefault(key, value)
    if r.model_type == "gemma2" and "attn_logit_softcapping" not in cfg:
        cfg["attn_logit_softcapping"] = 50.0  # an explicit null means no cap
    return Reader(r.model_type, cfg)


def _gemma2(r: Reader) -> Built:
    r = _gemma_defaults(r)
    scale = r.float("query_pre_attn_scalar") ** -0.5
    return standard_layers(r, pattern_windows(r, 2), scale=scale,
                     softcap=r.float("attn_logit_softcapping", default=None)), None


def _gemma3(r: Reader) -> Built:
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
    return standard_layers(r, windows, scale=scale, softcap=r.float("attn_logit_softcapping", default=None),
                     rope_for=lambda i, w: local if w else glob), None


def _gpt_oss(r: Reader) -> Built:
    moe = moe_spec(r, experts=("num_local_experts", "num_experts"),
               top_k=("num_experts_per_tok", "experts_per_token"), inter=("intermediate_size",))
    return standard_layers(r, pattern_windows(r, 2), sinks=True, moe_layers=lambda i: True), moe


def _glm4_moe(r: Reader) -> Built:
    moe = deepseek_moe(r)
    hd = r.head_dim
    prf = r.float("partial_rotary_factor", default=None)  # transformers 5 nests it in rope_parameters
    if prf is None:
        prf = float(r.rope_params().get("partial_rotary_factor", 0.5))
    rope = r.rope(hd, rotary_dim=int(hd * prf))
    return standard_layers(r, [None] * r.num_layers, moe_layers=deepseek_moe_layers(r),
                     rope_for=lambda i, w: rope), moe


def _gpt2(r: Reader) -> Built:
    scale_weights = bool(r.get("scale_attn_weights", default=True))
    hd = r.hidden_size // r.num_heads
    inverse_layer = bool(r.get("scale_attn_by_inverse_layer_idx", default=False))
    multi_query = r.model_type == "gpt_bigcode" and bool(r.get("multi_query", default=True))
    kv = 1 if multi_query else r.num_heads
    return standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd,
                     scale=hd ** -0.5 if scale_weights else 1.0,
                     rope_for=lambda i, w: None,
                     layer_scale=(lambda i: 1.0 / (i + 1)) if inverse_layer else None), None


def _falcon(r: Reader) -> Built:
    heads = r.num_heads
    if r.get("new_decoder_architecture", default=False):
        kv = r.int("num_kv_heads", default=heads)
    elif r.get("multi_query", default=True):
        kv = 1
    else:
        kv = heads
    alibi = bool(r.get("alibi", default=False))
    return standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=r.hidden_size // heads,
                     alibi=alibi), None


def _bloom(r: Reader) -> Built:
    return standard_layers(r, [None] * r.num_layers, head_dim=r.hidden_size // r.num_heads, alibi=True), None


def _mpt(r: Reader) -> Built:
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
    return standard_layers(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd, scale=scale, alibi=True), None


def _minimax(r: Reader) -> Built:
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
    layers = [s if types[i] == "full_attention" else
              LayerSpec(index=i, kind=LayerKind.LIGHTNING, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=StateDims(recurrent=((heads, hd, hd),)), moe=True)
              for i, s in enumerate(attn)]
    check_types(r, types, {"full_attention", "linear_attention"})
    moe = moe_spec(r, experts=("num_local_experts", "num_experts"), inter=("intermediate_size",))
    return layers, moe


def _jamba(r: Reader) -> Built:
    period, offset = r.int("attn_layer_period", default=8), r.int("attn_layer_offset", default=4)
    e_period, e_offset = r.int("expert_layer_period", default=2), r.int("expert_layer_offset", default=1)
    n_exp = r.int("num_experts", default=16)

    def is_moe(i: int) -> bool:
        return n_exp > 1 and i % e_period == e_offset

    attn = standard_layers(r, [None] * r.num_layers, moe_layers=is_moe, rope_for=lambda i, w: None)
    d_inner = r.int("mamba_expand", default=2) * r.hidden_size
    d_conv, d_state = r.int("mamba_d_conv", default=4), r.int("mamba_d_state", default=16)
    state = StateDims(conv=((d_inner, d_conv - 1),), recurrent=((d_inner, d_state),))
    layers = [s if i % period == offset else
              LayerSpec(index=i, kind=LayerKind.MAMBA, state=state, moe=is_moe(i))
              for i, s in enumerate(attn)]
    # Jamba's router keeps the raw top-k softmax weights (no renormalisation)
    moe = moe_spec(r, experts=("num_experts",), inter=("intermediate_size",), norm_topk_prob=False) if n_exp > 1 else None
    return layers, moe


def _gdn_types(r: Reader) -> list[str]:
    types = r.layer_types()
    if types is None:
        interval = r.int("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(r.num_layers)]
    check_types(r, types, {"full_attention", "linear_attention"})
    return types


def _qwen3_next(r: Reader) -> Built:
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
    layers = [s if types[i] == "full_attention" else
              LayerSpec(index=i, kind=LayerKind.GDN, num_heads=nv, head_size=dk, head_size_v=dv,
                        state=state, moe=moe_layers(i))
              for i, s in enumerate(attn)]
    moe = None
    if has_moe:
        shared = r.int("shared_expert_intermediate_size", default=0)
        moe = moe_spec(r, experts=("num_experts",), num_shared_experts=1 if shared else 0,
                   shared_intermediate_size=shared, norm_topk_prob=bool(r.get("norm_topk_prob", default=True)))
    return layers, moe


def _kimi_linear(r: Reader) -> Built:
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
    use_rope = not bool(r.get("mla_use_nope", default=True))  # Kimi-Linear's MLA has no RoPE unless told
    full_ids = [i for i, t in enumerate(types) if t == "full_attention"]
    mla = mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None, use_rope=use_rope, layer_ids=full_ids)
    heads = lac.get("num_heads", r.int("linear_num_heads", default=r.num_heads))
    hd = lac.get("head_dim", r.int("linear_head_dim", default=r.head_dim))
    k = lac.get("short_conv_kernel_size", r.int("linear_conv_kernel_dim", default=4))
    state = StateDims(conv=((heads * hd, k - 1),) * 3, recurrent=((heads, hd, hd),))
    moe_layers = deepseek_moe_layers(r)
    layers = [mla[i] if i in mla else
              LayerSpec(index=i, kind=LayerKind.KDA, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=state, moe=moe_layers(i))
              for i in range(r.num_layers)]
    return layers, deepseek_moe(r)


def _deepseek(r: Reader) -> Built:
    mla = mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None)
    return [mla[i] for i in range(r.num_layers)], deepseek_moe(r)


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


def _dsa(r: Reader) -> Built:
    types = _indexer_types(r)
    n_heads, head_dim, topk = r.int("index_n_heads"), r.int("index_head_dim"), r.int("index_topk")
    # a missing field means NeoX for DeepSeek; GLM-5 is interleaved (transformers hard-codes it
    # and does not write the field when it saves a glm_moe_dsa config)
    interleaved = bool(r.get("indexer_rope_interleave", default=r.model_type == "glm_moe_dsa"))

    def indexer(i: int) -> IndexerDims:
        return IndexerDims(n_heads=n_heads, head_dim=head_dim, topk=topk, rope_interleaved=interleaved,
                           has_cache=types[i] == "full")

    mla = mla_layers(r, LayerKind.SPARSE_MLA, indexer_for=indexer)
    return [mla[i] for i in range(r.num_layers)], deepseek_moe(r)


# fla-org's NSAConfig defaults, for configs that leave a field out (an explicit null keeps
# FLA's meaning: num_kv_heads null is one KV head per query head, window_size null no window)
_NSA_DEFAULTS = {"num_kv_heads": 4, "head_dim": 32, "block_size": 64, "block_counts": 16,
                 "window_size": 512, "rope_theta": 10000.0}


def _nsa_int(r: Reader, name: str, minimum: int) -> int:
    value = r.cfg.get(name, _NSA_DEFAULTS.get(name))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArchError(f"nsa: field '{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def _nsa(r: Reader) -> Built:
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
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ArchError(f"nsa: field 'rope_theta' must be a positive number, got {theta!r}")
    if hd % 2:
        raise ArchError(f"nsa: head_dim={hd} must be even (RoPE rotates the whole head)")
    dims = NSADims(block_size=block_size, block_counts=counts, window=window or None)
    rope = RopeConfig(rotary_dim=hd, theta=float(theta))  # FLA: NeoX half-split over the whole head
    return [LayerSpec(index=i, kind=LayerKind.NSA, num_heads=heads, num_kv_heads=kv, head_size=hd,
                      head_size_v=hd, scale=hd ** -0.5, rope=rope, nsa=dims)
            for i in range(r.num_layers)], None


BUILDERS: dict[str, Callable[[Reader], Built]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen,
    "qwen3": _qwen,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "phi3": _phi3,
    "starcoder2": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt2,
    "falcon": _falcon,
    "bloom": _bloom,
    "mpt": _mpt,
    "minimax": _minimax,
    "jamba": _jamba,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_next,
    "qwen3_5_moe": _qwen3_next,
    "kimi_linear": _kimi_linear,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "kimi_k2": _deepseek,
    "deepseek_v32": _dsa,
    "glm_moe_dsa": _dsa,
    "nsa": _nsa,
}
