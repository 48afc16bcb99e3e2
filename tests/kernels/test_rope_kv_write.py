"""RoPE fused with the KV-cache write (``ops/attention/kv_write_triton.rope_write_kv_cache``) against its
twins, on CPU through Triton's interpreter.

The twin is the unfused path: ``layers.fused.rotary_ref`` then ``attention.reference.write_kv``
(fp32, fp16: the same bits in q and in the cache). An fp8 cache is checked against the unfused
Triton path (``rotary`` then ``write_kv_cache``) to the bit instead: the interpreter rounds fp32
to fp8 with its own carry bug (see ``test_triton_attention.test_write_kv``), which both Triton
paths share and torch does not. Then TRITON_ATTN's ``forward_rope`` against ``forward`` after the
rotation, the layer's routing, and an engine whose tokens do not change.
"""

from __future__ import annotations

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.arch import RopeConfig  # noqa: E402
from attnserve.attention.backend import RopeTable  # noqa: E402
from attnserve.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from attnserve.attention.reference import write_kv  # noqa: E402
from attnserve.layers.fused import rotary_ref  # noqa: E402
from attnserve.layers.rotary import RotaryEmbedding  # noqa: E402
from attnserve.ops.attention.kv_write_triton import rope_write_kv_cache, write_kv_cache  # noqa: E402
from attnserve.ops.dense.fused_triton import rotary  # noqa: E402
from tests.kernels.test_torch_sdpa import BLOCK, make_batch  # noqa: E402


def qkv_views(tokens, num_heads, num_kv, head, head_v, dtype, seed):
    """q, k, v as strided views of one fused projection output, as the models hand them over."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + num_kv) * head + num_kv * head_v
    qkv = (torch.randn(tokens, width, generator=gen) * 2).to(dtype)
    q = qkv[:, : num_heads * head].view(tokens, num_heads, head)
    k = qkv[:, num_heads * head : (num_heads + num_kv) * head].view(tokens, num_kv, head)
    v = qkv[:, (num_heads + num_kv) * head :].view(tokens, num_kv, head_v)
    return q, k, v


def caches(num_blocks, page, num_kv, head, head_v, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, page, num_kv, d, generator=gen).to(dtype) for d in (head, head_v)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "head,head_v,rotary_dim,interleaved",
    [(64, 64, 64, False), (64, 64, 64, True), (80, 48, 32, False), (96, 96, 48, True)],
    ids=["neox", "gptj", "partial-neox-dv48", "partial-gptj"],
)
def test_matches_unfused_twin(dtype, head, head_v, rotary_dim, interleaved):
    num_heads, num_kv, tokens, page, num_blocks = 6, 2, 9, 16, 5
    rope = RotaryEmbedding(RopeConfig(rotary_dim, theta=1e4, interleaved=interleaved), head)
    table = rope._table("short", 300, "cpu")
    q, k, v = qkv_views(tokens, num_heads, num_kv, head, head_v, dtype, seed=head + rotary_dim)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(1))
    slots = torch.randperm(num_blocks * page, generator=torch.Generator().manual_seed(2))[:tokens]
    slots[torch.tensor([0, 4])] = -1  # tokens without a cache entry: q still rotates
    got = caches(num_blocks, page, num_kv, head, head_v, dtype, seed=3)
    want = [c.clone() for c in got]
    q_want, k_rot = rotary_ref(q, k, table, positions, rotary_dim, interleaved)
    write_kv(*want, k_rot, v, slots)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, rotary_dim, interleaved)
    assert same_bits(q_got, q_want)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)  # inputs unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_cache_matches_unfused_triton(dtype):
    num_heads, num_kv, head, tokens, page = 4, 2, 64, 7, 16
    rope = RotaryEmbedding(RopeConfig(head, theta=1e4), head)
    table = rope._table("short", 64, "cpu")
    q, k, v = qkv_views(tokens, num_heads, num_kv, head, head, dtype, seed=5)
    positions = torch.arange(40, 40 + tokens, dtype=torch.int32)
    slots = torch.tensor([3, 17, -1, 40, 41, 63, 8], dtype=torch.int32)
    got = caches(4, page, num_kv, head, head, torch.float8_e4m3fn, seed=6)
    want = [c.clone() for c in got]
    q_want, k_rot = rotary(q, k, table, positions, head, False)
    write_kv_cache(k_rot, v, *want, slots, 0.5, 2.0)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, head, False, 0.5, 2.0)
    assert same_bits(q_got, q_want)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    fresh = caches(4, page, num_kv, head, head, torch.float8_e4m3fn, seed=6)
    assert not same_bits(got[0], fresh[0])  # guard: the write happened


def test_fewer_slots_than_rows_and_checks():
    """Rows past the slot mapping (padding) rotate q and write nothing; bad inputs are named."""
    q, k, v = qkv_views(5, 2, 1, 32, 32, torch.float32, seed=7)
    table = RotaryEmbedding(RopeConfig(32, theta=1e4), 32)._table("short", 16, "cpu")
    positions = torch.arange(5)
    got = caches(2, 16, 1, 32, 32, torch.float32, seed=8)
    want = [c.clone() for c in got]
    slots = torch.tensor([5, 6, 7])
    q_want, k_rot = rotary_ref(q, k, table, positions, 32, False)
    write_kv(*want, k_rot[:3], v[:3], slots)
    q_got = rope_write_kv_cache(q, k, v, *got, slots, table, positions, 32, False)
    assert torch.equal(q_got, q_want) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_write_kv_cache(q, k, v, *got, slots, table, positions, 31, False)
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv_cache(q, k, v, *got, slots, table, positions[:4], 32, False)
    with pytest.raises(ValueError, match="do not fit the caches"):
        rope_write_kv_cache(q, k, v[:, :, :16], *got, slots, table, positions, 32, False)


# ----------------------------------------------------------------------------- the backend


def test_backend_forward_rope_equals_rotate_then_forward():
    """TRITON_ATTN's fused entry over a mixed batch equals rotating first, then ``forward``."""
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv, head = 4, 2, 16
    common, kc, vc = make_batch([1, 1, 5, 3], [9, 2, 6, 0], num_kv, head, gen)
    layer = SimpleNamespace(scale=head ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None,
                            k_scale=1.0, v_scale=1.0)
    t = common.num_tokens
    q, k, v = (torch.randn(t, h, head, generator=gen) for h in (num_heads, num_kv, num_kv))
    rope = RotaryEmbedding(RopeConfig(8, theta=1e4, interleaved=True), head)  # partial, GPT-J
    positions = common.positions
    table = rope._table("short", 64, "cpu")
    backend = TritonAttentionBackend(BLOCK)
    assert backend.fuses_rope
    meta = backend.build_metadata(common, 0)
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot, k_rot = rotary_ref(q, k, table, positions, 8, True)
    want = backend.forward(layer, q_rot, k_rot, v, (kc, vc), meta)
    got = backend.forward_rope(layer, q, k, v, (kc2, vc2), meta, RopeTable(table, positions, 8, True))
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_rope_table_only_for_position_only_ropes():
    pos = torch.arange(4)
    static = RotaryEmbedding(RopeConfig(16, theta=1e4, rope_type="linear", factor=2.0), 16)
    table = static.position_table(pos)
    assert table is not None and table.rotary_dim == 16 and table.positions is pos
    assert table.cos_sin_table.shape[0] >= 4 and table.cos_sin_table.dtype == torch.float32
    dynamic = RotaryEmbedding(RopeConfig(16, theta=1e4, rope_type="dynamic", factor=2.0,
                                         max_position_embeddings=64), 16)
    assert dynamic.position_table(pos) is None  # its cos/sin depend on the sequence length


