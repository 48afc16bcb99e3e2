"""The prefill forms of the Mamba-1 scan, lightning attention and the short causal conv, in Triton.

Each kernel reads the sequences' bounds from ``query_start_loc`` on the device (no host sync, no
padding to the longest sequence), starts from each sequence's state row (zeros where
``has_initial_state`` is False) and writes the final state back in place.

Mamba-1 (``fused_selective_scan_prefill``): one program per (sequence, tile of ``block_d``
channels) keeps ``h`` [block_d, N] in float32 registers and walks the sequence token by token::

    h <- exp(dt A) h + (dt x) B;  y = C . h + D x;  y <- y * SiLU(z)

Why sequential: ``A`` is per (channel, state), so a chunk's intra-chunk term is no matrix product
(Mamba-2's scalar decay makes it one), and a scan across the tokens of a chunk costs a shuffle
round per level for each of the N states, several times the loop's work. The loop does the least
work: one exp and four FMAs per state element and token, the exps (16 per clock per SM) being
the floor, above memory traffic at N = 16. A thread owns a channel's whole state row (one warp
per 32 channels), so ``C . h`` needs no shuffle; h depends on the previous token through one FMA
only, so the next token's loads are issued a step ahead and the loop is unrolled. H200, Jamba
(8192 x 16, bf16): 64 x 1024 tokens in 5.0 ms, 8 x 4096 in 2.6 ms, 2.4x the exp floor, 250x
the twin. Measured and dropped: Triton's software pipelining of the loads (num_stages: 40%
slower), prefetching two tokens ahead (4% faster at most), B and C in float32. One long sequence
gives too few programs (256 for 8192 channels): then each sequence is cut into ``pieces``, run
from zeros to each piece's end state (and its dt sum) in a first pass, carried across the pieces
(``h <- exp(A sum(dt)) h + end``), and rerun from each piece's entering state for the outputs:
twice the exps, but 1 x 32768 tokens in 4.4 ms instead of 15.

Lightning (``fused_lightning_prefill``): one program per (sequence, head, tile of ``block_v``
value columns) keeps ``S`` [dk, block_v] in float32 registers and walks blocks of BT tokens, with
``lambda = exp(-s_h)``, t and j positions in the block and n its tokens (n < BT in a last,
partial block: the state decays by ``lambda^n``, as the twin, whose padding does not decay)::

    o = (q lambda^(t+1)) S + [(q k^T) * lambda^(t-j) (j <= t)] v
    S <- lambda^n S + (k lambda^(n-1-j))^T v

The four products run on tensor cores; the float32 factors (S, the decayed q and k, the masked
scores) enter them rounded to bf16 for bf16 inputs (the pinned choice: twice as fast as tf32,
the state within 2e-3 of the twin's relative to its largest value), as tf32 for fp16 and split
in three tf32 parts for float32 (``tf32x3``: float32's accuracy, 12x faster than ``ieee``), a
constexpr. H200, MiniMax (64 heads x 128, bf16): 64 x 1024 tokens in 2.5 ms, 1 x 32768 in
1.4 ms, 25-55x the twin. Cutting one long sequence into pieces (as the scan) was measured and
does not pay here.

Conv (``fused_causal_conv1d_prefill``, ``fused_causal_conv1d_update``): one program per tile of
flat tokens and channels; each token finds its sequence by a binary search of
``query_start_loc`` (its loads of the inputs do not wait for it) and reads its K taps from the
new tokens or, for its sequence's first K-1, from the conv state row. A second launch writes each
row's new state (the last K-1 inputs of [old state | new tokens], so a sequence shorter than K-1
keeps part of its old state): in the first launch other programs may still be reading the old
row. H200, 8192 channels, K 4, bf16: about 1 TB/s, 8-10x the twin.

Arithmetic is float32 whatever the input dtypes (lightning's products as above); states are
stored back in their own dtype, outputs in the dtype of x (Mamba, conv) or v (lightning). A
negative state row is neither read nor written (the sequence starts from zeros; the conv's
decode step skips the sequence and outputs zeros, as the decode kernels do). Two sequences must
not share a state row. The PyTorch twins are ``selective_scan_prefill``,
``lightning_attention_prefill``, ``causal_conv1d_prefill`` and ``causal_conv1d_update``
(``attention/state``). Not here: the decode steps of the scan and of lightning
(``decode_triton.py``), the projections, norms and gates. Configs are pinned for the H200
(no autotune; ``benchmarks/gpu_state_prefill.py`` times them and a few variants); under
``TRITON_INTERPRET=1`` tiles cover whole channel and head dims, since the interpreter pays per
program. The kernels are in ``prefill_kernels_triton.py``; this file holds their launches,
input checks and pinned tiles.
"""

from __future__ import annotations

import torch
import triton

