"""The PyTorch MLA / DSA twins: paged storage, absorbed == expanded == transformers' MLA, the
indexer against transformers' DeepseekV32Indexer, fp8 top-k recall, sparse == dense.

Every test stores its cache through random, non-contiguous block tables (block 0 is null).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV32Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Indexer,
    DeepseekV32RotaryEmbedding,
    apply_rotary_pos_emb,
)

from attnserve.attention.reference_mla import (
    absorb_q,
    apply_w_uv,
    gather_indexer_keys,
    gather_latent,
    indexer_topk,
    mla_decode_absorbed,
    mla_prefill_expanded,
    sparse_mla_attention,
    write_indexer_keys,
    write_latent,
)
from attnserve.kvcache.fp8 import (
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    hadamard,
    mla_fp8_row_bytes,
    quantize_act_fp8,
    quantize_indexer_fp8,
    quantize_mla_fp8,
)

ATOL = 1e-5  # float32 paths that are algebraically equal


# ------------------------------------------------------------------ paging helpers


def paged_layout(seq_lens: list[int], block_size: int, gen: torch.Generator, spare: int = 3):
    """Random non-contiguous block table [B, max_blocks] (0 = null) and per-request slots."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + spare
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)
    slots = []
    for i, (s, n) in enumerate(zip(seq_lens, need)):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(s)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    return num_blocks, table, slots


def query_layout(seq_lens: list[int], query_lens: list[int]):
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    return qsl, torch.tensor(seq_lens, dtype=torch.int32), positions


def latent_cache(seq_lens, block_size, rank, rope, dtype, gen):
    """A paged latent cache holding random rows, and the rows per request."""
    num_blocks, table, slots = paged_layout(seq_lens, block_size, gen)
    width = mla_fp8_row_bytes(rank, rope) if dtype == torch.uint8 else rank + rope
    cache = torch.zeros(num_blocks, block_size, width, dtype=dtype)
    rows = []
    for s, slot in zip(seq_lens, slots):
        c_kv, k_pe = torch.randn(s, rank, generator=gen), torch.randn(s, rope, generator=gen)
        write_latent(cache, c_kv, k_pe, slot)
        rows.append((c_kv, k_pe))
    return cache, table, rows


def mla_inputs(num_tokens, heads, nope, rope, rank, v_dim, gen):
    q_nope = torch.randn(num_tokens, heads, nope, generator=gen)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen)
    w_uk = torch.randn(heads, nope, rank, generator=gen) * rank**-0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) * rank**-0.5
    return q_nope, q_pe, w_uk, w_uv


