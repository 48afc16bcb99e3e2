"""TORCH_MLA_SPARSE against its PyTorch twins (``reference_mla.py``), over random paged layouts.

Covers: the indexer's top-k (exact over a float32 cache, DeepSeek's fp8 formula over the
132-byte fp8 cache) on decode / prefill / mixed-chunked batches, the -1 slots and the causal
limit; the cache rows written (byte-exact to the twin's writer); sparse MLA over the selected
rows (float32, bfloat16, fp8 latent cache), rows of all -1 giving 0; top-k covering every key
equals dense TORCH_MLA; the query/token chunking; and the fp8 indexer's top-k recall against
the exact path (constructed tie-free inputs and plain random ones). Block 0 is the null block.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from attnserve.attention.backends import torch_mla_sparse
from attnserve.attention.backends.torch_mla import TorchMLABackend
from attnserve.attention.backends.torch_mla_sparse import TorchMLASparseBackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.reference_mla import (
    absorb_q,
    apply_w_uv,
    indexer_topk,
    sparse_mla_attention,
    write_indexer_keys,
    write_latent,
)
from attnserve.kvcache.fp8 import mla_fp8_row_bytes

BLOCK = 4
HEADS, NOPE, ROPE, V = 4, 16, 8, 12
IDX_HEADS, IDX_DIM = 16, 32
TOPK = 5

CASES = {
    "decode": ([1, 1, 1], [7, 0, 13]),
    "prefill": ([9, 5], [0, 0]),
    "mixed_chunked": ([1, 1, 6, 3], [11, 4, 5, 17]),
}


def make_common(query_lens, context_lens, gen, num_blocks=64) -> CommonAttentionMetadata:
    """Metadata with shuffled block tables (block 0 never used) for one KV cache group."""
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
    qsl = [0, *itertools.accumulate(query_lens)]
    return CommonAttentionMetadata(
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


def old_rows(common: CommonAttentionMetadata):
    """(slots, positions) of the keys already cached before this step, over all requests."""
    slots, positions = [], []
    bt = common.block_tables[0]
    for i, (s, q) in enumerate(zip(common.seq_lens_cpu, common.query_lens_cpu)):
        pos = torch.arange(s - q)
        slots.append(bt[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
        positions.append(pos)
    return torch.cat(slots), torch.cat(positions)


def indexer_cache(common, fp8: bool, gen, num_blocks=64) -> torch.Tensor:
    """An indexer cache whose context rows hold valid random keys (garbage elsewhere)."""
    if fp8:
        cache = torch.randint(0, 120, (num_blocks, BLOCK, IDX_DIM + 4), generator=gen)
        cache = cache.to(torch.uint8)
    else:
        cache = torch.randn(num_blocks, BLOCK, IDX_DIM, generator=gen) * 50  # far off if read
    slots, _ = old_rows(common)
    write_indexer_keys(cache, torch.randn(slots.numel(), IDX_DIM, generator=gen), slots)
    cache[0].zero_()
    return cache


def run_topk(case, fp8, seed, topk=TOPK):
    """(backend top-k, twin top-k, backend cache, twin cache, common) on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    common = make_common(*CASES[case], gen)
    cache = indexer_cache(common, fp8, gen)
    t = common.num_tokens
    q = torch.randn(t, IDX_HEADS, IDX_DIM, generator=gen)
    k = torch.randn(t, IDX_DIM, generator=gen)
    w = torch.randn(t, IDX_HEADS, generator=gen)
    ref_cache = cache.clone()
    write_indexer_keys(ref_cache, k, common.slot_mappings[0])
    ref = indexer_topk(
        q,
        w,
        ref_cache,
        common.block_tables[0],
        common.query_start_loc,
        common.seq_lens,
        common.positions,
        topk=topk,
        fp8=fp8,
    )
    backend = TorchMLASparseBackend(BLOCK)
    meta = backend.build_metadata(common, 0)
    got = backend.select_topk(q, k, w, {"indexer": cache}, meta, topk=topk)
    return got, ref, cache, ref_cache, common


def as_sets(topk: torch.Tensor) -> list[list[int]]:
    return [sorted(i for i in row.tolist() if i >= 0) for row in topk]