from attnserve import env
from attnserve.ops.state.prefill_kernels_triton import (
    conv_prefill_kernel,
    conv_state_kernel,
    conv_update_kernel,
    lightning_prefill_kernel,
    scan_carry_kernel,
    selective_scan_prefill_kernel,
)

__all__ = [
    "fused_causal_conv1d_prefill",
    "fused_causal_conv1d_update",
    "fused_lightning_prefill",
    "fused_selective_scan_prefill",
]

MAX_D_STATE = 256  # a channel's whole state row lives in registers
MAX_HEAD_K = 256  # the whole key dim of a lightning tile lives in registers
MAX_CONV_WIDTH = 16  # taps of the short conv, unrolled
_SCAN_PROGRAMS = 2048  # the scan's programs below which the sequences are cut (H200: about 15 per SM)
_SCAN_MAX_PIECES = 32


def _pow2(value: int | None, default: int, name: str) -> int:
    if value is None:
        return default
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def _check_varlen(query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  device: torch.device) -> int:
    """The number of sequences B, after checking the three per-sequence tensors agree on it."""
    b = state_indices.shape[0] if state_indices.dim() == 1 else -1
    if b < 0 or query_start_loc.shape != (b + 1,) or has_initial_state.shape != (b,):
        raise ValueError(f"want state_indices [B], query_start_loc [B+1], has_initial_state [B]; got "
                         f"{tuple(state_indices.shape)}, {tuple(query_start_loc.shape)}, "
                         f"{tuple(has_initial_state.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("state_indices", state_indices),
                    ("has_initial_state", has_initial_state)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the tokens on {device}")
    return b


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (rows may be strided, e.g. a chunk of a projection)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_selective_scan_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    ssm_state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = 128,
    block_d: int | None = None,
    unroll: int | None = None,
    pieces: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The Mamba-1 scan over several sequences; ``selective_scan_prefill``'s twin.

    Args:
        x: [T, D] conv output; dt: [T, D] step sizes after softplus; A: [D, N] (negative);
            B, C: [T, N]; D: [D] skip or None; z: [T, D] gate or None (any float dtypes; rows
            may be strided).
        ssm_state: [pool, D, N] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: not read or written) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten in place.
        query_start_loc: [B+1] int32 cumulative token counts, on the tokens' device.
        chunk_size: accepted for the twin's signature; the kernel walks tokens one by one.
        block_d: channels per program (a power of two); unroll: tokens per unrolled loop body;
            pieces: parts each sequence is cut into (1: one launch; more: three, see the module
            docstring); num_warps. None: the pinned choices (pieces > 1 only where the batch
            gives fewer than ``_SCAN_PROGRAMS`` programs).

    Returns:
        [T, D] in the dtype of ``x``.
    """
    t, dim = x.shape
    n = A.shape[-1]
    if dt.shape != x.shape or (z is not None and z.shape != x.shape) or A.shape != (dim, n):
        raise ValueError(f"want x, dt, z [T, D], A [D, N]; got x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"z {None if z is None else tuple(z.shape)}, A {tuple(A.shape)}")
    if B.shape != (t, n) or C.shape != (t, n) or (D is not None and D.shape != (dim,)):
        raise ValueError(f"want B, C [{t}, {n}], D [{dim}]; got B {tuple(B.shape)}, C {tuple(C.shape)}, "
                         f"D {None if D is None else tuple(D.shape)}")
    if ssm_state.dim() != 3 or ssm_state.shape[1:] != (dim, n):
        raise ValueError(f"ssm_state must be [pool, {dim}, {n}], got {tuple(ssm_state.shape)}")
    if n > MAX_D_STATE:
        raise ValueError(f"d_state {n} > {MAX_D_STATE}: the kernel keeps a whole state row in registers")
    b = _check_varlen(query_start_loc, state_indices, has_initial_state, x.device)
    has_d, has_z = D is not None, z is not None
    x, dt, B, C = (_rows(v) for v in (x, dt, B, C))
    z = x if z is None else _rows(z)  # x: a placeholder when HAS_Z is off
    skip = A if D is None else D.contiguous()  # A: a placeholder when HAS_D is off
    out = torch.empty(t, dim, dtype=x.dtype, device=x.device)
    if b == 0 or t == 0:
        return out
    interp = env.triton_interpret()
    whole = triton.next_power_of_2(dim)
    bd = _pow2(block_d, whole if interp else min(32, whole), "block_d")
    bn = triton.next_power_of_2(n)
    unroll = 1 if interp else _pow2(unroll, 4, "unroll")
    grid_d = triton.cdiv(dim, bd)
    if pieces is None:  # cut the sequences when they give too few programs, as one long prompt does
        few = b * grid_d < _SCAN_PROGRAMS
        pieces = min(_SCAN_MAX_PIECES, triton.cdiv(2 * _SCAN_PROGRAMS, b * grid_d), t // (b * 256)) if few else 1
        pieces = max(pieces, 1)
    ws = sums = out  # placeholders when the sequences are not cut
    if pieces > 1:
        ws = torch.empty(b * pieces, dim, bn, dtype=torch.float32, device=x.device)
        sums = torch.empty(b * pieces, dim, dtype=torch.float32, device=x.device)
    warps = num_warps or max(1, bd // 32)  # a thread per channel: its state row needs no shuffles
    # fmt: off
    args = (x, dt, A, B, C, skip, z, ssm_state, query_start_loc, state_indices, has_initial_state, out, ws, sums,
            x.stride(0), dt.stride(0), A.stride(0), A.stride(1), B.stride(0), C.stride(0), z.stride(0),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), dim, n, pieces)
    consts = dict(HAS_D=has_d, HAS_Z=has_z, UNROLL=unroll, INTERPRET=interp, BLOCK_D=bd, BLOCK_N=bn, num_warps=warps)
    if pieces == 1:
        selective_scan_prefill_kernel[(b, grid_d)](*args, MODE=0, **consts)
        return out
    selective_scan_prefill_kernel[(b * pieces, grid_d)](*args, MODE=1, **consts)
    scan_carry_kernel[(b, grid_d)](A, ssm_state, state_indices, has_initial_state, ws, sums, A.stride(0),
                                    A.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), dim,
                                    n, pieces, BLOCK_D=bd, BLOCK_N=bn, num_warps=warps)
    selective_scan_prefill_kernel[(b * pieces, grid_d)](*args, MODE=2, **consts)
    # fmt: on
    return out


def fused_lightning_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay_rates: torch.Tensor,
    state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    block_size: int = 256,
    block_v: int | None = None,
    block_t: int | None = None,
    dot: str | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Lightning attention over several sequences in one launch; ``lightning_attention_prefill``'s
    twin.

    Args:
        q, k: [T, H, dk]; v: [T, H, dv] (any float dtypes, one of them all; tokens may be strided).
        decay_rates: [H] the per-head ``s_h`` (the decay is ``exp(-s_h)``).
        state: [pool, H, dk, dv] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: not read or written) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten in place.
        query_start_loc: [B+1] int32 cumulative token counts, on the tokens' device.
        block_size: the twin's block; here only a bound on the kernel's token block (the block
            does not change the result), which the engine sizes to the longest prefill.
        block_v: value columns per program; block_t: tokens per block (powers of two, >= 16);
            dot: the products' precision: ``"ieee"``, ``"tf32x3"`` (float32 split into three
            tf32 parts: float32's accuracy on tensor cores), ``"tf32"``, or ``"bf16"`` (the
            float32 factors rounded to bf16). None: the pinned choices, tf32x3 for float32
            inputs, bf16 for bf16, tf32 for fp16 (bf16 would drop fp16's mantissa bits).
            num_warps: None: pinned.

    Returns:
        [T, H, dv] in the dtype of ``v``.
    """
    t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (t, h) or decay_rates.shape != (h,):
        raise ValueError(f"want q, k [T, H, dk], v [T, H, dv], decay_rates [H]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, decay_rates {tuple(decay_rates.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if state.dim() != 4 or state.shape[1:] != (h, dk, dv):
        raise ValueError(f"state must be [pool, {h}, {dk}, {dv}], got {tuple(state.shape)}")
    if dk > MAX_HEAD_K:
        raise ValueError(f"head dim {dk} > {MAX_HEAD_K}: the kernel keeps a whole key column in registers")
    if dot not in (None, "ieee", "tf32x3", "tf32", "bf16"):
        raise ValueError(f"dot must be 'ieee', 'tf32x3', 'tf32' or 'bf16', got {dot!r}")
    b = _check_varlen(query_start_loc, state_indices, has_initial_state, q.device)
    q, k, v = (_rows(x) for x in (q, k, v))
    rates = decay_rates.to(q.device, torch.float32).contiguous()
    out = torch.empty(t, h, dv, dtype=v.dtype, device=v.device)
    if b == 0 or t == 0:
        return out
    dot = dot or {torch.float32: "tf32x3", torch.bfloat16: "bf16"}.get(q.dtype, "tf32")
    whole_v = max(16, triton.next_power_of_2(dv))
    if env.triton_interpret():
        tile_v, tile_t, warps = whole_v, 64, 4
    elif dot in ("ieee", "tf32x3"):  # float32 operands, split in three: smaller tiles fit shared memory
        tile_v, tile_t, warps = 64, 32, 4
    else:  # H200, bf16: 128 columns where the heads alone fill the GPU, else 64 (more programs)
        tile_v, tile_t, warps = 128 if dot == "bf16" and b * h >= 2048 else 64, 64, 8
    bv = _pow2(block_v, min(tile_v, whole_v), "block_v")
    bt = _pow2(block_t, min(tile_t, max(16, triton.next_power_of_2(block_size))), "block_t")
    if bt < 16 or bv < 16:
        raise ValueError(f"block_t and block_v must be >= 16 (tl.dot), got {bt}, {bv}")
    # fmt: off
    lightning_prefill_kernel[(b, h, triton.cdiv(dv, bv))](
        q, k, v, rates, state, query_start_loc, state_indices, has_initial_state, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), h, dk, dv,
        PRECISION="tf32" if dot == "bf16" else dot, BF16_DOTS=dot == "bf16", INTERPRET=env.triton_interpret(),
        BLOCK_T=bt, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=bv, num_warps=num_warps or warps)
    # fmt: on
    return out


