"""RotaryEmbedding against transformers' rotary classes and apply functions (the oracle).

Covers every scaling type (default, linear, llama3, yarn incl. DeepSeek mscale, dynamic NTK,
longrope), both layouts (NeoX half-split, interleaved GPT-J pairs), partial rotary, per-token
sequence lengths, dtypes, cache growth and ``reserve``. Tolerances: cos/sin and rotated q/k
within 1e-5 (float32); q.k scores within 1e-4 (sums of 32 products); bf16 bit-exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Phi3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm_apply
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from attnserve.arch import RopeConfig
from attnserve.layers.rotary import RotaryEmbedding, get_rope

ATOL = 1e-5
HEAD = 32
ORIG = 256  # original_max_position_embeddings of the scaled types
MAX_POS = 1024

_FIELDS = {f.name for f in dataclasses.fields(RopeConfig)}


def rope_config(
    params: dict, rotary_dim: int, max_pos: int, interleaved: bool = False, orig: int | None = None
) -> RopeConfig:
    """Our RopeConfig for the same HF rope_parameters dict (written here, not by arch/families.py)."""
    renamed = {("theta" if k == "rope_theta" else k): v for k, v in params.items()}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in renamed.items() if k in _FIELDS}
    if orig is not None:
        kw["original_max_position_embeddings"] = orig
    return RopeConfig(
        rotary_dim=rotary_dim, interleaved=interleaved, max_position_embeddings=max_pos, **kw
    )


def llama(params: dict, max_pos: int = MAX_POS) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(
        hidden_size=2 * HEAD,
        num_attention_heads=2,
        head_dim=HEAD,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )
    return LlamaRotaryEmbedding(cfg)


def hf_cos_sin(module, positions: torch.Tensor, dtype=torch.float32):
    """HF cos, sin as [T, rotary_dim] (cat(freqs, freqs) layout)."""
    x = torch.zeros(1, dtype=dtype)
    cos, sin = module(x, positions[None])
    return cos[0], sin[0]


def spread_positions(gen: torch.Generator, n: int = 48, orig: int = ORIG) -> torch.Tensor:
    """Half below ``orig``, half beyond it (up to 3 * orig, past the first cos/sin table)."""
    low = torch.randint(0, orig, (n // 2,), generator=gen)
    high = torch.randint(orig, 3 * orig, (n - n // 2,), generator=gen)
    return torch.cat([low, high])


def qk(gen: torch.Generator, t: int, hq: int = 4, hk: int = 2, d: int = HEAD, dtype=torch.float32):
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hk, d, generator=gen).to(dtype)
    return q, k


def check_against(
    ours: RotaryEmbedding,
    cos,
    sin,
    positions,
    apply_fn,
    gen,
    seq_lens=None,
    dtype=torch.float32,
    atol=ATOL,
):
    """Our cos/sin and rotated q/k equal HF's for the given HF cos/sin rows."""
    half = ours.rotary_dim // 2
    c, s = ours.cos_sin(positions, seq_lens)
    torch.testing.assert_close(c, cos[:, :half].float(), atol=atol, rtol=0)
    torch.testing.assert_close(s, sin[:, :half].float(), atol=atol, rtol=0)
    q, k = qk(gen, positions.shape[0], d=ours.head_size, dtype=dtype)
    q_out, k_out = ours(positions, q, k, seq_lens)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.dtype == dtype and k_out.dtype == dtype
    # HF layout: [1, H, T, D] with cos [1, T, D]
    q_hf, k_hf = apply_fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=atol, rtol=0)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=atol, rtol=0)


STATIC = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_theta_1e6": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "yarn_betas_no_truncate": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "attention_factor": 0.75,
    },
    "yarn_deepseek_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
}


@pytest.mark.parametrize("name", list(STATIC))
def test_static_types_match_llama(name):
    gen = torch.Generator().manual_seed(0)
    params = STATIC[name]
    hf = llama(params)
    ours = RotaryEmbedding(rope_config(params, HEAD, MAX_POS), HEAD)
    assert ours.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = spread_positions(gen)
    cos, sin = hf_cos_sin(hf, positions)
    check_against(ours, cos, sin, positions, apply_rotary_pos_emb, gen)


