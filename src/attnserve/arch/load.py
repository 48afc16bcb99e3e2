"""Reading a model's ``config.json`` into a ``ModelArch``: the entry point of the ``arch`` package.

``load_hf_config`` reads the file (errors name it); ``read_arch`` unwraps multimodal wrappers
through their ``text_config``, dispatches to the family reader of the ``model_type`` (the
``FAMILIES`` table of ``families.py``) and checks what it built. Nothing outside this package
reads a raw config: the ``ModelArch`` it returns does not carry one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from attnserve.arch import families
from attnserve.arch.model_arch import ArchError, ModelArch

__all__ = ["load_hf_config", "read_arch"]


# bounds far above every released model (126 layers, 25,600 hidden, 262K vocabulary at most),
# far below what would exhaust memory while the architecture or a dummy model is built
_SIZE_BOUNDS = {"hidden_size": 1 << 18, "num_hidden_layers": 4096, "vocab_size": 1 << 24}


def _check_sizes(reader) -> None:
    """Raises ArchError naming the field when a model size is zero or absurd."""
    sizes = {"hidden_size": reader.hidden_size, "num_hidden_layers": reader.num_layers,
             "vocab_size": reader.int("vocab_size")}
    for name, value in sizes.items():
        if not 1 <= value <= _SIZE_BOUNDS[name]:
            raise ArchError(f"{reader.model_type}: field '{name}' must be in [1, {_SIZE_BOUNDS[name]}], "
                            f"got {value}")


def _positive(value: float | None) -> bool:
    return value is not None and 0 < value < math.inf


def _check_built(model_type: str, arch: ModelArch) -> None:
    """Raises ArchError naming the field when what the reader built has a non-finite or
    non-positive size, epsilon, scale or cap (a NaN epsilon runs, and generates nothing). The
    reader refuses what a config gives (``Reader.int``, ``Reader.float``); this catches what is
    derived from it."""
    def bad(field: str, value: Any, what: str = "a positive finite number") -> ArchError:
        return ArchError(f"{model_type}: {field} must be {what}, got {value!r}")

    if not _positive(arch.norm_eps):
        raise bad("the norm epsilon (rms_norm_eps, layer_norm_epsilon, ...)", arch.norm_eps)
    for name in ("final_softcap", "logit_scale"):
        value = getattr(arch, name)
        if value is not None and not (math.isfinite(value) and value != 0):
            raise bad({"final_softcap": "final_logit_softcapping"}.get(name, name), value, "a finite non-zero number")
    if arch.moe is not None:
        m = arch.moe
        if m.num_experts < 1:
            raise bad("the number of experts (num_experts, n_routed_experts, ...)", m.num_experts, "positive")
        if not 1 <= m.top_k <= m.num_experts:
            raise bad("num_experts_per_tok", m.top_k, f"in [1, num_experts={m.num_experts}]")
        if m.intermediate_size < 1:
            raise bad("moe_intermediate_size (an expert's width)", m.intermediate_size, "a positive integer")
        if not math.isfinite(m.routed_scaling_factor):
            raise bad("routed_scaling_factor", m.routed_scaling_factor, "finite")
    for s in arch.layers:
        where = f"layer {s.index}"
        if s.kind.is_attention and min(s.num_heads, s.head_size, s.head_size_v) < 1:
            raise bad(f"{where}'s heads and head sizes (num_attention_heads, head_dim, ...)",
                      (s.num_heads, s.head_size, s.head_size_v), "positive")
        if s.kind.is_attention and not _positive(s.scale):
            raise bad(f"{where}'s softmax scale (from head_dim, query_pre_attn_scalar, ...)", s.scale)
        if s.softcap is not None and not _positive(s.softcap):
            raise bad(f"{where}'s attn_logit_softcapping", s.softcap)
        if s.window is not None and s.window < 1:
            raise bad(f"{where}'s sliding_window", s.window, "a positive integer")
        eps = getattr(s.mixer, "norm_eps", None)
        if s.mixer is not None and eps is not None and not _positive(eps):
            raise bad(f"{where}'s mixer norm epsilon (rms_norm_eps)", eps)


def read_arch(config: Mapping[str, Any], *, use_mla: bool = True) -> ModelArch:
    """Build the architecture from a HF ``config.json`` dict.

    Args:
        config: the parsed ``config.json`` (a multimodal wrapper is read through its
            ``text_config``).
        use_mla: False runs MLA models with expanded per-head K/V (``ATTNSERVE_MLA_DISABLE``).
    Raises:
        ArchError: naming the model type and the field that cannot be understood.
    """
    if not isinstance(config, Mapping):
        raise ArchError(f"config must be a JSON object, got {type(config).__name__}")
    cfg = _text_config(config)
    model_type = cfg.get("model_type")
    if not model_type:
        raise ArchError("config has no 'model_type' field")
    family = families.FAMILIES.get(model_type)
    if family is None:
        known = ", ".join(sorted(families.FAMILIES))
        raise ArchError(f"model_type '{model_type}' is not supported (supported: {known})")
    reader = families.Reader(model_type, cfg)
    _check_sizes(reader)  # before anything is built from them (10**9 layers would not fit in memory)
    built = family.read(reader)
    layers = built.layers
    if not use_mla:
        layers = [families.expand_mla(s) for s in layers]
    if len(layers) != reader.num_layers:
        raise ArchError(f"{model_type}: built {len(layers)} layers for num_hidden_layers={reader.num_layers}")
    if not any(s.kind.is_attention for s in layers) and not any(s.kind.is_state for s in layers):
        raise ArchError(f"{model_type}: no attention or state layers found")
    eos = cfg.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tie = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tie is None:
        tie = family.tied_by_default
    quant = cfg.get("quantization_config")
    arch = ModelArch(
        model_type=model_type,
        architectures=tuple(config.get("architectures") or cfg.get("architectures") or ()),
        hidden_size=reader.hidden_size,
        num_layers=reader.num_layers,
        vocab_size=reader.int("vocab_size"),
        max_position_embeddings=reader.max_position_embeddings,
        dtype=_model_dtype(cfg, config, model_type),
        layers=tuple(layers),
        tie_word_embeddings=bool(tie),
        moe=built.moe,
        bos_token_id=cfg.get("bos_token_id", config.get("bos_token_id")),
        eos_token_ids=eos_ids,
        norm_eps=built.norm_eps,
        hidden_act=built.hidden_act,
        intermediate_size=built.intermediate_size,
        final_softcap=built.final_softcap,
        logit_scale=built.logit_scale,
        options=built.options,
        unsupported=built.unsupported,
        quantization_config=MappingProxyType(dict(quant)) if isinstance(quant, Mapping) else quant,
    )
    _check_built(model_type, arch)
    return arch


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a model directory or a file path, with errors naming the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ArchError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ArchError(f"{p}: expected a JSON object")
    return data


_TEXT_TYPE_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:  # noqa: C901
    """Read multimodal wrappers through their ``text_config``; normalise text model types."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        cfg = dict(text)
        cfg.setdefault("model_type", config.get("model_type"))
        for key in ("tie_word_embeddings", "torch_dtype", "dtype", "quantization_config"):
            if key not in cfg and key in config:
                cfg[key] = config[key]
    else:
        cfg = dict(config)
    mt = cfg.get("model_type")
    if mt == "gemma3":  # the wrapper type without a text_config: the text model itself
        cfg["model_type"] = "gemma3_text"
    cfg["model_type"] = _TEXT_TYPE_ALIASES.get(cfg.get("model_type"), cfg.get("model_type"))
    return cfg


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def _model_dtype(cfg: Mapping[str, Any], config: Mapping[str, Any], model_type: str) -> str:
    """``torch_dtype`` (or transformers 5's ``dtype``); when missing, float32 as transformers
    does, except for quantised checkpoints, whose activations run in bfloat16."""
    value = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    if value is None:
        quantized = "quantization_config" in cfg or "quantization_config" in config
        value = "bfloat16" if quantized else "float32"
    return _dtype_name(value, model_type)


def _dtype_name(value: Any, model_type: str) -> str:
    name = str(value).replace("torch.", "").lower()
    if name not in _DTYPES:
        raise ArchError(f"{model_type}: unsupported torch_dtype '{value}'")
    return _DTYPES[name]
