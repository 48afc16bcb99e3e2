"""layers/moe.py: every router against transformers' router code or a hand computation, the
grouped expert computation against a per-token loop, the checkpoint layouts against
transformers' expert modules, and DeepseekMoE against DeepseekV2Moe / DeepseekV3MoE.

Inputs are drawn fresh from fixed seeds; float32 throughout; tolerances are stated per test
(routing weights 1e-6, expert outputs 1e-5 relative to values of order 1).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from attnserve.arch import MoESpec, read_arch
from attnserve.layers.moe import DeepseekMoE, FusedExperts, GatedMLP, SparseMoE, select_experts
from attnserve.models.quantized import QuantScheme, dequantize_mxfp4, dequantized_weights
from attnserve.models.weights import load_named_weights

TOL = dict(rtol=1e-5, atol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spec(**kw) -> MoESpec:
    return MoESpec(**{"num_experts": 8, "top_k": 2, "intermediate_size": 16, **kw})


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by expert id (transformers' DeepSeek routers return unsorted top-k)."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def _hf_config(model_type: str, **kw):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**kw)


def _randomise(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    g = _gen(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


# --- routers against transformers --------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_greedy_matches_qwen3_moe_and_mixtral(norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    kw = dict(hidden_size=32, num_experts_per_tok=3, norm_topk_prob=norm)
    hf = Qwen3MoeTopKRouter(_hf_config("qwen3_moe", num_experts=8, **kw))
    if norm:  # Mixtral always renormalises
        hf = MixtralTopKRouter(_hf_config("mixtral", num_local_experts=8, **kw))
    _randomise(hf, 0)
    x = torch.randn(13, 32, generator=_gen(1))
    logits, ref_w, ref_ids = hf(x)
    w, ids = select_experts(logits, _spec(top_k=3, norm_topk_prob=norm))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(13))


def test_softmax_after_topk_matches_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    hf = GptOssTopKRouter(
        _hf_config("gpt_oss", hidden_size=32, num_local_experts=8, num_experts_per_tok=4)
    )
    _randomise(hf, 2)
    x = torch.randn(13, 32, generator=_gen(3))
    logits, ref_w, ref_ids = hf(x)
    w, ids = select_experts(logits, _spec(top_k=4), softmax_after_topk=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_hf(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = _hf_config(
        "deepseek_v2",
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=2.0,
    )
    hf = DeepseekV2TopkRouter(cfg)
    _randomise(hf, 4, std=1.0)
    x = torch.randn(29, 32, generator=_gen(5))
    logits, ref_w, ref_ids = hf(x)
    spec = _spec(
        num_experts=16,
        top_k=3,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=2.0,
        norm_topk_prob=False,
    )
    w, ids = _by_id(*select_experts(logits, spec))
    ref_w, ref_ids = _by_id(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    if method == "group_limited_greedy":  # the group limit changed some choices
        _, ids_free = _by_id(*select_experts(logits, replace(spec, topk_method="greedy")))
        assert not torch.equal(ids_free, ids)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_noaux_tc_matches_hf(model_type):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cls = DeepseekV3TopkRouter if model_type == "deepseek_v3" else Glm4MoeTopkRouter
    cfg = _hf_config(
        model_type,
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    hf = cls(cfg)
    _randomise(hf, 6, std=1.0)
    x = torch.randn(29, 32, generator=_gen(7))
    logits, ref_w, ref_ids = hf(x)
    spec = _spec(
        num_experts=16,
        top_k=4,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        scoring="sigmoid",
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    bias = hf.e_score_correction_bias
    w, ids = _by_id(*select_experts(logits, spec, correction_bias=bias))
    ref_w, ref_ids = _by_id(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    # the bias and the groups both matter for this draw
    assert not torch.equal(_by_id(*select_experts(logits, spec))[1], ids)
    ungrouped = replace(spec, n_group=1, topk_group=1)
    assert not torch.equal(_by_id(*select_experts(logits, ungrouped, correction_bias=bias))[1], ids)


# --- routers by hand ----------------------------------------------------------------------


def test_group_limited_greedy_by_hand():
    # groups {0, 1} and {2, 3}; expert 1 beats expert 3, but group 1 holds the best expert
    logits = torch.tensor([[0.0, 0.1, 3.0, -5.0]])
    spec = MoESpec(
        num_experts=4,
        top_k=2,
        intermediate_size=1,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=3.0,
    )
    w, ids = select_experts(logits, spec)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(w, 3.0 * logits.softmax(-1)[:, [2, 3]])


def test_noaux_tc_by_hand():
    # sigmoid scores: group 0 = {0.9, 0.1} (sum 1.0), group 1 = {0.6, 0.6} (sum 1.2)
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.6]])
    logits = torch.log(scores / (1 - scores))
    spec = MoESpec(
        num_experts=4,
        top_k=2,
        intermediate_size=1,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
    )
    w, ids = select_experts(logits, spec)
    assert sorted(ids[0].tolist()) == [2, 3]  # the best single expert (0) is in the losing group
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0]]))
    # a bias that lifts group 0 picks it; the weights use the scores without the bias
    w, ids = select_experts(logits, spec, correction_bias=torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[1.8, 0.2]]))


def test_router_errors():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits, _spec(scoring="relu"))
    with pytest.raises(ValueError, match="topk_method"):
        select_experts(logits, _spec(topk_method="random"))
    with pytest.raises(ValueError, match="n_group"):
        select_experts(logits, _spec(topk_method="noaux_tc", n_group=3))
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, _spec(top_k=4, topk_method="noaux_tc", n_group=4, topk_group=1))


# --- grouped experts ----------------------------------------------------------------------


def _loop_reference(x, weights, ids, ex: FusedExperts) -> torch.Tensor:
    """One token and one selected expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = ex.w13[e] @ x[t] + (ex.w13_bias[e] if ex.w13_bias is not None else 0)
            gate, up = h.chunk(2)
            if ex.swiglu_limit is None:
                a = F.silu(gate) * up
            else:
                gate, up = (
                    gate.clamp(max=ex.swiglu_limit),
                    up.clamp(-ex.swiglu_limit, ex.swiglu_limit),
                )
                a = gate * torch.sigmoid(ex.swiglu_alpha * gate) * (up + 1)
            y = ex.w2[e] @ a + (ex.w2_bias[e] if ex.w2_bias is not None else 0)
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("clamped", [False, True])
def test_fused_experts_match_per_token_loop(clamped):
    g = _gen(8)
    ex = FusedExperts(
        6,
        16,
        8,
        bias=clamped,
        swiglu_limit=7.0 if clamped else None,
        swiglu_alpha=1.702 if clamped else None,
    )
    _randomise(ex, 9, std=1.0 if clamped else 0.3)  # std 1: gate/up often beyond the limit
    x = torch.randn(11, 16, generator=g)
    ids = torch.randint(0, 4, (11, 3), generator=g)  # experts 4 and 5 get no tokens
    ids[:, 1] = (ids[:, 0] + 1) % 4
    ids[:, 2] = (ids[:, 0] + 2) % 4
    weights = torch.rand(11, 3, generator=g)
    out = ex(x, weights, ids)
    torch.testing.assert_close(out, _loop_reference(x, weights, ids, ex), **TOL)
    if clamped:
        h = torch.einsum("eoh,th->teo", ex.w13, x)
        assert (h.abs() > 7).any(), "the clamp was not exercised"