# ------------------------------------------------------------------ storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_latent_write_gather_roundtrip(dtype):
    gen = torch.Generator().manual_seed(0)
    seq_lens, rank, rope = [5, 11, 3], 128, 16
    cache, table, rows = latent_cache(seq_lens, 4, rank, rope, dtype, gen)
    assert (cache[0] == 0).all()  # the null block is never written
    for i, (c_kv, k_pe) in enumerate(rows):
        got = gather_latent(cache, table[i], seq_lens[i], kv_lora_rank=rank)
        if dtype == torch.uint8:
            want = torch.cat(dequantize_mla_fp8(quantize_mla_fp8(c_kv, k_pe), rank, rope), -1)
        else:
            want = torch.cat([c_kv, k_pe], -1).to(dtype).float()
        assert got.dtype == torch.float32 and torch.equal(got, want)
    skipped = torch.full((2,), -1)
    before = cache.clone()
    write_latent(cache, torch.randn(2, rank), torch.randn(2, rope), skipped)
    assert torch.equal(cache, before)
    if dtype == torch.uint8:
        with pytest.raises(ValueError):
            gather_latent(cache, table[0], 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_indexer_write_gather_roundtrip(dtype):
    gen = torch.Generator().manual_seed(1)
    seq_lens, dim = [6, 9], 32
    num_blocks, table, slots = paged_layout(seq_lens, 4, gen)
    cache = torch.zeros(num_blocks, 4, dim + 4 if dtype == torch.uint8 else dim, dtype=dtype)
    keys = [torch.randn(s, dim, generator=gen) for s in seq_lens]
    for k, slot in zip(keys, slots):
        write_indexer_keys(cache, k, slot)
    assert (cache[0] == 0).all()
    for i, k in enumerate(keys):
        got = gather_indexer_keys(cache, table[i], seq_lens[i])
        if dtype == torch.uint8:  # rotated space, e4m3 precision
            assert ((hadamard(got) - k).norm(dim=-1) / k.norm(dim=-1)).max() < 0.05
        else:
            assert torch.equal(got, k)


# ------------------------------------------------------------------ dense MLA


@pytest.mark.parametrize("dtype,rank", [(torch.float32, 48), (torch.uint8, 128)])
def test_absorbed_equals_expanded_chunked(dtype, rank):
    """Decode, chunked prefill over a cached prefix and a full prefill in one batch."""
    gen = torch.Generator().manual_seed(2)
    seq_lens, query_lens = [9, 13, 6, 1, 20], [1, 5, 6, 1, 3]
    heads, nope, rope, v_dim = 4, 16, 8, 12
    cache, table, _ = latent_cache(seq_lens, 4, rank, rope, dtype, gen)
    qsl, lens, _ = query_layout(seq_lens, query_lens)
    q_nope, q_pe, w_uk, w_uv = mla_inputs(sum(query_lens), heads, nope, rope, rank, v_dim, gen)
    args = (q_nope, q_pe, cache, table, qsl, lens)
    absorbed = mla_decode_absorbed(*args, w_uk=w_uk, w_uv=w_uv, scale=0.3)
    expanded = mla_prefill_expanded(*args, w_uk=w_uk, w_uv=w_uv, scale=0.3)
    assert absorbed.shape == (sum(query_lens), heads, v_dim)
    torch.testing.assert_close(absorbed, expanded, atol=ATOL, rtol=ATOL)
    # causality: request 2 is a whole prefill, so its first query sees only position 0
    first = gather_latent(cache, table[2], 1, kv_lora_rank=rank)[:, :rank]  # [1, L]
    want = apply_w_uv(first.expand(heads, -1)[None], w_uv)[0]  # [H, d_v]
    torch.testing.assert_close(absorbed[int(qsl[2])], want, atol=ATOL, rtol=ATOL)


def test_fp8_cache_reads_its_dequantised_values():
    gen = torch.Generator().manual_seed(3)
    seq_lens, query_lens, rank, rope = [7, 12], [2, 4], 128, 8
    cache8, table, rows = latent_cache(seq_lens, 4, rank, rope, torch.uint8, gen)
    cache32 = torch.zeros(cache8.shape[0], 4, rank + rope)
    for i, (c_kv, k_pe) in enumerate(rows):
        pos = torch.arange(seq_lens[i])
        slot = table[i, pos // 4].long() * 4 + pos % 4
        c_deq, pe_deq = dequantize_mla_fp8(quantize_mla_fp8(c_kv, k_pe), rank, rope)
        write_latent(cache32, c_deq, pe_deq, slot)
    qsl, lens, _ = query_layout(seq_lens, query_lens)
    q_nope, q_pe, w_uk, w_uv = mla_inputs(6, 2, 16, rope, rank, 16, gen)
    a = mla_decode_absorbed(q_nope, q_pe, cache8, table, qsl, lens, w_uk=w_uk, w_uv=w_uv, scale=0.2)
    b = mla_decode_absorbed(
        q_nope, q_pe, cache32, table, qsl, lens, w_uk=w_uk, w_uv=w_uv, scale=0.2
    )
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_absorbed_matches_transformers_mla():
    """Against transformers' DeepseekV3Attention (eager, float32) on the same weights."""
    torch.manual_seed(4)
    cfg = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        num_hidden_layers=1,
    )
    cfg._attn_implementation = "eager"
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
    seq_lens = [10, 7]
    xs = [torch.randn(1, s, 64) for s in seq_lens]
    rotary = DeepseekV3RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(4)
    num_blocks, table, slots = paged_layout(seq_lens, 4, gen)
    cache = torch.zeros(num_blocks, 4, 32 + 8)
    heads, nope, rope, rank = 4, 16, 8, 32
    want, q_nopes, q_pes = [], [], []
    with torch.no_grad():
        for x, slot, s in zip(xs, slots, seq_lens):
            cos, sin = rotary(x, torch.arange(s)[None])
            mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
            want.append(attn(x, (cos, sin), mask)[0][0])  # [S, D]
            q = attn.q_proj(x).view(1, s, heads, nope + rope).transpose(1, 2)
            q_nope, q_rot = q.split([nope, rope], dim=-1)
            kv = attn.kv_a_proj_with_mqa(x)
            c_kv, k_rot = kv.split([rank, rope], dim=-1)
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot[:, None], cos, sin)
            write_latent(cache, attn.kv_a_layernorm(c_kv)[0], k_rot[0, 0], slot)
            q_nopes.append(q_nope[0].transpose(0, 1))  # [S, H, nope]
            q_pes.append(q_rot[0].transpose(0, 1))
        w_kvb = attn.kv_b_proj.weight.view(heads, nope + 12, rank)  # [H, nope + v, L]
        query_lens = [4, 7]  # a chunk over a cached prefix, and a whole prefill
        q_nope = torch.cat([q[-n:] for q, n in zip(q_nopes, query_lens)])
        q_pe = torch.cat([q[-n:] for q, n in zip(q_pes, query_lens)])
        qsl, lens, _ = query_layout(seq_lens, query_lens)
        out = mla_decode_absorbed(
            q_nope,
            q_pe,
            cache,
            table,
            qsl,
            lens,
            w_uk=w_kvb[:, :nope],
            w_uv=w_kvb[:, nope:],
            scale=attn.scaling,
        )
        got = attn.o_proj(out.reshape(out.shape[0], -1))
    torch.testing.assert_close(
        got, torch.cat([w[-n:] for w, n in zip(want, query_lens)]), atol=ATOL, rtol=ATOL
    )


