"""The profiling pass (engine/profile_run.py): on CUDA it runs before the KV cache is sized.

Here it is forced on CPU: for one family of each cache type (dense GQA, sliding windows, MoE,
MLA, DSA, a hybrid with state layers) an engine built after the pass, its long step included,
must produce what an engine built without it produces (the pass binds temporary caches and
state slots, which the real allocation must replace completely), and the dummy lengths must
fill the step budget. The long step reaches what grows with the context: an MLA prefill's
context chunks, and prompt logprobs a bounded slice of rows at a time.
"""

from __future__ import annotations

import pytest

from attnserve import LLM, SamplingParams
from attnserve.attention.backends import torch_mla
from attnserve.engine import builder, profile_run
from attnserve.runner import model_runner
from tests.models.parity import build_hf_model, make_prompts
from tests.models.test_parity_dsa import FAMILIES as DSA
from tests.models.test_parity_hybrid import HYBRID

_DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("llama", _DENSE),
    "gemma2": ("gemma2", dict(_DENSE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "mixtral": ("mixtral", dict(_DENSE, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek_v3", dict(_DENSE, moe_intermediate_size=32, num_hidden_layers=3,
                                        num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                        q_lora_rank=32, n_group=2, topk_group=1)),
    "deepseek_v32": DSA["v32"],
    "qwen3_next": HYBRID["qwen3_next"],
}


@pytest.mark.parametrize(("total", "seqs", "max_len"), [(16384, 256, 4096), (2048, 128, 256), (10, 128, 4),
                                                        (5000, 2, 1000), (7, 3, 100)])
def test_dummy_lengths_fill_the_budget(total, seqs, max_len):
    lengths = profile_run.dummy_lengths(total, seqs, max_len)
    assert sum(lengths) == min(total, seqs * (max_len - 1))
    assert len(lengths) <= seqs and max(lengths) <= max_len - 1 and min(lengths) >= 1
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(("longest", "covered", "expected"), [
    (16384, 64, [2, 4, 8, 16, 32, 128, 256]), (63, 63, [2, 4, 8, 16, 32]), (64, 16, [2, 4, 8, 32, 64]),
    (1, 1, []), (3, 2, [])])
def test_warm_up_lengths_cover_each_power_of_two_class(longest, covered, expected):
    assert profile_run.warm_up_lengths(longest, covered) == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_after_the_pass_equals_one_without(family, tmp_path, monkeypatch):
    model_type, kwargs = FAMILIES[family]
    build_hf_model(model_type, kwargs, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in make_prompts([5, 19, 33], vocab=kwargs["vocab_size"])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    plain = LLM(str(tmp_path), **engine).generate(prompts, params)

    ran = []
    real = profile_run.profile_step

    def spy(*args, **kw):
        ran.append(real(*args, **kw))
        return ran[-1]

    monkeypatch.setattr(builder, "_PROFILED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(profile_run, "_WARM_UP_DEVICES", ("cuda", "cpu"))  # and its warm-up prefills
    monkeypatch.setattr(profile_run, "_LONG_STEP_DEVICES", ("cuda", "cpu"))  # and its long step
    monkeypatch.setattr(builder, "profile_step", spy)
    profiled = LLM(str(tmp_path), **engine).generate(prompts, params)
    assert ran == [None]  # it ran, and measures memory on CUDA only
    for a, b in zip(plain, profiled):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in x.items():
                assert abs(lp.logprob - y[tok].logprob) <= 1e-5


@pytest.mark.parametrize(("tokens", "max_len", "expected"), [(8192, 131072, (122879, 8192)), (2048, 1024, (0, 1023)),
                                                            (64, 256, (191, 64)), (16, 2, (0, 1))])
def test_long_step_follows_the_longest_context(tokens, max_len, expected):
    context, new = profile_run.long_step_lengths(tokens, max_len)
    assert (context, new) == expected and context + new <= max_len - 1


def test_long_step_reaches_the_chunked_context_and_sliced_prompt_logprobs(tmp_path, monkeypatch):
    """The pass's long step runs one chunk after a context of several MLA chunks (each expanded
    alone), with prompt logprobs computed a few rows at a time; the engine then serves a long
    prompt with prompt logprobs exactly as it does without the slicing."""
    model_type, kwargs = FAMILIES["deepseek_v3"]
    build_hf_model(model_type, dict(kwargs, max_position_embeddings=1024), tmp_path)
    monkeypatch.setattr(torch_mla, "_CONTEXT_ELEMENTS", 1)  # chunks of 256 keys
    calls, real = [], torch_mla.prefill_expanded

    def spy(q, cache, slots, *args, **kw):
        calls.append((q.shape[0], slots.shape[0]))
        return real(q, cache, slots, *args, **kw)

    monkeypatch.setattr(torch_mla, "prefill_expanded", spy)
    monkeypatch.setattr(builder, "_PROFILED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(profile_run, "_LONG_STEP_DEVICES", ("cuda", "cpu"))
    engine = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    llm = LLM(str(tmp_path), **engine)
    assert (64, 1023) in calls  # the long step: 64 new tokens after 959 of context (four chunks)
    prompt = make_prompts([700], vocab=kwargs["vocab_size"])[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    whole = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    monkeypatch.setattr(model_runner, "_PROMPT_LOGPROB_ELEMENTS", kwargs["vocab_size"] * 5)  # 5 rows a slice
    sliced = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert whole.outputs[0].token_ids == sliced.outputs[0].token_ids
    assert len(sliced.prompt_logprobs) == 700 and sliced.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], sliced.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-5 and a[t].rank == b[t].rank for t in a)
