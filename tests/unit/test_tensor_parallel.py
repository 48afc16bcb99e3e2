"""Tensor parallelism on CPU (gloo, loopback): two ranks give what one rank gives.

Tiny random transformers models (float32, saved with ``save_pretrained``): llama with GQA (8
heads, 4 KV heads: split), llama with one KV head (replicated on both ranks), deepseek_v3 (MLA
with a q LoRA, DeepSeek MoE with a shared expert), deepseek_v32 (DSA: the replicated indexer
must pick the same top-k on both ranks; ``index_topk`` 6, below the prompt lengths) and
qwen3_next (Gated DeltaNet heads and state split, gated attention, MoE with a shared expert).
Each family runs once with ``tensor_parallel_size=1`` and once with 2 in the same order:
a batch of mixed lengths with prompt logprobs, in chunks of at most 16 tokens (mixed prefill and
decode steps), then a second batch that hits the first one's cached prefix blocks (for
qwen3_next: state snapshot restores, broadcast to the worker). Greedy tokens must be identical,
logprobs within 1e-4.

Also: the sharding happened (rank 0 holds half the heads, experts and vocabulary; llama_mqa's odd
vocabulary pads the second slice), workers exit on ``close()``, on garbage collection and when
rank 0 alone fails while building, refusals before any process starts, which KV heads each rank
keeps, per-rank ``inspect`` arithmetic, and the torchrun recipe of ``docs/tensor_parallel.md``
(two simulated hosts of two ranks each on loopback) against a one-rank run. The whole file takes about 30 s.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.entrypoints.cli import main as cli_main
from attnserve.presets import MODEL_DIR
from attnserve.runner.parallel import ParallelLMHead, VocabParallelEmbedding
from tests.models.parity import VOCAB, build_hf_model, make_prompts

TOL = 1e-4
MAX_TOKENS = 6
REPO = Path(__file__).resolve().parents[2]

_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
)
_MLA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
FAMILIES = {
    "llama_gqa": ("llama", dict(_LLAMA, num_attention_heads=8, num_key_value_heads=4)),
    # an odd vocabulary: the second rank's slice is padded
    "llama_mqa": (
        "llama",
        dict(_LLAMA, num_attention_heads=4, num_key_value_heads=1, vocab_size=509),
    ),
    "deepseek_v3": ("deepseek_v3", dict(_MLA, routed_scaling_factor=2.5)),
    "deepseek_v32": ("deepseek_v32", dict(_MLA, index_n_heads=16, index_head_dim=32, index_topk=6)),
    "qwen3_next": (
        "qwen3_next",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread here and in the spawned workers (tiny tensors, a busy 2-core box)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # read by the spawned workers' torch
        yield
    torch.set_num_threads(previous)


def _run(path: Path, tp: int, check_sharded=None):
    """Two batches through one engine: prompt logprobs with chunked prefill, then prefix hits."""
    first = make_prompts([7, 21, 30], vocab=509, seed=3)
    second = [first[1][:20] + [5, 6, 7], first[2][:17] + [9]]  # 16-token blocks of batch one
    plp = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    with LLM(
        str(path),
        dtype="float32",
        tensor_parallel_size=tp,
        max_num_batched_tokens=16,
        block_size=16,
        num_gpu_blocks_override=64,
    ) as llm:
        if check_sharded is not None:
            check_sharded(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in first], plp)
        outs += llm.generate([{"prompt_token_ids": p} for p in second], plain)
    return outs


def _assert_same(ref, outs) -> None:
    """Greedy tokens identical; every reported logprob (prompt and output) within TOL."""
    for i, (a, b) in enumerate(zip(ref, outs, strict=True)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"request {i}: tokens differ"
        pairs = list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
        if a.prompt_logprobs is not None:
            pairs += list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True))
        for pa, pb in pairs:
            assert set(pa) == set(pb), f"request {i}: different top tokens"
            for tid, lp in pa.items():
                assert abs(lp.logprob - pb[tid].logprob) < TOL, f"request {i} token {tid}"


def _check_sharded(name: str):
    def check(llm) -> None:
        runner = llm.llm_engine.runner
        workers = llm.llm_engine.workers
        assert len(workers.processes) == 1 and workers.processes[0].is_alive()
        model = runner.model
        assert isinstance(model.embed_tokens, VocabParallelEmbedding)
        vocab = FAMILIES[name][1]["vocab_size"]
        assert isinstance(model.lm_head, ParallelLMHead)
        assert model.lm_head.weight.shape[0] == (vocab + 1) // 2  # ceil(V / 2) rows per rank
        layer = model.layers[-1]
        attn = layer.self_attn
        kwargs = FAMILIES[name][1]
        if name.startswith("deepseek"):
            assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape[0] == 2 * 32
            assert layer.mlp.experts.num_experts == 2 and layer.mlp.experts.first_expert == 0
        else:
            assert attn.attn.num_heads == kwargs["num_attention_heads"] // 2
            assert attn.attn.num_kv_heads == max(1, kwargs["num_key_value_heads"] // 2)
        if name == "qwen3_next":
            gdn = model.layers[0].linear_attn
            assert (gdn.num_k_heads, gdn.num_v_heads) == (1, 2)
            assert gdn.state_cache.recurrent[0].shape[1:] == (2, 16, 16)  # this rank's heads

    return check


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    out = {}
    for name, (model_type, kwargs) in FAMILIES.items():
        out[name] = tmp_path_factory.mktemp(name)
        build_hf_model(model_type, kwargs, out[name])
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_two_ranks_equal_one(model_dirs, name):
    ref = _run(model_dirs[name], 1)
    outs = _run(model_dirs[name], 2, _check_sharded(name))
    _assert_same(ref, outs)
    assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in ref]
    assert sum(o.num_cached_tokens for o in outs[3:]) > 0, "the second batch hit no cached prefix"
    if name == "deepseek_v32":  # the sparse path is live: the longest prompt exceeds index_topk
        assert max(len(o.prompt_token_ids) for o in ref) > FAMILIES[name][1]["index_topk"]


def test_workers_exit_on_close_and_on_collection(model_dirs):
    llm = LLM(
        str(model_dirs["llama_gqa"]),
        dtype="float32",
        tensor_parallel_size=2,
        num_gpu_blocks_override=32,
    )
    (proc,) = llm.llm_engine.workers.processes
    llm.close()
    assert not proc.is_alive() and proc.exitcode == 0
    llm = LLM(
        str(model_dirs["llama_mqa"]),
        dtype="float32",
        tensor_parallel_size=2,
        num_gpu_blocks_override=32,
    )
    (proc,) = llm.llm_engine.workers.processes
    del llm
    gc.collect()
    proc.join(30)
    assert not proc.is_alive() and proc.exitcode == 0


def test_refused_before_any_process_starts(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        LLM(str(model_dirs["llama_gqa"]), dtype="float32", tensor_parallel_size=3)
    build_hf_model(
        "gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64), tmp_path
    )
    with pytest.raises(NotImplementedError, match="no sharding plan for gpt2"):
        LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2)
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_a_failure_on_rank_0_alone_stops_the_workers(model_dirs, monkeypatch):
    """The worker (a fresh process) builds fine and waits in a collective rank 0 never joins."""
    import multiprocessing

    from attnserve.engine import builder

    def fail(*args, **kwargs):
        raise RuntimeError("only on rank 0")

    monkeypatch.setattr(builder, "determine_num_blocks", fail)
    with pytest.raises(RuntimeError, match="only on rank 0"):
        LLM(str(model_dirs["llama_gqa"]), dtype="float32", tensor_parallel_size=2)
    assert not multiprocessing.active_children()
    import torch.distributed as dist

    assert not dist.is_initialized()


def _inspect(capsys, *args) -> dict:
    assert cli_main(["inspect", *args, "--platform", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_per_rank(capsys):
    llama = ["meta-llama/Llama-3.1-8B-Instruct", "--memory", "16", "--max-model-len", "8192"]
    one = _inspect(capsys, *llama)
    two = _inspect(capsys, *llama, "--tensor-parallel-size", "2")
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2 == 65_536
    assert two["max_sequences"] == 2 * one["max_sequences"] == 32
    # 8 KV heads over 16 ranks: one replicated head each
    sixteen = _inspect(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "16")
    assert sixteen["kv_bytes_per_token"] == 131_072 // 8
    # MLA: every rank keeps the whole latent row (and the indexer key)
    v32 = [
        _inspect(capsys, "deepseek-ai/DeepSeek-V3.2", "--tensor-parallel-size", str(n))
        for n in (1, 8)
    ]
    assert v32[0]["kv_bytes_per_token"] == v32[1]["kv_bytes_per_token"]
    # GDN: each rank keeps the state of its heads
    qn = [
        _inspect(capsys, "Qwen/Qwen3-Next-80B-A3B-Instruct", "--tensor-parallel-size", str(n))
        for n in (1, 2)
    ]
    assert qn[1]["state_bytes_per_sequence"] * 2 == qn[0]["state_bytes_per_sequence"]
    assert (
        cli_main(["inspect", "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "3"])
        == 2
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_hosts_on_loopback(tmp_path, capsys):
    """``docs/tensor_parallel.md``: torchrun --nnodes 2 --nproc-per-node 2, once per simulated
    host: four ranks (tiny-llama's 8 query / 4 KV heads split four ways) equal one rank."""
    model = tmp_path / "tiny"
    model.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / "attnserve-tiny-llama" / f, model / f)  # tied embeddings
    flags = "--load-format dummy --dtype float32 --max-tokens 8 --ignore-eos --max-model-len 128"
    args = ["generate", "--model", str(model), "--prompt", "def fibonacci(n):", "--prompt", "Hello"]
    args += [*flags.split(), "--num-gpu-blocks-override", "32"]
    assert cli_main(args) == 0
    expected = capsys.readouterr().out.split("Throughput")[0]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    torchrun += f"--nproc-per-node 2 --master-addr 127.0.0.1 --master-port {port}".split()
    worker = ["-m", "attnserve.entrypoints.torchrun", *args, "--tensor-parallel-size", "4"]
    hosts = [
        subprocess.Popen(
            [*torchrun, "--node-rank", str(node), *worker],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    results = []
    for h in hosts:
        try:
            results.append(h.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            for other in hosts:
                other.kill()
            raise
    for h, (_, err) in zip(hosts, results):
        assert h.returncode == 0, err[-3000:]
    assert results[0][0].split("Throughput")[0] == expected
    assert results[1][0] == ""  # the worker host prints nothing of its own


@pytest.mark.parametrize("heads,kv_heads,world", [(8, 4, 2), (8, 2, 4), (8, 1, 4), (16, 4, 8)])
def test_each_rank_keeps_the_kv_heads_of_its_query_heads(heads, kv_heads, world):
    from attnserve.arch import kv_head_share
    from attnserve.runner.parallel import ParallelState

    group = heads // kv_heads  # query heads per KV head
    for rank in range(world):
        p = ParallelState(rank, world)
        q_lo, q_hi = p.split(heads, "heads")  # the query heads the sharding pass keeps
        kv_lo, kv_n = kv_head_share(kv_heads, world, rank)  # and the KV heads
        assert kv_n == max(1, kv_heads // world)
        assert {h // group for h in range(q_lo, q_hi)} <= set(range(kv_lo, kv_lo + kv_n))
