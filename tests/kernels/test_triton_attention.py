"""Triton paged attention and KV write kernels against their PyTorch twins, on CPU.

Runs through Triton's interpreter (``TRITON_INTERPRET=1``), in fp32 and fp16 (the interpreter
cannot do bf16 arithmetic; one bf16 case checks the kernel's fp32 up-cast). Every cache is
filled with NaN before the live tokens are written, so any read of the null block or of an
unused slot that reaches the output shows up as NaN. Block tables are random permutations
that never use block 0. Shapes are tiny; interpreter blocks are large (64 keys per tile).

Not covered here: GPU numerics and speed (``benchmarks/gpu_attention.py``).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv  # noqa: E402
from attnserve.ops.attention.kv_write_triton import write_kv_cache  # noqa: E402
from attnserve.ops.attention.paged_triton import (  # noqa: E402
    pick_config,
    unified_attention,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

# (query_lens, seq_lens): each request's new tokens are the last of its sequence.
BATCH_SPECS = {
    "decode": ([1, 1, 1, 1], [1, 17, 64, 95]),
    "prefill": ([16, 5, 33], [16, 5, 33]),
    "mixed": ([1, 1, 12, 30], [40, 9, 12, 30]),
    "chunked_prefix": ([20, 7, 1], [50, 88, 3]),
    "odd_boundaries": ([3, 1, 13, 65], [15, 16, 49, 65]),
    "idle_decode": ([1, 0, 1], [5, 9, 20]),  # a request with no new tokens this step
    "idle_mixed": ([0, 4, 1, 0], [8, 10, 3, 2]),
}
# Tolerances against the fp32 reference (max abs error on outputs of size ~1).
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_batch(
    query_lens,
    seq_lens,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    head_size_v=None,
    page=16,
    dtype=torch.float32,
    cache_dtype=None,
    k_scale=1.0,
    v_scale=1.0,
    seed=0,
):
    """Random q and a NaN-filled paged cache holding each sequence's K/V in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    head_size_v = head_size_v or head_size
    cache_dtype = cache_dtype or dtype
    max_blocks = max(-(-s // page) for s in seq_lens) + 1  # one spare column, never used
    num_blocks = len(seq_lens) * max_blocks + 2
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    key_cache = torch.full((num_blocks, page, num_kv_heads, head_size), float("nan"))
    value_cache = torch.full((num_blocks, page, num_kv_heads, head_size_v), float("nan"))
    key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    for i, seq_len in enumerate(seq_lens):
        n = -(-seq_len // page)
        block_table[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        slots = block_table[i].long()[torch.arange(seq_len) // page] * page
        slots += torch.arange(seq_len) % page
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size_v, generator=gen)
        write_kv(key_cache, value_cache, k, v, slots, k_scale, v_scale)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_size, generator=gen).to(dtype)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def run_both(batch, num_splits=None, merge="last_split", **features):
    """(kernel output, reference output) for one batch; features go to both."""
    q = batch["q"]
    scale = q.shape[-1] ** -0.5
    args = [batch[k] for k in ("key_cache", "value_cache")]
    meta = [batch[k] for k in ("block_table", "query_start_loc", "seq_lens")]
    ref = paged_attention(q, *args, *meta, scale=scale, **features)
    out = torch.full((q.shape[0], q.shape[1], args[1].shape[-1]), float("nan"), dtype=q.dtype)
    qsl, seq_lens = batch["query_start_loc"], batch["seq_lens"]
    unified_attention(
        q,
        *args,
        out,
        *meta,
        scale=scale,
        num_splits=num_splits,
        merge=merge,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        **features,
    )
    return out, ref


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "NaN in the kernel output"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec", list(BATCH_SPECS))
def test_batch_specs(spec, dtype):
    batch = make_batch(*BATCH_SPECS[spec], dtype=dtype)
    assert_close(*run_both(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_size,head_size_v", [(80, 80), (96, 96), (64, 32)])
def test_head_sizes(head_size, head_size_v, dtype):
    batch = make_batch(
        *BATCH_SPECS["mixed"], head_size=head_size, head_size_v=head_size_v, dtype=dtype, seed=1
    )
    assert_close(*run_both(batch), dtype)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (8, 2), (6, 2), (8, 1), (20, 1), (64, 1)],
    ids=["mha", "gqa4", "gqa3", "mqa8", "mqa20", "mqa64"],
)
def test_head_groups(num_heads, num_kv_heads):
    batch = make_batch(
        *BATCH_SPECS["chunked_prefix"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=32,
        seed=2,
    )
    assert_close(*run_both(batch), torch.float32)


@pytest.mark.parametrize("page", [16, 32, 128])
def test_page_sizes(page):
    batch = make_batch(*BATCH_SPECS["odd_boundaries"], page=page, seed=3)
    assert_close(*run_both(batch), torch.float32)


def _features(name: str, num_heads: int) -> dict:
    gen = torch.Generator().manual_seed(4)
    if name == "window":
        return {"window": 11}
    if name == "window_tile":  # a window wider than one tile but shorter than the context
        return {"window": 70}
    if name == "alibi":
        return {"alibi": alibi_slopes(num_heads)}
    if name == "sinks":
        return {"sinks": torch.randn(num_heads, generator=gen) * 2}
    if name == "softcap":
        return {"softcap": 0.8}
    return {
        "window": 23,
        "alibi": alibi_slopes(num_heads),
        "softcap": 1.5,
        "sinks": torch.randn(num_heads, generator=gen),
    }


FEATURES = ["window", "window_tile", "alibi", "sinks", "softcap", "all"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("feature", FEATURES)
def test_features(feature, dtype):
    # 6 query heads over 2 KV heads: ALiBi slopes of a non-power-of-two head count, group 3.
    batch = make_batch([1, 1, 9, 40], [150, 30, 9, 168], num_heads=6, dtype=dtype, seed=5)
    out, ref = run_both(batch, **_features(feature, 6))
    assert_close(out, ref, dtype)


def test_features_change_the_output():
    """Guards the feature tests: each feature must move the output well past tolerance."""
    batch = make_batch([1, 1, 9, 40], [150, 30, 9, 168], num_heads=6, seed=5)
    args = [batch[k] for k in ("q", "key_cache", "value_cache", "block_table")]
    args += [batch["query_start_loc"], batch["seq_lens"]]
    plain = paged_attention(*args, scale=0.125)
    for feature in FEATURES:
        out = paged_attention(*args, scale=0.125, **_features(feature, 6))
        assert (out - plain).abs().max() > 1e-2, feature


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_cache(dtype):
    batch = make_batch(
        *BATCH_SPECS["mixed"],
        dtype=dtype,
        cache_dtype=torch.float8_e4m3fn,
        k_scale=0.25,
        v_scale=2.0,
        seed=6,
    )
    assert_close(*run_both(batch, k_scale=0.25, v_scale=2.0), dtype)


def test_bf16_inputs_upcast_under_interpreter():
    batch = make_batch(*BATCH_SPECS["mixed"], dtype=torch.bfloat16, seed=7)
    assert_close(*run_both(batch), torch.bfloat16)


@pytest.mark.parametrize("merge", ["last_split", "kernel"])
@pytest.mark.parametrize(
    "num_splits,feature",
    [(3, "none"), (8, "none"), (2, "sinks"), (2, "window"), (3, "all"), (8, "all")],
)
def test_split_kv_decode(num_splits, feature, merge):
    """Split-KV equals the reference and the one-program path; 8 splits leave some empty."""
    batch = make_batch([1, 1, 1], [300, 7, 129], num_heads=8, seed=8)
    features = {} if feature == "none" else _features(feature, 8)
    split, ref = run_both(batch, num_splits=num_splits, merge=merge, **features)
    whole, _ = run_both(batch, num_splits=1, **features)
    assert_close(split, ref, torch.float32)
    assert (split - whole).abs().max().item() <= 2e-6


@pytest.mark.parametrize("merge", ["last_split", "kernel"])
def test_split_kv_mixed_batch_fp16(merge):
    batch = make_batch(*BATCH_SPECS["chunked_prefix"], dtype=torch.float16, seed=9)
    assert_close(*run_both(batch, num_splits=2, merge=merge), torch.float16)


def test_merge_in_kernel_leaves_counters_clean():
    """The last split resets its counter: two launches in a row (as two graph replays) over
    different batches both merge right, and every counter is back at 0 after each."""
    from attnserve.ops.attention.paged_triton import split_counters

    counters = split_counters(torch.device("cpu"), 1)
    for seed, seq_lens in ((13, [300, 7, 129]), (14, [64, 200, 1])):
        batch = make_batch([1, 1, 1], seq_lens, num_heads=8, seed=seed)
        for _ in range(2):
            assert_close(*run_both(batch, num_splits=4, sinks=torch.ones(8)), torch.float32)
            assert counters.abs().sum().item() == 0
    # test guard: a stale count makes the first split to arrive merge alone. The batch is one
    # not computed before, so no reused buffer can hold the partials it skips.
    counters[:6] = 2
    batch = make_batch([1, 1, 1], [300, 290, 280], num_heads=8, seed=15)
    out, ref = run_both(batch, num_splits=4)
    assert out.isnan().any() or (out - ref).abs().max().item() > 1e-3
    counters.zero_()


@pytest.fixture
def splits_interleaved(monkeypatch):
    """The interpreter runs a launch's programs one at a time, each (q block, KV head)'s splits
    back to back (the split is the innermost grid axis), so splits of different rows never
    interleave as they do on a GPU. This maps its n-th program to the grid with the split
    outermost: every row's split 0 first, then every row's split 1, and so on."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_idx = builder.set_grid_idx

    def permuted(x, y, z):
        nx, ny, nz = builder.grid_dim
        n = (x * ny + y) * nz + z
        split, rest = divmod(n, nx * ny)
        set_idx(rest // ny, rest % ny, split)

    monkeypatch.setattr(builder, "set_grid_idx", permuted)


def test_split_decode_counters_per_row_when_splits_interleave(splits_interleaved):
    """Each (request, KV head) counts its own splits' arrivals, whatever the launch order: the
    decode launch walks the grid request-major (program_id(0) is not the request), and a counter
    indexed by program_id(0) was shared by two rows, which then merged before their splits had
    all stored (NaN from the unwritten partials, on the H200)."""
    batch = make_batch([1] * 4, [300, 7, 129, 200], num_heads=16, num_kv_heads=8, seed=16)
    assert_close(*run_both(batch, num_splits=4), torch.float32)


def test_merge_rejects_unknown_mode():
    batch = make_batch([1], [20])
    with pytest.raises(ValueError, match="merge must be one of"):
        run_both(batch, num_splits=2, merge="atomic")


def test_padding_rows_untouched():
    batch = make_batch([1, 5], [33, 20], seed=10)
    pad = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(10))
    q = torch.cat([batch["q"], pad])  # 3 padding rows past the batch
    out = torch.full((q.shape[0], 4, 64), 7.0)
    for num_splits in (1, 2):
        unified_attention(
            q,
            batch["key_cache"],
            batch["value_cache"],
            out,
            batch["block_table"],
            batch["query_start_loc"],
            batch["seq_lens"],
            scale=0.125,
            max_query_len=5,
            max_seq_len=33,
            num_splits=num_splits,
        )
        assert (out[6:] == 7.0).all()
        assert not out[:6].isnan().any()


def test_pick_config_shapes():
    for head_size in (64, 80, 128, 256):
        for group in (1, 3, 4, 8, 16, 64):
            for max_query_len in (1, 7, 512):
                for interpret in (False, True):
                    cfg = pick_config(head_size, group, max_query_len, interpret)
                    assert cfg.block_m >= 16 and cfg.group_pad >= group
                    assert cfg.block_m & (cfg.block_m - 1) == 0  # power of two for tl.arange
                    if max_query_len == 1:
                        assert cfg.block_q == 1


# ----------------------------------------------------------------------------- KV write


@pytest.mark.parametrize(
    "dtype,cache_dtype,k_scale,v_scale",
    [
        (torch.float32, torch.float32, 1.0, 1.0),
        (torch.float16, torch.float16, 1.0, 1.0),
        (torch.bfloat16, torch.bfloat16, 1.0, 1.0),  # load/store only: exact under interpreter
        (torch.float32, torch.float8_e4m3fn, 0.5, 3.0),
        (torch.float16, torch.float8_e4m3fn, 1.0, 1.0),
    ],
    ids=["fp32", "fp16", "bf16", "fp32-fp8", "fp16-fp8"],
)
def test_write_kv(dtype, cache_dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(11)
    num_blocks, page, num_kv_heads, head_size, head_size_v, num_tokens = 6, 16, 3, 80, 48, 21
    # Values exact in the cache dtype after scaling: the interpreter rounds fp32 -> fp8 with
    # a carry bug (0.4945 -> 0.25) and fp32 -> bf16 by truncation; GPUs round in hardware.
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_size_v, generator=gen)
    k = (k.to(cache_dtype).float() * k_scale).to(dtype)
    v = (v.to(cache_dtype).float() * v_scale).to(dtype)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[torch.tensor([0, 5, 6, 20])] = -1  # skipped tokens
    caches = [
        torch.randn(num_blocks, page, num_kv_heads, d, generator=gen).to(cache_dtype)
        for d in (head_size, head_size_v)
    ]
    expected = [c.clone() for c in caches]
    write_kv(*expected, k, v, slots, k_scale, v_scale)
    write_kv_cache(k, v, *caches, slots, k_scale, v_scale)
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_kv_int32_slots_and_views():
    """Strided K/V views (as sliced from a fused QKV projection) and int32 slot ids."""
    gen = torch.Generator().manual_seed(12)
    qkv = torch.randn(9, 4 + 2 + 2, 32, generator=gen)
    k, v = qkv[:, 4:6], qkv[:, 6:8]  # [9, 2, 32], non-contiguous
    slots = torch.tensor([3, -1, 40, 41, 17, 0, -1, 63, 8], dtype=torch.int32)
    caches = [torch.zeros(4, 16, 2, 32) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(*expected, k, v, slots.long())
    write_kv_cache(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


# ----------------------------------------------------------------------------- GPU compile

# The real launch code's calls (GPU configs, constexprs, dtypes), compiled for sm_90 (``sm90.py``).
_LAUNCHES = r"""
from attnserve.ops.attention import kv_write_triton as W
from attnserve.ops.attention import paged_triton as A

record(A, "_attention_kernel", "_merge_splits_kernel")
record(W, "_write_kv_kernel")

def attention(dtype, cache_dtype, head, num_tokens, max_query_len, num_splits, **features):
    q = torch.zeros(num_tokens, 32, head, dtype=dtype)
    kc = torch.zeros(9, 16, 8, head, dtype=cache_dtype)
    out = torch.zeros(num_tokens, 32, head, dtype=dtype)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    A.unified_attention(q, kc, kc.clone(), out, torch.zeros(1, 16, dtype=torch.int32), qsl,
                        torch.tensor([100], dtype=torch.int32), scale=0.1,
                        max_query_len=max_query_len, max_seq_len=4096, num_splits=num_splits,
                        **features)

head_features = dict(window=128, alibi=torch.ones(32), sinks=torch.ones(32), softcap=30.0)
attention(torch.bfloat16, torch.bfloat16, 128, 64, 64, 1, **head_features)
attention(torch.float16, torch.float8_e4m3fn, 80, 1, 1, 4, sinks=torch.ones(32))
attention(torch.bfloat16, torch.bfloat16, 128, 1, 1, 8, merge="kernel")
attention(torch.bfloat16, torch.bfloat16, 256, 64, 64, 1)
k = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
W.write_kv_cache(k, k, torch.zeros(9, 16, 8, 128, dtype=torch.float8_e4m3fn),
                 torch.zeros(9, 16, 8, 128, dtype=torch.float8_e4m3fn),
                 torch.zeros(4, dtype=torch.int64), 0.5, 2.0)
"""


def test_kernels_compile_for_sm90():
    # 4 attention launches (one of them merging its splits in the kernel), 1 merge, 1 KV write
    assert len(compile_for_sm90(_LAUNCHES)) == 6
