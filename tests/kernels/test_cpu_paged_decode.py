"""The CPU paged decode kernel (``ops/cpu/paged_decode.py``) against its twins: TORCH_SDPA's
bucketed SDPA decode and the reference attention, on random paged caches as the backend sees
them (non-contiguous block tables, block 0 null, partial last blocks, padded rows with slot -1);
every instruction-set path this CPU runs (``supported_isas``: avx2, avx512, avx512_bf16), each
forced through ``paged_decode(isa=...)``; and an engine's greedy output with the kernel on and off."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.reference import paged_attention, write_kv
from attnserve.ops.cpu import paged_decode as cpu_paged_decode
from attnserve.platforms.cpu_info import cpu_info


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Skips where no C++ compiler exists (or the CPU is not x86-64 with AVX2); elsewhere the
    build must succeed."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the CPU decode kernel cannot be built")
    why = cpu_paged_decode.cpu_support()
    if why is not None:
        pytest.skip(f"the CPU decode kernel needs x86-64 with AVX2: {why}")
    assert cpu_paged_decode.prepare() is None, "the CPU decode kernel failed to build (see the log)"


def decode_batch(lens, num_kv, head, block, dtype, gen, pad_rows=0):
    """Decodes with ``lens`` keys each (the last one new), random non-contiguous block tables,
    and ``pad_rows`` padded rows at the end (one key in the null block 0, slot -1, as a
    padded batch has them)."""
    nblk = [-(-n // block) for n in lens]
    num_blocks = sum(nblk) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(nblk) + 1  # a spare column of zeros, as a step's table has
    bt = torch.zeros(len(lens) + pad_rows, width, dtype=torch.int32)
    slots = []
    for i, (n, k) in enumerate(zip(lens, nblk)):
        bt[i, :k] = torch.tensor(perm[:k])
        perm = perm[k:]
        slots.append(int(bt[i, (n - 1) // block]) * block + (n - 1) % block)
    seq = list(lens) + [1] * pad_rows
    slots += [-1] * pad_rows
    b = len(seq)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        positions=torch.tensor(seq) - 1, block_tables=[bt], slot_mappings=[torch.tensor(slots)],
        query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=seq, num_decodes=b, max_query_len=1, max_seq_len=max(seq))
    kc, vc = (torch.randn(num_blocks, block, num_kv, head, generator=gen).to(dtype) for _ in range(2))
    kc[0] = vc[0] = 0  # the null block is zeroed
    return common, kc, vc


def plain_layer(head):
    return SimpleNamespace(scale=head ** -0.5, window=None, alibi_slopes=None, sinks=None, softcap=None,
                           k_scale=1.0, v_scale=1.0)


def run_backend(block, layer, q, k, v, kc, vc, common, monkeypatch, kernel_on: bool):
    # the backend built as the plan hands it its attention.decode variant, or picking it itself
    backend = TorchSDPABackend(block, None if kernel_on else {"attention.decode": "torch"})
    meta = backend.build_metadata(common, 0)
    kc, vc = kc.clone(), vc.clone()
    out = backend.forward(layer, q, k, v, (kc, vc), meta)
    assert backend.kernels["attention.decode"] == ("cpu_ext" if kernel_on else "torch")
    assert (meta.decode_buckets is None) == kernel_on  # the kernel needs no buckets
    return out, kc, vc


LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 129]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_kernel_matches_the_bucketed_twin_and_the_reference(dtype, head, group, monkeypatch):
    gen = torch.Generator().manual_seed(head * 10 + group + (dtype == torch.bfloat16))
    num_kv, block = 2, 16
    common, kc, vc = decode_batch(LENGTHS, num_kv, head, block, dtype, gen, pad_rows=2)
    b = common.num_reqs
    q = torch.randn(b, num_kv * group, head, generator=gen).to(dtype)
    k, v = (torch.randn(b, num_kv, head, generator=gen).to(dtype) for _ in range(2))
    layer = plain_layer(head)
    out, kc_out, vc_out = run_backend(block, layer, q, k, v, kc, vc, common, monkeypatch, True)
    twin, kc_twin, _ = run_backend(block, layer, q, k, v, kc, vc, common, monkeypatch, False)
    assert torch.equal(kc_out, kc_twin)  # the same cache write
    ref = paged_attention(q.float(), kc_out.float(), vc_out.float(), common.block_tables[0], common.query_start_loc,
                          common.seq_lens, scale=layer.scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, twin, atol=2e-5, rtol=2e-5)
    else:  # float32 accumulation, one rounding to bf16: within a bf16 step of the exact result
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), twin.float(), atol=2e-2, rtol=2e-2)
    assert (out[-2:] == 0).all()  # padded rows read the zeroed null block


def isas() -> tuple[str, ...]:
    """The paths this machine runs (collected before the fixture builds: the flags alone)."""
    info = cpu_info()
    if info.decode_isa is None:
        return ()
    return cpu_paged_decode.ISAS[:cpu_paged_decode.ISAS.index(info.decode_isa) + 1]


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (dtype, head, head_v, group): the head sizes the compiled forms fix (64, 128) and others (40; 96
# keys with 64 values; 200 with 24: vectors cut by masks), every head chunk (8, 4, 2, 1; 6 query
# heads a KV head run as 2 + 2 + 2; 3 as 1 + 1 + 1)
CASES = [(BF16, 64, 64, 2), (BF16, 128, 128, 8), (BF16, 40, 40, 6), (BF16, 96, 64, 4), (BF16, 200, 24, 1),
         (BF16, 64, 64, 3), (FP32, 64, 64, 2), (FP32, 128, 128, 4), (FP32, 40, 40, 1), (FP16, 64, 64, 8),
         (FP16, 96, 64, 2)]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("dtype,head,head_v,group", CASES, ids=[f"{str(c[0])[6:]}-{c[1]}-{c[2]}-g{c[3]}" for c in CASES])
def test_every_path_matches_the_reference(isa, dtype, head, head_v, group):
    """Each path forced, on CASES, odd tiles (lengths 1, 17, 33, 129), blocks of 16 and the null block."""
    assert isa in cpu_paged_decode.supported_isas()
    gen = torch.Generator().manual_seed(head * 100 + head_v + group)
    num_kv, block = 2, 16
    common, kc, _ = decode_batch(LENGTHS, num_kv, head, block, dtype, gen, pad_rows=1)
    vc = torch.randn(kc.shape[0], block, num_kv, head_v, generator=gen).to(dtype)
    vc[0] = 0
    q = torch.randn(common.num_reqs, num_kv * group, head, generator=gen).to(dtype)
    out = torch.full((common.num_reqs, num_kv * group, head_v), float("nan"), dtype=dtype)
    cpu_paged_decode.paged_decode(q, kc, vc, common.block_tables[0], common.seq_lens, head ** -0.5, out, isa=isa)
    ref = paged_attention(q.float(), kc.float(), vc.float(), common.block_tables[0], common.query_start_loc,
                          common.seq_lens, scale=head ** -0.5)
    # float32 sums everywhere; bf16 and fp16 round the output once (avx512_bf16 also the weights)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert (out[-1] == 0).all()  # the padded row reads the zeroed null block


def test_the_paths_agree_and_the_default_is_the_best():
    """On one bf16 batch every path is within bf16 rounding of the others, and ``kernel_isa``
    (what the engine runs) is the best this CPU runs, ``ATTNSERVE_CPU_ISA`` unset."""
    gen = torch.Generator().manual_seed(7)
    common, kc, vc = decode_batch([5, 300, 77, 1024], 4, 128, 16, torch.bfloat16, gen)
    q = torch.randn(4, 16, 128, generator=gen).bfloat16()
    outs = {}
    for isa in cpu_paged_decode.supported_isas():
        outs[isa] = torch.empty(4, 16, 128, dtype=torch.bfloat16)
        cpu_paged_decode.paged_decode(q, kc, vc, common.block_tables[0], common.seq_lens, 0.1, outs[isa], isa=isa)
    default = cpu_paged_decode.paged_decode(q, kc, vc, common.block_tables[0], common.seq_lens, 0.1,
                                            torch.empty_like(q))
    assert cpu_paged_decode.kernel_isa() == cpu_paged_decode.supported_isas()[-1]
    assert torch.equal(default, outs[cpu_paged_decode.kernel_isa()])
    for isa, o in outs.items():
        torch.testing.assert_close(o.float(), outs["avx2"].float(), atol=2e-2, rtol=2e-2, msg=isa)


@pytest.mark.parametrize("isa", [i for i in cpu_paged_decode.ISAS if i not in isas()])
def test_a_path_this_cpu_lacks_is_an_error(isa):
    gen = torch.Generator().manual_seed(0)
    common, kc, vc = decode_batch([5], 1, 16, 4, torch.bfloat16, gen)
    q = torch.randn(1, 2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="cannot run"):
        cpu_paged_decode.paged_decode(q, kc, vc, common.block_tables[0], common.seq_lens, 1.0, torch.empty_like(q),
                                      isa=isa)


def test_cpu_isa_caps_the_paths(monkeypatch):
    """``ATTNSERVE_CPU_ISA`` caps the paths as it caps the flags (an AVX2-only CPU's view)."""
    monkeypatch.setenv("ATTNSERVE_CPU_ISA", "avx2")
    assert cpu_paged_decode.supported_isas() == ("avx2",)
    monkeypatch.setenv("ATTNSERVE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="ATTNSERVE_CPU_ISA must be"):
        cpu_paged_decode.supported_isas()


@pytest.mark.parametrize("block", [4, 16, 32])
def test_kernel_block_sizes_and_strided_query(block):
    """Block sizes under, at and over the kernel's 16-key tile; q as a strided view of a fused
    QKV projection and out as a strided slice; float16."""
    gen = torch.Generator().manual_seed(block)
    common, kc, vc = decode_batch([1, 3, 4, 5, 33, 70], 1, 16, block, torch.float16, gen)
    qkv = torch.randn(6, 6, 16, generator=gen).to(torch.float16)  # [B, H + 2 * Hkv, D]
    q = qkv[:, :4]
    out = torch.zeros(6, 8, 16, dtype=torch.float16)[:, ::2]
    cpu_paged_decode.paged_decode(q, kc, vc, common.block_tables[0], common.seq_lens, 0.3, out)
    ref = paged_attention(q.float(), kc.float(), vc.float(), common.block_tables[0], common.query_start_loc,
                          common.seq_lens, scale=0.3)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_kernel_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    common, kc, vc = decode_batch([5, 9], 2, 16, 4, torch.float32, gen)
    q, out = torch.randn(2, 4, 16), torch.empty(2, 4, 16)
    bt, seq = common.block_tables[0], common.seq_lens

    def call(**kw):
        args = dict(q=q, key_cache=kc, value_cache=vc, block_table=bt, seq_lens=seq, scale=1.0, out=out) | kw
        cpu_paged_decode.paged_decode(**args)

    with pytest.raises(RuntimeError, match="block id"):
        call(block_table=torch.full_like(bt, kc.shape[0]))
    with pytest.raises(RuntimeError, match="out of range"):
        call(seq_lens=torch.tensor([5, 99], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        call(block_table=bt.long())
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(q=q.bfloat16())
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        call(q=torch.randn(2, 3, 16), out=torch.empty(2, 3, 16))
    with pytest.raises(RuntimeError, match="multiples of 8"):
        call(q=q[..., :12], key_cache=kc[..., :12], value_cache=vc[..., :12], out=out[..., :12])
    with pytest.raises(ValueError, match="isa must be one of"):
        call(isa="avx1024")
    with pytest.raises(RuntimeError, match="isa must be 0"):  # the op itself, past the Python check
        torch.ops.attnserve_cpu.paged_decode(q, kc, vc, bt, seq, 1.0, out, 7)


def test_unsupported_layers_take_the_bucketed_path(monkeypatch):
    """A window (like ALiBi, sinks, soft-capping and fp8 caches) is not the kernel's: the step
    builds buckets for that layer, and the result is the reference's."""
    gen = torch.Generator().manual_seed(1)
    common, kc, vc = decode_batch([3, 20, 40], 2, 16, 4, torch.float32, gen)
    q, k, v = (torch.randn(3, h, 16, generator=gen) for h in (4, 2, 2))
    layer = SimpleNamespace(**{**vars(plain_layer(16)), "window": 7})
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, common.slot_mappings[0])
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale, window=7)
    backend = TorchSDPABackend(4)
    meta = backend.build_metadata(common, 0)
    out = backend.forward(layer, q, k, v, (kc, vc), meta)
    assert backend.kernels["attention.decode"] == "torch" and meta.decode_buckets is not None
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_engine_greedy_output_equals_with_the_kernel_off(tmp_path, monkeypatch):
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts, run_engine

    build_hf_model("llama", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), tmp_path)
    prompts = make_prompts([3, 17, 30, 9])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    calls = []
    kernel_call = cpu_paged_decode.paged_decode
    monkeypatch.setattr(cpu_paged_decode, "paged_decode", lambda *a: calls.append(1) or kernel_call(*a))
    outs = {}
    for disabled in ((), ("cpu_ext",)):  # the engine option that turns the kernel off
        llm = LLM(str(tmp_path), dtype="float32", block_size=4, attention_backend="TORCH_SDPA",
                  disabled_kernels=disabled)
        outs[disabled] = [o.outputs[0].token_ids for o in run_engine(llm, prompts, params)]
        assert bool(calls) == (not disabled)
        calls.clear()
    assert outs[()] == outs[("cpu_ext",)]
