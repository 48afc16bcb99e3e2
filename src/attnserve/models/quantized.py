"""Quantised checkpoints, dequantised as they are read: fp8 (block, channel or tensor scales) and MXFP4.

What this file is: a wrapper around a checkpoint's tensor stream (``weights.iter_safetensors``)
for a model whose ``config.json`` has a ``quantization_config``. Each quantised tensor is
paired with its scales, dequantised in float32 and yielded once, under the unquantised name
and in the model's dtype, so that the models' ``load_weights`` see an ordinary checkpoint.
- ``fp8`` with ``weight_block_size`` [bm, bn] (DeepSeek-V3/V3.2, GLM-5-FP8, Qwen3-*-FP8): a
  ``float8_e4m3fn`` (or e5m2) ``X.weight`` [..., out, in] and its ``X.weight_scale_inv``
  [..., ceil(out / bm), ceil(in / bn)]; the weight is each value times its block's scale, the
  edge blocks being partial. Scales are float32 (a power of two for ``scale_fmt`` ue8m0),
  ``float8_e8m0fnu``, or e8m0 exponents as uint8 (2 ** (byte - 127)).
- ``fp8`` without a block (AutoFP8 / vLLM's own fp8 checkpoints): one ``X.weight_scale`` per
  tensor; ``fbgemm_fp8`` (Meta's Llama-3.1-405B-FP8): ``X.weight_scale`` [out, 1], one per
  output channel. The weight is each value times its scale.
- ``compressed-tensors`` in its ``float-quantized`` format (the llm-compressor releases, e.g.
  RedHatAI's ``*-FP8-dynamic``): 8-bit float weights of every config group, with
  ``X.weight_scale`` per tensor, per channel or per block (``block_structure``), symmetric.
  The config is checked by this file's rules (what attnserve reads), then, when the optional
  ``compressed-tensors`` library is installed, by its ``QuantizationConfig`` (the rest).
- ``mxfp4`` (gpt-oss): ``X_blocks`` [E, out, G, 16] uint8 and ``X_scales`` [E, out, G] uint8.
  Each byte holds two e2m1 codes, the low nibble first (the even column), so a group of 16
  bytes is 32 consecutive values along ``in``, sharing the scale 2 ** (scale - 127). The
  unquantised tensor ``X`` is stored [E, in, out] (gpt-oss's ``gate_up_proj`` [E, H, 2I],
  ``down_proj`` [E, I, H]), so the dense [E, out, in] is yielded transposed.
A tensor is quantised when its dtype is the format's (fp8; uint8 blocks) and its partner
arrives, in any order and in any shard: the first of the two waits for the other. Static
activation and KV scales (``X.input_scale``, ``input_scale_ub``, ``k_scale``, ``v_scale``) are
dropped: the weights are dequantised and activations run in the model dtype, as transformers
runs a dequantised checkpoint. Everything else (norms, embeddings, routers, the modules the
config leaves unquantised) passes through untouched.

What it is not: kernels that keep weights quantised in memory (the model holds the dequantised
weights in its dtype), integer or 4-bit schemes other than MXFP4 (AWQ, GPTQ, bitsandbytes,
compressed-tensors' int and pack-quantized formats), asymmetric scales or sparsity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QuantScheme", "check_quantization_option", "dequantize_fp8_blocks", "dequantize_fp8_scaled", "dequantize_mxfp4",
           "dequantized_weights", "unquantised_modules"]

SUPPORTED = ("fp8 (quant_method 'fp8' with or without weight_block_size, 'fbgemm_fp8', and "
             "compressed-tensors' float-quantized 8-bit float weights) and mxfp4")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# static activation and KV cache scales: dropped, the weights being dequantised
_DROPPED_SCALES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale")
# e2m1 values by 4-bit code: sign bit high, then 2 exponent bits and 1 mantissa bit
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_GROUP_BYTES = 16  # 32 values per shared scale
_GRANULARITIES = ("block", "channel", "tensor")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint's weights are quantised: ``fp8`` (block, channel or tensor scales) or ``mxfp4``.

    ``granularity`` is "block" exactly when ``block_size`` is given; ``scale_suffix`` follows
    ``X.weight`` in the scale's name (``_scale_inv``: DeepSeek's block format; ``_scale``: the
    others). The defaults make ``QuantScheme("fp8", (128, 128))`` the DeepSeek format.
    """

    method: str
    block_size: tuple[int, int] | None = None  # fp8: rows x columns that share one scale
    granularity: str | None = None  # fp8: "block" | "channel" | "tensor"; None for mxfp4
    scale_suffix: str = "_scale_inv"

    def __post_init__(self) -> None:
        if self.method == "fp8" and self.block_size is not None and self.granularity is None:
            object.__setattr__(self, "granularity", "block")
        if self.method == "mxfp4":
            ok = self.block_size is None and self.granularity is None
        else:
            ok = (self.method == "fp8" and self.granularity in _GRANULARITIES
                  and (self.block_size is not None) == (self.granularity == "block")
                  and self.scale_suffix in ("_scale_inv", "_scale"))
        if not ok:
            raise ValueError(f"not a supported scheme: {self.method} with block {self.block_size}, "
                             f"{self.granularity} scales named '*.weight{self.scale_suffix}'")

    @classmethod
    def from_config(cls, qc: Mapping[str, Any] | None) -> QuantScheme | None:
        """The scheme of a ``quantization_config`` (None: not quantised).

        Raises:
            ValueError: a method or an fp8 variant that is not supported, naming it.
        """
        if qc is None:
            return None
        if not isinstance(qc, Mapping):
            raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method == "mxfp4":
            return cls("mxfp4")
        if method == "fbgemm_fp8":
            return cls("fp8", None, "channel", "_scale")
        if method == "compressed-tensors":
            return _compressed_tensors_scheme(qc)
        if method != "fp8":
            raise ValueError(f"quantization_config: quant_method '{method}' is not supported; attnserve "
                             f"loads {SUPPORTED} checkpoints, dequantised to the model dtype "
                             "(load_format='dummy' ignores quantisation)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config: fp8 activation_scheme '{scheme}' is not supported "
                             "(dynamic, or static, whose input scales are dropped: the weights are "
                             "dequantised and activations are never quantised)")
        block = qc.get("weight_block_size")
        if block is None:  # one weight_scale per tensor
            return cls("fp8", None, "tensor", "_scale")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config: fp8 scale_fmt '{scale_fmt}' is not supported "
                             "(float, ue8m0)")
        return cls("fp8", _block_size(block, "weight_block_size"))