def test_fused_experts_no_tokens():
    ex = FusedExperts(4, 8, 4)
    _randomise(ex, 10)
    out = ex(torch.zeros(0, 8), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, 8)


def test_per_expert_checkpoint_shards_match_mixtral_experts():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    hf = MixtralExperts(
        _hf_config("mixtral", hidden_size=16, intermediate_size=8, num_local_experts=4)
    )
    _randomise(hf, 11)
    ex = FusedExperts(4, 16, 8)
    for e in range(4):  # the checkpoint layout save_pretrained writes: w1, w3, w2 per expert
        ex.load_expert_weight(f"experts.{e}.w1.weight", hf.gate_up_proj[e, :8], e, "w1")
        ex.load_expert_weight(f"experts.{e}.w3.weight", hf.gate_up_proj[e, 8:], e, "w3")
        ex.load_expert_weight(f"experts.{e}.w2.weight", hf.down_proj[e], e, "w2")
    g = _gen(12)
    x = torch.randn(9, 16, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ex(x, w, ids), hf(x, ids, w), **TOL)
    fused = FusedExperts(4, 16, 8)  # transformers' in-memory layout, all experts at once
    fused.load_expert_weight("gate_up_proj", hf.gate_up_proj.detach(), None, "gate_up")
    fused.load_expert_weight("down_proj", hf.down_proj.detach(), None, "down")
    assert torch.equal(fused.w13, ex.w13) and torch.equal(fused.w2, ex.w2)


