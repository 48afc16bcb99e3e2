"""Small-M Triton linears (plain, RMSNorm prologue, act-and-mul prologue) against their twins, on CPU.

Runs through Triton's interpreter (``TRITON_INTERPRET=1``) in fp32 and fp16 at M in {1, 3, 16},
K = 96 and N = 80 (neither a multiple of the blocks), with and without bias, in both tile
products (the elementwise multiply and ``tl.dot``). The kernel's prologue computes the twin's
operand (``layers/gemv.py``'s ``*_ref``: ``layers/fused.py``'s twins, then ``F.linear``) with the
same roundings, so y may differ from the twin by one rounding of y plus the fp32 accumulation
order (and, for fp16, a one-ulp operand difference where rsqrt or exp rounds differently):
|got - want| <= ulp(want) + eps * (|a| @ |W|^T). One bf16 case (the interpreter truncates).
Also the dispatch (``layers/gemv.py``: what runs the kernels, what falls back to the modules)
and whole tiny Llama (biases) and Qwen3 (q/k norm) models at decode sizes, kernels forced on
against off, with a stub in place of the attention backend.

Not covered here: GPU numerics and speed (``benchmarks/gpu_gemv.py``).
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

try:
    import triton  # noqa: E402, F401
except ImportError:
    pytest.skip("triton is not installed (pip install attnserve[gpu])", allow_module_level=True)

from attnserve.arch import read_arch  # noqa: E402
from attnserve.layers import gemv  # noqa: E402
from attnserve.layers.activation import get_act_fn  # noqa: E402
from attnserve.layers.fused import act_and_mul_ref, rms_norm_ref  # noqa: E402
from attnserve.layers.norm import LayerNorm, RMSNorm  # noqa: E402
from attnserve.models.llama import LlamaForCausalLM  # noqa: E402
from attnserve.ops.dense import gemv_triton as triton_gemv  # noqa: E402
from attnserve.ops.dense.gemv_triton import GemvConfig  # noqa: E402

DTYPES = [torch.float32, torch.float16]
CONFIGS = [None, GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, dot=True)]  # None: pinned
_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
K, N = 96, 80


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_linear_close(got, want, a, w, operand_ulps=0):
    """|got - want| <= 1 ulp(want) + (2^-23 * 8 + operand_ulps * eps) * (|a| @ |w|^T)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = 2.0 ** -_MANTISSA[want.dtype]
    scale = a.double().abs() @ w.double().abs().T
    _, exp = torch.frexp(want.double())
    ulp = torch.pow(2.0, (exp - 1 - _MANTISSA[want.dtype]).double())
    bound = ulp + (8 * 2.0 ** -23 + operand_ulps * eps) * scale + 1e-30
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"max error {(err / bound).max().item():.2f} x the bound"


