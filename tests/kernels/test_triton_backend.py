"""TRITON_ATTN (the backend around the Triton kernels) against the PyTorch reference, on CPU
through Triton's interpreter: mixed decode/prefill batches, random paged layouts, features."""

from __future__ import annotations

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from attnserve.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from attnserve.attention.reference import alibi_slopes, paged_attention, write_kv  # noqa: E402
from tests.kernels.test_torch_sdpa import BLOCK, make_batch  # noqa: E402


@pytest.mark.parametrize("feature", ["plain", "window_alibi", "sinks_softcap"])
def test_mixed_batch_matches_reference(feature):
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv, head = 4, 2, 16
    common, kc, vc = make_batch([1, 1, 5, 3], [9, 2, 6, 0], num_kv, head, gen)
    layer = SimpleNamespace(scale=head ** -0.5, window=6 if feature == "window_alibi" else None,
                            alibi_slopes=alibi_slopes(num_heads) if feature == "window_alibi" else None,
                            sinks=torch.randn(num_heads, generator=gen) if feature == "sinks_softcap" else None,
                            softcap=2.5 if feature == "sinks_softcap" else None, k_scale=1.0, v_scale=1.0)
    t = common.num_tokens
    q = torch.randn(t, num_heads, head, generator=gen)
    k = torch.randn(t, num_kv, head, generator=gen)
    v = torch.randn(t, num_kv, head, generator=gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    write_kv(ref_k, ref_v, k, v, common.slot_mappings[0])
    ref = paged_attention(q, ref_k, ref_v, common.block_tables[0], common.query_start_loc, common.seq_lens,
                          scale=layer.scale, window=layer.window, alibi=layer.alibi_slopes, sinks=layer.sinks,
                          softcap=layer.softcap)
    backend = TritonAttentionBackend(BLOCK)
    meta = backend.build_metadata(common, 0)
    assert [(p.token_start, p.token_end, p.max_query_len) for p in meta.parts] == [(0, 2, 1), (2, 10, 5)]
    out = backend.forward(layer, q, k, v, (kc, vc), meta)
    torch.testing.assert_close(kc, ref_k)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_engine_with_triton_attn_matches_torch_sdpa(tmp_path):
    """The whole engine path (cache writes, decode/prefill split, chunked prefill) through
    TRITON_ATTN under the interpreter gives TORCH_SDPA's tokens and logprobs."""
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts, run_engine

    build_hf_model("llama", dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                   tmp_path)
    prompts = make_prompts([5, 11])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    outs = {}
    for name in ("TORCH_SDPA", "TRITON_ATTN"):
        llm = LLM(str(tmp_path), dtype="float32", block_size=16, attention_backend=name, max_num_batched_tokens=8)
        assert llm.llm_engine.parts.backend_names == [name]
        outs[name] = run_engine(llm, prompts, params)
    for a, b in zip(outs["TORCH_SDPA"], outs["TRITON_ATTN"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4