def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor) -> int:
    """The conv width K, after checking the shapes against x [*, C]."""
    c = x.shape[-1]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != c or (bias is not None and bias.shape != (c,)):
        raise ValueError(f"want x [T, C], weight [C, K], bias [C]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    width = weight.shape[1]
    if not 2 <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"conv width {width} must be in [2, {MAX_CONV_WIDTH}]")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (c, width - 1):
        raise ValueError(f"conv_state must be [pool, {c}, {width - 1}], got {tuple(conv_state.shape)}")
    return width


def fused_causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    silu: bool = False,
    block_t: int | None = None,
    block_c: int | None = None,
) -> torch.Tensor:
    """Depthwise causal conv over several sequences, in two launches; ``causal_conv1d_prefill``'s twin.

    Args:
        x: [T, C] new tokens (rows may be strided); weight: [C, K]; bias: [C] or None.
        conv_state: [pool, C, K-1] in any float dtype and strides; rows ``state_indices`` ([B],
            distinct; negative: not read or written) are read (zeros where
            ``has_initial_state`` [B] is False) and overwritten with the last K-1 inputs.
        query_start_loc: [B+1] int32 cumulative token counts, on the tokens' device.
        silu: apply SiLU to the output.
        block_t, block_c: tokens and channels per program (powers of two); None: pinned.

    Returns:
        [T, C] in the dtype of ``x``.
    """
    width = _check_conv(x, weight, bias, conv_state)
    b = _check_varlen(query_start_loc, state_indices, has_initial_state, x.device)
    t, c = x.shape
    x = _rows(x)
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if b == 0 or t == 0:
        return out
    interp = env.triton_interpret()
    bt = _pow2(block_t, min(64, triton.next_power_of_2(t)) if interp else 32, "block_t")
    bc = _pow2(block_c, triton.next_power_of_2(c) if interp else min(128, triton.next_power_of_2(c)), "block_c")
    # fmt: off
    conv_prefill_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, weight, weight if bias is None else bias, conv_state, query_start_loc, state_indices, has_initial_state,
        out, x.stride(0), weight.stride(0), weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), t, b, max(b - 1, 0).bit_length(), c,
        K=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=bt, BLOCK_C=bc, num_warps=4)
    conv_state_kernel[(b, triton.cdiv(c, bc))](
        x, conv_state, query_start_loc, state_indices, has_initial_state, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), c, K=width, BLOCK_W=triton.next_power_of_2(width - 1),
        BLOCK_C=bc, num_warps=4)
    # fmt: on
    return out


