"""The harness of ``attention.decode`` and ``attention.prefill`` variants: the backend that
launches the variant (TRITON_ATTN, TORCH_SDPA, FLEX_ATTENTION), built with it, over a paged batch,
against ``attention.reference.paged_attention``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from attnserve.attention.backends.triton_attn import TritonAttentionBackend
from attnserve.attention.kernels import KernelVariant
from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv
from attnserve.attention.registry import load_backend
from tests.kernels.variants import (
    BatchSpec,
    Mode,
    Result,
    backend_kernels,
    make_common,
    paged_layout,
    relative_error,
)

NUM_HEADS, NUM_KV_HEADS = 4, 2


def _dtype(variant: KernelVariant) -> torch.dtype:
    # Gluon kernels take bf16 (compiled, or run on Hopper); the interpreter wants fp32 or fp16
    return torch.bfloat16 if variant.tech == "gluon" else torch.float32


def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str:
    decode = variant.op == "attention.decode"
    if decode and spec.num_decodes == 0:
        return "no decode rows"
    if not decode and spec.num_decodes == len(spec.query_lens):
        return "no prefill rows"
    device, dtype = mode.device, _dtype(variant)
    head = 128 if variant.tech == "gluon" else 32
    gen = spec.generator()
    num_blocks, table, slots = paged_layout(spec, gen)
    common = make_common(spec, table, slots, device)
    cache_dtype = torch.float8_e4m3fn if spec.fp8 else dtype
    kc = torch.randn(num_blocks, spec.block_size, NUM_KV_HEADS, head, generator=gen).to(device, cache_dtype)
    vc = torch.randn(num_blocks, spec.block_size, NUM_KV_HEADS, head, generator=gen).to(device, cache_dtype)
    layer = SimpleNamespace(
        scale=head**-0.5, window=spec.window, softcap=spec.softcap,
        alibi_slopes=alibi_slopes(NUM_HEADS).to(device) if spec.alibi else None,
        sinks=torch.randn(NUM_HEADS, generator=gen).to(device) if spec.sinks else None,
        k_scale=0.5 if spec.fp8 else 1.0, v_scale=0.25 if spec.fp8 else 1.0)  # fmt: skip
    t = common.num_tokens
    q, k, v = (torch.randn(t, h, head, generator=gen) for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    if spec.fp8:  # values exact in e4m3 after scaling: Triton's interpreter rounds fp32 -> fp8 with a
        # carry bug (tests/kernels/test_triton_attention.test_write_kv); GPUs round in hardware
        k = k.to(cache_dtype).float() * layer.k_scale
        v = v.to(cache_dtype).float() * layer.v_scale
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    reasons = variant.takes(TritonAttentionBackend._problem(layer, q, kc, vc))
    if reasons:
        return "; ".join(reasons)
    (backend_name,) = variant.launched_by
    backend = load_backend(backend_name)(spec.block_size, backend_kernels(variant, mode))
    before = (kc.clone(), vc.clone())
    metadata = backend.build_metadata(common, 0)
    out = backend.forward(layer, q, k, v, (kc, vc), metadata)
    assert backend.kernels[variant.op] == variant.name
    if not mode.numeric:
        return Result(0.0, 0.0, "compiled")
    # the reference's own write of this step's k and v over the caches as they were, then its
    # attention: the backend's caches and output are both compared
    ref_k, ref_v = before
    write_kv(ref_k, ref_v, k, v, slots.to(device), layer.k_scale, layer.v_scale)
    ref = paged_attention(q.float(), ref_k, ref_v, table.to(device), common.query_start_loc, common.seq_lens,
                          scale=layer.scale, window=layer.window, alibi=layer.alibi_slopes, sinks=layer.sinks,
                          softcap=layer.softcap, k_scale=layer.k_scale, v_scale=layer.v_scale)
    err = max(relative_error(out, ref), relative_error(kc.float(), ref_k.float()),
              relative_error(vc.float(), ref_v.float()))
    return Result(err, 2e-2 if dtype == torch.bfloat16 else 1e-4)
