"""What a model's weights cost in memory, from its config alone: ``attnserve inspect --device-memory``.

``weight_footprint`` builds the model attnserve would run on PyTorch's meta device (no memory is
allocated, no checkpoint is read), keeps one tensor-parallel rank's shard, and adds up:
- ``loaded_bytes``: the parameters as the engine holds them, in the model dtype (a quantised
  checkpoint is dequantised when it is loaded: ``models/quantized.py``), float32 routers kept;
- ``checkpoint_bytes``: the same parameters as a quantised checkpoint stores them. fp8
  (``quantization_config`` ``fp8``, ``fbgemm_fp8`` or compressed-tensors): the weights of the
  linear projections and experts at one byte each plus one float32 scale per block, output
  channel or tensor (a fused projection's parts each their own), the rest (embeddings, the
  output head, norms, routers, the DSA indexer's head weights, biases and the modules the
  config leaves unquantised: ``modules_to_not_convert``, compressed-tensors' ``ignore``) in the
  checkpoint dtype. MXFP4 (gpt-oss): the expert weights at
  half a byte each plus one byte per 32 values. Without quantisation: equal to the parameters
  in the checkpoint dtype.

What it is not: a reader of safetensors headers (a checkpoint may round its scale blocks or
keep other modules unquantised: these are the config's figures), nor the engine's memory
profile (activations, CUDA graphs and the allocator come on top, as the report says).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
from torch import nn

from attnserve.arch import ModelArch
from attnserve.layers.linear import MergedLinear, QKVLinear
from attnserve.layers.moe import FusedExperts
from attnserve.models.quantized import QuantScheme, unquantised_modules
from attnserve.models.registry import get_model_class
from attnserve.runner.parallel import ParallelState, shard_model

__all__ = ["WeightFootprint", "weight_footprint"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# linear modules a block-fp8 checkpoint keeps unquantised (vLLM builds them without a quant config)
_FP8_UNQUANTISED = ("lm_head", "weights_proj")
_MXFP4_GROUP = 32  # values per one-byte scale
_FLOAT32_STORED = ("e_score_correction_bias",)  # float32 in DeepSeek's and GLM's checkpoints


@dataclass(frozen=True, slots=True)
class WeightFootprint:
    """One rank's weights: their count and bytes as loaded and as the checkpoint stores them."""

    num_parameters: int
    loaded_bytes: int  # in ``dtype`` (routers in float32): what the engine allocates
    checkpoint_bytes: int  # as stored: quantised where ``quantization`` says
    dtype: str
    quantization: str | None  # "fp8" | "mxfp4" | None
    sharded: bool = True  # False: tensor parallelism has no sharding plan; loaded / tp is an estimate


def weight_footprint(arch: ModelArch, dtype: str, tensor_parallel_size: int = 1) -> WeightFootprint:
    """The weights of ``arch`` built in ``dtype``, one rank of ``tensor_parallel_size``.

    Raises:
        ValueError: attnserve cannot build this model (``arch.unsupported``), or its
            ``quantization_config`` is not one attnserve loads.
    """
    # ModelArch equality leaves the quantization_config out: it joins the cache key here
    quant = json.dumps(arch.quantization_config, sort_keys=True, default=str)
    return _footprint(arch, quant, dtype, tensor_parallel_size)


@functools.lru_cache(maxsize=8)  # a meta build of a 671B-parameter model takes seconds
def _footprint(arch: ModelArch, quant: str, dtype: str, tensor_parallel_size: int) -> WeightFootprint:
    if arch.unsupported:
        raise ValueError(f"{arch.model_type}: {arch.unsupported}")
    scheme = QuantScheme.from_config(arch.quantization_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(_TORCH_DTYPES[dtype])
    try:
        with torch.device("meta"):
            model = get_model_class(arch)(arch)
    finally:
        torch.set_default_dtype(previous)
    sharded, divide = True, 1
    if tensor_parallel_size > 1:
        try:
            shard_model(model, ParallelState(0, tensor_parallel_size))
        except (NotImplementedError, ValueError):
            sharded, divide = False, tensor_parallel_size
    stored_itemsize = _TORCH_DTYPES.get(arch.dtype, torch.bfloat16).itemsize
    params = dict(model.named_parameters())  # a tied weight once
    loaded = sum(p.numel() * p.element_size() for p in params.values())
    quantised = _quantised_bytes(model, scheme, arch)
    plain = sum(p.numel() * (4 if name.endswith(_FLOAT32_STORED) else stored_itemsize)
                for name, p in params.items() if name not in quantised)
    return WeightFootprint(
        num_parameters=sum(p.numel() for p in params.values()) // divide,
        loaded_bytes=loaded // divide, checkpoint_bytes=(plain + sum(quantised.values())) // divide,
        dtype=dtype, quantization=scheme.method if scheme else None, sharded=sharded)


def _quantised_bytes(model: nn.Module, scheme: QuantScheme | None, arch: ModelArch) -> dict[str, int]:
    """Stored bytes (values and scales) of each parameter the checkpoint keeps quantised."""
    if scheme is None:
        return {}
    skip = unquantised_modules(arch.quantization_config)
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        if _not_converted(name, skip):
            continue
        if isinstance(module, FusedExperts):
            for pname in ("w13", "w2"):
                w = getattr(module, pname)
                out[f"{name}.{pname}"] = _stored(scheme, w.shape[0], [w.shape[1]], w.shape[2])
        elif scheme.method == "fp8" and isinstance(module, nn.Linear) \
                and not name.endswith(_FP8_UNQUANTISED) and not name.endswith(".gate"):
            w = module.weight
            pieces = list(module.out_sizes) if isinstance(module, MergedLinear) else \
                list(module.sizes.values()) if isinstance(module, QKVLinear) else [w.shape[0]]
            if sum(pieces) != w.shape[0]:  # sharded: the pieces shrank alike
                pieces = [w.shape[0]]
            out[f"{name}.weight"] = _stored(scheme, 1, pieces, w.shape[1])
    return out


def _not_converted(name: str, patterns: list[str]) -> bool:
    """Whether a pattern names this module or one above it (checkpoint names, with or without
    "model."): glob patterns (``modules_to_not_convert``), or ``re:`` regular expressions that
    match the whole name (compressed-tensors' ``ignore``)."""
    names = [name, f"model.{name}"]
    for p in patterns:
        if p.startswith("re:"):
            if any(re.fullmatch(p[3:], n) for n in names):
                return True
        elif any(fnmatch(n, p) or fnmatch(n, p + ".*") or p == n for n in names):
            return True
    return False


def _stored(scheme: QuantScheme, experts: int, out_pieces: list[int], in_features: int) -> int:
    """Bytes of ``experts`` quantised matrices of sum(out_pieces) x in_features, scales included."""
    values = sum(out_pieces) * in_features
    if scheme.method == "mxfp4":
        return experts * (values // 2 + math.ceil(values / _MXFP4_GROUP))
    if scheme.granularity == "channel":
        return experts * (values + 4 * sum(out_pieces))
    if scheme.granularity == "tensor":
        return experts * (values + 4 * len(out_pieces))
    bm, bn = scheme.block_size
    blocks = sum(math.ceil(o / bm) for o in out_pieces) * math.ceil(in_features / bn)
    return experts * (values + 4 * blocks)
