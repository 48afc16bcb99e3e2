"""The profiling pass (engine/profile_run.py): on CUDA it runs before the KV cache is sized.

Here it is forced on CPU: for one family of each cache type (dense GQA, sliding windows, MoE,
MLA, DSA, a hybrid with state layers) an engine built after the pass must produce what an
engine built without it produces (the pass binds temporary caches and state slots, which the
real allocation must replace completely), and the dummy lengths must fill the step budget.
"""

from __future__ import annotations

import pytest

from attnserve import LLM, SamplingParams
from attnserve.engine import builder, profile_run
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
    monkeypatch.setattr(builder, "profile_step", spy)
    profiled = LLM(str(tmp_path), **engine).generate(prompts, params)
    assert ran == [None]  # it ran, and measures memory on CUDA only
    for a, b in zip(plain, profiled):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in x.items():
                assert abs(lp.logprob - y[tok].logprob) <= 1e-5
