"""Parity with transformers for the ALiBi families: BLOOM, MPT and Falcon with ``alibi=True``.

Same harness and paths as ``test_standard_parity.py`` (plain, chunked prefill, prefix-cache
hits, preemption; 1e-4 on log-probabilities, identical greedy tokens), with 4 heads and with 6
(not a power of two, where the second slope series is used and MPT orders its slopes its own
way). Variants that only change a detail run the plain path.

Falcon with ALiBi is compared with transformers' ``sdpa`` attention, the implementation
``from_pretrained`` picks for Falcon: its eager path adds the ALiBi bias twice (once in the
scores, once more through the causal mask it builds for sdpa), which the original Falcon-RW code
and the sdpa path do not (``test_falcon_alibi_eager_is_not_the_reference`` pins that down).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnserve import SamplingParams
from attnserve.arch import read_arch
from attnserve.attention.reference import alibi_slopes
from attnserve.models.mpt import MPTForCausalLM, mpt_alibi_slopes
from tests.models.parity import (
    VOCAB,
    build_hf_model,
    check_chunked_prefill,
    check_plain,
    check_preemption,
    check_prefix_hits,
    hf_reference,
    make_prompts,
)

# tied embeddings after BLOOM's embedding LayerNorm make greedy output repeat one token: untie
BLOOM = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    n_layer=2,
    n_head=4,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# use_cache: the reference's generate is faster with a cache
MPT = dict(
    vocab_size=VOCAB,
    d_model=64,
    n_layers=2,
    n_heads=4,
    max_seq_len=256,
    bos_token_id=1,
    eos_token_id=2,
    use_cache=True,
)
FALCON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    alibi=True,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "bloom": ("bloom", dict(BLOOM)),
    "bloom_6h_post_ln": (
        "bloom",
        dict(BLOOM, hidden_size=48, n_head=6, apply_residual_connection_post_layernorm=True),
    ),
    "mpt_6h": ("mpt", dict(MPT, d_model=48, n_heads=6, attn_config={"clip_qkv": 0.6})),
    "mpt": ("mpt", dict(MPT)),
    "falcon_rw": (
        "falcon",
        dict(FALCON, multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False),
    ),
    "falcon_alibi_6h_mqa": (
        "falcon",
        dict(FALCON, hidden_size=48, num_attention_heads=6, multi_query=True),
    ),
}
PLAIN_ONLY = {"bloom_6h_post_ln", "mpt", "falcon_alibi_6h_mqa"}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


def _reference_model(model_type: str, model, path):
    """The transformers model to compare with: Falcon through sdpa (see the module docstring)."""
    if model_type != "falcon":
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            model_type, kwargs = FAMILIES[name]
            out = tmp_path_factory.mktemp(name)
            model = _reference_model(model_type, build_hf_model(model_type, kwargs, out), out)
            prompts = make_prompts(LENGTHS)
            cache[name] = (name, out, model, prompts, hf_reference(model, prompts, MAX_TOKENS))
        return cache[name]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def any_family(request, built):
    return built(request.param)


@pytest.fixture(params=sorted(set(FAMILIES) - PLAIN_ONLY))
def family(request, built):
    return built(request.param)


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kw)


def test_plain(any_family):
    check_plain(any_family)


def test_chunked_prefill(family):
    check_chunked_prefill(family)


def test_prefix_cache_hits(family):
    check_prefix_hits(family)


def test_preemption(family):
    check_preemption(family)


def test_falcon_alibi_eager_is_the_sdpa_path_or_the_known_bug(built):
    """transformers' eager Falcon-ALiBi differed from its sdpa path up to 5.17 (the bias counted
    twice), so the sdpa model is the reference here; 5.25 computes the same logits both ways.
    Either state is known: equal to float32 rounding, or off by the double bias; anything in
    between is a new difference to look at."""
    import transformers
    from transformers import AutoModelForCausalLM

    _, path, sdpa_model, prompts, _ = built("falcon_rw")
    eager = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        diff = (eager(ids).logits - sdpa_model(ids).logits).abs().max().item()
    assert diff < 1e-4 or diff > 1e-2, f"transformers {transformers.__version__}: eager and sdpa differ by {diff}"


@pytest.mark.parametrize("num_heads", [1, 4, 6, 8, 12, 20])
def test_slopes_match_transformers(num_heads):
    """BLOOM's and MPT's slope formulas as transformers computes them; MPT's differ from BLOOM's
    only when ``alibi_bias_max`` is not 8."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.testing.assert_close(
        alibi_slopes(num_heads), _get_alibi_slopes(num_heads, "cpu"), rtol=1e-6, atol=0
    )
    for bias_max in (8, 16):
        bias = build_mpt_alibi_tensor(num_heads, 2, bias_max)  # [H, 1, 2]: -slope, 0
        hf = -bias[:, 0, 0]
        torch.testing.assert_close(
            mpt_alibi_slopes(num_heads, bias_max), hf.float(), rtol=1e-6, atol=0
        )
    if num_heads > 1:
        assert not torch.allclose(mpt_alibi_slopes(num_heads, 16), alibi_slopes(num_heads))


def test_mpt_logit_scale():
    """``logit_scale`` (MosaicML's code; transformers ignores it) multiplies the logits."""
    cfg = {
        "model_type": "mpt",
        "d_model": 16,
        "n_heads": 2,
        "n_layers": 1,
        "vocab_size": 32,
        "max_seq_len": 16,
    }
    torch.manual_seed(0)
    plain = MPTForCausalLM(read_arch(cfg))
    scaled = MPTForCausalLM(read_arch(dict(cfg, logit_scale="inv_sqrt_d_model")))
    scaled.load_state_dict(plain.state_dict())
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(
        scaled.compute_logits(hidden), plain.compute_logits(hidden) / math.sqrt(16)
    )
