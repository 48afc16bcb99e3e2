"""The per-head q/k RMSNorm fused into the RoPE + KV-cache write (``rope_write_kv_cache`` with
``qk_norm``), on CPU through Triton's interpreter.

The twin is the unfused path: ``layers.fused.rms_norm_ref`` on q and k, then ``rotary_ref``, then
``attention.reference.write_kv``. On a quarter grid every sum of squares is exact in any order,
so the fused kernel must give the twin's bits (fp32, fp16). On random inputs the sum of squares
is reduced in another order than torch's, so the twin is matched to a tolerance (a 1-ulp
difference in 1/rms can flip one rounding of the normalised value, which the rotation carries),
and the unfused Triton path (``rms_norm`` then ``rotary`` then ``write_kv_cache``), which sums
the same padded tile as the fused kernel, to the bit. Then the layer's routing and an engine (a
tiny Qwen3) whose tokens do not change with the fusion.
"""

from __future__ import annotations

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.arch import LayerKind, LayerSpec, RopeConfig  # noqa: E402
from attnserve.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from attnserve.attention.reference import write_kv  # noqa: E402
from attnserve.core.forward_context import ForwardContext, forward_context  # noqa: E402
from attnserve.layers.attention import Attention  # noqa: E402
from attnserve.layers.fused import rms_norm_ref, rotary_ref  # noqa: E402
from attnserve.layers.norm import RMSNorm  # noqa: E402
from attnserve.layers.rotary import RotaryEmbedding  # noqa: E402
from attnserve.ops.attention.kv_write_triton import rope_write_kv_cache, write_kv_cache  # noqa: E402
from attnserve.ops.dense.fused_triton import rms_norm, rotary  # noqa: E402
from tests.kernels.test_rope_kv_write import (  # noqa: E402
    caches,
    engine_outputs_fused_and_unfused,
    qkv_views,
    same_bits,
)

EPS = 1e-6
CASES = [(64, 64, 64, False), (64, 64, 64, True), (80, 48, 32, False), (96, 96, 48, True)]
CASE_IDS = ["neox", "gptj", "partial-neox-dv48", "partial-gptj"]


def setup(head, head_v, rotary_dim, interleaved, dtype, seed, grid):
    num_heads, num_kv, tokens, page, num_blocks = 6, 2, 9, 16, 5
    q, k, v = qkv_views(tokens, num_heads, num_kv, head, head_v, dtype, seed)
    if grid:  # quarter grid: every sum of squares is exact, in any order
        for x in (q, k):
            x.copy_((x.float() * 4).round().clamp(-12, 12) / 4)
    gen = torch.Generator().manual_seed(seed + 1)
    q_w, k_w = ((torch.randn(head, generator=gen) * 0.5 + 1).to(dtype) for _ in range(2))
    table = RotaryEmbedding(RopeConfig(rotary_dim, theta=1e4, interleaved=interleaved), head)._table("short", 300, "cpu")
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
    slots[torch.tensor([0, 4])] = -1  # tokens without a cache entry: q still rotates
    kv = caches(num_blocks, page, num_kv, head, head_v, dtype, seed=3)
    return q, k, v, (q_w, k_w, EPS, 2 * EPS), table, positions, slots, kv


