"""Host-resident sparse-MLA latents (``kv_offload_sparse_latents``) on the tiny DSA models.

The tiny DeepSeek-V3.2 and GLM-5 models of ``test_parity_dsa.py`` (``index_topk`` 6, far below
the prompts, so the indexer really selects). With the flag, each sparse layer's latent cache
is a separate host tensor and attention runs on rows gathered into a staging buffer (on CPU
both are CPU memory, but the code path is the one CUDA runs). Checked here:

- bit-exact against the all-on-device path (``==`` on greedy tokens, prompt and sample
  logprobs) through the four engine paths: a batch of mixed lengths, chunked prefill (mixed
  decode + prefill steps), prefix-cache hits, preemption; and with fp8 latent and indexer caches;
- attention really reads the host store (perturbing it changes a prefix hit's logprobs);
- capacity: under a fixed KV budget, a ``max_model_len`` that does not fit without the flag
  fits with it, and a prompt of that length gives the same output as a roomy all-device run;
- clear errors: a model without sparse MLA, tensor parallelism,
  prefix offloading, a size without the flag, a host size above what is available or below
  one sequence;
- ``attnserve inspect`` and the command line flags.

The Triton backend's path is in ``tests/kernels/test_host_latent_sparse.py``.
"""

from __future__ import annotations

import pytest
import torch

from attnserve import LLM
from attnserve.attention.backends.host_latent_sparse import HostLatentSparseBackend
from tests.models.parity import build_hf_model, make_prompts, run_engine
from tests.models.test_parity_dsa import DSA, FAMILIES, LENGTHS, _variant, params


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> model directory, each built once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model_type, kwargs = FAMILIES[name]
            cache[name] = tmp_path_factory.mktemp(name)
            build_hf_model(model_type, kwargs, cache[name])
        return cache[name]

    return get


def llm(path, **engine) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, **engine)


def outputs(outs) -> list:
    """Everything a request returns that attention decides, as plain comparable values."""

    def lp(entries):
        return [None if e is None else {t: x.logprob for t, x in e.items()} for e in entries or []]

    return [(o.outputs[0].token_ids, lp(o.prompt_logprobs), lp(o.outputs[0].logprobs)) for o in outs]


def both(path, run, **engine) -> tuple[list, list]:
    """``run(llm)`` on the all-on-device engine and on the host-latent one."""
    device = run(llm(path, **engine))
    host_llm = llm(path, kv_offload_sparse_latents=True, **engine)
    assert all(isinstance(b, HostLatentSparseBackend) for b in host_llm.llm_engine.parts.runner.backends)
    return device, run(host_llm)


PROMPTS = make_prompts(LENGTHS)


def plain(engine):
    return outputs(run_engine(engine, PROMPTS, params(prompt_logprobs=3)))


def prefix_hits(engine):
    base = make_prompts([24], seed=7)[0]
    later = [base[:16] + make_prompts([5], seed=8)[0], base + [7, 8]]
    run_engine(engine, [base], params())
    outs = run_engine(engine, later, params())
    assert [o.num_cached_tokens for o in outs] == [16, 24]
    return outputs(outs)


def preemption(engine):
    out = plain(engine)
    assert engine.llm_engine.scheduler.stats.num_preemptions > 0, "the budget did not force a preemption"
    return out


PATHS = {
    "plain": (plain, {}),
    "chunked": (plain, {"max_num_batched_tokens": 7}),
    "prefix_hits": (prefix_hits, {}),
    "preemption": (preemption, {"max_model_len": 64, "num_gpu_blocks_override": 22}),
}


