"""TORCH_MLA against its PyTorch twin (``reference_mla.py``), over random paged layouts.

Covers: decode / prefill / mixed batches with chunks over cached context, float32, bfloat16
and fp8 latent caches (the fp8 rows byte-exact to ``kvcache/fp8.py``), absorbed == expanded
on random inputs, slots of -1 that must not be written, and the chunked-context prefill
(``prefill_expanded``) against the whole context at once, at lengths around its chunk. Block 0
is the null block.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from attnserve.attention.backends.torch_mla import (
    TorchMLABackend,
    attend_absorbed,
    attend_expanded,
    attention_lse,
    context_chunk,
    prefill_expanded,
)
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.reference_mla import (
    gather_latent,
    mla_decode_absorbed,
    mla_prefill_expanded,
    write_latent,
)
from attnserve.kvcache.fp8 import mla_fp8_row_bytes, quantize_mla_fp8

BLOCK = 4
HEADS, NOPE, ROPE, V = 4, 16, 8, 12


def make_batch(query_lens, context_lens, width, cache_dtype, gen, num_blocks=64):
    """Random latent cache (old rows random) and metadata with shuffled block tables."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots = [], []
    for q, s in zip(query_lens, seq_lens):
        n = -(-s // BLOCK)
        row, perm = perm[:n], perm[n:]
        tables.append(row)
        slots.extend(row[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s))
    bt = torch.zeros(len(tables), max(len(t) for t in tables) + 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    if cache_dtype == torch.uint8:
        cache = torch.randint(0, 120, (num_blocks, BLOCK, width), generator=gen, dtype=torch.uint8)
    else:
        cache = torch.randn(num_blocks, BLOCK, width, generator=gen).to(cache_dtype)
    cache[0].zero_()
    qsl = [0, *itertools.accumulate(query_lens)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]),
        block_tables=[bt],
        slot_mappings=[torch.tensor(slots, dtype=torch.int64)],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decodes=sum(1 for _ in itertools.takewhile(lambda q: q == 1, query_lens)),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return common, cache


def fp8_fill(cache: torch.Tensor, rank: int, gen: torch.Generator) -> None:
    """Overwrite every row of an fp8 cache with valid packed rows of random latents."""
    n = cache.shape[0] * cache.shape[1]
    rows = quantize_mla_fp8(
        torch.randn(n, rank, generator=gen), torch.randn(n, ROPE, generator=gen)
    )
    cache.copy_(rows.view(cache.shape))


def make_layer(rank, gen, scale=0.3, dtype=torch.float32):
    w = torch.randn(HEADS, NOPE + V, rank, generator=gen) * rank**-0.5
    return SimpleNamespace(
        kv_lora_rank=rank,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        scale=scale,
        w_kv_b=w.to(dtype),
    )


CASES = {
    "decode": ([1, 1, 1], [7, 0, 13]),
    "prefill": ([9, 5], [0, 0]),
    "mixed_chunked": ([1, 1, 6, 3], [11, 4, 5, 17]),
}


def run_both(case, cache_dtype, rank, seed, model_dtype=torch.float32):
    """(backend output, reference output, backend cache, reference cache) on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    width = mla_fp8_row_bytes(rank, ROPE) if cache_dtype == torch.uint8 else rank + ROPE
    common, cache = make_batch(*CASES[case], width, cache_dtype, gen)
    if cache_dtype == torch.uint8:
        fp8_fill(cache, rank, gen)
        cache[0].zero_()
    layer = make_layer(rank, gen, dtype=model_dtype)
    t = common.num_tokens
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen).to(model_dtype)
    rows = torch.randn(t, rank + ROPE, generator=gen).to(model_dtype)
    ref_cache = cache.clone()
    slots = common.slot_mappings[0]
    write_latent(ref_cache, rows[:, :rank], rows[:, rank:], slots)
    w = layer.w_kv_b.float()
    args = (
        q[..., :NOPE],
        q[..., NOPE:],
        ref_cache,
        common.block_tables[0],
        common.query_start_loc,
        common.seq_lens,
    )
    ref = mla_decode_absorbed(*args, w_uk=w[:, :NOPE], w_uv=w[:, NOPE:], scale=layer.scale)
    if case != "decode":  # the twin's expanded form must agree with its absorbed form too
        ref_exp = mla_prefill_expanded(*args, w_uk=w[:, :NOPE], w_uv=w[:, NOPE:], scale=layer.scale)
        torch.testing.assert_close(ref_exp, ref, atol=1e-5, rtol=1e-5)
    backend = TorchMLABackend(BLOCK)
    out = backend.forward(
        layer, q, rows, None, {"latent": cache}, backend.build_metadata(common, 0)
    )
    return out, ref, cache, ref_cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_matches_reference(case):
    out, ref, cache, ref_cache = run_both(case, torch.float32, 32, seed=len(case))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, ref_cache)  # the new rows landed in their slots, nothing else moved


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_matches_reference(case):
    out, ref, cache, ref_cache = run_both(
        case, torch.bfloat16, 32, seed=7, model_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(cache, ref_cache)
    # bf16 products and outputs: about 3 significant digits on O(1) values
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_cache_byte_exact_and_matches_reference(case):
    out, ref, cache, ref_cache = run_both(case, torch.uint8, 128, seed=11)
    assert cache.shape[-1] == mla_fp8_row_bytes(128, ROPE) == 128 + 4 + 2 * ROPE
    assert torch.equal(cache, ref_cache)  # byte for byte what fp8.py defines
    # both sides read the same dequantised rows: only float32 rounding differs
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_fp8_rows_are_the_656_byte_layout():
    """DeepSeek-V3 dims: each written row is quantize_mla_fp8 of its (c_kv, k_pe)."""
    gen = torch.Generator().manual_seed(3)
    rank, rope = 512, 64
    common, cache = make_batch([3, 2], [0, 5], mla_fp8_row_bytes(rank, rope), torch.uint8, gen)
    assert cache.shape[-1] == 656
    layer = SimpleNamespace(
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=NOPE,
        scale=0.1,
        w_kv_b=torch.randn(2, NOPE + V, rank, generator=gen),
    )
    rows = torch.randn(common.num_tokens, rank + rope, generator=gen) * 3
    q = torch.randn(common.num_tokens, 2, NOPE + rope, generator=gen)
    backend = TorchMLABackend(BLOCK)
    backend.forward(layer, q, rows, None, {"latent": cache}, backend.build_metadata(common, 0))
    slots = common.slot_mappings[0]
    written = cache.view(-1, 656)[slots]
    assert torch.equal(written, quantize_mla_fp8(rows[:, :rank], rows[:, rank:]))


def test_skipped_slots_are_not_written():
    gen = torch.Generator().manual_seed(5)
    common, cache = make_batch([3], [2], 32 + ROPE, torch.float32, gen)
    common.slot_mappings[0][1] = -1
    before = cache.clone()
    layer = make_layer(32, gen)
    rows = torch.randn(3, 32 + ROPE, generator=gen)
    q = torch.randn(3, HEADS, NOPE + ROPE, generator=gen)
    backend = TorchMLABackend(BLOCK)
    backend.forward(layer, q, rows, None, {"latent": cache}, backend.build_metadata(common, 0))
    changed = (cache != before).any(-1).view(-1).nonzero().flatten().tolist()
    slots = common.slot_mappings[0].tolist()
    assert changed == sorted([slots[0], slots[2]])


@pytest.mark.parametrize("queries", [1, 5, 12], ids=["decode", "chunk", "whole"])
def test_absorbed_equals_expanded(queries):
    """The two forms are the same algebra: equal on random inputs (causal and masked)."""
    gen = torch.Generator().manual_seed(queries)
    rank, seq = 32, 12
    w = torch.randn(HEADS, NOPE + V, rank, generator=gen) * rank**-0.5
    q = torch.randn(2, queries, HEADS, NOPE + ROPE, generator=gen)
    latent = torch.randn(2, seq, rank + ROPE, generator=gen)
    a = attend_absorbed(q, latent, None, w, 0.2)
    e = attend_expanded(q, latent, None, w, 0.2)
    assert a.shape == (2, queries, HEADS, V)
    torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    mask = torch.rand(2, queries, seq, generator=gen) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    torch.testing.assert_close(
        attend_absorbed(q, latent, mask, w, 0.2),
        attend_expanded(q, latent, mask, w, 0.2),
        atol=1e-5,
        rtol=1e-5,
    )
    # and the causal default is the causal mask with the queries last
    causal = torch.arange(seq)[None, :] <= torch.arange(seq - queries, seq)[:, None]
    torch.testing.assert_close(
        a, attend_expanded(q, latent, causal.expand(2, -1, -1), w, 0.2), atol=1e-5, rtol=1e-5
    )


def test_decode_sees_every_cached_key():
    """Changing one old cache row of a decode's sequence changes its output (no key dropped)."""
    gen = torch.Generator().manual_seed(9)
    common, cache = make_batch([1], [10], 32 + ROPE, torch.float32, gen)
    layer = make_layer(32, gen)
    rows = torch.randn(1, 32 + ROPE, generator=gen)
    q = torch.randn(1, HEADS, NOPE + ROPE, generator=gen)
    backend = TorchMLABackend(BLOCK)
    meta = backend.build_metadata(common, 0)
    base = backend.forward(layer, q, rows, None, {"latent": cache}, meta)
    table = common.block_tables[0][0]
    for pos in (0, 5, 9):
        edited = cache.clone()
        edited[table[pos // BLOCK], pos % BLOCK] += 1.0
        out = backend.forward(layer, q, rows, None, {"latent": edited}, meta)
        assert (out - base).abs().max() > 1e-4, f"position {pos} was not attended"
    assert torch.equal(gather_latent(cache, table, 11)[10], rows[0])


# ----------------------------------------------------------------------------- chunked context


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_lse_fused_equals_math(causal, dtype):
    """The fused kernel's output and log-sum-exp equal the PyTorch twin's (V narrower and wider
    than K: the kernels take one head size, the wrapper pads)."""
    gen = torch.Generator().manual_seed(3)
    for dv in (12, 40):
        q, k = (torch.randn(1, HEADS, 33, 24, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(1, HEADS, 33, dv, generator=gen).to(dtype)
        out, lse = attention_lse(q, k, v, 0.3, causal)
        ref, ref_lse = attention_lse(q, k, v, 0.3, causal, fused=False)
        scores = (q.float() @ k.float().transpose(-1, -2)) * 0.3
        if causal:
            scores = scores.masked_fill(~torch.ones(33, 33, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(ref_lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert out.shape == ref.shape == (1, HEADS, 33, dv)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="square"):
        attention_lse(q[:, :, :5], k, v, 0.3, causal=True)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("context", [255, 256, 257, 600, 1030])
def test_chunked_context_equals_whole(context, fused, monkeypatch):
    """A prefill over a context longer than a chunk (256 keys here) equals the whole context at
    once: every chunk boundary (just under, at, just over one chunk; several; a ragged last one)."""
    if not fused:  # the PyTorch twin alone
        from attnserve.attention.backends import torch_mla

        monkeypatch.setattr(torch_mla, "_fused_lse", lambda *a: None)
    gen = torch.Generator().manual_seed(context)
    rank, q_len = 32, 37
    seq = context + q_len
    num_blocks = seq // BLOCK + 8
    cache = torch.randn(num_blocks, BLOCK, rank + ROPE, generator=gen)
    slots = (torch.randperm(num_blocks * BLOCK - BLOCK, generator=gen) + BLOCK)[:seq]
    layer = make_layer(rank, gen)
    q = torch.randn(q_len, HEADS, NOPE + ROPE, generator=gen)
    whole = prefill_expanded(q, cache, slots, rank, ROPE, layer.w_kv_b, layer.scale, chunk=1 << 20)
    chunked = prefill_expanded(q, cache, slots, rank, ROPE, layer.w_kv_b, layer.scale, chunk=256)
    torch.testing.assert_close(chunked, whole, atol=2e-5, rtol=2e-5)
    # and the whole-at-once path is the absorbed algebra over the same keys
    latent = cache.view(-1, rank + ROPE)[slots][None]
    torch.testing.assert_close(whole, attend_absorbed(q[None], latent, None, layer.w_kv_b, layer.scale)[0],
                               atol=2e-5, rtol=2e-5)


def test_backend_prefill_over_long_context_is_chunked(monkeypatch):
    """TORCH_MLA's prefill over a context past its chunk expands at most a chunk of it at a time
    (the largest K/V it builds is bounded) and still matches the reference."""
    from attnserve.attention.backends import torch_mla

    monkeypatch.setattr(torch_mla, "_CONTEXT_ELEMENTS", 1)  # one 256-key chunk at a time
    assert context_chunk(HEADS, NOPE + ROPE, NOPE, V) == 256
    widest, expand = [], torch_mla._expand
    monkeypatch.setattr(torch_mla, "_expand", lambda latent, *a: widest.append(latent.shape[0]) or expand(latent, *a))
    gen = torch.Generator().manual_seed(11)
    rank = 32
    common, cache = make_batch([1, 20], [30, 700], rank + ROPE, torch.float32, gen, num_blocks=200)
    layer = make_layer(rank, gen)
    q = torch.randn(common.num_tokens, HEADS, NOPE + ROPE, generator=gen)
    rows = torch.randn(common.num_tokens, rank + ROPE, generator=gen)
    ref_cache = cache.clone()
    write_latent(ref_cache, rows[:, :rank], rows[:, rank:], common.slot_mappings[0])
    w = layer.w_kv_b
    ref = mla_prefill_expanded(q[..., :NOPE], q[..., NOPE:], ref_cache, common.block_tables[0],
                               common.query_start_loc, common.seq_lens, w_uk=w[:, :NOPE], w_uv=w[:, NOPE:],
                               scale=layer.scale)
    backend = TorchMLABackend(BLOCK)
    out = backend.forward(layer, q, rows, None, {"latent": cache}, backend.build_metadata(common, 0))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert widest == [20, 256, 256, 188]  # the new tokens, then the 700-key context in chunks