def twin(q, k, v, norm, table, positions, slots, kv, rotary_dim, interleaved):
    """The PyTorch path: RMSNorm module arithmetic, then the unfused rotation, then the write."""
    q_w, k_w, q_eps, k_eps = norm
    q_rot, k_rot = rotary_ref(rms_norm_ref(q, q_w, q_eps), rms_norm_ref(k, k_w, k_eps), table, positions,
                              rotary_dim, interleaved)
    write_kv(*kv, k_rot, v, slots)
    return q_rot


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head,head_v,rotary_dim,interleaved", CASES, ids=CASE_IDS)
def test_matches_twin_bit_exact_when_the_sum_is(dtype, head, head_v, rotary_dim, interleaved):
    q, k, v, norm, table, positions, slots, got = setup(head, head_v, rotary_dim, interleaved, dtype,
                                                        seed=head + rotary_dim, grid=True)
    q0, k0 = q.clone(), k.clone()
    want = [c.clone() for c in got]
    q_want = twin(q, k, v, norm, table, positions, slots, want, rotary_dim, interleaved)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, rotary_dim, interleaved, qk_norm=norm)
    assert same_bits(q_got, q_want)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs unchanged
    plain = rope_write_kv_cache(q, k, v, *[c.clone() for c in got], slots, table, positions, rotary_dim,
                                interleaved)
    assert not torch.equal(plain, q_got)  # guard: the norm did something


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head,head_v,rotary_dim,interleaved", [CASES[0], CASES[3]], ids=["neox", "partial-gptj"])
def test_random_inputs(dtype, head, head_v, rotary_dim, interleaved):
    """Random values: the unfused Triton path's bits, the twin's values to a tolerance."""
    q, k, v, norm, table, positions, slots, got = setup(head, head_v, rotary_dim, interleaved, dtype,
                                                        seed=7, grid=False)
    unfused = [c.clone() for c in got]
    ref = [c.clone() for c in got]
    q_n, k_n = rms_norm(q, norm[0], norm[2]), rms_norm(k, norm[1], norm[3])
    q_unf, k_rot = rotary(q_n, k_n, table, positions, rotary_dim, interleaved)
    write_kv_cache(k_rot, v, *unfused, slots)
    q_ref = twin(q, k, v, norm, table, positions, slots, ref, rotary_dim, interleaved)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, rotary_dim, interleaved, qk_norm=norm)
    assert same_bits(q_got, q_unf)
    assert same_bits(got[0], unfused[0]) and same_bits(got[1], unfused[1])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=2e-3)
    torch.testing.assert_close(q_got, q_ref, **tol)
    torch.testing.assert_close(got[0], ref[0], **tol)


def test_fp8_cache_and_checks():
    """An fp8 cache with scales equals the unfused Triton path; bad norm weights are named."""
    head, tokens = 64, 7
    q, k, v = qkv_views(tokens, 4, 2, head, head, torch.float16, seed=5)
    table = RotaryEmbedding(RopeConfig(head, theta=1e4), head)._table("short", 64, "cpu")
    positions = torch.arange(40, 40 + tokens, dtype=torch.int32)
    slots = torch.tensor([3, 17, -1, 40, 41, 63, 8], dtype=torch.int32)
    gen = torch.Generator().manual_seed(6)
    q_w, k_w = ((torch.randn(head, generator=gen) * 0.5 + 1).half() for _ in range(2))
    got = caches(4, 16, 2, head, head, torch.float8_e4m3fn, seed=6)
    want = [c.clone() for c in got]
    q_want, k_rot = rotary(rms_norm(q, q_w, EPS), rms_norm(k, k_w, EPS), table, positions, head, False)
    write_kv_cache(k_rot, v, *want, slots, 0.5, 2.0)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, head, False, 0.5, 2.0,
                                qk_norm=(q_w, k_w, EPS, EPS))
    assert same_bits(q_got, q_want)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    with pytest.raises(ValueError, match="the k weight"):
        rope_write_kv_cache(q, k, v, *got, slots, table, positions, head, False, qk_norm=(q_w, k_w.float(), EPS, EPS))
    with pytest.raises(ValueError, match="the q weight"):
        rope_write_kv_cache(q, k, v, *got, slots, table, positions, head, False, qk_norm=(q_w[:32], k_w, EPS, EPS))


def handed_to_fusing_backend(qk_norm: tuple[RMSNorm, RMSNorm], dtype: torch.dtype):
    """(q, k, the q and k the backend is handed, the RopeTable's qk_norm) when an ``Attention``
    layer runs with ``qk_norm`` over a backend that fuses RoPE into its cache write."""
    handed = {}

    def forward_rope(layer, q, k, v, kv_cache, meta, table):
        handed.update(q=q, k=k, qk_norm=table.qk_norm)
        return torch.zeros(q.shape[0], layer.num_heads, layer.head_size_v, dtype=q.dtype)

    layer = Attention(LayerSpec(0, LayerKind.FULL, num_heads=4, num_kv_heads=2, head_size=16, head_size_v=16,
                                scale=0.25))
    layer.backend, layer.group_id = SimpleNamespace(fuses_rope=True, forward_rope=forward_rope), 0
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    rope = RotaryEmbedding(RopeConfig(16, theta=1e4), 16)
    with torch.no_grad(), forward_context(ForwardContext(None, [None])):
        layer(q, k, v, positions=torch.arange(3), rope=rope, qk_norm=qk_norm)
    return q, k, handed["q"], handed["k"], handed["qk_norm"]