@pytest.mark.parametrize("path_name", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_exact_against_all_on_device(name, path_name, built):
    run, engine = PATHS[path_name]
    device, host = both(built(name), run, **engine)
    assert host == device


def test_fp8_caches_exact(tmp_path):
    """656-byte-layout latent rows (kv_lora_rank 128) are packed on the device, stored in the
    host tensor as raw bytes, and read back the same: exact against the device path."""
    build_hf_model("deepseek_v32", dict(DSA, kv_lora_rank=128), tmp_path)
    engine = dict(kv_cache_dtype="fp8", max_num_batched_tokens=7)
    device, host = both(tmp_path, plain, **engine)
    assert host == device
    cache = llm(tmp_path, kv_offload_sparse_latents=True, **engine).llm_engine.parts.runner.model.layers[0]
    assert cache.self_attn.kv_cache["latent"].dtype == torch.uint8


def test_attention_reads_the_host_store(built):
    """Scaling the host latent rows of the cached prefix changes what a prefix hit computes
    (the staged rows come from the host store, not from a device copy)."""
    path = built("v32")
    base = make_prompts([24], seed=7)[0]
    later = [base + [7, 8]]

    def run(perturb: bool):
        engine = llm(path, kv_offload_sparse_latents=True)
        run_engine(engine, [base], params())
        if perturb:
            for layer in engine.llm_engine.parts.runner.model.layers:
                layer.self_attn.kv_cache["latent"].mul_(3.0)
        outs = run_engine(engine, later, params())
        assert outs[0].num_cached_tokens == 24
        return outputs(outs)

    clean, perturbed = run(False), run(True)
    assert clean != perturbed
    assert clean == run(False)


def test_capacity_grows_under_a_fixed_budget(built):
    """max_model_len 256 under a KV budget of 50 all-on-device blocks (200 tokens): too long
    without the flag; with it the same budget pays only indexer keys (and the staging buffer)
    and holds the sequence, whose output equals a roomy all-device run."""
    path = built("v32")
    groups = llm(path, max_model_len=64).llm_engine.parts.groups
    per_block = sum(e.spec.page_size_bytes for e in groups[0].entries)  # 3 x (latent + indexer) pages
    latent = sum(e.spec.page_size_bytes for e in groups[0].entries if e.name == "latent")
    budget = dict(kv_cache_memory=50 * per_block / 1024**3, max_num_seqs=4, max_model_len=256)
    with pytest.raises(ValueError, match="one sequence of max_model_len=256"):
        llm(path, **budget)
    without = llm(path, **{**budget, "max_model_len": 128}).llm_engine.parts.num_blocks
    host = llm(path, kv_offload_sparse_latents=True, **budget)
    with_flag = host.llm_engine.parts.num_blocks
    assert without == 51
    # the device pays (per_block - latent) per block after the staging reserve
    assert with_flag > 1.5 * without and with_flag - 1 >= 64
    assert with_flag < 50 * per_block // (per_block - latent) + 1
    prompt = make_prompts([240], seed=11)  # + 16 new tokens: max_model_len
    got = outputs(run_engine(host, prompt, params(prompt_logprobs=1)))
    want = outputs(run_engine(llm(path, max_model_len=256), prompt, params(prompt_logprobs=1)))
    assert got == want


def test_clear_errors(built, tmp_path):
    path = built("v32")
    dense = _variant(path, tmp_path / "dense", {"model_type": "deepseek_v3", "architectures":
                                                 ["DeepseekV3ForCausalLM"]}, drop=("indexer.",))
    with pytest.raises(ValueError, match="has no sparse-MLA layers"):
        llm(dense, kv_offload_sparse_latents=True)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        llm(path, kv_offload_sparse_latents=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        llm(path, kv_offload_sparse_latents=True, kv_offloading_size=0.01)
    with pytest.raises(ValueError, match="set that too"):
        llm(path, kv_offload_sparse_latents_size=1.0)
    with pytest.raises(ValueError, match="of host memory is available"):
        llm(path, kv_offload_sparse_latents=True, kv_offload_sparse_latents_size=1e6)
    with pytest.raises(ValueError, match="one sequence of max_model_len needs"):
        llm(path, kv_offload_sparse_latents=True, kv_offload_sparse_latents_size=1e-5)


def test_host_size_caps_the_blocks(built):
    """kv_offload_sparse_latents_size bounds the host store, and so the block count."""
    path = built("v32")
    parts = llm(path, kv_offload_sparse_latents=True, max_model_len=64).llm_engine.parts
    latent = sum(e.spec.page_size_bytes for e in parts.groups[0].entries if e.name == "latent")
    size = 40 * latent
    capped = llm(path, kv_offload_sparse_latents=True, max_model_len=64,
                 kv_offload_sparse_latents_size=size / 1024**3).llm_engine.parts
    assert parts.num_blocks > 40 and capped.num_blocks == 40


def test_inspect_reports_device_bytes_with_host_latents():
    from attnserve.entrypoints.inspect import build_report
    from attnserve.platforms import get_platform

    cuda = get_platform("cuda", (9, 0))
    report = build_report("deepseek-ai/DeepSeek-V3.2", cuda, kv_cache_dtype="fp8", memory_gib=80)
    assert report.kv_bytes_per_token == 61 * (656 + 132)
    assert report.device_bytes_per_token_host_latents == 61 * 132
    info = report.to_json()["sparse_latent_offload"]
    assert info == {"device_bytes_per_token": 8052, "host_bytes_per_token": 61 * 656,
                    "max_tokens": 80 * 1024**3 // 8052}
    assert "With --kv-offload-sparse-latents: 8,052 B per token on the device" in report.render()
    dense = build_report("Qwen/Qwen3-8B", cuda)
    assert dense.device_bytes_per_token_host_latents is None
    assert "sparse_latent_offload" not in dense.to_json() and "--kv-offload-sparse" not in dense.render()


def test_command_line_flags():
    import argparse

    from attnserve.entrypoints.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-offload-sparse-latents", "--kv-offload-sparse-latents-size", "2.5"])
    kw = engine_kwargs(args)
    assert kw["kv_offload_sparse_latents"] is True and kw["kv_offload_sparse_latents_size"] == 2.5
    assert "kv_offload_sparse_latents" not in engine_kwargs(p.parse_args([]))