def test_interleaved_checkpoint_matches_gpt_oss_experts():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = _hf_config("gpt_oss", hidden_size=16, intermediate_size=8, num_local_experts=4)
    hf = GptOssExperts(cfg)
    _randomise(hf, 13, std=1.0)
    ex = FusedExperts(
        4, 16, 8, bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha
    )
    for name, shard in (
        ("gate_up_proj", "gate_up_interleaved"),
        ("gate_up_proj_bias", "gate_up_interleaved"),
        ("down_proj", "down_transposed"),
        ("down_proj_bias", "down_transposed"),
    ):
        ex.load_expert_weight(name, getattr(hf, name).detach(), None, shard)
    g = _gen(14)
    x = torch.randn(9, 16, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ex(x, w, ids), hf(x, ids, w), **TOL)


def test_loader_names_and_errors():
    assert FusedExperts.checkpoint_target("3.gate_proj.weight") == ("w13", (3, "gate"))
    assert FusedExperts.checkpoint_target("0.w2.weight") == ("w2", (0, "down"))
    assert FusedExperts.checkpoint_target("1.up_proj.bias") == ("w13_bias", (1, "up"))
    assert FusedExperts.checkpoint_target("gate_up_proj") is None
    assert SparseMoE.rename("experts.2.w3.weight") == ("experts.w13", (2, "up"))
    assert DeepseekMoE.rename("shared_experts.up_proj.weight") == (
        "shared_experts.gate_up_proj.weight",
        1,
    )
    assert (
        DeepseekMoE.rename("shared_experts.down_proj.weight") == "shared_experts.down_proj.weight"
    )
    assert GatedMLP.rename("gate_proj.weight") == ("gate_up_proj.weight", 0)
    ex = FusedExperts(4, 16, 8)
    with pytest.raises(ValueError, match="shape mismatch"):
        ex.load_expert_weight("experts.0.w1.weight", torch.zeros(16, 8), 0, "w1")
    with pytest.raises(ValueError, match="out of range"):
        ex.load_expert_weight("experts.4.w1.weight", torch.zeros(8, 16), 4, "w1")
    with pytest.raises(ValueError, match="no biases"):
        ex.load_expert_weight("experts.0.w1.bias", torch.zeros(8), 0, "w1")


# --- DeepseekMoE --------------------------------------------------------------------------