def check_quantization_option(option: str | None, qc: Mapping[str, Any] | None) -> None:
    """vLLM's ``quantization`` option against the checkpoint's ``quantization_config``: it must
    name the checkpoint's method (None: any).

    Raises:
        ValueError: the checkpoint is not quantised (attnserve does not quantise as it loads),
            or is quantised with another method; naming both.
    """
    if option is None:
        return
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method is None:
        raise ValueError(f"quantization={option!r}: this checkpoint is not quantised (no quantization_config), "
                         "and attnserve does not quantise weights as it loads them; leave the option out to "
                         "run it in the model dtype")
    if method != option:
        raise ValueError(f"quantization={option!r} does not match the checkpoint's quantization_config, whose "
                         f"quant_method is {method!r}; leave the option out or pass {method!r}")


def unquantised_modules(qc: Mapping[str, Any] | None) -> list[str]:
    """The module patterns a ``quantization_config`` keeps unquantised: ``modules_to_not_convert``
    and vLLM's ``ignored_layers`` (fnmatch globs), or compressed-tensors' ``ignore`` (names, or
    ``re:`` regular expressions)."""
    if not qc:
        return []
    if qc.get("quant_method") == "compressed-tensors":
        return [str(m) for m in qc.get("ignore") or ()]
    return [str(m) for key in ("modules_to_not_convert", "ignored_layers") for m in qc.get(key) or ()]


