"""Quantised checkpoints, dequantised as they are read: block-wise fp8 and MXFP4.

What this file is: a wrapper around a checkpoint's tensor stream (``weights.iter_safetensors``)
for a model whose ``config.json`` has a ``quantization_config``. Each quantised tensor is
paired with its scales, dequantised in float32 and yielded once, under the unquantised name
and in the model's dtype, so that the models' ``load_weights`` see an ordinary checkpoint.
- ``fp8`` with ``weight_block_size`` [bm, bn] (DeepSeek-V3/V3.2, GLM-5-FP8, Qwen3-*-FP8): a
  ``float8_e4m3fn`` (or e5m2) ``X.weight`` [..., out, in] and its ``X.weight_scale_inv``
  [..., ceil(out / bm), ceil(in / bn)]; the weight is each value times its block's scale, the
  edge blocks being partial. Scales are float32 (a power of two for ``scale_fmt`` ue8m0),
  ``float8_e8m0fnu``, or e8m0 exponents as uint8 (2 ** (byte - 127)).
- ``mxfp4`` (gpt-oss): ``X_blocks`` [E, out, G, 16] uint8 and ``X_scales`` [E, out, G] uint8.
  Each byte holds two e2m1 codes, the low nibble first (the even column), so a group of 16
  bytes is 32 consecutive values along ``in``, sharing the scale 2 ** (scale - 127). The
  unquantised tensor ``X`` is stored [E, in, out] (gpt-oss's ``gate_up_proj`` [E, H, 2I],
  ``down_proj`` [E, I, H]), so the dense [E, out, in] is yielded transposed.
A tensor is quantised when its dtype is the format's (fp8; uint8 blocks) and its partner
arrives, in any order and in any shard: the first of the two waits for the other. Everything
else (norms, embeddings, routers, ``modules_to_not_convert``) passes through untouched.

What it is not: kernels that keep weights quantised in memory (the model holds the dequantised
weights in its dtype), per-tensor fp8 (one ``weight_scale`` per tensor), static activation
scales, or any other quantisation method (AWQ, GPTQ, bitsandbytes, compressed-tensors, ...).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QuantScheme", "dequantize_fp8_blocks", "dequantize_mxfp4", "dequantized_weights"]

SUPPORTED = "block-wise fp8 (quant_method 'fp8' with weight_block_size) and mxfp4"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_SCALE = ".weight_scale_inv"
# e2m1 values by 4-bit code: sign bit high, then 2 exponent bits and 1 mantissa bit
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4_GROUP_BYTES = 16  # 32 values per shared scale


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint's weights are quantised: ``fp8`` (with its block) or ``mxfp4``."""

    method: str
    block_size: tuple[int, int] | None = None  # fp8: rows x columns that share one scale

    def __post_init__(self) -> None:
        if self.method not in ("fp8", "mxfp4") or (self.block_size is None) != (self.method == "mxfp4"):
            raise ValueError(f"not a supported scheme: {self.method} with block {self.block_size}")

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
        if method != "fp8":
            raise ValueError(f"quantization_config: quant_method '{method}' is not supported; attnserve "
                             f"loads {SUPPORTED} checkpoints, dequantised to the model dtype "
                             "(load_format='dummy' ignores quantisation)")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config: fp8 without weight_block_size is per-tensor fp8 (one "
                             "weight_scale per tensor), which is not supported; attnserve loads "
                             f"{SUPPORTED} checkpoints")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError("quantization_config: fp8 weight_block_size must be two positive integers, "
                             f"got {block!r}")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config: fp8 activation_scheme '{scheme}' is not supported (only "
                             "'dynamic': the weights are dequantised and activations are never quantised)")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config: fp8 scale_fmt '{scale_fmt}' is not supported "
                             "(float, ue8m0)")
        return cls("fp8", (block[0], block[1]))


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
        if name.endswith(_FP8_SCALE):
            return name[: -len("_scale_inv")], "scale"
        if name.endswith(".weight") and tensor.dtype in _FP8_DTYPES:
            return name, "weight"
        return None
    if tensor.dtype == torch.uint8:  # mxfp4
        for suffix, part in (("_blocks", "weight"), ("_scales", "scale")):
            if name.endswith(suffix):
                return name[: -len(suffix)], part
    return None


def _partner_name(scheme: QuantScheme, base: str, part: str) -> str:
    if scheme.method == "fp8":
        return base if part == "weight" else base + "_scale_inv"
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
        if scheme.method == "fp8":
            return dequantize_fp8_blocks(weight, scale, scheme.block_size, dtype)
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
                          dtype: torch.dtype) -> torch.Tensor:
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
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, but the weight "
                         f"{tuple(weight.shape)} in blocks of {list(block)} needs {expected}")
    col_scales = _scale_values(scale_inv).repeat_interleave(bn, dim=-1)[..., :cols]  # [..., out / bm, in]
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for i in range(expected[-2]):
        r0, r1 = i * bm, min((i + 1) * bm, rows)
        block_rows = weight[..., r0:r1, :].float()  # [..., <= bm, in]
        out[..., r0:r1, :] = (block_rows * col_scales[..., i : i + 1, :]).to(dtype)
    return out


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
