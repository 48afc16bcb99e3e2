"""Fused Triton RMSNorm (+ residual), RoPE and act-and-mul against their PyTorch twins, on CPU.

Runs through Triton's interpreter (``TRITON_INTERPRET=1``) in fp32 and fp16, on odd sizes
(D = 96, 130; T = 1, 7). Tolerances: RoPE is bit-exact in both dtypes (same roundings, FMA
contraction off); RMSNorm is bit-exact where the sum of squares is exact in any order, else
within 4 fp32 ulps (the reduction order differs) and 1 ulp of fp16; act-and-mul within 4 fp32
ulps plus the cancellation in gelu's tails, 3 ulps of fp16 (exp/erf differ in fp32, and the
activation is rounded to the dtype before the product). One bf16 case per kernel checks the
up-cast and the store, within 1-3 bf16 ulps: the interpreter truncates fp32 -> bf16 instead of
rounding to nearest. Also the dispatch of ``layers/fused.py``: CPU tensors run the twin unless
the kernel is forced, and the layers (RMSNorm, RotaryEmbedding, gated) route through it.

Not covered here: GPU numerics and speed.
"""

from __future__ import annotations

# triton decides at import whether its own helpers (tl.sum, ...) are interpreted
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.arch import RopeConfig  # noqa: E402
from attnserve.layers import fused  # noqa: E402
from attnserve.layers.activation import gated, get_act_fn  # noqa: E402
from attnserve.layers.norm import RMSNorm  # noqa: E402
from attnserve.layers.rotary import RotaryEmbedding  # noqa: E402
from attnserve.ops.dense import fused_triton as triton_fused  # noqa: E402