def test_only_plain_norms_in_the_dtype_fuse():
    """The layer leaves plain RMSNorms in q's dtype to the fused kernel (q and k go unnormalised,
    the weights in the table); any other norm it applies itself and the table carries none."""
    plain = (RMSNorm(16, 1e-6), RMSNorm(16, 1e-5))
    with torch.no_grad():
        for n in plain:
            n.weight.uniform_(0.5, 1.5)
    q, k, got_q, got_k, fused = handed_to_fusing_backend(plain, torch.float32)
    assert fused is not None and fused[0] is plain[0].weight and fused[1] is plain[1].weight
    assert fused[2:] == (1e-6, 1e-5)
    assert torch.equal(got_q, q) and torch.equal(got_k, k)
    gemma = RMSNorm(16, zero_centered=True)  # stores w - 1: either such norm keeps both unfused
    # fp32 weights on fp16 q: the norm's output promotes, the fused kernel's would not
    for norms, dtype in (((gemma, plain[1]), torch.float32), ((plain[0], gemma), torch.float32),
                         (plain, torch.float16)):
        q, k, got_q, got_k, fused = handed_to_fusing_backend(norms, dtype)
        assert fused is None
        with torch.no_grad():
            assert torch.equal(got_q, norms[0](q)) and torch.equal(got_k, norms[1](k))


def test_engine_qwen3_tokens_unchanged_with_fused_qk_norm(tmp_path, monkeypatch):
    """A tiny Qwen3 (q/k norms with non-trivial weights) on TRITON_ATTN (interpreter) gives the
    same tokens and logprobs with the norms and RoPE fused into the cache write as unfused."""
    from tests.models.parity import build_hf_model

    model = build_hf_model("qwen3", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=64), tmp_path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:  # HF initialises them to ones
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    model.save_pretrained(tmp_path)
    engine_outputs_fused_and_unfused(monkeypatch, tmp_path, lambda rope: rope.qk_norm is not None)


_LAUNCHES = r"""
from attnserve.ops.attention import kv_write_triton as W

record(W, "_rope_write_kv_kernel")

def launch(dtype, cache_dtype, rotary_dim, interleaved, num_tokens):
    # Qwen3-0.6B's shapes: 16 query heads, 8 KV heads of 128
    q = torch.zeros(num_tokens, 32, 128, dtype=dtype)
    cache = torch.zeros(9, 16, 8, 128, dtype=cache_dtype)
    w = torch.ones(128, dtype=dtype)
    W.rope_write_kv_cache(q[:, :16], q[:, 16:24], q[:, 24:], cache, cache.clone(),
                          torch.zeros(num_tokens, dtype=torch.int64), torch.zeros(64, rotary_dim),
                          torch.zeros(num_tokens, dtype=torch.int64), rotary_dim, interleaved,
                          qk_norm=(w, w, 1e-6, 1e-6))

launch(torch.bfloat16, torch.bfloat16, 128, False, 1)
launch(torch.bfloat16, torch.float8_e4m3fn, 64, True, 256)
"""


def test_kernel_compiles_for_sm90():
    from tests.kernels.sm90 import compile_for_sm90

    assert len(compile_for_sm90(_LAUNCHES)) == 2


def test_backend_forward_rope_with_norm_layer_namespace():
    """``forward_rope`` hands the table's norms to the kernel (a layer namespace, no model)."""
    from attnserve.attention.backend import RopeTable
    from tests.kernels.test_torch_sdpa import BLOCK, make_batch

    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv, head = 4, 2, 16
    common, kc, vc = make_batch([1, 1, 5, 3], [9, 2, 6, 0], num_kv, head, gen)
    layer = SimpleNamespace(scale=head ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None,
                            k_scale=1.0, v_scale=1.0)
    t = common.num_tokens
    q, k, v = (torch.randn(t, h, head, generator=gen) * 3 for h in (num_heads, num_kv, num_kv))
    norm = ((torch.rand(head, generator=gen) + 0.5), (torch.rand(head, generator=gen) + 0.5), EPS, EPS)
    table = RotaryEmbedding(RopeConfig(8, theta=1e4), head)._table("short", 64, "cpu")
    backend = TritonAttentionBackend(BLOCK)
    meta = backend.build_metadata(common, 0)
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot, k_rot = rotary_ref(rms_norm(q, norm[0], EPS), rms_norm(k, norm[1], EPS), table, common.positions, 8, False)
    want = backend.forward(layer, q_rot, k_rot, v, (kc, vc), meta)
    got = backend.forward_rope(layer, q, k, v, (kc2, vc2), meta,
                               RopeTable(table, common.positions, 8, False, qk_norm=norm))
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
