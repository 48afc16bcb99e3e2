"""Typed reading of a Hugging Face text config, and the building blocks family readers share.

``Reader`` gives each field with an error that names the model type and the field; the helpers
turn common patterns (window layouts, RoPE, MoE shapes, MLA dims) into ``LayerSpec`` lists;
``Built`` is what a family reader returns. The readers that use them are
``readers_standard.py`` and ``readers_mla_state.py``; the table of families is ``families.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from attnserve.arch.model_arch import (
    ArchError,
    IndexerDims,
    LayerKind,
    LayerSpec,
    MLADims,
    MoESpec,
    RopeConfig,
)

if TYPE_CHECKING:
    from attnserve.arch.options import FamilyOptions

_REQUIRED = object()
# fields that are sizes or counts: a config that gives one gives a positive one (an explicit 0
# builds empty matrices that run and generate nothing); fields where 0 means "none" are not here
_POSITIVE_INTS = frozenset({
    "intermediate_size", "moe_intermediate_size", "n_inner", "ffn_hidden_size", "head_dim", "q_lora_rank",
    "kv_lora_rank", "v_head_dim", "num_experts_per_tok", "num_experts_per_token", "experts_per_token",
    "index_n_heads", "index_head_dim", "index_topk", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_num_heads", "linear_head_dim",
    "linear_conv_kernel_dim", "mamba_d_state", "mamba_d_conv", "mamba_expand", "block_size", "rotary_dim",
    "sliding_window_pattern", "_sliding_window_pattern", "full_attention_interval", "attn_layer_period",
    "expert_layer_period", "index_topk_freq",
})
# floats that must be positive besides the epsilons (any field named *eps or *epsilon)
_POSITIVE_FLOATS = frozenset({"query_pre_attn_scalar", "rope_local_base_freq", "attn_logit_softcapping",
                              "final_logit_softcapping", "partial_rotary_factor", "swiglu_limit", "swiglu_alpha",
                              "rope_theta", "expansion_ratio", "attn_config.clip_qkv", "attn_config.alibi_bias_max",
                              "logit_scale"})


def _must_be_positive(name: str) -> bool:
    return name in _POSITIVE_FLOATS or name.endswith(("eps", "epsilon"))


@dataclass(frozen=True, slots=True)
class Built:
    """What a family reader returns: one ``LayerSpec`` per layer, the MoE shape, and the facts
    its model reads (the ``ModelArch`` fields of the same names)."""

    layers: list[LayerSpec]
    norm_eps: float
    hidden_act: str
    intermediate_size: int | None = None
    moe: MoESpec | None = None
    options: FamilyOptions | None = None
    final_softcap: float | None = None
    logit_scale: float | None = None
    unsupported: str | None = None


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

    def _given(self, names: tuple[str, ...]) -> str:
        """The name of the first of ``names`` the config gives (the first name if none)."""
        return next((n for n in names if self.cfg.get(n) is not None), names[0])

    def int(self, *names: str, default: Any = _REQUIRED) -> int:
        value = self.get(*names, default=default)
        if value is None:
            return value
        name = self._given(names)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArchError(f"{self.model_type}: field '{name}' must be a non-negative integer, got {value!r}")
        if value == 0 and name in _POSITIVE_INTS and self.cfg.get(name) is not None:
            raise ArchError(f"{self.model_type}: field '{name}' must be a positive integer, got 0")
        return value

    def flag(self, name: str, default: bool) -> bool:
        """``bool(cfg.get(name, default))``: an explicit null is False, as the model files read it."""
        return bool(self.cfg.get(name, default))

    def float(self, *names: str, default: Any = _REQUIRED) -> float | None:
        """A finite number; positive where the field is an epsilon, a scale or a soft-cap."""
        value = self.get(*names, default=default)
        if value is None:
            return None
        return self.number(self._given(names), value)

    def number(self, name: str, value: Any) -> float:
        """``value`` of field ``name`` as a finite float (positive where ``name`` must be)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ArchError(f"{self.model_type}: field '{name}' must be a finite number, got {value!r}")
        if value <= 0 and _must_be_positive(name):
            raise ArchError(f"{self.model_type}: field '{name}' must be positive, got {value!r}")
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
        theta = self.number("rope_theta", theta)
        if rotary_dim is None:
            prf = p.get("partial_rotary_factor", self.cfg.get("partial_rotary_factor", 1.0))
            rotary_dim = int(head_dim * self.number("partial_rotary_factor", prf))
        omax = self.cfg.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
        if omax is None and rope_type in ("llama3", "yarn", "longrope"):
            omax = self.max_position_embeddings
        factor = p.get("factor", 1.0)
        if rope_type != "default" and rope_type != "longrope" and factor is None:
            raise ArchError(f"{self.model_type}: rope type '{rope_type}' needs a 'factor'")
        if factor is not None and self.number("rope_scaling.factor", factor) <= 0:
            raise ArchError(f"{self.model_type}: field 'rope_scaling.factor' must be positive, got {factor!r}")
        for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                    "attention_factor"):
            if p.get(key) is not None:
                self.number(f"rope_scaling.{key}", p[key])

        def tup(key: str) -> tuple[float, ...] | None:
            v = p.get(key)
            if v is not None and not isinstance(v, (list, tuple)):
                raise ArchError(f"{self.model_type}: field 'rope_scaling.{key}' must be a list of numbers")
            return tuple(self.number(f"rope_scaling.{key}", x) for x in v) if v is not None else None

        return RopeConfig(
            rotary_dim=rotary_dim, theta=theta, rope_type=rope_type, interleaved=interleaved,
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

def windows_from_layer_types(r: Reader, window: int | None) -> list[int | None] | None:
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


def qwen_windows(r: Reader) -> list[int | None]:
    """Qwen2/Qwen3 ship ``sliding_window`` with ``use_sliding_window: false``: that is no window."""
    window = r.get("sliding_window", default=None) if r.get("use_sliding_window", default=False) else None
    from_types = windows_from_layer_types(r, window) if window else None
    if from_types is not None:
        return from_types
    max_window_layers = r.int("max_window_layers", default=0)
    return [window if window and i >= max_window_layers else None for i in range(r.num_layers)]


def every_layer_window(r: Reader) -> list[int | None]:
    window = r.get("sliding_window", default=None)
    return [window or None] * r.num_layers


def pattern_windows(r: Reader, period: int) -> list[int | None]:
    """Gemma 2/3, GPT-OSS: ``layer_types`` or every ``period``-th layer full, the rest sliding."""
    window = r.int("sliding_window", default=None)
    from_types = windows_from_layer_types(r, window)
    if from_types is not None:
        return from_types
    return [None if (i + 1) % period == 0 else window for i in range(r.num_layers)]


def standard_layers(r: Reader, windows: list[int | None], *, moe_layers: Callable[[int], bool] = lambda i: False,
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


def moe_spec(r: Reader, *, experts: tuple[str, ...], top_k: tuple[str, ...] = ("num_experts_per_tok",),
         inter: tuple[str, ...] = ("moe_intermediate_size",), **kw: Any) -> MoESpec:
    return MoESpec(num_experts=r.int(*experts), top_k=r.int(*top_k), intermediate_size=r.int(*inter), **kw)


def qwen_moe_layers(r: Reader) -> Callable[[int], bool]:
    n = r.int("num_experts", "num_local_experts", default=0)
    step = r.int("decoder_sparse_step", default=1) or 1
    only_mlp = set(r.get("mlp_only_layers", default=[]) or [])
    return lambda i: n > 0 and i not in only_mlp and (i + 1) % step == 0


def deepseek_moe_layers(r: Reader) -> Callable[[int], bool]:
    types = r.cfg.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == r.num_layers:
        return lambda i: types[i] == "sparse"
    n = r.int("n_routed_experts", "num_experts", default=0)
    first = r.int("first_k_dense_replace", default=0)
    freq = r.int("moe_layer_freq", default=1) or 1
    return lambda i: bool(n) and i >= first and i % freq == 0


# Routing defaults of the families whose configs may omit them (HF config classes' defaults).
_SIGMOID_ROUTED = frozenset({"deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "kimi_linear"})


def deepseek_moe(r: Reader) -> MoESpec | None:
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


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_layers(r: Reader, kind: LayerKind, *, indexer_for: Callable[[int], IndexerDims | None],
                use_rope: bool = True, layer_ids: list[int] | None = None) -> dict[int, LayerSpec]:
    dims = MLADims(q_lora_rank=r.int("q_lora_rank", default=None), kv_lora_rank=r.int("kv_lora_rank"),
                   qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                   v_head_dim=r.int("v_head_dim"), attention_bias=r.flag("attention_bias", False))
    params = r.rope_params()
    rope = None
    scale = dims.qk_head_dim ** -0.5
    if use_rope:
        rope = r.rope(dims.qk_rope_head_dim, params=params, rotary_dim=dims.qk_rope_head_dim,
                      interleaved=bool(r.get("rope_interleave", default=True)))
        if rope.rope_type != "default" and rope.mscale_all_dim:
            m = yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
    moe = deepseek_moe_layers(r)
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


def check_types(r: Reader, types: list[str], allowed: set[str]) -> None:
    bad = sorted(set(types) - allowed)
    if bad or len(types) != r.num_layers:
        raise ArchError(f"{r.model_type}: unsupported layer types {bad} in layer_types "
                        f"(allowed: {sorted(allowed)})")
