"""TORCH_SDPA and FLEX_ATTENTION against the PyTorch reference twin, over random paged layouts
and every feature."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnserve.attention.backends.flex import FlexAttentionBackend
from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv

BLOCK = 4


def make_batch(query_lens, context_lens, num_kv_heads, head, gen, num_blocks=64, dtype=torch.float32,
               cache_dtype=None):
    """Random caches with random (non-contiguous) block tables; block 0 is the null block."""
    cache_dtype = cache_dtype or dtype
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots = [], []
    for q, s in zip(query_lens, seq_lens):
        n = -(-s // BLOCK)
        row, perm = perm[:n], perm[n:]
        tables.append(row)
        slots.extend(row[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s))
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    kc = torch.randn(num_blocks, BLOCK, num_kv_heads, head, generator=gen).to(cache_dtype)
    vc = torch.randn(num_blocks, BLOCK, num_kv_heads, head, generator=gen).to(cache_dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]),
        block_tables=[bt], slot_mappings=[torch.tensor(slots)], query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        num_decodes=sum(1 for _ in __import__("itertools").takewhile(lambda q: q == 1, query_lens)),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return common, kc, vc


CASES = {
    "decode": ([1, 1, 1], [7, 0, 13]),
    "prefill": ([9, 5], [0, 0]),
    "mixed_chunked": ([1, 1, 6, 3], [11, 4, 5, 17]),
}
FEATURES = {
    "plain": {},
    "window": {"window": 5},
    "alibi": {"alibi": True},
    "sinks": {"sinks": True},
    "softcap": {"softcap": 2.0},
    "all": {"window": 6, "alibi": True, "sinks": True, "softcap": 3.0},
}


BACKENDS = {"torch_sdpa": TorchSDPABackend, "flex": FlexAttentionBackend}


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("heads", [(6, 2), (6, 1), (6, 6)], ids=["gqa", "mqa", "mha"])
def test_matches_reference(case, feature, heads, backend_name):
    gen = torch.Generator().manual_seed(hash((case, feature, heads)) % 2**31)
    num_heads, num_kv = heads
    head = 8
    query_lens, context_lens = CASES[case]
    common, kc, vc = make_batch(query_lens, context_lens, num_kv, head, gen)
    f = FEATURES[feature]
    layer = SimpleNamespace(scale=head ** -0.5, window=f.get("window"), softcap=f.get("softcap"),
                            alibi_slopes=alibi_slopes(num_heads) if f.get("alibi") else None,
                            sinks=torch.randn(num_heads, generator=gen) if f.get("sinks") else None,
                            k_scale=1.0, v_scale=1.0)
    t = common.num_tokens
    q = torch.randn(t, num_heads, head, generator=gen)
    k = torch.randn(t, num_kv, head, generator=gen)
    v = torch.randn(t, num_kv, head, generator=gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, common.slot_mappings[0])
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale, window=layer.window, alibi=layer.alibi_slopes, sinks=layer.sinks,
                          softcap=layer.softcap)
    backend = BACKENDS[backend_name](BLOCK)
    out = backend.forward(layer, q, k, v, (kc, vc), backend.build_metadata(common, 0))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, ref_k)  # the new K/V landed in their slots


def test_fp8_cache_matches_reference_on_the_same_bytes():
    gen = torch.Generator().manual_seed(0)
    common, kc, vc = make_batch([1, 5], [9, 3], 2, 8, gen, cache_dtype=torch.float8_e4m3fn)
    layer = SimpleNamespace(scale=8 ** -0.5, window=None, softcap=None, alibi_slopes=None, sinks=None,
                            k_scale=0.5, v_scale=2.0)
    t = common.num_tokens
    q, k, v = (torch.randn(t, h, 8, generator=gen) for h in (4, 2, 2))
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, common.slot_mappings[0], k_scale=0.5, v_scale=2.0)
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale, k_scale=0.5, v_scale=2.0)
    backend = TorchSDPABackend(BLOCK)
    out = backend.forward(layer, q, k, v, (kc, vc), backend.build_metadata(common, 0))
    assert kc.dtype == torch.float8_e4m3fn
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_engine_with_flex_attention_matches_torch_sdpa(tmp_path):
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts, run_engine

    build_hf_model("gemma2", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                                  sliding_window=6, max_position_embeddings=64), tmp_path)
    prompts = make_prompts([5, 13])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    outs = {}
    for name in ("TORCH_SDPA", "FLEX_ATTENTION"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, attention_backend=name, max_num_batched_tokens=8)
        assert set(llm.llm_engine.parts.backend_names) == {name}
        outs[name] = run_engine(llm, prompts, params)
    for a, b in zip(outs["TORCH_SDPA"], outs["FLEX_ATTENTION"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries", [1, 5])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_folded_gqa_equals_sdpa_with_enable_gqa(dtype, num_queries, heads):
    """``attend`` folds a KV head's query heads into the query length; the result is SDPA's
    with ``enable_gqa`` (the twin), per-batch masks included."""
    from attnserve.attention.backends.torch_sdpa import attend

    gen = torch.Generator().manual_seed(num_queries * 10 + heads[1])
    (h, hkv), b, s, d = heads, 3, 40, 16
    q = torch.randn(b, h, num_queries, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, s, d, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([40, 17, 9])
    qpos = lens[:, None] - num_queries + torch.arange(num_queries)[None]  # [B, Q]
    dist = qpos[:, :, None] - torch.arange(s)[None, None]  # [B, Q, S]
    valid = (torch.arange(s)[None, None] < lens[:, None, None]).expand(b, num_queries, s)
    layer = SimpleNamespace(scale=d ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None)
    out = attend(q, k, v, dist, valid, layer)
    mask = (valid & (dist >= 0))[:, None]
    twin = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale,
                                                            enable_gqa=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, twin, atol=tol, rtol=tol)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_decodes_match_one_padded_batch(feature, dtype, monkeypatch):
    """Decodes of spread lengths, in an order that is not sorted, split into several buckets:
    the same as the reference and as one padded batch (the bucket cost set so high that one
    bucket wins), for every feature."""
    from attnserve.attention.backends import torch_sdpa

    gen = torch.Generator().manual_seed(len(feature) + (dtype == torch.float32))
    context_lens = [3, 40, 0, 17, 61, 8, 33, 2, 50, 25]
    common, kc, vc = make_batch([1] * len(context_lens), context_lens, 2, 8, gen, num_blocks=256)
    f = FEATURES[feature]
    layer = SimpleNamespace(scale=8 ** -0.5, window=f.get("window"), softcap=f.get("softcap"),
                            alibi_slopes=alibi_slopes(6) if f.get("alibi") else None,
                            sinks=torch.randn(6, generator=gen) if f.get("sinks") else None, k_scale=1.0, v_scale=1.0)
    q, k, v = (torch.randn(len(context_lens), h, 8, generator=gen) for h in (6, 2, 2))
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, common.slot_mappings[0])
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale, window=layer.window, alibi=layer.alibi_slopes, sinks=layer.sinks,
                          softcap=layer.softcap)
    outs = {}
    for cost in (8, 10**9):
        monkeypatch.setattr(torch_sdpa, "BUCKET_COST_KEYS", cost)
        backend = TorchSDPABackend(BLOCK, {"attention.decode": "torch"})  # plain layers would take the CPU kernel
        meta = backend.build_metadata(common, 0)
        outs[cost] = [backend.forward(layer, q.to(dtype), k.to(dtype), v.to(dtype), (kc.to(dtype), vc.to(dtype)), meta)
                      for _ in range(2)]  # the second layer reuses the step's buckets and masks
        assert (len(meta.decode_buckets) > 2) == (cost == 8)
        assert (meta.decode_order is not None) == (cost == 8)
        assert torch.equal(outs[cost][0], outs[cost][1])
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[8][0].float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[8][0], outs[10**9][0], atol=tol, rtol=tol)


def test_split_decodes_is_the_cheapest_split():
    """``split_decodes`` against every split of small sorted inputs (brute force)."""
    from itertools import combinations

    from attnserve.attention.backends.torch_sdpa import split_decodes

    gen = torch.Generator().manual_seed(3)
    for trial in range(30):
        n = 1 + trial % 7
        blocks = sorted(torch.randint(1, 12, (n,), generator=gen).tolist(), reverse=True)
        cost = [0, 1, 3, 10, 100][trial % 5]
        runs = split_decodes(blocks, cost)
        assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        assert all(w == blocks[s] for s, _, w in runs)
        got = sum((e - s) * w + cost for s, e, w in runs)
        best = min(sum((e - s) * blocks[s] + cost for s, e in zip((0, *cuts), (*cuts, n)))
                   for r in range(n) for cuts in combinations(range(1, n), r))
        assert got == best
    with pytest.raises(ValueError, match="descending"):
        split_decodes([1, 2], 0)