def _checkpoint_items(hf_moe, num_experts: int, inter: int):
    """transformers' fused in-memory experts -> per-expert checkpoint names."""
    items = []
    for name, t in hf_moe.state_dict().items():
        if name == "experts.gate_up_proj":
            for e in range(num_experts):
                items += [
                    (f"experts.{e}.gate_proj.weight", t[e, :inter]),
                    (f"experts.{e}.up_proj.weight", t[e, inter:]),
                ]
        elif name == "experts.down_proj":
            items += [(f"experts.{e}.down_proj.weight", t[e]) for e in range(num_experts)]
        else:
            items.append((name, t))
    return items


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_deepseek_moe_matches_hf(version):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    )
    if version == "v2":
        cfg = _hf_config("deepseek_v2", topk_method="group_limited_greedy", **kw)
        hf = DeepseekV2Moe(cfg)
    else:
        cfg = _hf_config("deepseek_v3", **kw)
        hf = DeepseekV3MoE(cfg)
    _randomise(hf, 15)
    arch = read_arch(cfg.to_dict())
    moe = DeepseekMoE(arch)
    assert (moe.gate.e_score_correction_bias is not None) == (version == "v3")
    load_named_weights(moe, _checkpoint_items(hf, 8, 16), DeepseekMoE.rename)
    x = torch.randn(1, 21, 32, generator=_gen(16))
    with torch.no_grad():
        torch.testing.assert_close(moe(x[0]), hf(x)[0], **TOL)


# --- GPT-OSS MXFP4 checkpoints ------------------------------------------------------------


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = _gen(17)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 132, (3, 10, 2), generator=g, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype=torch.float32)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), ref)
    mxfp4 = QuantScheme("mxfp4")
    items = dict(
        dequantized_weights(
            [
                ("a.gate_up_proj_blocks", blocks),
                ("a.bias", scales),
                ("a.gate_up_proj_scales", scales),
            ],
            mxfp4,
            torch.float32,
        )
    )
    assert set(items) == {"a.bias", "a.gate_up_proj"} and torch.equal(
        items["a.gate_up_proj"].float(), ref
    )
    with pytest.raises(ValueError, match="'a.down_proj_blocks' .* has no 'a.down_proj_scales'"):
        dict(dequantized_weights([("a.down_proj_blocks", blocks)], mxfp4, torch.float32))


def test_gpt_oss_loads_mxfp4_experts():
    """A checkpoint with ``*_blocks``/``*_scales`` experts loads (through ``models/quantized.py``)
    as its dequantised twin."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from attnserve.models.gpt_oss import GptOssForCausalLM

    cfg = _hf_config(
        "gpt_oss",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        max_position_embeddings=128,
        sliding_window=8,
    )
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).state_dict()
    g = _gen(18)
    quantised, expected = {}, {}
    for name in list(dense):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = dense[name].shape
            blocks = torch.randint(
                0, 256, (e, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8
            )
            scales = torch.randint(122, 128, (e, n_out, n_in // 32), generator=g, dtype=torch.uint8)
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantised[name] = dense[name]
    arch = read_arch(cfg.to_dict())
    ours, twin = GptOssForCausalLM(arch), GptOssForCausalLM(arch)
    ours.load_weights(dequantized_weights(sorted(quantised.items()), QuantScheme("mxfp4"), torch.float32))
    twin.load_weights({**{k: v for k, v in dense.items() if k not in expected}, **expected}.items())
    for (name, a), (_, b) in zip(ours.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert ours.layers[1].mlp.experts.w2.abs().sum() > 0


def test_moe_family_rename_skips_mtp_layers():
    from attnserve.models.moe_families import MoEForCausalLM

    cfg = _hf_config(
        "glm4_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,  # transformers' default of 8 is more than the 4 experts (refused)
        moe_intermediate_size=16,
    )
    model = MoEForCausalLM(read_arch(cfg.to_dict()))
    assert model.rename("model.layers.2.mlp.gate.weight") is None  # the MTP layer
    assert model.rename("model.layers.0.mlp.up_proj.weight") == (
        "layers.0.mlp.gate_up_proj.weight",
        1,
    )
    assert model.rename("model.layers.1.mlp.experts.3.down_proj.weight") == (
        "layers.1.mlp.experts.w2",
        (3, "down"),
    )
    assert model.rename("model.layers.1.self_attn.k_proj.bias") == (
        "layers.1.self_attn.qkv_proj.bias",
        "k",
    )