def test_scalings_change_the_angles():
    """Guards against a scaled type silently falling back to the default frequencies."""
    positions = torch.arange(ORIG, 2 * ORIG)
    base_cos, _ = RotaryEmbedding(rope_config(STATIC["default"], HEAD, MAX_POS), HEAD).cos_sin(
        positions
    )
    for name in ("linear", "llama3", "yarn", "yarn_deepseek_mscale"):
        cos, _ = RotaryEmbedding(rope_config(STATIC[name], HEAD, MAX_POS), HEAD).cos_sin(positions)
        assert (cos - base_cos).abs().max() > 0.1, name


def test_deepseek_mscale_rule():
    """Equal mscale and mscale_all_dim cancel (1.0); otherwise the ratio; default 0.1 ln f + 1."""
    ds = rope_config(dict(STATIC["yarn_deepseek_mscale"], mscale=1.0), HEAD, MAX_POS)
    assert RotaryEmbedding(ds, HEAD).attention_factor == 1.0
    generic = RotaryEmbedding(rope_config(STATIC["yarn"], HEAD, MAX_POS), HEAD)
    assert generic.attention_factor == pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1)


DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize("seq_len", [40, 64, 65, 100, 300])
def test_dynamic_one_request(seq_len):
    """One request (prefill or decode chunk): HF's batch-wide L equals our per-token L."""
    gen = torch.Generator().manual_seed(seq_len)
    hf = llama(DYNAMIC, max_pos=64)
    ours = RotaryEmbedding(rope_config(DYNAMIC, HEAD, 64), HEAD)
    start = int(torch.randint(0, seq_len, (1,), generator=gen))
    positions = torch.arange(start, seq_len)
    cos, sin = hf_cos_sin(hf, positions)
    check_against(ours, cos, sin, positions, apply_rotary_pos_emb, gen)  # seq_lens=None
    lens = torch.full_like(positions, seq_len)
    check_against(ours, cos, sin, positions, apply_rotary_pos_emb, gen, seq_lens=lens)
    # like HF, dynamic measures L against max_position_embeddings, not an original max
    with_orig = RotaryEmbedding(rope_config(DYNAMIC, HEAD, 64, orig=32), HEAD)
    check_against(with_orig, cos, sin, positions, apply_rotary_pos_emb, gen, seq_lens=lens)


def test_dynamic_per_token_lengths_in_one_batch():
    """A batch of a short prefill, a long chunk and a decode token: each equals HF run alone."""
    gen = torch.Generator().manual_seed(1)
    ours = RotaryEmbedding(rope_config(DYNAMIC, HEAD, 64), HEAD)
    requests = [torch.arange(0, 40), torch.arange(60, 100), torch.tensor([150])]
    positions = torch.cat(requests)
    lens = torch.cat([torch.full_like(r, int(r.max()) + 1) for r in requests])
    cos, sin = zip(*(hf_cos_sin(llama(DYNAMIC, max_pos=64), r) for r in requests))
    check_against(
        ours, torch.cat(cos), torch.cat(sin), positions, apply_rotary_pos_emb, gen, seq_lens=lens
    )


def phi3(params: dict) -> Phi3RotaryEmbedding:
    cfg = Phi3Config(
        hidden_size=2 * HEAD,
        num_attention_heads=2,
        max_position_embeddings=4 * 64,
        original_max_position_embeddings=64,
        rope_parameters=dict(params),
    )
    return Phi3RotaryEmbedding(cfg)


