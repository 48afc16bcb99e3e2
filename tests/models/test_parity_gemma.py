"""Parity with transformers for Gemma 1, Gemma 2 and Gemma 3 (text), on every engine path.

Each family: a tiny random model (float32, zero-centred norm weights randomised so that every
norm matters), prompts longer than the sliding window, and four runs through attnserve: plain;
chunked prefill forced small; a shared prefix served from the prefix cache; preemption forced
by a tiny block budget. Each must give transformers' greedy tokens and its log-probabilities
within 1e-4, with the block pool intact after every step.

The configs make each Gemma feature visible above that tolerance: ``query_pre_attn_scalar``
differs from ``head_dim``, Gemma 2's soft-caps are small enough to bend the logits, Gemma 3's
sliding layers use a RoPE base far from the full layers' (which are linearly scaled). Two
ablations check on attnserve's side that the window and the soft-caps are really applied.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.arch import load_hf_config, read_arch
from attnserve.models.gemma import GemmaForCausalLM
from attnserve.models.weights import iter_safetensors
from tests.models.parity import (
    VOCAB,
    build_hf_model,
    check_chunked_prefill,
    check_plain,
    check_preemption,
    check_prefix_hits,
    hf_reference,
    make_prompts,
    run_engine,
)

WINDOW = 8
DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=16,
)
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}

FAMILIES = {
    "gemma": ("gemma", dict(DENSE)),
    # layers alternate sliding/full (layer_types written by the config class)
    "gemma2": (
        "gemma2",
        dict(
            DENSE,
            num_hidden_layers=4,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(
            DENSE,
            num_hidden_layers=4,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            rope_parameters=GEMMA3_ROPE,
        ),
    ),
}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


def build_gemma(model_type: str, kwargs: dict, out: Path, seed: int = 0):
    """``build_hf_model``, then random zero-centred norm weights (HF initialises them to 0, where
    a misplaced or mis-loaded norm would go unnoticed), saved again."""
    model = build_hf_model(model_type, kwargs, out, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model_type, kwargs = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    model = build_gemma(model_type, kwargs, out)
    prompts = make_prompts(LENGTHS)
    return request.param, out, model, prompts, hf_reference(model, prompts, MAX_TOKENS)


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kw)


def test_plain(family):
    _, path, _, _, _ = family
    assert type(LLM(str(path), dtype="float32", block_size=4).llm_engine.runner.model) is GemmaForCausalLM
    check_plain(family)


def test_chunked_prefill(family):
    check_chunked_prefill(family)


def test_prefix_cache_hits(family):
    check_prefix_hits(family)


def test_preemption(family):
    check_preemption(family, max_num_batched_tokens=8)


def _last_prompt_logprob(path: str, prompt: list[int]) -> float:
    llm = LLM(path, dtype="float32", block_size=4)
    (out,) = run_engine(llm, [prompt], params(prompt_logprobs=1))
    return out.prompt_logprobs[-1][prompt[-1]].logprob


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_window_is_exercised(name):
    """Widening the window changes attnserve's output: the sliding layers' mask is real."""
    model_type, kwargs = FAMILIES[name]
    prompt = make_prompts([30])[0]
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        build_gemma(model_type, kwargs, Path(d1))
        build_gemma(model_type, dict(kwargs, sliding_window=1000), Path(d2))
        assert abs(_last_prompt_logprob(d1, prompt) - _last_prompt_logprob(d2, prompt)) > 1e-3


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_softcap_is_exercised(cap):
    """Dropping either Gemma 2 soft-cap changes attnserve's output: both are applied."""
    model_type, kwargs = FAMILIES["gemma2"]
    prompt = make_prompts([30])[0]
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        build_gemma(model_type, kwargs, Path(d1))
        build_gemma(model_type, dict(kwargs, **{cap: None}), Path(d2))
        assert abs(_last_prompt_logprob(d1, prompt) - _last_prompt_logprob(d2, prompt)) > 1e-3


def test_multimodal_checkpoint_names(tmp_path):
    """A Gemma 3 multimodal checkpoint (both prefix spellings) loads its language model exactly,
    skipping the vision tower and the projector."""
    model_type, kwargs = FAMILIES["gemma3_text"]
    build_gemma(model_type, kwargs, tmp_path)
    arch = read_arch(load_hf_config(tmp_path))
    plain = GemmaForCausalLM(arch)
    plain.load_weights(iter_safetensors(tmp_path))
    extra = [
        ("model.vision_tower.patch.weight", torch.zeros(2)),
        ("vision_tower.patch.weight", torch.zeros(2)),
        ("model.multi_modal_projector.w", torch.zeros(2)),
        ("multi_modal_projector.w", torch.zeros(2)),
    ]
    for new_prefix in ("model.language_model.", "language_model.model."):
        renamed = [(new_prefix + n[len("model.") :], t) for n, t in iter_safetensors(tmp_path)]
        wrapped = GemmaForCausalLM(arch)
        wrapped.load_weights(renamed + extra)
        for (name, a), (_, b) in zip(
            plain.state_dict().items(), wrapped.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), f"{new_prefix}: {name} differs"


def test_bidirectional_config_is_refused(tmp_path):
    model_type, kwargs = FAMILIES["gemma3_text"]
    build_gemma(model_type, dict(kwargs, use_bidirectional_attention=True), tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaForCausalLM(read_arch(load_hf_config(tmp_path)))
