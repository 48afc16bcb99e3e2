"""The memory plan on CUDA: no step the engine accepts can exceed it (skipped without a GPU).

An engine is planned under a small budget (``gpu_memory_utilization`` a few GiB above what is in
use), the process's allocator is capped at the same fraction of the device, and then the steps
that allocate the most run: one request of ``max_model_len - 1`` tokens with the most prompt
logprobs (its chunks follow the longest context, where an MLA prefill expands it a bounded
chunk at a time), then ``max_num_seqs`` requests decoding together with the most logprobs (in
CUDA graphs). None may fail. And an engine deleted in the same process gives its memory back:
the next one gets as many blocks.

On the GPU machine: ``TRITON_INTERPRET=0 python -m pytest tests/models/test_memory_plan.py``.
The shapes are DeepSeek-V3's attention (128 heads, rank 512) in two layers (one dense, one MoE
of four experts), DeepSeek-V3.2's with its indexer, and Llama-3.1-8B's in two layers.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIGS = Path(__file__).resolve().parents[2] / "src/attnserve/presets/hf_configs"
CUTS = {
    "deepseek_v3": ("deepseek-ai__DeepSeek-V3.json", dict(num_hidden_layers=2, first_k_dense_replace=1,
                                                          n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                          topk_group=1)),
    "deepseek_v32": ("deepseek-ai__DeepSeek-V3.2.json", dict(num_hidden_layers=2, first_k_dense_replace=1,
                                                             n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                             topk_group=1)),
    "llama": ("meta-llama__Llama-3.1-8B-Instruct.json", dict(num_hidden_layers=2)),
}
MAX_LEN = 32768
GIB = 1 << 30


def _model(tmp_path: Path, name: str) -> str:
    file, overrides = CUTS[name]
    cfg = json.loads((CONFIGS / file).read_text())
    cfg.pop("quantization_config", None)
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _free_all() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", sorted(CUTS))
def test_planned_under_a_small_budget_no_step_fails(name, tmp_path):
    path = _model(tmp_path, name)
    _free_all()
    free, total = torch.cuda.mem_get_info()
    # what the weights will take, measured by a first engine; then a budget of 6 GiB beyond them
    probe = LLM(path, load_format="dummy", max_model_len=MAX_LEN, max_num_seqs=8, kv_cache_memory=0.5,
                enforce_eager=True)
    weights = sum(p.numel() * p.element_size() for p in probe.llm_engine.runner.model.parameters())
    del probe
    _free_all()
    used = total - torch.cuda.mem_get_info()[0]
    fraction = (used + weights + 6 * GIB) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        llm = LLM(path, load_format="dummy", max_model_len=MAX_LEN, max_num_seqs=64, gpu_memory_utilization=fraction,
                  max_num_batched_tokens=8192)
        blocks = llm.llm_engine.parts.num_blocks
        assert blocks * llm.llm_engine.parts.config.cache.block_size >= MAX_LEN, "the plan left no room for one sequence"
        vocab = llm.llm_engine.arch.vocab_size
        long = [(7 * j + 3) % vocab for j in range(MAX_LEN - 1)]
        out = llm.generate([{"prompt_token_ids": long}],
                           SamplingParams(max_tokens=1, prompt_logprobs=20, ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "length" and len(out.prompt_logprobs) == MAX_LEN - 1
        many = [{"prompt_token_ids": [(11 * i + j) % vocab for j in range(64)]} for i in range(64)]
        outs = llm.generate(many, SamplingParams(max_tokens=16, logprobs=20, temperature=1.0, top_p=0.9, top_k=50,
                                                 ignore_eos=True))
        assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 16 for o in outs)
        del llm, out, outs
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        _free_all()


def test_a_deleted_engine_leaves_the_next_the_whole_device(tmp_path):
    path = _model(tmp_path, "llama")
    kwargs = dict(load_format="dummy", max_model_len=4096, max_num_seqs=16, gpu_memory_utilization=0.5)
    _free_all()
    first = LLM(path, **kwargs)
    blocks = first.llm_engine.parts.num_blocks
    first.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, SamplingParams(max_tokens=4))
    del first  # no gc.collect, no empty_cache: the next engine must manage on its own
    second = LLM(path, **kwargs)
    assert second.llm_engine.parts.num_blocks >= 0.99 * blocks
    del second
    _free_all()