DTYPES = [torch.float32, torch.float16]
_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, slack=0.0) -> None:
    """Elementwise |got - want| <= ulps * ulp(want) + slack, ulp in want's dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    _, exp = torch.frexp(w)
    ulp = torch.pow(2.0, (exp - 1 - _MANTISSA[want.dtype]).double())
    ulp = ulp.clamp(min=torch.finfo(want.dtype).smallest_normal * 2.0 ** -_MANTISSA[want.dtype])
    err = ((g - w).abs() - slack).clamp(min=0) / ulp
    assert err.max().item() <= ulps, f"max error {err.max().item():.1f} ulps > {ulps}"


# --- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 130])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm(dtype, dim, tokens, with_residual, zero_centered):
    g = gen(dim + tokens)
    x = (torch.randn(tokens, dim, generator=g) * 3).to(dtype)
    w = (torch.randn(dim, generator=g) * 0.5 + (0.0 if zero_centered else 1.0)).to(dtype)
    res = torch.randn(tokens, dim, generator=g).to(dtype) if with_residual else None
    x0 = x.clone()
    got = triton_fused.rms_norm(x, w, 1e-6, res, zero_centered)
    want = fused.rms_norm_ref(x, w, 1e-6, res, zero_centered)
    if with_residual:
        assert torch.equal(got[1], want[1])  # r = x + residual: one rounding in both
        got, want = got[0], want[0]
    assert_ulps(got, want, 4 if dtype == torch.float32 else 1)
    assert torch.equal(x, x0)  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_bit_exact_when_the_sum_is(dtype, zero_centered):
    """Inputs on a quarter grid make every sum of squares exact in any order: then all the
    arithmetic after the reduction (rsqrt, the cast before the weight, the weight) must match
    the twin bit for bit."""
    g = gen(12)
    x = (torch.randint(-12, 13, (7, 130), generator=g) / 4).to(dtype)
    res = (torch.randint(-12, 13, (7, 130), generator=g) / 4).to(dtype)
    w = (torch.randn(130, generator=g) * 0.5 + 1).to(dtype)
    out, r = triton_fused.rms_norm(x, w, 1e-6, res, zero_centered)
    want, want_r = fused.rms_norm_ref(x, w, 1e-6, res, zero_centered)
    assert torch.equal(r, want_r) and torch.equal(out, want)


def test_rms_norm_strided_heads_and_promotion():
    """A [T, H, D] q view of a fused QKV row (qk-norm), fp32 weight on fp16 input."""
    g = gen(1)
    qkv = torch.randn(5, 3 * 4 * 96, generator=g).to(torch.float16)
    q = qkv[:, : 4 * 96].view(5, 4, 96)  # [T, H, D], row stride 3 * 4 * 96
    w = torch.randn(96, generator=g)
    got = triton_fused.rms_norm(q, w, 1e-5)
    want = fused.rms_norm_ref(q, w, 1e-5)
    assert got.dtype == want.dtype == torch.float32  # weight * h.to(fp16) promotes
    assert_ulps(got, want, 4)


def test_rms_norm_bf16():
    g = gen(2)
    x = torch.randn(7, 130, generator=g).to(torch.bfloat16)
    res = torch.randn(7, 130, generator=g).to(torch.bfloat16)
    w = torch.randn(130, generator=g).to(torch.bfloat16)
    out, r = triton_fused.rms_norm(x, w, 1e-6, res)
    want, want_r = fused.rms_norm_ref(x, w, 1e-6, res)
    assert_ulps(r, want_r, 1)
    assert_ulps(out, want, 3)  # truncated twice (the cast before the weight, the product)


# --- RoPE ------------------------------------------------------------------------------------


def qk_views(tokens, hq, hk, head, dtype, seed):
    """q [T, Hq, D] and k [T, Hk, D] as strided views of one fused QKV tensor."""
    qkv = torch.randn(tokens, (hq + 2 * hk) * head, generator=gen(seed)).to(dtype)
    q = qkv[:, : hq * head].view(tokens, hq, head)
    k = qkv[:, hq * head : (hq + hk) * head].view(tokens, hk, head)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head,rotary_dim", [(96, 96), (96, 32), (130, 64)])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary(dtype, head, rotary_dim, tokens, interleaved):
    rope = RotaryEmbedding(RopeConfig(rotary_dim, theta=1e4, interleaved=interleaved), head)
    positions = torch.randint(0, 300, (tokens,), generator=gen(tokens))
    q, k = qk_views(tokens, 4, 2, head, dtype, seed=head + rotary_dim)
    q0, k0 = q.clone(), k.clone()
    table = rope._table("short", 300, "cpu")
    q_got, k_got = triton_fused.rotary(q, k, table, positions, rotary_dim, interleaved)
    q_want, k_want = fused.rotary_ref(q, k, table, positions, rotary_dim, interleaved)
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want)
    with fused.override_impl("torch"):  # and RotaryEmbedding.forward's PyTorch path
        q_layer, k_layer = rope(positions, q, k)
    assert torch.equal(q_got, q_layer) and torch.equal(k_got, k_layer)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place


@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
def test_rotary_scaled_layer(rope_type):
    """Scaled static types (attention factor in the table) through the layer, int32 positions."""
    extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if rope_type == "llama3" else {}
    cfg = RopeConfig(
        64, theta=5e5, rope_type=rope_type, factor=8.0, original_max_position_embeddings=128,
        **extra,
    )  # fmt: skip
    rope = RotaryEmbedding(cfg, 64)
    positions = torch.randint(0, 1000, (7,), generator=gen(3), dtype=torch.int32)
    q, k = qk_views(7, 2, 1, 64, torch.float32, seed=4)
    with fused.override_impl("triton"):
        q_got, k_got = rope(positions, q, k)
    with fused.override_impl("torch"):
        q_want, k_want = rope(positions, q, k)
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want)


def test_rotary_bf16():
    rope = RotaryEmbedding(RopeConfig(64), 96)
    positions = torch.randint(0, 300, (7,), generator=gen(5))
    q, k = qk_views(7, 4, 2, 96, torch.bfloat16, seed=6)
    table = rope._table("short", 300, "cpu")
    q_got, k_got = triton_fused.rotary(q, k, table, positions, 64, False)
    q_want, k_want = fused.rotary_ref(q, k, table, positions, 64, False)
    # each product is truncated (<= 1 ulp of |x|), then the sum, which may cancel
    assert_ulps(q_got, q_want, 1, slack=2.0**-6 * q.double().abs().max())
    assert_ulps(k_got, k_want, 1, slack=2.0**-6 * k.double().abs().max())


# --- act-and-mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", fused.FUSED_ACTS)
@pytest.mark.parametrize("inter", [96, 130])
@pytest.mark.parametrize("tokens", [1, 7])
def test_act_and_mul(dtype, act, inter, tokens):
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen(inter + tokens)) * 3).to(dtype)
    got = triton_fused.act_and_mul(gate_up, act)
    want = fused.act_and_mul_ref(gate_up, act)
    # gelu's 1 + erf (or tanh) cancels for negative gates: the fp32 math functions may differ
    # there by a few fp32 ulps of the cancelling terms, |gate * up| / 2 in size
    gate, up = gate_up.double().chunk(2, dim=-1)
    slack = 0.0 if act == "silu" else 2.0**-21 * (gate * up).abs()
    # fp16: act(gate) is rounded before the product (as torch does), so 1 ulp there can be
    # 2 ulps of the product, 3 after its own rounding
    assert_ulps(got, want, 4 if dtype == torch.float32 else 3, slack)
    if dtype == torch.float16:  # without the rounding before the product, about 25% differ
        assert (got != want).float().mean().item() < 0.1


def test_act_and_mul_leading_dims_and_bf16():
    gate_up = (torch.randn(2, 3, 2 * 130, generator=gen(7)) * 3).to(torch.bfloat16)
    got = triton_fused.act_and_mul(gate_up, "silu")
    assert got.shape == (2, 3, 130)
    assert_ulps(got, fused.act_and_mul_ref(gate_up, "silu"), 3)  # truncated twice


def test_many_blocks(monkeypatch):
    """Tiny blocks: several programs per row set, head set and row, with partial last blocks."""
    monkeypatch.setattr(triton_fused, "block_elems", lambda: 64)
    g = gen(13)
    x, res, w = torch.randn(7, 20, generator=g), torch.randn(7, 20, generator=g), torch.randn(20)
    out, r = triton_fused.rms_norm(x, w, 1e-6, res)  # 2 rows per program, 4 programs
    want, want_r = fused.rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(r, want_r)
    assert_ulps(out, want, 4)
    q, k = qk_views(3, 8, 6, 40, torch.float32, seed=14)  # 4 heads per block: 2 of q, 2 of k
    table = RotaryEmbedding(RopeConfig(32), 40)._table("short", 64, "cpu")
    positions = torch.randint(0, 64, (3,), generator=g)
    got = triton_fused.rotary(q, k, table, positions, 32, False)
    want = fused.rotary_ref(q, k, table, positions, 32, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    gate_up = torch.randn(3, 2 * 130, generator=g)  # 32 columns per program: 5 programs per row
    assert_ulps(
        triton_fused.act_and_mul(gate_up, "silu"), fused.act_and_mul_ref(gate_up, "silu"), 4
    )


def test_act_names_agree():
    assert triton_fused.FUSED_ACTS == fused.FUSED_ACTS
    with pytest.raises(ValueError):
        triton_fused.act_and_mul(torch.zeros(1, 4), "relu")


# --- dispatch --------------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls into the Triton wrappers, by name."""
    calls = {"rms_norm": 0, "rotary": 0, "act_and_mul": 0}
    for name in calls:
        real = getattr(triton_fused, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_fused, name, spy)
    return calls