def engine_outputs_fused_and_unfused(monkeypatch, model_dir, ran_fused) -> None:
    """Run the model in ``model_dir`` on TRITON_ATTN (interpreter) with the backend's RoPE fusion
    on, then off: the same tokens, and logprobs within 1e-5; ``ran_fused(rope)`` says whether a
    ``forward_rope`` call took the fused path under test, and such calls happen only when on."""
    from attnserve import LLM, SamplingParams
    from tests.models.parity import make_prompts, run_engine

    prompts = make_prompts([5, 11])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    calls = {"fused": 0}
    fused_entry = TritonAttentionBackend.forward_rope

    def counting(self, layer, q, k, v, kv_cache, meta, rope):
        calls["fused"] += bool(ran_fused(rope))
        return fused_entry(self, layer, q, k, v, kv_cache, meta, rope)

    monkeypatch.setattr(TritonAttentionBackend, "forward_rope", counting)
    outs = {}
    for fuse in (True, False):
        monkeypatch.setattr(TritonAttentionBackend, "fuses_rope", fuse)
        before = calls["fused"]
        llm = LLM(str(model_dir), dtype="float32", block_size=16, attention_backend="TRITON_ATTN",
                  max_num_batched_tokens=8)
        outs[fuse] = run_engine(llm, prompts, params)
        assert (calls["fused"] > before) == fuse
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) + list(zip(a.outputs[0].logprobs,
                                                                                   b.outputs[0].logprobs))
        for ea, eb in pairs:
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-5


def test_engine_tokens_unchanged_with_fused_rope(tmp_path, monkeypatch):
    """A tiny Llama gives the same tokens and logprobs with RoPE fused into the cache write as
    with the unfused path, and the fused entry is the one that ran."""
    from tests.models.parity import build_hf_model

    build_hf_model("llama", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                   tmp_path)
    engine_outputs_fused_and_unfused(monkeypatch, tmp_path, lambda rope: True)


# ----------------------------------------------------------------------------- GPU compile

_LAUNCHES = r"""
from attnserve.ops.attention import kv_write_triton as W

record(W, "_rope_write_kv_kernel")

def launch(dtype, cache_dtype, rotary_dim, interleaved, num_tokens):
    # Llama-3.1-8B's shapes: 32 query heads, 8 KV heads of 128
    q = torch.zeros(num_tokens, 48, 128, dtype=dtype)
    cache = torch.zeros(9, 16, 8, 128, dtype=cache_dtype)
    W.rope_write_kv_cache(q[:, :32], q[:, 32:40], q[:, 40:], cache, cache.clone(),
                          torch.zeros(num_tokens, dtype=torch.int64), torch.zeros(64, rotary_dim),
                          torch.zeros(num_tokens, dtype=torch.int64), rotary_dim, interleaved)

launch(torch.bfloat16, torch.bfloat16, 128, False, 1)
launch(torch.bfloat16, torch.float8_e4m3fn, 64, True, 64)
launch(torch.float16, torch.float16, 32, False, 8)
"""


def test_kernel_compiles_for_sm90():
    from tests.kernels.sm90 import compile_for_sm90

    assert len(compile_for_sm90(_LAUNCHES)) == 3
