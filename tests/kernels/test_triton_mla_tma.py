"""The TMA form of the dense MLA decode kernel (``ops/mla/decode_triton_tma``) against the PyTorch twin
and the pointer kernel, on CPU through Triton's interpreter (which emulates tensor descriptors).

Caches are NaN-filled before the live rows are written: a read of an unused slot, the null
block or the rows past a sequence in its last page shows up as NaN. Lengths sit on and around
tile and page boundaries; splits leave some programs only the partial tile, others none.
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.attention.reference_mla import sparse_mla_attention, write_latent  # noqa: E402
from attnserve.ops.mla.decode_triton import mla_decode  # noqa: E402
from attnserve.ops.mla.decode_triton_tma import mla_decode_tma, tma_fits  # noqa: E402
from attnserve.ops.mla.latent import MLAConfig  # noqa: E402

RANK, ROPE, SCALE = 32, 16, 0.3


def _cache(lens, page, dtype, seed):
    """NaN-filled cache with each request's rows in random blocks (never block 0)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // page) for s in lens) + 1
    num_blocks = len(lens) * max_blocks + 2
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.full((num_blocks, page, RANK + ROPE), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, s in enumerate(lens):
        n = -(-s // page)
        table[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        pos = torch.arange(s)
        slots = table[i].long()[pos // page] * page + pos % page
        write_latent(cache, torch.randn(s, RANK, generator=gen), torch.randn(s, ROPE, generator=gen),
                     slots)  # fmt: skip
    return cache, table


def _positions(lens) -> torch.Tensor:
    width = max(max(lens), 1)
    pos = torch.full((len(lens), width), -1, dtype=torch.int32)
    for i, s in enumerate(lens):
        pos[i, :s] = torch.arange(s, dtype=torch.int32)
    return pos


def _rel(out, ref):
    assert not out.isnan().any(), "NaN: a row past a sequence or an unused slot was read"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize(
    "dtype,page,block_n,heads",
    [(torch.float32, 16, 16, 4), (torch.float16, 32, 16, 20), (torch.float32, 64, 32, 20)],
    ids=["fp32-page16", "fp16-page32-heads20", "fp32-page64-tile32"],
)
def test_tma_decode_matches_twin_and_pointer_kernel(dtype, page, block_n, heads):
    lens = [0, 1, block_n - 1, block_n, block_n + 1, 2 * page + 3, 100]
    cache, table = _cache(lens, page, dtype, seed=1)
    q = torch.randn(len(lens), heads, RANK + ROPE, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert tma_fits(cache, RANK, block_n)
    ref = sparse_mla_attention(q.float(), cache.float(), table, _positions(lens),
                               kv_lora_rank=RANK, scale=SCALE)  # fmt: skip
    pointer = mla_decode(q, cache, table, seq_lens, kv_lora_rank=RANK, scale=SCALE,
                         max_seq_len=100, config=MLAConfig(16, block_n, 4, 1))  # fmt: skip
    for splits in (1, 3, 8):
        cfg = MLAConfig(16, block_n, 4, 1)
        out = torch.full((len(lens), heads, RANK), float("nan"), dtype=dtype)
        mla_decode_tma(q, cache, table, seq_lens, kv_lora_rank=RANK, scale=SCALE, max_seq_len=100,
                   out=out, num_splits=splits, config=cfg)  # fmt: skip
        assert (out[0] == 0).all(), "a request with no keys gives 0"
        tol = 2e-5 if dtype == torch.float32 else 5e-3
        assert _rel(out[1:], ref[1:]) < tol, cfg
        assert _rel(out[1:], pointer[1:]) < tol, cfg


def test_tma_fits_rejects_what_tma_cannot_load():
    cache = torch.zeros(4, 16, RANK + ROPE)
    assert tma_fits(cache, RANK, 16)
    assert not tma_fits(cache, RANK, 32), "a tile larger than the page"
    assert not tma_fits(torch.zeros(4, 16, RANK + 8), RANK, 16), "rope of 8: under 16 columns"
    assert not tma_fits(torch.zeros(4, 16, 48 + ROPE), 48, 16), "half of 24 columns"
    assert not tma_fits(torch.zeros(4, 16, RANK + ROPE, dtype=torch.uint8), RANK, 16)
    assert not tma_fits(torch.zeros(4, 16, 2 * (RANK + ROPE))[..., : RANK + ROPE], RANK, 16)


def test_tma_entry_refuses_a_cache_it_cannot_take():
    """Pages smaller than the key tile: ``mla_decode_tma`` refuses them (the kernel table never
    picks it there: ``mla.absorbed/triton_tma`` takes pages of a multiple of 64)."""
    lens = [5, 40]
    cache, table = _cache(lens, 8, torch.float32, seed=3)
    q = torch.randn(2, 4, RANK + ROPE, generator=torch.Generator().manual_seed(4))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(kv_lora_rank=RANK, scale=SCALE, max_seq_len=40, num_splits=1)
    with pytest.raises(ValueError, match="tma_fits"):
        mla_decode_tma(q, cache, table, seq_lens, config=MLAConfig(16, 16, 4, 1), **kw)
