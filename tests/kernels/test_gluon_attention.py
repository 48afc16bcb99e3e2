"""The Gluon causal prefill kernel (``ops/attention/prefill_gluon``): its input checks, its sm_90 compile,
and on a Hopper GPU its output against the PyTorch twin.

Gluon has no interpreter, so on CPU the kernel is only compiled (``sm90.py``: TTGIR, PTX, the
bundled ptxas) and its compiled form checked for what the design promises, for every variant in
``CONFIGS`` and pages of 16 and 64: no spills, shared memory within the 227 KB a block may take,
the score MMA as ``m64n{block_n}k16`` per warp group and P V as ``m64n64k16`` with P in registers
(no shared-memory operand for A), one wait for the two score groups while P V runs (the overlap
variants), the TMA loads in the loader warp (one per box and half: ``4 * block_n / box``), and the
register split of the warp specialization (``setmaxnreg``; split variants: one partition per
consumer warp group). The numeric test runs only where a
Hopper GPU is (``benchmarks/gpu_prefill_gluon.py`` checks and times it there).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="Triton without Gluon")

from attnserve.attention.backend import tensor_problem  # noqa: E402
from attnserve.attention.kernels import get_variant, reasons  # noqa: E402
from attnserve.attention.reference import paged_attention, write_kv  # noqa: E402
from attnserve.ops.attention.prefill_gluon import (  # noqa: E402
    CONFIGS,
    PrefillConfig,
    check_prefill_inputs,
    prefill_attention_gluon,
)
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402

SCALE = 128**-0.5
BF16 = torch.bfloat16


def _inputs(tokens=6, heads=8, kv_heads=2, page=16, blocks=4, seqs=2, **over):
    d = dict(q=torch.zeros(tokens, heads, 128, dtype=BF16),
             key_cache=torch.zeros(blocks, page, kv_heads, 128, dtype=BF16),
             value_cache=torch.zeros(blocks, page, kv_heads, 128, dtype=BF16),
             out=torch.zeros(tokens, heads, 128, dtype=BF16),
             block_table=torch.zeros(seqs, 3, dtype=torch.int32),
             query_start_loc=torch.tensor([0, 2, tokens][: seqs + 1], dtype=torch.int32),
             seq_lens=torch.tensor([2, 4][:seqs], dtype=torch.int32),
             scale=SCALE, max_query_len=4)  # fmt: skip
    d.update(over)
    return d


_CACHE_64 = torch.zeros(4, 16, 2, 64, dtype=BF16)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(window=8), r"plain causal attention only, got \['window'\]"),
        (dict(alibi=torch.zeros(8)), r"\['alibi'\]"),
        (dict(sinks=torch.zeros(8)), r"\['sinks'\]"),
        (dict(softcap=30.0), r"\['softcap'\]"),
        (dict(k_scale=0.5), r"\[.k_scale.\]"),
        (dict(num_splits=2), "not split"),
        (dict(max_query_len=1), "prefill steps only"),
        (dict(scale=0.0), "scale must be positive"),
        (dict(q=torch.zeros(6, 8, 64, dtype=BF16)), r"q must be \[tokens, heads, 128\]"),
        (dict(q=torch.zeros(6, 8, 128)), "bf16 or fp16"),
        (dict(key_cache=_CACHE_64), r"key_cache must be \[blocks, page, kv_heads, 128\]"),
        (dict(value_cache=torch.zeros(5, 16, 2, 128, dtype=BF16)), "value_cache must be"),
        (dict(value_cache=torch.zeros(4, 16, 2, 128, dtype=torch.float16)), "q's dtype"),
        (dict(key_cache=torch.zeros(4, 2, 16, 128, dtype=BF16).transpose(1, 2)), "contiguous"),
        (dict(key_cache=torch.zeros(4, 12, 2, 128, dtype=BF16),
              value_cache=torch.zeros(4, 12, 2, 128, dtype=BF16)), "multiple of 8"),  # fmt: skip
        (dict(q=torch.zeros(6, 7, 128, dtype=BF16)), "7 query heads for 2 KV heads"),
        (dict(q=torch.zeros(6, 32, 128, dtype=BF16)), "1 to 8 query heads per KV head"),
        (dict(out=torch.zeros(6, 8, 128)), "out must be"),
        (dict(q=torch.zeros(6, 128, 8, dtype=BF16).transpose(1, 2)), "last dimension"),
        (dict(block_table=torch.zeros(2, 3, dtype=torch.int64)), "block_table must be int32"),
        (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), "block_table must be .* 2 rows"),
        (dict(query_start_loc=torch.tensor([0, 6], dtype=torch.int32)), "query_start_loc"),
        (dict(seq_lens=torch.tensor([[2, 4]], dtype=torch.int32)), "seq_lens must be"),
        ({}, "Hopper"),  # everything right, but on CPU
    ],
)
def test_inputs_outside_the_class_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        check_prefill_inputs(**_inputs(**change))


_FEATURES = {"window": "sliding_window", "alibi": "alibi", "sinks": "sinks", "softcap": "softcap"}


def _problem(d):
    """The kernel problem the plan (or TRITON_ATTN) builds for a layer with these tensors."""
    q, kc, vc = d["q"], d["key_cache"], d["value_cache"]
    return tensor_problem(q, kc, num_heads=q.shape[1], num_kv_heads=kc.shape[2], head_size=kc.shape[3],
                          head_size_v=vc.shape[3], features=frozenset(f for k, f in _FEATURES.items() if k in d))


@pytest.mark.parametrize(
    "change",
    [
        dict(window=8), dict(alibi=torch.zeros(8)), dict(sinks=torch.zeros(8)), dict(softcap=30.0),
        dict(q=torch.zeros(6, 8, 64, dtype=BF16), key_cache=torch.zeros(4, 16, 2, 64, dtype=BF16),
             value_cache=torch.zeros(4, 16, 2, 64, dtype=BF16)),
        dict(q=torch.zeros(6, 8, 128)), dict(key_cache=_CACHE_64),
        dict(key_cache=torch.zeros(4, 12, 2, 128, dtype=BF16),
             value_cache=torch.zeros(4, 12, 2, 128, dtype=BF16)),
        dict(q=torch.zeros(6, 32, 128, dtype=BF16)),
    ],
)  # fmt: skip
def test_kernel_table_class_agrees_with_the_checks(change):
    """The kernel table's ``takes`` for ``attention.prefill/gluon`` (what the plan asks) refuses
    what ``check_prefill_inputs`` refuses, and takes what it accepts short of the device."""
    variant = get_variant("attention.prefill", "gluon")
    d = _inputs(**change)
    features = {k: d[k] for k in _FEATURES if k in d}
    with pytest.raises(ValueError):
        check_prefill_inputs(**{k: v for k, v in d.items() if k not in features}, **features)
    assert variant.takes(_problem(d))
    ok = _inputs()
    assert variant.takes(_problem(ok)) == []
    # on CPU the pick passes the Gluon kernel over: it runs on Hopper only
    assert any("runs on cuda" in r for r in reasons(variant, _problem(ok)))


def test_entry_point_checks_before_launching():
    d = _inputs()
    d.pop("out")
    with pytest.raises(ValueError, match="Hopper"):
        prefill_attention_gluon(**d, out=torch.zeros(6, 8, 128, dtype=BF16), max_seq_len=4)


@pytest.mark.parametrize("config", [(96, 3, True), (128, 1, True), (128, 4, True)])
def test_configs_outside_the_kernel_are_refused(config):
    with pytest.raises(ValueError):
        PrefillConfig(*config)


# Every variant at pages 16 and 64, GQA 32/8, recorded on CPU tensors through the launcher the
# entry point calls after its checks.
_LAUNCHES = r"""
try:
    import attnserve.ops.attention.prefill_gluon as ga