# ------------------------------------------------------------------ DSA indexer


def hf_indexer_case(seq_lens, topk, seed, n_heads=16, head_dim=32):
    """transformers' indexer over each whole sequence, plus its roped q, k and raw weights."""
    torch.manual_seed(seed)
    cfg = DeepseekV32Config(
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=n_heads,
        index_head_dim=head_dim,
        index_topk=topk,
        num_hidden_layers=1,
    )
    indexer = DeepseekV32Indexer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        indexer.k_norm.weight.normal_(1.0, 0.2)
        indexer.k_norm.bias.normal_(0.0, 0.2)
    rotary = DeepseekV32RotaryEmbedding(cfg)
    cases = []
    with torch.no_grad():
        for s in seq_lens:
            x, q_resid = torch.randn(1, s, 64), torch.randn(1, s, 24)
            cos, sin = rotary(x, torch.arange(s)[None])
            causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
            hf = indexer(x, q_resid, (cos, sin), causal, torch.arange(s)[None])[0]  # [S, k]
            q = indexer.wq_b(q_resid).view(1, s, n_heads, head_dim)
            k = indexer.k_norm(indexer.wk(x))[:, :, None]  # [1, S, 1, D]
            q_rot, k_rot = apply_rotary_pos_emb(q[..., :16], k[..., :16], cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q[..., 16:]], -1)[0]  # [S, H, D]
            k = torch.cat([k_rot, k[..., 16:]], -1)[0, :, 0]  # [S, D]
            cases.append((hf, q, k, indexer.weights_proj(x)[0]))
    return cases


def paged_indexer(cases, seq_lens, query_lens, fp8_cache, gen, block_size=4):
    num_blocks, table, slots = paged_layout(seq_lens, block_size, gen)
    dim = cases[0][2].shape[-1]
    cache = torch.zeros(
        num_blocks,
        block_size,
        dim + 4 if fp8_cache else dim,
        dtype=torch.uint8 if fp8_cache else torch.float32,
    )
    for (_, _, k, _), slot in zip(cases, slots):
        write_indexer_keys(cache, k, slot)
    q = torch.cat([c[1][-n:] for c, n in zip(cases, query_lens)])
    w = torch.cat([c[3][-n:] for c, n in zip(cases, query_lens)])
    qsl, lens, positions = query_layout(seq_lens, query_lens)
    return q, w, cache, table, qsl, lens, positions


