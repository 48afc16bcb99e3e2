"""TRITON_MLA's absorbed short prefills against TORCH_MLA, on CPU through Triton's interpreter.

Prefills of at most ``ABSORBED_MAX_QUERY`` new tokens run in the absorbed form with the decode
kernel, one row per query token over its causal keys; longer ones keep the expanded path.
Backend level: steps mixing decodes, a short chunk over earlier context, a short whole prompt
and a long prefill (between or after the short ones) give TORCH_MLA's outputs (float32 and fp8
latent caches, NaN-filled so a stray read shows), and only the long prefill is expanded.
Engine level: a tiny DeepSeek-V3 with chunked prefill and prefix-cache hits gives TORCH_MLA's
greedy tokens and logprobs, and no short prefill reaches the expanded path.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.attention.backends import triton_mla  # noqa: E402
from attnserve.attention.backends.torch_mla import TorchMLABackend, write_latent_rows  # noqa: E402
from attnserve.attention.backends.triton_mla import ABSORBED_MAX_QUERY, TritonMLABackend  # noqa: E402
from attnserve.attention.metadata import CommonAttentionMetadata  # noqa: E402
from attnserve.kvcache.fp8 import mla_fp8_row_bytes  # noqa: E402
from tests.kernels.test_triton_mla import paged, rel_err  # noqa: E402

HEADS, NOPE, ROPE, V, PAGE = 4, 16, 8, 12, 16
LONG = ABSORBED_MAX_QUERY + 8
# (query_len, seq_len) per request, decodes first: two decodes, a 5-token chunk over 40 cached
# keys, a long prefill over 10 cached keys, a 7-token whole prompt; or all prefills short
BATCHES = {
    "long_between": [(1, 1), (1, 40), (5, 45), (LONG, LONG + 10), (7, 7)],
    "all_short": [(1, 70), (3, 20), (ABSORBED_MAX_QUERY, ABSORBED_MAX_QUERY + 17)],
    "prefills_only": [(2, 66), (LONG, LONG)],
}


def mla_step(batch, fp8: bool, seed: int = 0):
    """(layer, q [T, H, d_nope + R], new rows [T, L + R], cache holding every request's
    earlier rows (NaN elsewhere but in the null block), common metadata) of one step."""
    rank = 128 if fp8 else 32
    gen = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = [b[0] for b in batch], [b[1] for b in batch]
    if fp8:
        cache, table, slots = paged(seq_lens, mla_fp8_row_bytes(rank, ROPE), PAGE, gen, 255, torch.uint8)
    else:
        cache, table, slots = paged(seq_lens, rank + ROPE, PAGE, gen, float("nan"))
    cache[0] = 0  # the null block: TORCH_MLA's padded decode reads it (masked), as NaN * 0
    for ql, sl, s in zip(query_lens, seq_lens, slots):  # the context already cached
        write_latent_rows(cache, torch.randn(sl - ql, rank + ROPE, generator=gen), s[: sl - ql], rank)
    new_slots = torch.cat([s[sl - ql :] for ql, sl, s in zip(query_lens, seq_lens, slots)])
    positions = torch.cat([torch.arange(sl - ql, sl) for ql, sl in zip(query_lens, seq_lens)])
    qsl = [0, *itertools.accumulate(query_lens)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=positions,
        block_tables=[table],
        slot_mappings=[new_slots],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decodes=sum(1 for _ in itertools.takewhile(lambda n: n == 1, query_lens)),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    layer = SimpleNamespace(
        kv_lora_rank=rank, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, scale=0.3,
        w_kv_b=torch.randn(HEADS, NOPE + V, rank, generator=gen) * rank**-0.5,
    )  # fmt: skip
    t = qsl[-1]
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen)
    return layer, q, torch.randn(t, rank + ROPE, generator=gen), cache, common


@pytest.fixture
def expanded(monkeypatch) -> list[int]:
    """Query lengths TRITON_MLA sends through the expanded path, in call order."""
    lengths, attend = [], triton_mla.prefill_expanded

    def spy(q, *args):
        lengths.append(q.shape[0])
        return attend(q, *args)

    monkeypatch.setattr(triton_mla, "prefill_expanded", spy)
    return lengths


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_short_prefills_match_torch_mla(batch, fp8, expanded):
    layer, q, rows, cache, common = mla_step(BATCHES[batch], fp8)
    outs, caches = [], []
    for backend in (TorchMLABackend(PAGE), TritonMLABackend(PAGE)):
        kv = cache.clone()
        md = backend.build_metadata(common, 0)
        outs.append(backend.forward(layer, q, rows, None, {"latent": kv}, md))
        caches.append(kv)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert rel_err(outs[1], outs[0]) < 2e-5
    long = [n for n, _ in BATCHES[batch] if n > ABSORBED_MAX_QUERY]
    assert expanded == long, "a short prefill was expanded, or a long one absorbed"


def test_decode_batch_metadata_only_slices():
    """A decode-only step builds what a CUDA graph captures: slices of the common tensors."""
    _, _, _, _, common = mla_step([(1, 9), (1, 40), (1, 3)], fp8=False)
    md = TritonMLABackend(PAGE).build_metadata(common, 0)
    assert md.absorbed_rows is None and md.num_absorbed == 3 and md.prefills == []
    assert md.block_table.data_ptr() == common.block_tables[0].data_ptr()
    assert md.seq_lens.data_ptr() == common.seq_lens.data_ptr() and md.max_seq_len == 40


def test_short_prefill_rows_see_their_causal_keys():
    md = TritonMLABackend(PAGE).build_metadata(mla_step(BATCHES["long_between"], False)[4], 0)
    # decodes (rows 0, 1), the chunk (rows 2-6), then the short prompt after the long prefill
    want_rows = [0, 1, *range(2, 7), *range(7 + LONG, 14 + LONG)]
    assert md.absorbed_rows.tolist() == want_rows and md.num_absorbed == len(want_rows)
    assert md.seq_lens.tolist() == [1, 40, 41, 42, 43, 44, 45, *range(1, 8)]
    assert md.max_seq_len == 45 and [p[:2] for p in md.prefills] == [(7, 7 + LONG)]
    table = mla_step(BATCHES["long_between"], False)[4].block_tables[0]
    assert torch.equal(md.block_table, table[[0, 1, *[2] * 5, *[4] * 7]])


# ----------------------------------------------------------------------------- engine


@pytest.mark.parametrize("engine", [{}, {"kv_cache_dtype": "fp8"}], ids=["fp32", "fp8"])
def test_engine_chunks_and_prefix_hits_match_torch_mla(engine, tmp_path, expanded):
    """A budget of ABSORBED_MAX_QUERY + 8: the prompt 5 tokens longer runs a long chunk
    (expanded) then a short one over it; the later prompts hit the prefix cache and recompute a
    short tail (absorbed)."""
    from attnserve import LLM, SamplingParams
    from tests.kernels.test_triton_mla import _config
    from tests.models.parity import build_hf_model, make_prompts, run_engine

    overrides = {"kv_lora_rank": 128} if engine else {}
    build_hf_model("deepseek_v3", {**_config("test_parity_deepseek"), **overrides}, tmp_path)
    budget = ABSORBED_MAX_QUERY + 8
    base, tails = make_prompts([budget + 5], seed=3)[0], make_prompts([2, 9], seed=4)
    hit = len(base) // 4 * 4  # the whole 4-token blocks of the base prompt
    later = [base + tails[0], base[:20] + tails[1], make_prompts([6], seed=5)[0]]
    # no prompt logprobs: they would make the later prompts skip the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = {}
    for name in ("TORCH_MLA", "TRITON_MLA"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, attention_backend=name,
                  max_num_batched_tokens=budget, **engine)  # fmt: skip
        outs[name] = run_engine(llm, [base], params) + run_engine(llm, later, params)
    assert [o.num_cached_tokens for o in outs["TRITON_MLA"]] == [0, hit, 20, 0]
    assert set(expanded) == {budget}, "only the long chunk is expanded"
    for a, b in zip(outs["TORCH_MLA"], outs["TRITON_MLA"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(ea) == set(eb)
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4
