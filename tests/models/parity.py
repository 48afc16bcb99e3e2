"""Parity with Hugging Face transformers: tiny random models, saved and loaded by attnserve.

``build_hf_model`` makes a tiny model from a transformers config (float32, eager attention),
saves it with ``save_pretrained``; ``hf_reference`` records its prompt log-probabilities at every
position and its greedy generation; ``run_engine`` drives attnserve's engine step by step,
checking block-pool integrity after every step; ``assert_parity`` compares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOL = 1e-4
VOCAB = 512


@dataclass
class Reference:
    prompts: list[list[int]]
    prompt_logprobs: list[torch.Tensor]  # per prompt [L - 1, V]: row i predicts token i + 1
    greedy: list[list[int]]
    greedy_logprobs: list[torch.Tensor]  # per prompt [N, V]


def build_hf_model(model_type: str, kwargs: dict, out_dir: Path, seed: int = 0, init_range: float = 0.1):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[model_type](**{"initializer_range": init_range, **kwargs})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return model


def make_prompts(lengths: list[int], vocab: int = VOCAB, seed: int = 1, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append((prefix or []) + ids)
    return out


@torch.no_grad()
def hf_reference(model, prompts: list[list[int]], max_new_tokens: int = 16) -> Reference:
    plp, greedy, glp = [], [], []
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for p in prompts:
        _reset_rope_state(model)
        ids = torch.tensor([p])
        logits = model(ids).logits[0].float()
        plp.append(torch.log_softmax(logits[:-1], dim=-1))
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
        greedy.append(gen.sequences[0, len(p):].tolist())
        glp.append(torch.log_softmax(torch.stack([x[0].float() for x in gen.logits]), dim=-1))
    return Reference(prompts, plp, greedy, glp)


def _reset_rope_state(model) -> None:
    """transformers' dynamic/longrope embeddings keep frequencies grown by earlier calls; each
    request must start from the original ones, as it does in a fresh model."""
    for m in model.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "max_seq_len_cached"):
            m.inv_freq = m.original_inv_freq.clone()
            m.max_seq_len_cached = getattr(m, "original_max_seq_len", m.max_seq_len_cached)


def run_engine(llm, prompts: list[list[int]], params, check_integrity: bool = True):
    """Submit every prompt, step until done, checking the block pool after every step."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if check_integrity:
            engine.kv_manager.check_integrity()
    if check_integrity:
        engine.kv_manager.check_integrity()
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks - 1, "blocks leaked"
    return [finals[i] for i in ids]


def assert_parity(ref: Reference, outs, *, prompt_logprobs: bool = True, tol: float = TOL) -> float:
    """Greedy tokens identical; prompt and output logprobs within ``tol``. Returns the max deviation."""
    worst = 0.0
    for i, out in enumerate(outs):
        toks = out.outputs[0].token_ids
        assert toks == ref.greedy[i], f"prompt {i}: greedy tokens differ\n attnserve {toks}\n hf        {ref.greedy[i]}"
        for step, entry in enumerate(out.outputs[0].logprobs or []):
            for tid, lp in entry.items():
                d = abs(lp.logprob - ref.greedy_logprobs[i][step, tid].item())
                worst = max(worst, d)
                assert d < tol, f"prompt {i} output step {step} token {tid}: logprob off by {d:.2e}"
        if prompt_logprobs:
            plp = out.prompt_logprobs
            assert plp is not None and len(plp) == len(ref.prompts[i]) and plp[0] is None
            for pos in range(1, len(plp)):
                assert ref.prompts[i][pos] in plp[pos], f"prompt {i} position {pos}: the prompt token is missing"
                for tid, lp in plp[pos].items():
                    d = abs(lp.logprob - ref.prompt_logprobs[i][pos - 1, tid].item())
                    worst = max(worst, d)
                    assert d < tol, f"prompt {i} position {pos} token {tid}: logprob off by {d:.2e}"
    return worst


# --- the four engine paths every family is checked on ------------------------------------------
# A family is the tuple (name, model_dir, hf_model, prompts, reference) the test files build.

MAX_TOKENS = 16


def greedy(**kw):
    from attnserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kw)


def _llm(path, **engine):
    from attnserve import LLM

    return LLM(str(path), dtype="float32", block_size=4, **engine)


def check_plain(family, **engine) -> None:
    _, path, _, prompts, ref = family
    assert_parity(ref, run_engine(_llm(path, **engine), prompts, greedy(prompt_logprobs=3)))


def check_chunked_prefill(family, chunk: int = 7, **engine) -> None:
    _, path, _, prompts, ref = family
    llm = _llm(path, max_num_batched_tokens=chunk, **engine)
    assert_parity(ref, run_engine(llm, prompts, greedy(prompt_logprobs=3)))


def check_prefix_hits(family, expected=(16, 12, 24), **engine) -> None:
    """A 24-token prompt is served, then three that share 16, 12 and all 24 of its tokens."""
    _, path, model, _, _ = family
    base = make_prompts([24], seed=7)[0]
    later = [base[:16] + make_prompts([5], seed=8)[0], base[:12] + make_prompts([9], seed=9)[0], base + [7, 8]]
    ref = hf_reference(model, later, MAX_TOKENS)
    llm = _llm(path, **engine)
    run_engine(llm, [base], greedy())
    outs = run_engine(llm, later, greedy())
    assert [o.num_cached_tokens for o in outs] == list(expected)
    assert_parity(ref, outs, prompt_logprobs=False)


def check_preemption(family, num_blocks: int = 22, **engine) -> None:
    _, path, _, prompts, ref = family
    llm = _llm(path, max_model_len=64, num_gpu_blocks_override=num_blocks, **engine)
    outs = run_engine(llm, prompts, greedy(prompt_logprobs=3))
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0, "the budget did not force a preemption"
    assert_parity(ref, outs)