except ImportError as exc:
    print(exc); sys.exit(77)

record(ga, "_prefill_kernel")
q = torch.zeros(300, 32, 128, dtype=torch.bfloat16)
table = torch.zeros(3, 40, dtype=torch.int32)
qsl = torch.zeros(4, dtype=torch.int32)
lens = torch.zeros(3, dtype=torch.int32)
for name, config in ga.CONFIGS.items():
    for page in (16, 64):
        cache = torch.zeros(40, page, 8, 128, dtype=torch.bfloat16)
        ga.launch_prefill(q, cache, cache, torch.zeros_like(q), table, qsl, lens, 0.088, config)
"""


def test_every_variant_compiles_for_sm90_without_spills():
    infos = compile_for_sm90(_LAUNCHES, ptxas=True)
    cases = [(c, page) for c in CONFIGS.values() for page in (16, 64)]
    assert len(infos) == len(cases), infos
    for info, (config, page) in zip(infos, cases):
        assert info["spill"] == 0, (config, page, info)
        assert info["shared"] <= 227 * 1024, info  # Q 32 KB + stages of K and V: 224 KB
        assert info["regs"] <= 168, info  # 12 warps at launch (the loader's padded to 4)
        # the consumers' registers raised to 240 (the loader's dropped to 24); split: warp group
        # 0 holds 256 before the partitions start, the idle workers 120
        assert info["setmaxnreg"] == ([24, 120, 240, 256] if config.split else [24, 240]), info
        assert info["wgmma"] == sorted({
            f"wgmma.mma_async.sync.aligned.m64n{config.block_n}k16.f32.bf16.bf16",  # S
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",  # P V, each half of O
        }), info  # fmt: skip
        assert info["wgmma_a_regs"], info  # P V takes P from registers
        # per consumer partition: the first tile's scores, the loop's (with overlap: the scores
        # alone, then P V), the last P V
        waits = [0, 0, 0, 2] if config.overlap else [0, 0, 0]
        assert info["wgmma_waits"] == sorted(waits * (2 if config.split else 1)), info
        assert info["tma_loads"] == 4 * config.block_n // math.gcd(page, config.block_n), info


def _nan_batch(q_lens, seq_lens, page, heads=32, kv_heads=8, dtype=BF16, seed=0):
    """q and NaN-filled caches with each request's K/V in shuffled blocks (never block 0)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    shape = (sum(pages) + 1, page, kv_heads, 128)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    free = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    for i, (n, p) in enumerate(zip(seq_lens, pages)):
        table[i, :p] = torch.tensor(free[:p], dtype=torch.int32)
        free = free[p:]
        pos = torch.arange(n)
        slots = table[i].long()[pos // page] * page + pos % page
        kv = torch.randn(2, n, kv_heads, 128, generator=gen)
        write_kv(k_cache, v_cache, kv[0], kv[1], slots, 1.0, 1.0)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, 128, generator=gen).to(dtype)
    return dict(q=q, key_cache=k_cache, value_cache=v_cache, block_table=table,
                query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32))  # fmt: skip


_HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon kernel runs on Hopper GPUs only",
)


def _check_on_hopper(b: dict, config: PrefillConfig, max_query_len: int) -> None:
    """The kernel on batch ``b`` (CPU tensors) against the twin; rows past the batch untouched."""
    ref = paged_attention(**b, scale=SCALE)
    dev = {k: v.cuda() for k, v in b.items()}
    pad, shape = 7, b["q"].shape  # rows past the batch's tokens must stay untouched
    dev["q"] = torch.cat([dev["q"], dev["q"].new_zeros(pad, *shape[1:])])
    out = torch.full((shape[0] + pad, *shape[1:]), 3.0, dtype=b["q"].dtype, device="cuda")
    prefill_attention_gluon(**dev, out=out, scale=SCALE, max_query_len=max_query_len,
                            max_seq_len=int(b["seq_lens"].max()), config=config)  # fmt: skip
    out = out.cpu().float()
    assert (out[-pad:] == 3.0).all(), "a row past the batch's tokens was written"
    got = out[:-pad]
    assert not got.isnan().any(), "a stale slot or a row past a sequence reached the output"
    err = (got - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 2e-2, err


@_HOPPER
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([17], [17]), ([1000], [1000]), ([5, 300, 2049], [105, 300, 6145]), ([0, 3, 1], [9, 40, 7])],
)
def test_matches_twin_on_hopper(name, page, q_lens, seq_lens):
    b = _nan_batch(q_lens, seq_lens, page)
    _check_on_hopper(b, CONFIGS[name], max(max(q_lens), 2))


@_HOPPER
@pytest.mark.parametrize("name", ["n128_s3_overlap", "n128_s3_split"])
@pytest.mark.parametrize("heads,kv_heads,dtype", [(8, 8, torch.float16), (24, 8, BF16), (64, 8, BF16)])
def test_head_groups_and_fp16_on_hopper(name, heads, kv_heads, dtype):
    b = _nan_batch([5, 300, 2049], [105, 300, 6145], 16, heads, kv_heads, dtype)
    _check_on_hopper(b, CONFIGS[name], 2049)
