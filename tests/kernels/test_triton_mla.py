"""Triton MLA kernels (dense decode, sparse MLA) against their PyTorch twins, on CPU.

Runs through Triton's interpreter (``TRITON_INTERPRET=1``), in fp32 and fp16 (bf16 once, to
check the kernels' fp32 up-cast; the interpreter cannot do bf16 arithmetic), over model-dtype
and fp8 (656-byte layout at tiny size: kv_lora_rank 128) latent caches. Caches are filled with
NaN (0xFF bytes for fp8) before the live rows are written, so a read of the null block or of
an unused slot shows up as NaN. Block tables are random permutations that never use block 0.
Lengths sit on and around page and tile boundaries. Then the backends end to end: tiny
DeepSeek-V3 and V3.2 models through ``LLM(attention_backend=TRITON_MLA / TRITON_MLA_SPARSE)``
give TORCH_MLA's / TORCH_MLA_SPARSE's greedy tokens and logprobs (1e-4).

Not covered here: the DSA indexer (``test_triton_indexer.py``), GPU numerics and speed
(``benchmarks/gpu_mla.py``).
"""

from __future__ import annotations

import itertools

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.attention.reference_mla import (  # noqa: E402
    absorb_q,
    apply_w_uv,
    mla_decode_absorbed,
    sparse_mla_attention,
    write_latent,
)
from attnserve.kvcache.fp8 import mla_fp8_row_bytes  # noqa: E402
from attnserve.ops.mla.decode_triton import mla_decode  # noqa: E402
from attnserve.ops.mla.latent import MLAConfig  # noqa: E402
from attnserve.ops.mla.sparse_triton import sparse_mla  # noqa: E402

