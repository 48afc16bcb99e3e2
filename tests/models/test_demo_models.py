"""The demo models shipped with the package: they load, their held-out perplexity is below a
stated bound and equal to transformers', their greedy completions are the recorded ones, and
the DSA variant with a top-k covering everything is the dense MLA model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve import LLM, SamplingParams
from attnserve.presets import resolve_model_preset

DATA = Path(__file__).parent / "data"
MECHANISMS = {"attnserve-demo-gqa": "GQA", "attnserve-demo-mla": "MLA", "attnserve-demo-dsa": "SPARSE_MLA"}
CHUNK = 256
# Held-out perplexity bounds on the first six 256-token chunks of demo_held_out.txt (file openings,
# harder than the random windows training.json reports). Measured 42.8 / 52.1 / 57.9 (GQA / MLA /
# DSA) for the models trained on the H200; a random-weight model of the same shape scores about
# the vocabulary size, 4,096.
PERPLEXITY_BOUND = {"attnserve-demo-gqa": 55.0, "attnserve-demo-mla": 65.0, "attnserve-demo-dsa": 70.0}


@pytest.fixture(scope="module", params=sorted(MECHANISMS))
def demo(request):
    path = resolve_model_preset(request.param)
    assert path is not None, f"{request.param} is not shipped"
    return request.param, path, LLM(request.param, dtype="float32", max_model_len=512)


def held_out_chunks(llm) -> list[list[int]]:
    ids = llm.get_tokenizer().encode((DATA / "demo_held_out.txt").read_text())
    return [ids[i:i + CHUNK] for i in range(0, len(ids) - CHUNK, CHUNK)][:6]


def test_loads_with_its_mechanism(demo):
    name, _, llm = demo
    assert llm.llm_engine.arch.mechanism.value == MECHANISMS[name]


def test_held_out_perplexity_is_low_and_equals_transformers(demo):
    from transformers import AutoModelForCausalLM

    name, path, llm = demo
    chunks = held_out_chunks(llm)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    ours = [o.prompt_logprobs[i][c[i]].logprob for o, c in zip(outs, chunks) for i in range(1, len(c))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = []
        for c in chunks:
            lp = torch.log_softmax(hf(torch.tensor([c])).logits[0, :-1].float(), -1)
            ref.extend(lp[torch.arange(len(c) - 1), torch.tensor(c[1:])].tolist())
    ppl, ppl_hf = math.exp(-sum(ours) / len(ours)), math.exp(-sum(ref) / len(ref))
    print(f"\n[{name}] held-out perplexity {ppl:.2f} (transformers {ppl_hf:.2f})")
    assert abs(ppl - ppl_hf) / ppl_hf < 1e-3
    assert ppl < PERPLEXITY_BOUND[name]


def test_greedy_completions_are_the_recorded_ones(demo):
    name, _, llm = demo
    recorded = json.loads((DATA / "demo_completions.json").read_text())[name]
    outs = llm.generate(list(recorded), SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))
    for prompt, out in zip(recorded, outs):
        ours, want = out.outputs[0].token_ids, recorded[prompt]
        i = next((j for j, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        if i is None:
            assert len(ours) == len(want)
            continue
        # another CPU's float32 rounding may only flip a near-tie: both tokens top-2, 1e-3 apart
        top = out.outputs[0].logprobs[i]
        assert want[i] in top, f"{prompt!r}: token {i} is {ours[i]}, recorded {want[i]}"
        assert abs(top[ours[i]].logprob - top[want[i]].logprob) < 1e-3, f"{prompt!r} diverges at token {i}"


def test_dsa_with_full_topk_is_dense_mla(tmp_path):
    src = resolve_model_preset("attnserve-demo-dsa")
    dense, wide = tmp_path / "dense", tmp_path / "wide"
    shutil.copytree(src, wide)
    cfg = json.loads((wide / "config.json").read_text())
    # a top-k as long as the longest sequence (max_position_embeddings) selects every key
    (wide / "config.json").write_text(json.dumps(dict(cfg, index_topk=cfg["max_position_embeddings"])))
    shutil.copytree(src, dense)
    (dense / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v3",
                                                       architectures=["DeepseekV3ForCausalLM"])))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".indexer." not in k}, str(dense / "model.safetensors"))
    prompt = {"prompt_token_ids": LLM(str(wide), dtype="float32").get_tokenizer().encode("def main():\n    return 0\n" * 16)}
    params = SamplingParams(max_tokens=4, prompt_logprobs=0, temperature=0.0)
    a = LLM(str(wide), dtype="float32").generate(prompt, params)[0]
    b = LLM(str(dense), dtype="float32").generate(prompt, params)[0]
    assert len(a.prompt_token_ids) > 64  # longer than the demo's top-k: sparsity would matter
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        for tid in ea:
            assert abs(ea[tid].logprob - eb[tid].logprob) < 1e-4


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_inspect_shows_each_mechanism_and_its_bytes(name):
    from attnserve.entrypoints.inspect import build_report
    from attnserve.platforms import get_platform

    report = build_report(name, get_platform("cpu")).to_json()
    assert report["mechanism"] == MECHANISMS[name]
    # 6 layers, bf16; GQA: 2 KV heads x head dim 32 x (K+V); MLA: latent 64 + rope 16; DSA adds the indexer key 32
    per_token = {"attnserve-demo-gqa": 6 * 2 * 2 * 32 * 2, "attnserve-demo-mla": 6 * (64 + 16) * 2,
                 "attnserve-demo-dsa": 6 * ((64 + 16) + 32) * 2}[name]
    assert report["kv_bytes_per_token"] == per_token
