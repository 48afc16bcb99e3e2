"""TORCH_SDPA's prefill in query chunks (``attend_prefill``): the same result as one call over
the whole prompt (the path before chunking) and as the reference, at lengths around the chunk
size, for every layer feature it serves (a cached context, a window, ALiBi, sinks, soft-capping;
GQA and MHA); and no call holds more than its budget of [head x query x key] elements, in the
backend's own prefill of a long prompt over a cached context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnserve.attention.backends import torch_sdpa
from attnserve.attention.backends.torch_sdpa import TorchSDPABackend, attend_prefill
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv

D = 16


def layer_with(heads: int, feature: str | None) -> SimpleNamespace:
    layer = SimpleNamespace(scale=D ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None,
                            k_scale=1.0, v_scale=1.0)
    if feature == "window":
        layer.window = 7
    elif feature == "alibi":
        layer.alibi_slopes = alibi_slopes(heads)
    elif feature == "sinks":
        layer.sinks = torch.linspace(-1.0, 2.0, heads)
    elif feature == "softcap":
        layer.softcap = 5.0
    return layer


ROWS = 8  # queries a chunk at the budget below: budget // (H * S)


@pytest.mark.parametrize("feature", [None, "window", "alibi", "sinks", "softcap"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("num_queries,context", [(7, 5), (8, 5), (9, 5), (17, 0), (16, 30), (24, 1)])
def test_chunks_equal_one_call_and_the_reference(feature, heads, num_queries, context):
    h, hkv = heads
    gen = torch.Generator().manual_seed(num_queries * 100 + context)
    s = context + num_queries
    q = torch.randn(1, h, num_queries, D, generator=gen)
    k, v = (torch.randn(1, hkv, s, D, generator=gen) for _ in range(2))
    layer = layer_with(h, feature)
    whole = attend_prefill(q, k, v, context, layer, budget=1 << 30)  # one call: the path before chunking
    chunked = attend_prefill(q, k, v, context, layer, budget=ROWS * h * s)
    torch.testing.assert_close(chunked, whole, atol=2e-6, rtol=2e-6)
    # the reference, over a paged cache of blocks of 4 holding the same keys
    blocks = -(-s // 4)
    kc = torch.zeros(blocks + 1, 4, hkv, D)
    vc = torch.zeros_like(kc)
    write_kv(kc, vc, k[0].transpose(0, 1), v[0].transpose(0, 1), torch.arange(4, 4 + s))
    ref = paged_attention(q[0].transpose(0, 1), kc, vc, torch.arange(1, blocks + 1, dtype=torch.int32)[None],
                          torch.tensor([0, num_queries]), torch.tensor([s]), scale=layer.scale, window=layer.window,
                          alibi=layer.alibi_slopes, sinks=layer.sinks, softcap=layer.softcap)
    torch.testing.assert_close(chunked[0].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_chunks_equal_one_call(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 40, D, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 100, D, generator=gen).to(dtype) for _ in range(2))
    layer = layer_with(8, None)
    whole = attend_prefill(q, k, v, 60, layer, budget=1 << 30)
    chunked = attend_prefill(q, k, v, 60, layer, budget=ROWS * 8 * 100)
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: SDPA's rounding of a chunk's own softmax
    torch.testing.assert_close(chunked.float(), whole.float(), atol=tol, rtol=tol)


def make_prefill(context: int, new: int, gen: torch.Generator, block: int = 16):
    """One request prefilling ``new`` tokens after ``context`` cached ones: (metadata, caches,
    q, k, v, slots), random block ids, block 0 null."""
    seq = context + new
    nblk = -(-seq // block)
    bt = torch.zeros(1, nblk + 1, dtype=torch.int32)
    bt[0, :nblk] = torch.randperm(nblk + 2, generator=gen)[:nblk] + 1
    kc, vc = (torch.randn(nblk + 3, block, 2, D, generator=gen) for _ in range(2))
    kc[0] = vc[0] = 0
    pos = torch.arange(context, seq)
    slots = bt[0, pos // block].long() * block + pos % block
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, new], dtype=torch.int32), seq_lens=torch.tensor([seq], dtype=torch.int32),
        positions=pos, block_tables=[bt], slot_mappings=[slots], query_start_loc_cpu=[0, new], seq_lens_cpu=[seq],
        num_decodes=0, max_query_len=new, max_seq_len=seq)
    q = torch.randn(new, 4, D, generator=gen)
    k, v = (torch.randn(new, 2, D, generator=gen) for _ in range(2))
    return common, (kc, vc), q, k, v, slots


@pytest.mark.parametrize("context", [100, 0])
def test_backend_prefill_stays_within_the_budget(context, monkeypatch):
    """96 new tokens over a cached context of 100 (a chunked prefill's second step), through the
    backend with a budget of 8 queries a chunk: every ``attend`` call holds at most that, and
    the output and the cache write are the reference's; a plain prefill from position 0 takes
    causal SDPA (CPU flash attention, no scores held) and never ``attend``."""
    new = 96
    budget = 4 * 8 * (context + new)  # H * rows * S
    monkeypatch.setattr(torch_sdpa, "PREFILL_SCORES_BUDGET", budget)
    held = []
    real = torch_sdpa.attend
    monkeypatch.setattr(torch_sdpa, "attend",
                        lambda q, k, *a: held.append(q.shape[1] * q.shape[2] * k.shape[2]) or real(q, k, *a))
    common, (kc, vc), q, k, v, slots = make_prefill(context, new, torch.Generator().manual_seed(context))
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, slots)
    layer = layer_with(4, None)
    backend = TorchSDPABackend(16)
    out = backend.forward(layer, q, k, v, (kc, vc), backend.build_metadata(common, 0))
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert len(held) == (new // 8 if context else 0) and max(held, default=0) <= budget
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