def test_indexer_matches_transformers():
    seq_lens, query_lens, topk = [12, 9, 20, 3], [12, 1, 6, 3], 5
    cases = hf_indexer_case(seq_lens, topk, seed=5)
    gen = torch.Generator().manual_seed(5)
    q, w, cache, table, qsl, lens, positions = paged_indexer(
        cases, seq_lens, query_lens, False, gen
    )
    got = indexer_topk(q, w, cache, table, qsl, lens, positions, topk=topk, fp8=False)
    assert got.shape == (sum(query_lens), topk) and got.dtype == torch.int32
    hf_rows = [row for c, n in zip(cases, query_lens) for row in c[0][-n:]]  # widths differ
    for t in range(got.shape[0]):
        pos = int(positions[t])
        mine = got[t][got[t] >= 0].tolist()
        theirs = [i for i in hf_rows[t].tolist() if i <= pos]  # HF pads short rows with futures
        assert sorted(mine) == sorted(theirs), (t, mine, theirs)
        assert len(mine) == min(topk, pos + 1)


def test_indexer_minus_one_and_never_future():
    gen = torch.Generator().manual_seed(6)
    seq_lens, query_lens, topk, heads, dim = [3, 17, 30, 8], [3, 9, 2, 8], 12, 16, 32
    num_blocks, table, slots = paged_layout(seq_lens, 4, gen)
    cache = torch.zeros(num_blocks, 4, dim)
    for s, slot in zip(seq_lens, slots):
        write_indexer_keys(cache, torch.randn(s, dim, generator=gen), slot)
    qsl, lens, positions = query_layout(seq_lens, query_lens)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    w = torch.randn(sum(query_lens), heads, generator=gen)
    # a garbage key in the future of every query must never be picked
    for fp8 in (False, True):
        got = indexer_topk(q, w, cache, table, qsl, lens, positions, topk=topk, fp8=fp8)
        for t in range(got.shape[0]):
            n_valid = min(topk, int(positions[t]) + 1)
            assert (got[t, :n_valid] >= 0).all() and (got[t, n_valid:] == -1).all()
            assert (got[t, :n_valid] <= positions[t]).all()
            assert len(set(got[t, :n_valid].tolist())) == n_valid


def scores_by_hand(q, w, k, positions, fp8):
    """Index scores [T, S] in float64, future keys at -inf. fp8: DeepSeek's formula on the
    dequantised Hadamard-rotated q and k (``kernel.py::fp8_index``); else transformers'."""
    heads, dim = q.shape[1:]
    if fp8:
        q8, q_scale = quantize_act_fp8(hadamard(q))
        q = q8.double() * q_scale.double().unsqueeze(-1)
        k = dequantize_indexer_fp8(quantize_indexer_fp8(k))
    dots = torch.relu(torch.einsum("thd,sd->ths", q.double(), k.double()) * dim**-0.5)
    scores = torch.einsum("th,ths->ts", w.double() * heads**-0.5, dots)
    return scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], -torch.inf)


def test_indexer_fp8_path_recall_and_cache_forms():
    """fp8 top-k: equals DeepSeek's formula by hand; the same over an fp8 cache or a float32
    cache quantised on the fly; recall against the exact path on tie-free random inputs."""
    gen = torch.Generator().manual_seed(7)
    seq_len, num_queries, topk, heads, dim = 256, 96, 32, 16, 128
    num_blocks, table, (slot,) = paged_layout([seq_len], 16, gen)
    cache32 = torch.zeros(num_blocks, 16, dim)
    cache8 = torch.zeros(num_blocks, 16, dim + 4, dtype=torch.uint8)
    k = torch.randn(seq_len, dim, generator=gen)
    write_indexer_keys(cache32, k, slot)
    write_indexer_keys(cache8, k, slot)
    qsl, lens, positions = query_layout([seq_len], [num_queries])
    q = torch.randn(num_queries, heads, dim, generator=gen)
    w = torch.rand(num_queries, heads, generator=gen) + 0.5

    def run(cache, fp8):
        return indexer_topk(q, w, cache, table, qsl, lens, positions, topk=topk, fp8=fp8)

    exact, fp8_32, fp8_8, exact_8 = (
        run(cache32, False),
        run(cache32, True),
        run(cache8, True),
        run(cache8, False),
    )
    assert torch.equal(fp8_32, fp8_8)
    by_hand = scores_by_hand(q, w, k, positions, fp8=True).topk(topk, dim=-1).indices
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(fp8_8, by_hand))
    exact_scores = scores_by_hand(q, w, k, positions, fp8=False)  # [T, S]
    kth = exact_scores.topk(topk, dim=-1).values[:, -1:]  # [T, 1]

    def recall(got, tol=0.0):
        """Share of exact top-k slots matched; with tol, a key also counts if its exact score
        is within tol (relative) of the exact k-th score (a near-tie at e4m3 resolution)."""
        ok = (got.long()[:, :, None] == exact.long()[:, None, :]).any(-1)  # [T, topk]
        if tol:
            ok |= exact_scores.gather(1, got.long()) >= kth * (1 - tol)
        return ok.float().mean().item()

    strict, near, cache_only = recall(fp8_8), recall(fp8_8, tol=0.02), recall(exact_8)
    print(
        f"\nindexer top-{topk} of {seq_len} keys, {heads} heads, D={dim}: fp8 recall "
        f"{strict:.4f} strict, {near:.4f} within 2% of the k-th score; exact q over the fp8 "
        f"cache {cache_only:.4f}"
    )
    # i.i.d. Gaussian scores crowd the rank-k boundary: fp8 (~1.6% score error) swaps
    # near-ties there, so strict recall is ~0.97; the swaps are near-ties.
    assert strict >= 0.95 and near >= 0.99 and cache_only >= 0.96