def inputs(m, dtype, seed, k=K, bias=True):
    g = gen(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(N, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(dtype, m, bias, config):
    x, w, b = inputs(m, dtype, seed=m)
    x0 = x.clone()
    got = triton_gemv.linear(x, w, b, config=config)
    assert_linear_close(got, F.linear(x, w, b), x, w)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_linear(dtype, m, with_residual, config):
    x, w, b = inputs(m, dtype, seed=10 + m, bias=with_residual)  # bias on half the cases
    g = gen(20 + m)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    res = torch.randn(m, K, generator=g).to(dtype) if with_residual else None
    x0 = x.clone()
    got = triton_gemv.rms_norm_linear(x, nw, 1e-6, w, b, res, config=config)
    want = gemv.norm_linear_ref(x, nw, 1e-6, w, b, res)
    if with_residual:
        assert torch.equal(got[1], want[1])  # s = x + residual, one rounding in both
        got, want = got[0], want[0]
    operand = rms_norm_ref(x if res is None else x + res, nw, 1e-6)
    assert_linear_close(got, want, operand, w, operand_ulps=0 if dtype == torch.float32 else 1)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_and_mul_linear(dtype, m, act, config):
    x, w, b = inputs(m, dtype, seed=30 + m, k=2 * K, bias=act != "gelu")
    w = w[:, :K].contiguous()
    got = triton_gemv.act_and_mul_linear(x, act, w, b, config=config)
    want = gemv.act_linear_ref(x, act, w, b)
    # fp32: exp/erf differ by a few ulps, scaled by |up| (<= 4 ulps of the operand's size)
    assert_linear_close(got, want, act_and_mul_ref(x, act), w, operand_ulps=1 if dtype == torch.float16 else 0)


def test_bf16():
    x, w, b = inputs(3, torch.bfloat16, seed=40)
    nw = torch.rand(K, generator=gen(41)).to(torch.bfloat16) + 0.5
    res = torch.randn(3, K, generator=gen(42)).to(torch.bfloat16)
    got, s = triton_gemv.rms_norm_linear(x, nw, 1e-6, w, b, res)
    want, want_s = gemv.norm_linear_ref(x, nw, 1e-6, w, b, res)
    assert torch.equal(s, want_s) or (s.float() - want_s.float()).abs().max() <= 2**-7 * want_s.float().abs().max()
    # the interpreter truncates each bf16 cast (operand, product, y): a few bf16 ulps
    assert_linear_close(got, want, rms_norm_ref(want_s, nw, 1e-6), w, operand_ulps=4)


def test_checks():
    x, w, _ = inputs(2, torch.float32, seed=50)
    with pytest.raises(ValueError, match="M <= 16"):
        triton_gemv.linear(torch.zeros(17, K), w)
    with pytest.raises(ValueError, match="share one float dtype"):
        triton_gemv.linear(x.half(), w)
    with pytest.raises(ValueError, match="row-major"):
        triton_gemv.linear(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="bias"):
        triton_gemv.linear(x, w, torch.zeros(N + 1))
    with pytest.raises(ValueError, match="norm weight"):
        triton_gemv.rms_norm_linear(x, torch.ones(K + 1), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        triton_gemv.rms_norm_linear(x, torch.ones(K), 1e-6, w, None, torch.zeros(3, K))
    with pytest.raises(ValueError, match="unsupported fused activation"):
        triton_gemv.act_and_mul_linear(torch.zeros(2, 2 * K), "relu", w)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=24, block_k=64)
    with pytest.raises(ValueError, match=">= 16"):
        GemvConfig(block_n=8, block_k=64, dot=True)
    assert triton_gemv.linear(torch.zeros(0, K), w).shape == (0, N)


# --- dispatch (layers/gemv.py) -------------------------------------------------------------------


class _RowParallelLike(nn.Module):
    """A linear whose forward is not ``nn.Linear.forward`` (as tensor parallelism's row shard)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 2


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    calls = dict.fromkeys(("linear", "rms_norm_linear", "act_and_mul_linear"), 0)
    for name in calls:
        fn = getattr(triton_gemv, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(triton_gemv, name, wrapped)
    return calls


@torch.no_grad()
def test_dispatch(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    torch.manual_seed(0)
    lin, norm, down = nn.Linear(K, N), RMSNorm(K, 1e-5), nn.Linear(K, N)
    m = gemv.MAX_M  # the most rows that take the kernels
    x, res, gate_up = torch.randn(m, K), torch.randn(m, K), torch.randn(m, 2 * K)
    silu = get_act_fn("silu")

    def run(**kw):
        return [gemv.linear(x, lin, **kw), *gemv.norm_linear(norm, x, res, lin, **kw),
                *gemv.norm_linear(norm, x, None, lin, **kw), gemv.act_linear(gate_up, silu, down, **kw)]

    want = [lin(x), lin(norm(x + res)), x + res, lin(norm(x)), x, down(F.silu(gate_up[:, :K]) * gate_up[:, K:])]
    for got, w in zip(run(), want, strict=True):  # CPU tensors, automatic: the modules, exactly
        assert torch.equal(got, w)
    assert sum(calls.values()) == 0
    with gemv.override_impl("triton"):
        for got, w in zip(run(enabled=False), want, strict=True):  # the override beats the switch
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
        assert calls == {"linear": 1, "rms_norm_linear": 2, "act_and_mul_linear": 1}
        # no kernel: more than MAX_M rows, a forward of its own, a norm or activation without one
        big = torch.randn(gemv.MAX_M + 1, K)
        assert torch.equal(gemv.linear(big, lin), lin(big))
        assert torch.equal(gemv.linear(x, _RowParallelLike(lin)), 2 * lin(x))
        ln = LayerNorm(K)
        assert torch.equal(gemv.norm_linear(ln, x, res, lin)[0], lin(ln(x + res)))
        zc = RMSNorm(K, zero_centered=True)
        assert torch.equal(gemv.norm_linear(zc, x, res, lin)[0], lin(zc(x, res)[0]))
        relu = get_act_fn("relu")
        assert torch.equal(gemv.act_linear(gate_up, relu, down), down(F.relu(gate_up[:, :K]) * gate_up[:, K:]))
        assert calls == {"linear": 1, "rms_norm_linear": 2, "act_and_mul_linear": 1}
    with pytest.raises(ValueError), gemv.override_impl("cuda"):
        pass


def test_the_plans_choice_is_read_at_build():
    """A model built by an engine reads the plan's dense.small_m variant; outside an engine's
    build the kernels run wherever the device allows."""
    from attnserve.attention.kernels import model_kernels

    assert gemv.enabled()
    with model_kernels({"dense.small_m": "torch"}):
        assert not gemv.enabled()
    with model_kernels({"dense.small_m": "triton_gemv"}):
        assert gemv.enabled()
    assert gemv.enabled()


# --- whole models, kernels on against off ---------------------------------------------------------


class _StubAttention(nn.Module):
    """Stands in for the attention backend (no KV cache or forward context): q/k norms, then a
    deterministic per-token mix of q, k and v [T, H * Dv]."""

    def forward(self, q, k, v, positions, rope, qk_norm):
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        t, h, _ = q.shape
        hk = k.shape[1]
        k = k.repeat_interleave(h // hk, dim=1)  # [T, H, D]
        v = v.reshape(t, hk, -1).repeat_interleave(h // hk, dim=1)  # [T, Hkv * Dv] -> [T, H, Dv]
        return (torch.sigmoid((q * k).sum(-1, keepdim=True)) * v).reshape(t, -1)


_TINY = {
    "llama": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
}


@pytest.mark.parametrize("family", sorted(_TINY))
@torch.no_grad()
def test_model_decode_kernels_on_equals_off(family, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setattr(gemv, "MAX_M", triton_gemv.MAX_M)  # the dot path (M > 1) too, off by default
    cfg = {"hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "max_position_embeddings": 256, **_TINY[family]}
    torch.manual_seed(0)
    model = LlamaForCausalLM(read_arch(cfg)).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    for layer in model.layers:
        layer.self_attn.attn = _StubAttention()
    for m in (1, 4):
        ids = torch.randint(0, 128, (m,), generator=gen(m))
        positions = torch.arange(m) + 7
        with gemv.override_impl("torch"):
            want = model(ids, positions)
        with gemv.override_impl("triton"):
            got = model(ids, positions)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # per layer: norm + qkv, o_proj, norm + gate_up, act + down
    assert calls == {"linear": 2 * 2, "rms_norm_linear": 2 * 2 * 2, "act_and_mul_linear": 2 * 2}


@pytest.mark.parametrize("prologue", triton_gemv.PROLOGUES)
def test_rule_of_thumb_configs(prologue, monkeypatch):
    """The GPU configs for untuned shapes: valid, dot only above M == 1, small M == 1 tiles, and
    pinned entries win (``CONFIGS`` is keyed by prologue, M bucket, N, K)."""
    for n, k in [(6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1024, 2048), (80, 96)]:
        for m in (1, 2, 5, 16):
            cfg = triton_gemv._rule_of_thumb(m, n, k, prologue)
            assert cfg.dot == (m > 1)
            assert m > 1 or cfg.block_n * cfg.block_k <= 4096
    pinned = GemvConfig(8, 256)
    monkeypatch.setitem(triton_gemv.CONFIGS, (prologue, 4, 6144, 4096), pinned)
    assert triton_gemv.config_for(3, 6144, 4096, prologue) is triton_gemv._INTERPRET_CONFIG
    monkeypatch.setattr(triton_gemv.env, "triton_interpret", lambda: False)  # the GPU's table
    assert triton_gemv.config_for(3, 6144, 4096, prologue) is pinned
    assert triton_gemv.config_for(5, 6144, 4096, prologue) != pinned  # M bucket 8