HEADS, NOPE, ROPE, V = 4, 16, 8, 12
SCALE = 0.3
# max|out - ref| / max|ref| against the float32 twins
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def paged(seq_lens, width, page, gen, fill, dtype=torch.float32):
    """A NaN-filled paged cache, block tables (random blocks, block 0 never used, one spare
    column of zeros) and each request's slots [S]."""
    max_blocks = max(-(-s // page) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 2
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for i, s in enumerate(seq_lens):
        n = -(-s // page)
        table[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        pos = torch.arange(s)
        slots.append(table[i].long()[pos // page] * page + pos % page)
    cache = torch.full((num_blocks, page, width), fill, dtype=dtype)
    return cache, table, slots


def latent_batch(seq_lens, rank, dtype, fp8, page, seed):
    """(cache, block_table) holding random latent rows of each request."""
    gen = torch.Generator().manual_seed(seed)
    if fp8:
        cache, table, slots = paged(seq_lens, mla_fp8_row_bytes(rank, ROPE), page, gen, 255,
                                    torch.uint8)  # fmt: skip
    else:
        cache, table, slots = paged(seq_lens, rank + ROPE, page, gen, float("nan"), dtype)
    for s in slots:
        c_kv, k_pe = (
            torch.randn(len(s), rank, generator=gen),
            torch.randn(len(s), ROPE, generator=gen),
        )
        write_latent(cache, c_kv, k_pe, s)
    return cache, table


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN: an unused slot or the null block was read"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ----------------------------------------------------------------------------- dense decode

DECODE_LENS = [1, 16, 17, 63, 64, 65, 100]  # page 16, interpreter tiles of 64 keys


@pytest.mark.parametrize(
    "dtype,fp8",
    [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
     (torch.float32, True), (torch.float16, True)],
    ids=["fp32", "fp16", "bf16", "fp32-fp8", "fp16-fp8"],
)  # fmt: skip
def test_mla_decode_matches_twin(dtype, fp8):
    rank = 256 if fp8 else 32  # two scale tiles per fp8 row
    gen = torch.Generator().manual_seed(1)
    cache, table = latent_batch(DECODE_LENS, rank, dtype, fp8, 16, seed=2)
    b = len(DECODE_LENS)
    q_nope, q_pe = (
        torch.randn(b, HEADS, NOPE, generator=gen),
        torch.randn(b, HEADS, ROPE, generator=gen),
    )
    w_uk = torch.randn(HEADS, NOPE, rank, generator=gen) * rank**-0.5
    w_uv = torch.randn(HEADS, V, rank, generator=gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    ref = mla_decode_absorbed(q_nope, q_pe, cache, table, torch.arange(b + 1), seq_lens,
                              w_uk=w_uk, w_uv=w_uv, scale=SCALE)  # fmt: skip
    q = absorb_q(q_nope, q_pe, w_uk).to(dtype)  # [B, H, L + R]
    u = mla_decode(q, cache, table, seq_lens, kv_lora_rank=rank, scale=SCALE, max_seq_len=100)
    assert u.dtype == dtype and u.shape == (b, HEADS, rank)
    assert rel_err(apply_w_uv(u, w_uv), ref) < TOL[dtype]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_mla_decode_split_matches_unsplit(fp8):
    """Splits of uneven size, empty splits (short rows) and a row with no keys (output 0)."""
    rank, lens = (128 if fp8 else 32), [0, 3, 47, 129, 200]
    cache, table = latent_batch(lens, rank, torch.float32, fp8, 16, seed=3)
    q = torch.randn(len(lens), HEADS, rank + ROPE, generator=torch.Generator().manual_seed(4))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cfg = MLAConfig(16, 16, 4, 1)  # 16-key tiles: up to 13 tiles, so every split has work
    whole = mla_decode(q, cache, table, seq_lens, kv_lora_rank=rank, scale=SCALE,
                       max_seq_len=200, num_splits=1, config=cfg)  # fmt: skip
    assert (whole[0] == 0).all()
    for splits in (2, 3, 8):
        part = mla_decode(q, cache, table, seq_lens, kv_lora_rank=rank, scale=SCALE,
                          max_seq_len=200, num_splits=splits, config=cfg)  # fmt: skip
        assert (part[0] == 0).all()
        assert rel_err(part, whole) < 2e-6, splits


@pytest.mark.parametrize("page,block_n", [(4, 32), (32, 16)], ids=["pages<tile", "pages>tile"])
def test_mla_decode_head_blocks_and_pages(page, block_n):
    """20 heads in blocks of 16 (a masked tail block), pages smaller and larger than a tile."""
    lens, heads, rank = [5, 33, 70], 20, 32
    cache, table = latent_batch(lens, rank, torch.float32, False, page, seed=5)
    q = torch.randn(len(lens), heads, rank + ROPE, generator=torch.Generator().manual_seed(6))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = sparse_mla_attention(
        q, cache, table, _all_positions(lens), kv_lora_rank=rank, scale=SCALE
    )
    out = torch.full((len(lens), heads, rank), float("nan"))
    mla_decode(q, cache, table, seq_lens, kv_lora_rank=rank, scale=SCALE, max_seq_len=70,
               out=out, config=MLAConfig(16, block_n, 4, 1))  # fmt: skip
    assert rel_err(out, ref) < TOL[torch.float32]


def test_many_head_configs_pipeline_dense_bf16_only():
    """128 heads on the GPU: dense bf16 decode pipelines two 64-key tiles (read by TMA where the
    kernel table picks ``mla.absorbed/triton_tma``: no register spills on the H200); fp8 rows and
    sparse MLA keep one stage. The interpreter's config never changes."""
    from attnserve.ops.mla.latent import pick_mla_config

    dense = pick_mla_config(128, torch.bfloat16, interpret=False)
    assert (dense.block_h, dense.block_n, dense.num_warps, dense.num_stages) == (64, 64, 8, 2)
    fp8 = pick_mla_config(128, torch.bfloat16, interpret=False, fp8=True)
    sparse = pick_mla_config(128, torch.bfloat16, interpret=False, sparse=True)
    assert fp8.num_stages == sparse.num_stages == 1
    assert pick_mla_config(16, torch.bfloat16, interpret=False).block_h == 16  # 16 heads: 16-row programs
    interp = pick_mla_config(128, torch.bfloat16, interpret=True)
    assert interp == pick_mla_config(128, torch.bfloat16, interpret=True, sparse=True)


def _all_positions(lens) -> torch.Tensor:
    """[B, max] every position of each request, -1 padded (dense attention as sparse rows)."""
    width = max(lens)
    cols = torch.arange(width)
    return torch.stack([torch.where(cols < n, cols, -1) for n in lens]).to(torch.int32)


# ----------------------------------------------------------------------------- sparse MLA


def sparse_rows(query_lens, seq_lens, topk, gen):
    """Per query row: its request, and top-k positions drawn from its causal range with -1
    slots mixed in; the last row of the first request selects nothing."""
    reqs, rows = [], []
    for r, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(sl - ql, sl):
            pick = torch.randperm(pos + 1, generator=gen)[:topk]
            row = torch.full((topk,), -1, dtype=torch.int32)
            row[: len(pick)] = pick.to(torch.int32)
            rows.append(row[torch.randperm(topk, generator=gen)])
            reqs.append(r)
    idx = torch.stack(rows)
    idx[query_lens[0] - 1] = -1
    return idx, torch.tensor(reqs, dtype=torch.int32)


@pytest.mark.parametrize(
    "dtype,fp8",
    [(torch.float32, False), (torch.float16, False), (torch.float32, True), (torch.float16, True)],
    ids=["fp32", "fp16", "fp32-fp8", "fp16-fp8"],
)
def test_sparse_mla_matches_twin(dtype, fp8):
    """Decode rows and prefill rows (a chunk over a cached prefix) in one call."""
    rank, topk = (128 if fp8 else 32), 24
    query_lens, seq_lens = [1, 1, 9, 5], [3, 40, 30, 5]
    gen = torch.Generator().manual_seed(7)
    cache, table = latent_batch(seq_lens, rank, dtype, fp8, 8, seed=8)
    idx, reqs = sparse_rows(query_lens, seq_lens, topk, gen)
    q = torch.randn(len(reqs), HEADS, rank + ROPE, generator=gen)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)])
    ref = sparse_mla_attention(q, cache, table, idx, kv_lora_rank=rank, scale=SCALE,
                               query_start_loc=qsl)  # fmt: skip
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    u = sparse_mla(q.to(dtype), cache, table, lens, idx, reqs, kv_lora_rank=rank, scale=SCALE)
    assert (u[0] == 0).all(), "a row of all -1 gives 0"
    assert rel_err(u, ref) < TOL[dtype]


def test_sparse_mla_splits_and_out_of_range():
    """Split K gives the unsplit result; positions >= the request's length count as -1."""
    query_lens, seq_lens, rank = [1, 1, 1], [50, 7, 90], 32
    gen = torch.Generator().manual_seed(9)
    cache, table = latent_batch(seq_lens, rank, torch.float32, False, 16, seed=10)
    idx, reqs = sparse_rows(query_lens, seq_lens, 40, gen)
    q = torch.randn(3, HEADS, rank + ROPE, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cfg = MLAConfig(16, 16, 4, 1)
    whole = sparse_mla(q, cache, table, lens, idx, reqs, kv_lora_rank=rank, scale=SCALE,
                       num_splits=1, config=cfg)  # fmt: skip
    for splits in (2, 3):
        part = sparse_mla(q, cache, table, lens, idx, reqs, kv_lora_rank=rank, scale=SCALE,
                          num_splits=splits, config=cfg)  # fmt: skip
        assert rel_err(part, whole) < 2e-6
    beyond = torch.where(idx < 0, torch.tensor([[200], [7], [95]], dtype=torch.int32), idx)
    same = sparse_mla(q, cache, table, lens, beyond, reqs, kv_lora_rank=rank, scale=SCALE,
                      config=cfg)  # fmt: skip
    assert rel_err(same, whole) < 2e-6


# ----------------------------------------------------------------------------- backends, end to end

ENGINE_CASES = {  # name -> (model type, config module, overrides, engine options)
    "v3": ("deepseek_v3", "test_parity_deepseek", {}, {}),
    "v3_fp8": ("deepseek_v3", "test_parity_deepseek", {"kv_lora_rank": 128}, {"kv_cache_dtype": "fp8"}),
    "v32": ("deepseek_v32", "test_parity_dsa", {}, {}),
    "v32_fp8": ("deepseek_v32", "test_parity_dsa", {"kv_lora_rank": 128}, {"kv_cache_dtype": "fp8"}),
}  # fmt: skip


def _config(module: str) -> dict:
    import importlib

    mod = importlib.import_module(f"tests.models.{module}")
    return dict(mod.FAMILIES["v3"][1]) if module == "test_parity_deepseek" else dict(mod.DSA)


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_matches_torch_backend(case, tmp_path):
    """Chunked prefill (mixed decode + prefill steps) and decode through the Triton backend
    give the PyTorch backend's greedy tokens, prompt and sample logprobs (1e-4). The DSA
    prompts are longer than index_topk (6), so the indexer really selects."""
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts, run_engine

    model_type, module, overrides, engine = ENGINE_CASES[case]
    build_hf_model(model_type, {**_config(module), **overrides}, tmp_path)
    prompts = make_prompts([5, 19, 27])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)  # fmt: skip
    sparse = model_type == "deepseek_v32"
    names = ("TORCH_MLA_SPARSE", "TRITON_MLA_SPARSE") if sparse else ("TORCH_MLA", "TRITON_MLA")
    outs = {}
    for name in names:
        llm = LLM(str(tmp_path), dtype="float32", block_size=16, attention_backend=name,
                  max_num_batched_tokens=12, **engine)  # fmt: skip
        assert llm.llm_engine.parts.backend_names == [name]
        outs[name] = run_engine(llm, prompts, params)
    for a, b in zip(outs[names[0]], outs[names[1]]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = [*zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]),
                 *zip(a.outputs[0].logprobs, b.outputs[0].logprobs)]  # fmt: skip
        for ea, eb in pairs:
            assert set(ea) == set(eb)
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4