@pytest.mark.parametrize("fp8", [False, True], ids=["exact", "fp8"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_select_topk_matches_twin(case, fp8):
    got, ref, cache, ref_cache, common = run_topk(case, fp8, seed=len(case) + fp8)
    assert got.shape == (common.num_tokens, TOPK) and got.dtype == torch.int32
    assert torch.equal(cache, ref_cache)  # new keys in their slots, byte-exact, nothing else
    assert as_sets(got) == as_sets(ref)
    for t, pos in enumerate(common.positions.tolist()):
        n_valid = min(TOPK, pos + 1)  # causal and inclusive: pos + 1 keys exist
        assert (got[t, :n_valid] >= 0).all() and (got[t, n_valid:] == -1).all()
        assert (got[t, :n_valid] <= pos).all()  # never a future position
        assert len(set(got[t, :n_valid].tolist())) == n_valid


def test_select_topk_skips_unwritten_slots():
    gen = torch.Generator().manual_seed(4)
    common = make_common([3], [2], gen)
    common.slot_mappings[0][1] = -1
    cache = indexer_cache(common, False, gen)
    before = cache.clone()
    backend = TorchMLASparseBackend(BLOCK)
    k = torch.randn(3, IDX_DIM, generator=gen)
    backend.select_topk(
        torch.randn(3, IDX_HEADS, IDX_DIM, generator=gen),
        k,
        torch.randn(3, IDX_HEADS, generator=gen),
        {"indexer": cache},
        backend.build_metadata(common, 0),
        topk=TOPK,
    )
    changed = (cache != before).any(-1).view(-1).nonzero().flatten().tolist()
    slots = common.slot_mappings[0].tolist()
    assert changed == sorted([slots[0], slots[2]])


# ------------------------------------------------------------------ sparse attention


def make_layer(rank, gen, scale=0.3, dtype=torch.float32):
    w = torch.randn(HEADS, NOPE + V, rank, generator=gen) * rank**-0.5
    return SimpleNamespace(
        kv_lora_rank=rank,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        scale=scale,
        w_kv_b=w.to(dtype),
    )


def latent_cache(common, rank, cache_dtype, gen, num_blocks=64):
    width = mla_fp8_row_bytes(rank, ROPE) if cache_dtype == torch.uint8 else rank + ROPE
    if cache_dtype == torch.uint8:
        cache = torch.randint(0, 120, (num_blocks, BLOCK, width), generator=gen).to(torch.uint8)
    else:
        cache = torch.randn(num_blocks, BLOCK, width, generator=gen).to(cache_dtype) * 50
    slots, _ = old_rows(common)
    n = slots.numel()
    write_latent(
        cache, torch.randn(n, rank, generator=gen), torch.randn(n, ROPE, generator=gen), slots
    )
    cache[0].zero_()
    return cache


def random_indices(common, width, gen) -> torch.Tensor:
    """Per token a random subset of its visible positions in shuffled slots, -1 elsewhere; the
    last token of the batch gets no index at all."""
    out = torch.full((common.num_tokens, width), -1, dtype=torch.int32)
    for t, pos in enumerate(common.positions.tolist()):
        n = int(torch.randint(1, min(width, pos + 1) + 1, (1,), generator=gen))
        chosen = torch.randperm(pos + 1, generator=gen)[:n]
        out[t, torch.randperm(width, generator=gen)[:n]] = chosen.to(torch.int32)
    out[-1] = -1
    return out


def run_sparse(case, cache_dtype, rank, seed, model_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    common = make_common(*CASES[case], gen)
    cache = latent_cache(common, rank, cache_dtype, gen)
    layer = make_layer(rank, gen, dtype=model_dtype)
    t = common.num_tokens
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen).to(model_dtype)
    rows = torch.randn(t, rank + ROPE, generator=gen).to(model_dtype)
    idx = random_indices(common, 7, gen)
    ref_cache = cache.clone()
    write_latent(ref_cache, rows[:, :rank], rows[:, rank:], common.slot_mappings[0])
    w = layer.w_kv_b.float()
    u = sparse_mla_attention(
        absorb_q(q[..., :NOPE], q[..., NOPE:], w[:, :NOPE]),
        ref_cache,
        common.block_tables[0],
        idx,
        kv_lora_rank=rank,
        scale=layer.scale,
        query_start_loc=common.query_start_loc,
    )
    ref = apply_w_uv(u, w[:, NOPE:])
    backend = TorchMLASparseBackend(BLOCK)
    meta = backend.build_metadata(common, 0)
    out = backend.forward(layer, q, rows, None, {"latent": cache}, meta, topk_indices=idx)
    return out, ref, cache, ref_cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_float32_matches_twin(case):
    out, ref, cache, ref_cache = run_sparse(case, torch.float32, 32, seed=20 + len(case))
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # every slot -1: output 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_fp8_latent_matches_twin(case):
    out, ref, cache, ref_cache = run_sparse(case, torch.uint8, 128, seed=30 + len(case))
    assert torch.equal(cache, ref_cache)  # the 656-byte layout at tiny size, byte for byte
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_sparse_bfloat16_matches_twin():
    out, ref, cache, ref_cache = run_sparse(
        "mixed_chunked", torch.bfloat16, 32, seed=40, model_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16 and torch.equal(cache, ref_cache)
    # bf16 products and outputs: about 3 significant digits on O(1) values
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_missing_topk_is_an_error():
    gen = torch.Generator().manual_seed(1)
    common = make_common([2], [0], gen)
    backend = TorchMLASparseBackend(BLOCK)
    with pytest.raises(ValueError, match="topk_indices"):
        backend.forward(
            make_layer(32, gen),
            torch.randn(2, HEADS, NOPE + ROPE),
            torch.randn(2, 32 + ROPE),
            None,
            {"latent": torch.zeros(8, BLOCK, 32 + ROPE)},
            backend.build_metadata(common, 0),
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_topk_covering_every_key_equals_dense_mla(case):
    """Indexer then sparse MLA with top-k >= every sequence: the dense TORCH_MLA result; with
    a small top-k the result really differs (sparsity is active)."""
    gen = torch.Generator().manual_seed(50 + len(case))
    common = make_common(*CASES[case], gen)
    rank = 32
    latent = latent_cache(common, rank, torch.float32, gen)
    index = indexer_cache(common, False, gen)
    layer = make_layer(rank, gen)
    t = common.num_tokens
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen)
    rows = torch.randn(t, rank + ROPE, generator=gen)
    q_i = torch.randn(t, IDX_HEADS, IDX_DIM, generator=gen)
    k_i = torch.randn(t, IDX_DIM, generator=gen)
    w_i = torch.randn(t, IDX_HEADS, generator=gen)
    dense_be = TorchMLABackend(BLOCK)
    dense = dense_be.forward(
        layer, q, rows, None, {"latent": latent.clone()}, dense_be.build_metadata(common, 0)
    )
    outs = {}
    for topk in (common.max_seq_len + 3, 2):
        backend = TorchMLASparseBackend(BLOCK)
        meta = backend.build_metadata(common, 0)
        caches = {"latent": latent.clone(), "indexer": index.clone()}
        idx = backend.select_topk(q_i, k_i, w_i, caches, meta, topk=topk)
        outs[topk] = backend.forward(layer, q, rows, None, caches, meta, topk_indices=idx)
    torch.testing.assert_close(outs[common.max_seq_len + 3], dense, atol=2e-5, rtol=2e-5)
    beyond = common.positions >= 2  # tokens with more than 2 visible keys
    assert (outs[2][beyond] - dense[beyond]).abs().amax() > 1e-2


@pytest.mark.parametrize("fp8", [False, True], ids=["exact", "fp8"])
def test_chunking_does_not_change_results(fp8, monkeypatch):
    """Tiny chunks (one query / token at a time) give the same top-k and outputs."""
    got, ref, *_ = run_topk("mixed_chunked", fp8, seed=60)
    out, out_ref, *_ = run_sparse("mixed_chunked", torch.float32, 32, seed=61)
    monkeypatch.setattr(torch_mla_sparse, "_CHUNK_ELEMENTS", 1)
    got_small, *_ = run_topk("mixed_chunked", fp8, seed=60)
    out_small, *_ = run_sparse("mixed_chunked", torch.float32, 32, seed=61)
    assert torch.equal(got_small, got)
    torch.testing.assert_close(out_small, out, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ fp8 indexer recall


def recall_case(q, k, w, topk):
    """(recall of the fp8 top-k against the exact one, exact scores, fp8 scores) for one
    prefill of len(k) keys with len(q) queries as its last tokens."""
    seq_len, num_q = k.shape[0], q.shape[0]
    gen = torch.Generator().manual_seed(0)
    common = make_common([num_q], [seq_len - num_q], gen, num_blocks=seq_len // BLOCK + 2)
    slots, _ = old_rows(common)
    sets = {}
    for fp8 in (False, True):
        width = IDX_DIM + 4 if fp8 else IDX_DIM
        dtype = torch.uint8 if fp8 else torch.float32
        cache = torch.zeros(seq_len // BLOCK + 2, BLOCK, width, dtype=dtype)
        write_indexer_keys(cache, k[: seq_len - num_q], slots)
        backend = TorchMLASparseBackend(BLOCK)
        sets[fp8] = backend.select_topk(
            q,
            k[seq_len - num_q :],
            w,
            {"indexer": cache},
            backend.build_metadata(common, 0),
            topk=topk,
        )
    hit = (sets[True].long()[:, :, None] == sets[False].long()[:, None, :]).any(-1)
    return hit.float().mean().item()


def score_gap_and_error(q, k, w, topk):
    """Smallest exact score gap between rank k and k + 1 (last query row, every key visible)
    and the largest |fp8 - exact| score error, both in float64 over the same inputs."""
    from attnserve.attention.backends.torch_mla_sparse import index_scores
    from attnserve.kvcache.fp8 import quantize_indexer_fp8

    exact = index_scores(q[None].double(), w[None].double(), k[None].double())[0]
    fp8 = index_scores(q[None], w[None], quantize_indexer_fp8(k)[None])[0].double()
    # only the last query sees every key; the rest see a prefix: compare where visible
    visible = (
        torch.arange(k.shape[0])[None, :]
        <= torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    )
    top2 = exact.masked_fill(~visible, -torch.inf).topk(topk + 1, dim=-1).values
    gap = (top2[:, topk - 1] - top2[:, topk]).min().item()
    return gap, (fp8 - exact).abs().masked_fill(~visible, 0).amax().item()


def test_fp8_indexer_recall():
    """fp8 top-k sets against the exact ones. Constructed inputs: every query and key share one
    direction (positive head weights), and the keys' loadings put the top ``topk`` well apart
    from the rest, so the exact score gap at rank k exceeds the fp8 score error (checked);
    recall must then be >= 0.99. Plain Gaussian inputs crowd the rank-k boundary with
    near-ties, so their recall is lower: reported, and bounded loosely."""
    gen = torch.Generator().manual_seed(70)
    seq_len, num_q, topk = 512, 32, 64
    u = torch.nn.functional.normalize(torch.randn(IDX_DIM, generator=gen), dim=0)
    load = torch.rand(seq_len, generator=gen)  # [0, 1): the non-selected keys
    top = torch.randperm(seq_len - num_q, generator=gen)[:topk]  # winners among the cached keys
    load[top] = 2.0 + torch.rand(topk, generator=gen)  # [2, 3): the winners
    k = load[:, None] * u * 4 + 0.3 * torch.randn(seq_len, IDX_DIM, generator=gen)
    q = (torch.rand(num_q, IDX_HEADS, 1, generator=gen) + 0.5) * u * 4
    q = q + 0.3 * torch.randn(num_q, IDX_HEADS, IDX_DIM, generator=gen)
    w = torch.rand(num_q, IDX_HEADS, generator=gen) + 0.5
    gap, err = score_gap_and_error(q, k, w, topk)
    assert gap > 2 * err, f"construction not tie-free: gap {gap:.3g} vs fp8 error {err:.3g}"
    constructed = recall_case(q, k, w, topk)

    plain = []
    for seed in range(3):
        g = torch.Generator().manual_seed(80 + seed)
        plain.append(
            recall_case(
                torch.randn(num_q, IDX_HEADS, IDX_DIM, generator=g),
                torch.randn(seq_len, IDX_DIM, generator=g),
                torch.rand(num_q, IDX_HEADS, generator=g) + 0.5,
                topk,
            )
        )
    print(
        f"\nfp8 indexer top-{topk} of {seq_len} keys, {IDX_HEADS} heads, D={IDX_DIM}: recall "
        f"{constructed:.4f} on tie-free inputs (score gap {gap:.3g} > 2 x fp8 error {err:.3g}); "
        f"{sum(plain) / len(plain):.4f} on plain Gaussian inputs "
        f"({', '.join(f'{r:.4f}' for r in plain)})"
    )
    assert constructed >= 0.99
    assert min(plain) >= 0.85
