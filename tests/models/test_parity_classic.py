"""Parity with transformers for GPT-2, GPT-BigCode (MQA and MHA) and rotary Falcon, on every path.

As in ``test_standard_parity.py``: a tiny random model per family (float32, initializer range
0.1), prompts of mixed lengths, and four attnserve runs (plain; chunked prefill forced small; a
shared prefix served from the prefix cache; preemption forced by a tiny block budget). Each must
give transformers' greedy tokens and its log-probabilities within 1e-4, with the block pool
intact after every step. The families cover: learned positions and Conv1D weights (gpt2, with
``scale_attn_by_inverse_layer_idx`` and ``n_inner``), a one-head KV cache and per-head fused QKV
(gpt_bigcode), Falcon-7B (multi_query, parallel attention), Falcon-40B (new decoder
architecture: GQA, two LayerNorms), Falcon2-11B (one LayerNorm) and plain MHA Falcon with
sequential attention and biases. Some families untie the LM head so that greedy output
varies at this size (tied ones tend to repeat a token); the others keep it tied. ``test_qkv_layouts`` checks the weight reordering on its own.
"""

from __future__ import annotations

import pytest
import torch

from attnserve import SamplingParams
from attnserve.arch import read_arch
from attnserve.models.base import deinterleave_qkv
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

GPT = dict(
    vocab_size=VOCAB,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=256,
    bos_token_id=1,
    eos_token_id=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
FALCON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "gpt2": (
        "gpt2",
        dict(GPT, scale_attn_by_inverse_layer_idx=True, n_inner=96, tie_word_embeddings=False),
    ),
    "bigcode_mqa": ("gpt_bigcode", dict(GPT, multi_query=True)),
    "bigcode_mha": ("gpt_bigcode", dict(GPT, multi_query=False, activation_function="gelu_new")),
    "falcon_mqa": ("falcon", dict(FALCON, multi_query=True, parallel_attn=True)),
    "falcon_gqa": ("falcon", dict(FALCON, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_gqa_1ln": (
        "falcon",
        dict(
            FALCON,
            new_decoder_architecture=True,
            num_kv_heads=2,
            num_ln_in_parallel_attn=1,
            ffn_hidden_size=96,
        ),
    ),
    "falcon_mha_seq": (
        "falcon",
        dict(FALCON, multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False),
    ),
}
# variants that differ from a main family in one detail run the plain path only
PLAIN_ONLY = {"falcon_gqa_1ln"}

LENGTHS = [5, 12, 19, 27]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's HF model and reference, built once for the module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model_type, kwargs = FAMILIES[name]
            out = tmp_path_factory.mktemp(name)
            model = build_hf_model(model_type, kwargs, out)
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


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 3), (4, 1)])
def test_qkv_layouts(num_heads, num_kv_heads):
    """Rows grouped per KV head ([q.. k v] per group) come out as [q | k | v], weights and biases."""
    d, hidden = 3, 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_heads, d, hidden, generator=g)
    k = torch.randn(num_kv_heads, d, hidden, generator=g)
    v = torch.randn(num_kv_heads, d, hidden, generator=g)
    group = num_heads // num_kv_heads
    grouped = torch.cat(
        [
            torch.cat([q[i * group : (i + 1) * group], k[i : i + 1], v[i : i + 1]])
            for i in range(num_kv_heads)
        ]
    )  # [Hkv * (group + 2), D, in]
    expected = torch.cat([q, k, v]).reshape(-1, hidden)
    out = deinterleave_qkv(grouped.reshape(-1, hidden), num_heads, num_kv_heads, d)
    assert torch.equal(out, expected)
    bias = deinterleave_qkv(grouped[..., 0].reshape(-1), num_heads, num_kv_heads, d)
    assert torch.equal(bias, expected[:, 0])


def test_gpt2_hub_checkpoint_names(built):
    """Original GPT-2 checkpoints name tensors without ``transformer.`` and carry causal-mask
    buffers (``h.N.attn.bias``, ``h.N.attn.masked_bias``): they load to the same parameters."""
    from attnserve.arch import load_hf_config
    from attnserve.models.gpt2 import GPT2LMHeadModel
    from attnserve.models.weights import iter_safetensors

    _, path, _, _, _ = built("gpt2")
    arch = read_arch(load_hf_config(path))
    saved = list(iter_safetensors(path))
    hub = [(name.removeprefix("transformer."), t) for name, t in saved]
    for i in range(arch.num_layers):
        hub += [
            (f"h.{i}.attn.bias", torch.ones(1, 1, 8, 8)),
            (f"h.{i}.attn.masked_bias", torch.tensor(-1e4)),
        ]
    a, b = GPT2LMHeadModel(arch), GPT2LMHeadModel(arch)
    a.load_weights(saved)
    b.load_weights(hub)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert any(n.startswith("transformer.") for n, _ in saved)