def fused_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    silu: bool = False,
    block_c: int | None = None,
) -> torch.Tensor:
    """One decode token per sequence, in one launch; ``causal_conv1d_update``'s twin.

    Args:
        x: [B, C] one new token per sequence; weight: [C, K]; bias: [C] or None.
        conv_state: [pool, C, K-1], rows ``state_indices`` ([B], distinct; negative: skipped)
            read and shifted in place.
        silu: apply SiLU to the output.
        block_c: channels per program (a power of two); None: pinned.

    Returns:
        [B, C] in the dtype of ``x``; zeros for skipped sequences.
    """
    width = _check_conv(x, weight, bias, conv_state)
    b, c = x.shape
    if state_indices.shape != (b,):
        raise ValueError(f"state_indices must be [{b}], got {tuple(state_indices.shape)}")
    x = _rows(x)
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    whole = triton.next_power_of_2(c)
    bc = _pow2(block_c, whole if env.triton_interpret() else min(256, whole), "block_c")  # H200: 256
    # fmt: off
    conv_update_kernel[(b, triton.cdiv(c, bc))](
        x, weight, weight if bias is None else bias, conv_state, state_indices, out, x.stride(0), weight.stride(0),
        weight.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), c,
        K=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_W=triton.next_power_of_2(width - 1), BLOCK_C=bc,
        num_warps=4)
    # fmt: on
    return out