# ------------------------------------------------------------------ sparse MLA


@pytest.mark.parametrize("dtype,rank", [(torch.float32, 48), (torch.uint8, 128)])
def test_sparse_with_every_key_equals_dense(dtype, rank):
    gen = torch.Generator().manual_seed(8)
    seq_lens, query_lens, heads, nope, rope, v_dim = [9, 14, 5], [3, 1, 5], 4, 16, 8, 12
    cache, table, _ = latent_cache(seq_lens, 4, rank, rope, dtype, gen)
    qsl, lens, positions = query_layout(seq_lens, query_lens)
    q_nope, q_pe, w_uk, w_uv = mla_inputs(sum(query_lens), heads, nope, rope, rank, v_dim, gen)
    dense = mla_decode_absorbed(
        q_nope, q_pe, cache, table, qsl, lens, w_uk=w_uk, w_uv=w_uv, scale=0.25
    )
    # top-k = every valid key, in a shuffled order, padded with -1
    width = max(seq_lens) + 2
    indices = torch.full((sum(query_lens), width), -1, dtype=torch.int32)
    for t, pos in enumerate(positions.tolist()):
        indices[t, : pos + 1] = torch.randperm(pos + 1, generator=gen).to(torch.int32)
    u = sparse_mla_attention(
        absorb_q(q_nope, q_pe, w_uk),
        cache,
        table,
        indices,
        kv_lora_rank=rank,
        scale=0.25,
        query_start_loc=qsl,
    )
    torch.testing.assert_close(apply_w_uv(u, w_uv), dense, atol=ATOL, rtol=ATOL)
    # decode form: one query per request, block_table rows = query rows
    last = qsl[1:].long() - 1
    u_dec = sparse_mla_attention(
        absorb_q(q_nope, q_pe, w_uk)[last],
        cache,
        table,
        indices[last],
        kv_lora_rank=rank,
        scale=0.25,
    )
    torch.testing.assert_close(apply_w_uv(u_dec, w_uv), dense[last], atol=ATOL, rtol=ATOL)


def test_sparse_subset_and_empty_rows():
    gen = torch.Generator().manual_seed(9)
    seq_lens, rank, rope, heads = [16, 11], 32, 8, 3
    cache, table, rows = latent_cache(seq_lens, 4, rank, rope, torch.float32, gen)
    q = torch.randn(2, heads, rank + rope, generator=gen)
    indices = torch.tensor([[3, 15, -1, 0, 7], [-1, -1, -1, -1, -1]], dtype=torch.int32)
    u = sparse_mla_attention(q, cache, table, indices, kv_lora_rank=rank, scale=0.5)
    assert torch.equal(u[1], torch.zeros(heads, rank))
    latent = torch.cat(rows[0], -1)[[3, 15, 0, 7]]  # [4, L + R]
    probs = torch.softmax(torch.einsum("hc,sc->hs", q[0], latent) * 0.5, dim=-1)
    torch.testing.assert_close(u[0], probs @ latent[:, :rank], atol=ATOL, rtol=ATOL)