def test_cpu_tensors_use_the_twin(kernel_calls):
    """Even with TRITON_INTERPRET=1 set, CPU tensors run the twin unless a test forces it."""
    x = torch.randn(7, 96, generator=gen(8))
    assert not fused.uses_kernel(x)
    norm = RMSNorm(96)
    assert torch.equal(norm(x), fused.rms_norm_ref(x, norm.weight, norm.eps))
    assert torch.equal(gated(torch.cat([x, x], -1), F.silu), F.silu(x) * x)
    q, k = qk_views(7, 2, 1, 96, torch.float32, seed=9)
    RotaryEmbedding(RopeConfig(96), 96)(torch.arange(7), q, k)
    assert kernel_calls == {"rms_norm": 0, "rotary": 0, "act_and_mul": 0}


def test_layers_route_through_kernels(kernel_calls):
    g = gen(10)
    x, res = torch.randn(7, 130, generator=g), torch.randn(7, 130, generator=g)
    norm = RMSNorm(130, eps=1e-5, zero_centered=True)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    q, k = qk_views(7, 4, 2, 96, torch.float32, seed=11)
    positions = torch.randint(0, 50, (7,), generator=g)
    rope = RotaryEmbedding(RopeConfig(32, interleaved=True), 96)
    dynamic = RotaryEmbedding(
        RopeConfig(32, rope_type="dynamic", factor=2.0, max_position_embeddings=16), 96
    )
    runs = {}
    for impl in ("triton", "torch"):
        with fused.override_impl(impl):
            runs[impl] = [
                *norm(x, res), norm(x), *rope(positions, q, k), *dynamic(positions, q, k),
                gated(torch.cat([x, res], -1), get_act_fn("gelu_pytorch_tanh")),
                gated(torch.cat([x, res], -1), get_act_fn("relu")),  # not fused: torch ops
            ]  # fmt: skip
    assert kernel_calls == {"rms_norm": 2, "rotary": 1, "act_and_mul": 1}
    for got, want in zip(runs["triton"], runs["torch"], strict=True):  # values of size ~1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out, r = runs["torch"][:2]
    assert torch.equal(r, x + res) and torch.equal(out, norm(x + res))


def test_override_impl_scope():
    x = torch.zeros(2, 4)
    with fused.override_impl("triton"):
        assert fused.uses_kernel(x)
        with fused.override_impl(None):
            assert not fused.uses_kernel(x)
        assert fused.uses_kernel(x)
    assert not fused.uses_kernel(x)
    with pytest.raises(ValueError), fused.override_impl("cuda"):
        pass


def test_residual_must_match():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError):
        fused.rms_norm_ref(x, torch.ones(4), 1e-6, torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        triton_fused.rms_norm(x, torch.ones(4), 1e-6, torch.zeros(3, 4))
