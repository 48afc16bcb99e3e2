"""Per-family readers of HF configs: how each model type lays out its layers.

``arch.ModelArch.from_hf`` dispatches here by ``model_type``. Each builder returns the list of
``LayerSpec`` (one per layer) and the model's ``MoESpec`` (or None). The quirks handled here
are listed in DESIGN.md (ModelArch); each has a test in ``tests/unit/test_arch.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from attnserve.arch import (
    ArchError,
    IndexerDims,
    LayerKind,
    LayerSpec,
    MLADims,
    MoESpec,
    RopeConfig,
    StateDims,
)

_REQUIRED = object()

# Families whose HF config class ties input and output embeddings unless told otherwise.
TIED_BY_DEFAULT = frozenset({"gpt2", "gpt_bigcode", "falcon", "bloom", "mpt", "gemma", "gemma2",
                             "gemma3_text"})


class Reader:
    """Typed access to one text config, with errors that name the model type and the field."""

    def __init__(self, model_type: str, cfg: Mapping[str, Any]):
        self.model_type = model_type
        self.cfg = cfg

    def get(self, *names: str, default: Any = _REQUIRED) -> Any:
        for name in names:
            if self.cfg.get(name) is not None:
                return self.cfg[name]
        if default is _REQUIRED:
            raise ArchError(f"{self.model_type}: missing required field '{names[0]}'")
        return default

    def int(self, *names: str, default: Any = _REQUIRED) -> int:
        value = self.get(*names, default=default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArchError(f"{self.model_type}: field '{names[0]}' must be a non-negative integer, "
                            f"got {value!r}")
        return value

    def float(self, *names: str, default: Any = _REQUIRED) -> float | None:
        value = self.get(*names, default=default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArchError(f"{self.model_type}: field '{names[0]}' must be a number, got {value!r}")
        return float(value)

    # --- common fields -------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.int("hidden_size", "n_embd", "d_model", "n_embed")

    @property
    def num_layers(self) -> int:
        return self.int("num_hidden_layers", "n_layer", "n_layers", "num_layers")

    @property
    def num_heads(self) -> int:
        n = self.int("num_attention_heads", "n_head", "n_heads")
        if n == 0:
            raise ArchError(f"{self.model_type}: field 'num_attention_heads' must be positive")
        return n

    @property
    def num_kv_heads(self) -> int:
        kv = self.int("num_key_value_heads", default=None)
        heads = self.num_heads
        kv = heads if kv is None else kv
        if kv == 0 or heads % kv:
            raise ArchError(f"{self.model_type}: num_attention_heads={heads} is not a multiple of "
                            f"num_key_value_heads={kv}")
        return kv

    @property
    def head_dim(self) -> int:
        hd = self.int("head_dim", default=None)
        if hd:
            return hd
        if self.hidden_size % self.num_heads:
            raise ArchError(f"{self.model_type}: hidden_size={self.hidden_size} is not divisible by "
                            f"num_attention_heads={self.num_heads} and no head_dim is given")
        return self.hidden_size // self.num_heads

    @property
    def max_position_embeddings(self) -> int | None:
        return self.int("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                        "model_max_length", default=None)

    def layer_types(self) -> list[str] | None:
        lt = self.cfg.get("layer_types")
        if lt is None:
            return None
        if not isinstance(lt, list) or len(lt) != self.num_layers:
            raise ArchError(f"{self.model_type}: field 'layer_types' must list one type per layer "
                            f"({self.num_layers})")
        return [str(t) for t in lt]

    # --- RoPE ---------------------------------------------------------------------------
    def rope_params(self, layer_type: str | None = None) -> dict[str, Any]:
        """The RoPE dict for one layer type, from ``rope_parameters`` or ``rope_scaling``."""
        params = self.cfg.get("rope_parameters")
        if not isinstance(params, Mapping):
            params = self.cfg.get("rope_scaling")
        params = dict(params) if isinstance(params, Mapping) else {}
        nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
        if nested and layer_type is not None and layer_type in nested:
            return dict(nested[layer_type])
        if nested and all(k.endswith("attention") for k in nested):
            return dict(nested.get("full_attention") or next(iter(nested.values())))
        return params

    def rope(self, head_dim: int, *, params: Mapping[str, Any] | None = None,
             interleaved: bool = False, rotary_dim: int | None = None,
             theta: float | None = None) -> RopeConfig:
        p = dict(self.rope_params() if params is None else params)
        rope_type = str(p.get("rope_type") or p.get("type") or "default")
        rope_type = {"su": "longrope", "mrope": "default", "dynamic_ntk": "dynamic"}.get(rope_type, rope_type)
        if rope_type not in ("default", "linear", "dynamic", "yarn", "llama3", "longrope"):
            raise ArchError(f"{self.model_type}: unsupported rope type '{rope_type}' in rope_scaling")
        if theta is None:
            theta = p.get("rope_theta", self.cfg.get("rope_theta", 10000.0))
        if rotary_dim is None:
            prf = p.get("partial_rotary_factor", self.cfg.get("partial_rotary_factor", 1.0))
            rotary_dim = int(head_dim * float(prf))
        omax = self.cfg.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
        if omax is None and rope_type in ("llama3", "yarn", "longrope"):
            omax = self.max_position_embeddings
        factor = p.get("factor", 1.0)
        if rope_type != "default" and rope_type != "longrope" and factor is None:
            raise ArchError(f"{self.model_type}: rope type '{rope_type}' needs a 'factor'")

        def tup(key: str) -> tuple[float, ...] | None:
            v = p.get(key)
            return tuple(float(x) for x in v) if v is not None else None

        return RopeConfig(
            rotary_dim=rotary_dim, theta=float(theta), rope_type=rope_type, interleaved=interleaved,
            factor=float(factor if factor is not None else 1.0),
            max_position_embeddings=self.max_position_embeddings,
            original_max_position_embeddings=int(omax) if omax is not None else None,
            low_freq_factor=p.get("low_freq_factor"), high_freq_factor=p.get("high_freq_factor"),
            beta_fast=p.get("beta_fast"), beta_slow=p.get("beta_slow"), mscale=p.get("mscale"),
            mscale_all_dim=p.get("mscale_all_dim"), attention_factor=p.get("attention_factor"),
            truncate=bool(p.get("truncate", True)), short_factor=tup("short_factor"),
            long_factor=tup("long_factor"),
        )


# --- building blocks ----------------------------------------------------------------------

def _windows_from_layer_types(r: Reader, window: int | None) -> list[int | None] | None:
    types = r.layer_types()
    if types is None:
        return None
    out: list[int | None] = []
    for t in types:
        if t in ("sliding_attention", "sliding"):
            if not window:
                raise ArchError(f"{r.model_type}: layer_types has sliding layers but no 'sliding_window'")
            out.append(window)
        elif t in ("full_attention", "attention", "full"):
            out.append(None)
        else:
            raise ArchError(f"{r.model_type}: unsupported layer type '{t}' in layer_types")
    return out


def _qwen_windows(r: Reader) -> list[int | None]:
    """Qwen2/Qwen3 ship ``sliding_window`` with ``use_sliding_window: false``: that is no window."""
    window = r.get("sliding_window", default=None) if r.get("use_sliding_window", default=False) else None
    from_types = _windows_from_layer_types(r, window) if window else None
    if from_types is not None:
        return from_types
    max_window_layers = r.int("max_window_layers", default=0)
    return [window if window and i >= max_window_layers else None for i in range(r.num_layers)]


def _every_layer_window(r: Reader) -> list[int | None]:
    window = r.get("sliding_window", default=None)
    return [window or None] * r.num_layers


def _pattern_windows(r: Reader, period: int) -> list[int | None]:
    """Gemma 2/3, GPT-OSS: ``layer_types`` or every ``period``-th layer full, the rest sliding."""
    window = r.int("sliding_window", default=None)
    from_types = _windows_from_layer_types(r, window)
    if from_types is not None:
        return from_types
    return [None if (i + 1) % period == 0 else window for i in range(r.num_layers)]


def _standard(r: Reader, windows: list[int | None], *, moe_layers: Callable[[int], bool] = lambda i: False,
              rope_for: Callable[[int, int | None], RopeConfig | None] | None = None,
              num_kv_heads: int | None = None, head_dim: int | None = None,
              scale: float | None = None, alibi: bool = False, sinks: bool = False,
              softcap: float | None = None, layer_scale: Callable[[int], float] | None = None,
              ) -> list[LayerSpec]:
    hd = head_dim or r.head_dim
    kv = num_kv_heads if num_kv_heads is not None else r.num_kv_heads
    if rope_for is None:
        rope = None if alibi else r.rope(hd)
        rope_for = lambda i, w: rope  # noqa: E731
    layers = []
    for i, w in enumerate(windows):
        sc = scale if scale is not None else hd ** -0.5
        if layer_scale is not None:
            sc = sc * layer_scale(i)
        layers.append(LayerSpec(
            index=i, kind=LayerKind.SLIDING if w else LayerKind.FULL, num_heads=r.num_heads,
            num_kv_heads=kv, head_size=hd, head_size_v=hd, scale=sc, window=w or None,
            rope=rope_for(i, w), alibi=alibi, sinks=sinks, softcap=softcap, moe=moe_layers(i)))
    return layers


def _moe(r: Reader, *, experts: tuple[str, ...], top_k: tuple[str, ...] = ("num_experts_per_tok",),
         inter: tuple[str, ...] = ("moe_intermediate_size",), **kw: Any) -> MoESpec:
    return MoESpec(num_experts=r.int(*experts), top_k=r.int(*top_k), intermediate_size=r.int(*inter), **kw)


def _qwen_moe_layers(r: Reader) -> Callable[[int], bool]:
    n = r.int("num_experts", "num_local_experts", default=0)
    step = r.int("decoder_sparse_step", default=1) or 1
    only_mlp = set(r.get("mlp_only_layers", default=[]) or [])
    return lambda i: n > 0 and i not in only_mlp and (i + 1) % step == 0


def _deepseek_moe_layers(r: Reader) -> Callable[[int], bool]:
    types = r.cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == r.num_layers:
        return lambda i: types[i] == "sparse"
    n = r.int("n_routed_experts", "num_experts", default=0)
    first = r.int("first_k_dense_replace", default=0)
    freq = r.int("moe_layer_freq", default=1) or 1
    return lambda i: bool(n) and i >= first and i % freq == 0


# Routing defaults of the families whose configs may omit them (HF config classes' defaults).
_SIGMOID_ROUTED = frozenset({"deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "kimi_linear"})


def _deepseek_moe(r: Reader) -> MoESpec | None:
    if not r.int("n_routed_experts", "num_experts", default=0):
        return None
    sigmoid_family = r.model_type in _SIGMOID_ROUTED
    scoring = r.get("scoring_func", "moe_router_activation_func",
                    default="sigmoid" if sigmoid_family else "softmax")
    method = r.get("topk_method", default="noaux_tc" if scoring == "sigmoid" else "greedy")
    if r.model_type in ("glm4_moe", "glm_moe_dsa"):
        method = "noaux_tc"  # GLM routes with the correction bias whatever topk_method says
    if r.get("use_grouped_topk", default=False) and method == "greedy":
        method = "noaux_tc"
    n_shared = r.int("n_shared_experts", "num_shared_experts", default=0)
    return MoESpec(
        num_experts=r.int("n_routed_experts", "num_experts"),
        top_k=r.int("num_experts_per_tok", "num_experts_per_token"),
        intermediate_size=r.int("moe_intermediate_size"),
        num_shared_experts=n_shared,
        shared_intermediate_size=n_shared * r.int("moe_intermediate_size"),
        scoring=scoring,
        norm_topk_prob=bool(r.get("norm_topk_prob", "moe_renormalize", default=sigmoid_family)),
        routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
        topk_method=method, n_group=r.int("n_group", "num_expert_group", default=1) or 1,
        topk_group=r.int("topk_group", default=1) or 1)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_layers(r: Reader, kind: LayerKind, *, indexer_for: Callable[[int], IndexerDims | None],
                use_rope: bool = True, layer_ids: list[int] | None = None) -> dict[int, LayerSpec]:
    dims = MLADims(q_lora_rank=r.int("q_lora_rank", default=None), kv_lora_rank=r.int("kv_lora_rank"),
                   qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                   v_head_dim=r.int("v_head_dim"))
    params = r.rope_params()
    rope = None
    scale = dims.qk_head_dim ** -0.5
    if use_rope:
        rope = r.rope(dims.qk_rope_head_dim, params=params, rotary_dim=dims.qk_rope_head_dim,
                      interleaved=bool(r.get("rope_interleave", default=True)))
        if rope.rope_type != "default" and rope.mscale_all_dim:
            m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
    moe = _deepseek_moe_layers(r)
    heads = r.num_heads
    out = {}
    for i in layer_ids if layer_ids is not None else range(r.num_layers):
        out[i] = LayerSpec(index=i, kind=kind, num_heads=heads, num_kv_heads=1,
                           head_size=dims.qk_head_dim, head_size_v=dims.v_head_dim, scale=scale,
                           rope=rope, mla=dims, indexer=indexer_for(i), moe=moe(i))
    return out


def expand_mla(spec: LayerSpec) -> LayerSpec:
    """MLA run as plain MHA over expanded per-head K/V (``ATTNSERVE_MLA_DISABLE=1``)."""
    if spec.kind is not LayerKind.MLA:
        return spec
    return replace(spec, kind=LayerKind.FULL, num_kv_heads=spec.num_heads)


# --- families -----------------------------------------------------------------------------
Built = tuple[list[LayerSpec], MoESpec | None]


def _llama(r: Reader) -> Built:
    windows = _windows_from_layer_types(r, r.get("sliding_window", default=None)) or [None] * r.num_layers
    return _standard(r, windows), None


def _mistral(r: Reader) -> Built:
    return _standard(r, _every_layer_window(r)), None


def _mixtral(r: Reader) -> Built:
    moe = _moe(r, experts=("num_local_experts",), inter=("intermediate_size",))
    return _standard(r, _every_layer_window(r), moe_layers=lambda i: True), moe


def _qwen(r: Reader) -> Built:
    return _standard(r, _qwen_windows(r)), None


def _qwen_moe(r: Reader) -> Built:
    shared = r.int("shared_expert_intermediate_size", default=0)
    moe = _moe(r, experts=("num_experts", "num_local_experts"), num_shared_experts=1 if shared else 0,
               shared_intermediate_size=shared, norm_topk_prob=bool(r.get("norm_topk_prob", default=False)))
    return _standard(r, _qwen_windows(r), moe_layers=_qwen_moe_layers(r)), moe


def _phi3(r: Reader) -> Built:
    return _standard(r, _every_layer_window(r)), None


def _gemma(r: Reader) -> Built:
    return _standard(r, [None] * r.num_layers), None


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
    return _standard(r, _pattern_windows(r, 2), scale=scale,
                     softcap=r.float("attn_logit_softcapping", default=None)), None


def _gemma3(r: Reader) -> Built:
    r = _gemma_defaults(r)
    hd = r.head_dim
    scale = r.float("query_pre_attn_scalar") ** -0.5
    windows = _pattern_windows(r, r.int("sliding_window_pattern", "_sliding_window_pattern", default=6))
    params = r.cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:  # transformers 5 spelling
        local = r.rope(hd, params=r.rope_params("sliding_attention"))
        glob = r.rope(hd, params=r.rope_params("full_attention"))
    else:  # checkpoint spelling: rope_local_base_freq for sliding layers, rope_scaling for full ones
        local = RopeConfig(rotary_dim=hd, theta=r.float("rope_local_base_freq", default=10000.0))
        glob = r.rope(hd)
    return _standard(r, windows, scale=scale, softcap=r.float("attn_logit_softcapping", default=None),
                     rope_for=lambda i, w: local if w else glob), None


def _gpt_oss(r: Reader) -> Built:
    moe = _moe(r, experts=("num_local_experts", "num_experts"),
               top_k=("num_experts_per_tok", "experts_per_token"), inter=("intermediate_size",))
    return _standard(r, _pattern_windows(r, 2), sinks=True, moe_layers=lambda i: True), moe


def _glm4_moe(r: Reader) -> Built:
    moe = _deepseek_moe(r)
    hd = r.head_dim
    prf = r.float("partial_rotary_factor", default=None)  # transformers 5 nests it in rope_parameters
    if prf is None:
        prf = float(r.rope_params().get("partial_rotary_factor", 0.5))
    rope = r.rope(hd, rotary_dim=int(hd * prf))
    return _standard(r, [None] * r.num_layers, moe_layers=_deepseek_moe_layers(r),
                     rope_for=lambda i, w: rope), moe


def _gpt2(r: Reader) -> Built:
    scale_weights = bool(r.get("scale_attn_weights", default=True))
    hd = r.hidden_size // r.num_heads
    inverse_layer = bool(r.get("scale_attn_by_inverse_layer_idx", default=False))
    multi_query = r.model_type == "gpt_bigcode" and bool(r.get("multi_query", default=True))
    kv = 1 if multi_query else r.num_heads
    return _standard(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd,
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
    return _standard(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=r.hidden_size // heads,
                     alibi=alibi), None


def _bloom(r: Reader) -> Built:
    return _standard(r, [None] * r.num_layers, head_dim=r.hidden_size // r.num_heads, alibi=True), None


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
    return _standard(r, [None] * r.num_layers, num_kv_heads=kv, head_dim=hd, scale=scale, alibi=True), None


def _minimax(r: Reader) -> Built:
    types = r.layer_types()
    if types is None and isinstance(r.cfg.get("attn_type_list"), list):
        types = ["full_attention" if t == 1 else "linear_attention" for t in r.cfg["attn_type_list"]]
    if types is None:
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(r.num_layers)]
    hd = r.head_dim
    rotary = r.int("rotary_dim", default=None)
    attn = _standard(r, [None] * r.num_layers, moe_layers=lambda i: True,
                     rope_for=lambda i, w: r.rope(hd, rotary_dim=rotary))
    heads = r.num_heads
    layers = [s if types[i] == "full_attention" else
              LayerSpec(index=i, kind=LayerKind.LIGHTNING, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=StateDims(recurrent=((heads, hd, hd),)), moe=True)
              for i, s in enumerate(attn)]
    _check_types(r, types, {"full_attention", "linear_attention"})
    moe = _moe(r, experts=("num_local_experts", "num_experts"), inter=("intermediate_size",))
    return layers, moe


def _jamba(r: Reader) -> Built:
    period, offset = r.int("attn_layer_period", default=8), r.int("attn_layer_offset", default=4)
    e_period, e_offset = r.int("expert_layer_period", default=2), r.int("expert_layer_offset", default=1)
    n_exp = r.int("num_experts", default=16)

    def is_moe(i: int) -> bool:
        return n_exp > 1 and i % e_period == e_offset

    attn = _standard(r, [None] * r.num_layers, moe_layers=is_moe, rope_for=lambda i, w: None)
    d_inner = r.int("mamba_expand", default=2) * r.hidden_size
    d_conv, d_state = r.int("mamba_d_conv", default=4), r.int("mamba_d_state", default=16)
    state = StateDims(conv=((d_inner, d_conv - 1),), recurrent=((d_inner, d_state),))
    layers = [s if i % period == offset else
              LayerSpec(index=i, kind=LayerKind.MAMBA, state=state, moe=is_moe(i))
              for i, s in enumerate(attn)]
    # Jamba's router keeps the raw top-k softmax weights (no renormalisation)
    moe = _moe(r, experts=("num_experts",), inter=("intermediate_size",), norm_topk_prob=False) if n_exp > 1 else None
    return layers, moe


def _gdn_types(r: Reader) -> list[str]:
    types = r.layer_types()
    if types is None:
        interval = r.int("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(r.num_layers)]
    _check_types(r, types, {"full_attention", "linear_attention"})
    return types


def _qwen3_next(r: Reader) -> Built:
    types = _gdn_types(r)
    hd = r.head_dim
    prf = r.float("partial_rotary_factor", default=None)
    if prf is None:
        prf = float(r.rope_params().get("partial_rotary_factor", 0.25))
    rope = r.rope(hd, rotary_dim=int(hd * prf))
    has_moe = r.int("num_experts", default=0) > 0
    moe_layers = _qwen_moe_layers(r) if has_moe else (lambda i: False)
    attn = _standard(r, [None] * r.num_layers, moe_layers=moe_layers, rope_for=lambda i, w: rope)
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
        moe = _moe(r, experts=("num_experts",), num_shared_experts=1 if shared else 0,
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
    _check_types(r, types, {"full_attention", "linear_attention"})
    use_rope = not bool(r.get("mla_use_nope", default=True))  # Kimi-Linear's MLA has no RoPE unless told
    full_ids = [i for i, t in enumerate(types) if t == "full_attention"]
    mla = _mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None, use_rope=use_rope, layer_ids=full_ids)
    heads = lac.get("num_heads", r.int("linear_num_heads", default=r.num_heads))
    hd = lac.get("head_dim", r.int("linear_head_dim", default=r.head_dim))
    k = lac.get("short_conv_kernel_size", r.int("linear_conv_kernel_dim", default=4))
    state = StateDims(conv=((heads * hd, k - 1),) * 3, recurrent=((heads, hd, hd),))
    moe_layers = _deepseek_moe_layers(r)
    layers = [mla[i] if i in mla else
              LayerSpec(index=i, kind=LayerKind.KDA, num_heads=heads, head_size=hd, head_size_v=hd,
                        state=state, moe=moe_layers(i))
              for i in range(r.num_layers)]
    return layers, _deepseek_moe(r)


def _deepseek(r: Reader) -> Built:
    mla = _mla_layers(r, LayerKind.MLA, indexer_for=lambda i: None)
    return [mla[i] for i in range(r.num_layers)], _deepseek_moe(r)


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

    mla = _mla_layers(r, LayerKind.SPARSE_MLA, indexer_for=indexer)
    return [mla[i] for i in range(r.num_layers)], _deepseek_moe(r)


def _check_types(r: Reader, types: list[str], allowed: set[str]) -> None:
    bad = sorted(set(types) - allowed)
    if bad or len(types) != r.num_layers:
        raise ArchError(f"{r.model_type}: unsupported layer types {bad} in layer_types "
                        f"(allowed: {sorted(allowed)})")


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
}