def _block_size(block: Any, what: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config: fp8 {what} must be two positive integers, got {block!r}")
    return block[0], block[1]


def _compressed_tensors_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    """compressed-tensors' config: 8-bit float weights in every group, one granularity for all."""
    where = "quantization_config (compressed-tensors)"
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{where}: format '{fmt}' is not supported; attnserve loads float-quantized "
                         "8-bit float (fp8) weights, dequantised to the model dtype")
    if qc.get("sparsity_config"):
        raise ValueError(f"{where}: sparsity_config is not supported (dense weights only)")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}: config_groups must be a non-empty object, got {groups!r}")
    kinds = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise ValueError(f"{where}: config group '{name}' has no weights scheme")
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits != 8 or kind != "float":
            raise ValueError(f"{where}: config group '{name}' quantises weights to {bits}-bit {kind}; "
                             "attnserve loads 8-bit float (fp8) weights only")
        if weights.get("symmetric") is False:
            raise ValueError(f"{where}: config group '{name}' has asymmetric weights (zero points); "
                             "attnserve loads symmetric fp8 weights only")
        strategy = weights.get("strategy")
        if strategy == "block":
            kinds.add(("block", _block_size(weights.get("block_structure"), f"group '{name}' block_structure")))
        elif strategy in ("tensor", "channel"):
            kinds.add((strategy, None))
        else:
            raise ValueError(f"{where}: config group '{name}' has weight strategy '{strategy}'; attnserve "
                             "loads tensor, channel and block scales")
        acts = group.get("input_activations")
        if acts is not None and (not isinstance(acts, Mapping) or acts.get("num_bits") != 8
                                 or acts.get("type") != "float"):
            raise ValueError(f"{where}: config group '{name}' quantises activations as {acts!r}; attnserve "
                             "takes 8-bit float activation schemes (dropped: activations run in the model dtype)")
    if len(kinds) > 1:
        raise ValueError(f"{where}: config groups mix weight scales {sorted(k for k, _ in kinds)}; attnserve "
                         "loads one granularity per checkpoint")
    try:  # what attnserve reads is checked above; the library (optional) checks the rest
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        QuantizationConfig = None
    if QuantizationConfig is not None:
        try:
            QuantizationConfig.model_validate(dict(qc))
        except Exception as e:  # pydantic's ValidationError, or the library's own checks
            raise ValueError(f"{where}: {e}") from None
    ((granularity, block),) = kinds
    return QuantScheme("fp8", block, granularity, "_scale")


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme,
                        dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each quantised tensor and its scales replaced by one dense tensor.

    Args:
        weights: (name, tensor) pairs, e.g. ``iter_safetensors(model_dir)``.
        scheme: ``QuantScheme.from_config`` of the model's ``quantization_config``.
        dtype: the dtype of the dense tensors (the model's); they are computed in float32.
    Raises:
        ValueError: scales that do not fit their tensor, or a quantised tensor or a scale
            left without its partner at the end of the checkpoint (naming them).
    """
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # dense name -> role -> (name, tensor)
    for name, tensor in weights:
        role = _role(scheme, name, tensor)
        if role is None:
            yield name, tensor
            continue
        base, part = role
        if part == "drop":
            continue
        parts = pending.setdefault(base, {})
        if part in parts:
            raise ValueError(f"checkpoint tensor '{name}' appears twice")
        parts[part] = name, tensor
        if len(parts) == 2:
            del pending[base]
            yield base, _dequantize(scheme, parts, dtype)
    if pending:
        missing = [_missing(scheme, base, parts) for base, parts in sorted(pending.items())]
        shown = "; ".join(missing[:8]) + (f"; and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"{scheme.method} checkpoint: tensors without their partner: {shown}")


def _role(scheme: QuantScheme, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """(dense name, "weight" | "scale") for a tensor of the quantised format, else None."""
    if scheme.method == "fp8":
        if name.endswith(".weight" + scheme.scale_suffix):
            return name[: -len(scheme.scale_suffix)], "scale"
        if name.endswith(".weight") and tensor.dtype in _FP8_DTYPES:
            return name, "weight"
        if name.endswith(_DROPPED_SCALES):
            return name, "drop"
        return None
    if tensor.dtype == torch.uint8:  # mxfp4
        for suffix, part in (("_blocks", "weight"), ("_scales", "scale")):
            if name.endswith(suffix):
                return name[: -len(suffix)], part
    return None


def _partner_name(scheme: QuantScheme, base: str, part: str) -> str:
    if scheme.method == "fp8":
        return base if part == "weight" else base + scheme.scale_suffix
    return base + ("_blocks" if part == "weight" else "_scales")


def _missing(scheme: QuantScheme, base: str, parts: dict[str, tuple[str, torch.Tensor]]) -> str:
    ((part, (name, tensor)),) = parts.items()
    if part == "weight":
        return f"'{name}' ({tensor.dtype}) has no '{_partner_name(scheme, base, 'scale')}'"
    kind = "fp8" if scheme.method == "fp8" else "uint8"
    return f"'{name}' has no {kind} '{_partner_name(scheme, base, 'weight')}'"


def _dequantize(scheme: QuantScheme, parts: dict[str, tuple[str, torch.Tensor]],
                dtype: torch.dtype) -> torch.Tensor:
    (wname, weight), (sname, scale) = parts["weight"], parts["scale"]
    try:
        if scheme.granularity == "block":
            return dequantize_fp8_blocks(weight, scale, scheme.block_size, dtype, scheme.scale_suffix)
        if scheme.method == "fp8":
            return dequantize_fp8_scaled(weight, scale, scheme.granularity, dtype)
        # [E, out, in] -> [E, in, out]: gpt-oss stores the unquantised experts transposed
        return dequantize_mxfp4(weight, scale, dtype).transpose(-1, -2)
    except ValueError as e:
        raise ValueError(f"checkpoint tensors '{wname}' and '{sname}': {e}") from e


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales; uint8 ones are e8m0 exponents (bias 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype, scale_suffix: str = "_scale_inv") -> torch.Tensor:
    """Block-wise fp8 -> dense: each value times the scale of its [bm, bn] block.

    Args:
        weight: [..., out, in] fp8.
        scale_inv: [..., ceil(out / bm), ceil(in / bn)] (edge blocks partial).
        block: (bm, bn), the config's ``weight_block_size``.
    Returns:
        [..., out, in] in ``dtype``, computed in float32 one row of blocks at a time.
    Raises:
        ValueError: the scales' shape does not fit the weight and the block.
    """
    bm, bn = block
    if weight.dim() < 2:
        raise ValueError(f"an fp8 weight must have at least 2 dims, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight{scale_suffix} has shape {tuple(scale_inv.shape)}, but the weight "
                         f"{tuple(weight.shape)} in blocks of {list(block)} needs {expected}")
    col_scales = _scale_values(scale_inv).repeat_interleave(bn, dim=-1)[..., :cols]  # [..., out / bm, in]
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for i in range(expected[-2]):
        r0, r1 = i * bm, min((i + 1) * bm, rows)
        block_rows = weight[..., r0:r1, :].float()  # [..., <= bm, in]
        out[..., r0:r1, :] = (block_rows * col_scales[..., i : i + 1, :]).to(dtype)
    return out


def dequantize_fp8_scaled(weight: torch.Tensor, scale: torch.Tensor, granularity: str,
                          dtype: torch.dtype) -> torch.Tensor:
    """fp8 with one scale per tensor or per output channel -> dense: each value times its scale.

    Args:
        weight: [..., out, in] fp8 (leading dims: experts stored as one tensor).
        scale: "tensor": one value ([], [1], or one per leading index: [..., 1, 1] or [...]);
            "channel": [..., out, 1] or [..., out].
        granularity: "tensor" or "channel", the config's.
    Returns:
        [..., out, in] in ``dtype``, computed in float32.
    Raises:
        ValueError: the scale's shape is not one of those, or a scale is not finite.
    """
    if weight.dim() < 2:
        raise ValueError(f"an fp8 weight must have at least 2 dims, got shape {tuple(weight.shape)}")
    lead, out_dim = tuple(weight.shape[:-2]), weight.shape[-2]
    if granularity == "tensor":
        shapes = {(), (1,), (*lead, 1, 1), lead} if lead else {(), (1,), (1, 1)}
        broadcast = (lambda s: s.reshape(*lead, 1, 1)) if lead and scale.numel() > 1 else (lambda s: s.reshape(()))
    else:
        shapes = {(*lead, out_dim, 1), (*lead, out_dim)}
        broadcast = lambda s: s.reshape(*lead, out_dim, 1)  # noqa: E731
    if tuple(scale.shape) not in shapes:
        wanted = " or ".join(str(list(x)) for x in sorted(shapes, key=len))
        raise ValueError(f"weight_scale has shape {tuple(scale.shape)}, but the weight {tuple(weight.shape)} "
                         f"with {granularity} scales needs {wanted}")
    values = _scale_values(scale)
    if not torch.isfinite(values).all():
        raise ValueError(f"weight_scale holds non-finite values ({granularity} scales)")
    return (weight.float() * broadcast(values)).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dense: 32 e2m1 values per group (two per byte, low nibble first), one e8m0 scale.

    Args:
        blocks: [E, N, G, 16] uint8.
        scales: [E, N, G] uint8 exponents, bias 127.
    Returns:
        [E, N, G * 32] in ``dtype``, computed in float32 one expert at a time (every MXFP4
        value is exact in bfloat16).
    Raises:
        ValueError: shapes that are not MXFP4 blocks and their scales.
    """
    fits = blocks.dim() == 4 and blocks.shape[-1] == _MXFP4_GROUP_BYTES
    if not fits or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: "
                         f"expected blocks [experts, rows, groups, {_MXFP4_GROUP_BYTES}] and scales "
                         "[experts, rows, groups]")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    e, n, g, b = blocks.shape
    out = torch.empty(e, n, g * b * 2, dtype=dtype, device=blocks.device)
    for i in range(e):
        codes = blocks[i]  # [N, G, 16]
        pairs = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # [N, G, 16, 2]
        exps = scales[i].to(torch.int32) - 127  # [N, G]
        values = torch.ldexp(pairs.view(n, g, b * 2), exps[..., None].float())  # [N, G, 32]
        out[i] = values.view(n, g * b * 2).to(dtype)
    return out