def longrope_params(gen: torch.Generator, **extra) -> dict:
    short = (1 + torch.rand(HEAD // 2, generator=gen)).tolist()
    long = (1 + 8 * torch.rand(HEAD // 2, generator=gen)).tolist()
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": short,
        "long_factor": long,
        **extra,
    }


@pytest.mark.parametrize(
    "extra",
    [{}, {"attention_factor": 1.25}, {"factor": 16.0}],
    ids=["phi3_default_factor", "attention_factor", "explicit_factor"],
)
@pytest.mark.parametrize("seq_len", [50, 64, 65, 200])
def test_longrope_one_request(seq_len, extra):
    gen = torch.Generator().manual_seed(seq_len)
    params = longrope_params(gen, **extra)
    hf = phi3(params)
    ours = RotaryEmbedding(rope_config(params, HEAD, 4 * 64, orig=64), HEAD)
    assert ours.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = torch.arange(seq_len // 2, seq_len)
    cos, sin = hf_cos_sin(hf, positions)
    check_against(ours, cos, sin, positions, apply_rotary_pos_emb, gen)


def test_longrope_per_token_lengths_in_one_batch():
    gen = torch.Generator().manual_seed(2)
    params = longrope_params(gen)
    ours = RotaryEmbedding(rope_config(params, HEAD, 4 * 64, orig=64), HEAD)
    requests = [torch.arange(0, 30), torch.arange(100, 130), torch.tensor([63]), torch.tensor([64])]
    positions = torch.cat(requests)
    lens = torch.cat([torch.full_like(r, int(r.max()) + 1) for r in requests])
    cos, sin = zip(*(hf_cos_sin(phi3(params), r) for r in requests))
    cos, sin = torch.cat(cos), torch.cat(sin)
    check_against(ours, cos, sin, positions, apply_rotary_pos_emb, gen, seq_lens=lens)
    # the short request really used the short factors: HF with the batch-wide L would not
    batch_cos, _ = hf_cos_sin(phi3(params), positions)
    assert (batch_cos[:30] - cos[:30]).abs().max() > 1e-3


def deepseek(params: dict, rope_dim: int) -> DeepseekV3RotaryEmbedding:
    cfg = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=2,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=16,
        v_head_dim=16,
        kv_lora_rank=32,
        q_lora_rank=32,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(params),
    )
    return DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("name", ["default", "yarn_deepseek_mscale"])
@pytest.mark.parametrize("head_size", [HEAD, 2 * HEAD], ids=["full", "partial"])
def test_interleaved_scores_match_deepseek(name, head_size):
    """GPT-J pairs: HF de-interleaves (a permutation), so compare q.k scores and the permuted
    outputs; the partial case rotates the first 32 of 64 dims (GLM-5 indexer style)."""
    gen = torch.Generator().manual_seed(3)
    params = STATIC[name]
    ours = RotaryEmbedding(rope_config(params, HEAD, MAX_POS, interleaved=True), head_size)
    positions = spread_positions(gen, n=24)
    cos, sin = hf_cos_sin(deepseek(params, HEAD), positions)
    q, k = qk(gen, positions.shape[0], hq=2, hk=1, d=head_size)
    q_out, k_out = ours(positions, q, k)
    q_hf, k_hf = apply_rotary_pos_emb_interleave(
        q[..., :HEAD].transpose(0, 1)[None],
        k[..., :HEAD].transpose(0, 1)[None],
        cos[None],
        sin[None],
    )
    q_hf = torch.cat([q_hf[0].transpose(0, 1), q[..., HEAD:]], dim=-1)  # [T, H, head_size]
    k_hf = torch.cat([k_hf[0].transpose(0, 1), k[..., HEAD:]], dim=-1)
    scores = torch.einsum("thd,sd->hts", q_out, k_out[:, 0])
    scores_hf = torch.einsum("thd,sd->hts", q_hf, k_hf[:, 0])
    torch.testing.assert_close(scores, scores_hf, atol=1e-4, rtol=0)
    perm = torch.cat(
        [torch.arange(0, HEAD, 2), torch.arange(1, HEAD, 2), torch.arange(HEAD, head_size)]
    )
    torch.testing.assert_close(q_out[..., perm], q_hf, atol=ATOL, rtol=0)
    torch.testing.assert_close(k_out[..., perm], k_hf, atol=ATOL, rtol=0)


PARTIAL = {
    "default": STATIC["default"],
    "yarn": STATIC["yarn"],
    "llama3": STATIC["llama3"],
    "dynamic": DYNAMIC,
}


@pytest.mark.parametrize("name", list(PARTIAL))
def test_partial_rotary_matches_glm4_moe(name):
    """partial_rotary_factor 0.5: the first 16 of 32 dims rotate (NeoX), the rest pass."""
    gen = torch.Generator().manual_seed(4)
    params = PARTIAL[name]
    max_pos = 64 if name == "dynamic" else MAX_POS
    cfg = Glm4MoeConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=HEAD,
        partial_rotary_factor=0.5,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )
    hf = Glm4MoeRotaryEmbedding(cfg)
    ours = get_rope(rope_config(params, HEAD // 2, max_pos), HEAD)
    positions = torch.arange(200, 260) if name == "dynamic" else spread_positions(gen)
    cos, sin = hf_cos_sin(hf, positions)
    assert cos.shape[-1] == HEAD // 2
    check_against(ours, cos, sin, positions, glm_apply, gen)
    q, k = qk(gen, positions.shape[0])
    q_out, k_out = ours(positions, q, k)
    assert torch.equal(q_out[..., HEAD // 2 :], q[..., HEAD // 2 :])
    assert torch.equal(k_out[..., HEAD // 2 :], k[..., HEAD // 2 :])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_hf_bit_exact(dtype):
    """cos/sin in float32, cast to the input dtype, rotation in that dtype, as HF does."""
    gen = torch.Generator().manual_seed(5)
    params = STATIC["yarn"]
    ours = RotaryEmbedding(rope_config(params, HEAD, MAX_POS), HEAD)
    positions = spread_positions(gen)
    cos, sin = hf_cos_sin(llama(params), positions, dtype=dtype)
    q, k = qk(gen, positions.shape[0], dtype=dtype)
    q_out, k_out = ours(positions, q, k)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    assert q_out.dtype == dtype
    assert torch.equal(q_out, q_hf[0].transpose(0, 1))
    assert torch.equal(k_out, k_hf[0].transpose(0, 1))


def test_cache_growth_and_reserve():
    gen = torch.Generator().manual_seed(6)
    cfg = rope_config(STATIC["llama3"], HEAD, MAX_POS)
    grown, reserved = RotaryEmbedding(cfg, HEAD), RotaryEmbedding(cfg, HEAD)
    small = torch.arange(10)
    q, k = qk(gen, 10)
    grown(small, q, k)
    assert grown._tables["short"].shape[0] == 256
    far = torch.tensor([5, 700, 1000])
    c_grown, s_grown = grown.cos_sin(far)
    assert grown._tables["short"].shape[0] == 1024
    reserved.reserve(MAX_POS)
    assert reserved._reserved == MAX_POS
    c_res, s_res = reserved.cos_sin(far)
    assert torch.equal(c_grown, c_res) and torch.equal(s_grown, s_res)
    assert reserved._tables["short"].shape[0] == 1024


def test_table_keeps_float32_under_model_to():
    ours = RotaryEmbedding(rope_config(STATIC["default"], HEAD, MAX_POS), HEAD)
    ours.reserve(300)
    ours.to(torch.bfloat16)
    cos, _ = ours.cos_sin(torch.tensor([299]))
    assert cos.dtype == torch.float32


def test_get_rope_and_errors():
    assert get_rope(None, HEAD) is None
    with pytest.raises(ValueError, match="exceeds head_size"):
        RotaryEmbedding(RopeConfig(rotary_dim=2 * HEAD), HEAD)
    bad = RopeConfig(
        rotary_dim=HEAD,
        rope_type="longrope",
        original_max_position_embeddings=64,
        short_factor=(1.0,) * 3,
        long_factor=(1.0,) * 3,
    )
    with pytest.raises(ValueError, match="length 16"):
        RotaryEmbedding(bad, HEAD)
    with pytest.raises(ValueError, match="low_freq_factor"):
        RotaryEmbedding(
            RopeConfig(
                rotary_dim=HEAD, rope_type="llama3", factor=8.0, original_max_position_embeddings=64
            ),
            HEAD,
        )
    ours = RotaryEmbedding(rope_config(DYNAMIC, HEAD, 64), HEAD)
    with pytest.raises(ValueError, match="seq_lens"):
        ours.cos_sin(torch.arange(4), torch.tensor([4, 4]))
