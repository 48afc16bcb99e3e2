"""Batch limits by platform, device memory and usage context (``engine/batch_limits.py``).

The resolution table per device class and usage context, values the user sets winning over it,
the caps on defaults (state slots, KV blocks; never on a user's value), the chunked-prefill
rule, and what ``inspect``, ``--help`` and the start-up log say about the choice. No GPU: the
device type and memory are passed in, or the budget is mocked.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from attnserve import LLM
from attnserve.config import EngineConfig, SchedulerConfig
from attnserve.engine import builder
from attnserve.engine.async_engine import AsyncLLMEngine
from attnserve.engine.batch_limits import (
    BATCH_DEFAULTS,
    BatchLimits,
    device_class,
    resolve_batch_limits,
)
from attnserve.engine.engine import LLMEngine
from attnserve.entrypoints.cli import build_parser, main

GIB = 1024**3
H200, L4 = 141 * GIB, 24 * GIB


@pytest.mark.parametrize(("device_type", "memory", "cls"), [
    ("cuda", H200, "gpu-large"), ("cuda", 70 * GIB, "gpu-large"), ("cuda", 70 * GIB - 1, "gpu"),
    ("cuda", L4, "gpu"), ("cuda", None, "gpu"), ("cpu", None, "cpu"), ("cpu", H200, "cpu"),
])
@pytest.mark.parametrize("usage", ["llm", "server"])
def test_defaults_come_from_the_table_by_device_class_and_usage(device_type, memory, cls, usage):
    assert device_class(device_type, memory) == cls
    limits = resolve_batch_limits(SchedulerConfig(), device_type, memory, usage, max_model_len=4096)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == BATCH_DEFAULTS[(cls, usage)]
    assert limits.seqs_reason == limits.tokens_reason and limits.seqs_reason.startswith("platform default for ")
    assert not limits.seqs_by_user


def test_the_table_grows_with_the_device_and_keeps_the_cpu_as_it_was():
    # the CPU defaults are the engine's old ones, in both contexts
    assert BATCH_DEFAULTS[("cpu", "llm")] == BATCH_DEFAULTS[("cpu", "server")] == (128, 2048)
    for usage in ("llm", "server"):
        large, small, cpu = (BATCH_DEFAULTS[(c, usage)] for c in ("gpu-large", "gpu", "cpu"))
        assert large[0] >= small[0] >= cpu[0] and large[1] >= small[1] >= cpu[1]
    for cls in ("gpu-large", "gpu"):  # a server keeps its steps no longer than an offline batch's
        assert BATCH_DEFAULTS[(cls, "server")][1] <= BATCH_DEFAULTS[(cls, "llm")][1]
    assert BATCH_DEFAULTS[("gpu-large", "llm")][1] > BATCH_DEFAULTS[("cpu", "llm")][1]


def test_the_reason_names_the_platform_and_the_context():
    llm = resolve_batch_limits(SchedulerConfig(), "cuda", H200, "llm", 4096)
    server = resolve_batch_limits(SchedulerConfig(), "cuda", L4, "server", 4096)
    assert llm.describe().endswith("(platform default for GPU >= 70 GiB, LLM class)")
    assert server.describe().endswith("(platform default for GPU < 70 GiB, OpenAI server)")


@pytest.mark.parametrize("device_type,memory", [("cuda", H200), ("cuda", L4), ("cpu", None)])
def test_values_the_user_sets_win(device_type, memory):
    limits = resolve_batch_limits(SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=333), device_type,
                                  memory, "llm", 4096)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (7, 333)
    assert limits.describe() == "max_num_seqs 7, max_num_batched_tokens 333 (set by the user)"
    # one set, the other by platform
    only = resolve_batch_limits(SchedulerConfig(max_num_seqs=5), device_type, memory, "server", 4096)
    cls = device_class(device_type, memory)
    assert (only.max_num_seqs, only.max_num_batched_tokens) == (5, BATCH_DEFAULTS[(cls, "server")][1])
    assert only.seqs_reason == "set by the user" and only.tokens_reason.startswith("platform default")


def test_a_default_max_num_seqs_stays_within_the_users_token_budget():
    limits = resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=512), "cuda", H200, "llm", 4096)
    assert limits.max_num_seqs == 512 and "lowered to max_num_batched_tokens" in limits.seqs_reason
    # a user's own max_num_seqs is not lowered
    mine = resolve_batch_limits(SchedulerConfig(max_num_seqs=900, max_num_batched_tokens=512), "cuda", H200,
                                "llm", 4096)
    assert mine.max_num_seqs == 900


def test_without_chunked_prefill_the_token_budget_holds_a_whole_prompt():
    off = SchedulerConfig(enable_chunked_prefill=False)
    limits = resolve_batch_limits(off, "cpu", None, "llm", max_model_len=32768)
    assert limits.max_num_batched_tokens == 32768 and "raised to max_model_len" in limits.tokens_reason
    assert resolve_batch_limits(off, "cpu", None, "llm", max_model_len=1024).max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2048\) is smaller than max_model_len \(4096\)"):
        resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=2048, enable_chunked_prefill=False),
                             "cuda", H200, "llm", 4096)


def test_caps_lower_only_defaults_and_say_so():
    default = resolve_batch_limits(SchedulerConfig(), "cuda", H200, "llm", 4096)
    state = 74 * 1024**2  # Qwen3-Next's state per sequence
    capped = default.cap_by_state(10 * GIB, state, snapshots_per_seq=1)
    assert capped.max_num_seqs == 10 * GIB // 2 // (2 * state) < default.max_num_seqs
    assert f"capped from {default.max_num_seqs}" in capped.seqs_reason
    assert capped.max_num_batched_tokens == default.max_num_batched_tokens
    assert default.cap_by_state(10 * GIB, state, snapshots_per_seq=0).max_num_seqs == 10 * GIB // 2 // state
    assert default.cap_by_state(10**15, state, 1) is default  # room for all: unchanged
    assert default.cap_by_blocks(300).max_num_seqs == 300
    assert "the KV cache holds 300 blocks" in default.cap_by_blocks(300).seqs_reason
    assert default.cap_by_blocks(5000) is default
    assert default.cap_by_state(0, state, 1).max_num_seqs == 1  # never below one
    user = resolve_batch_limits(SchedulerConfig(max_num_seqs=1024), "cuda", H200, "llm", 4096)
    assert user.cap_by_state(10 * GIB, state, 1) is user and user.cap_by_blocks(3) is user


def test_the_builder_caps_a_hybrid_models_state_slots_by_the_gpu_budget(monkeypatch):
    """``_cap_by_state`` with a mocked budget: half of it for the slots (one running and one
    snapshot per sequence), only on CUDA, and a user's value untouched."""
    monkeypatch.setattr(builder, "device_budget_bytes", lambda cache, device: 20 * GIB)
    plan = SimpleNamespace(state_groups=("gdn",), state_bytes_per_sequence=100 * 1024**2)
    config = EngineConfig.from_kwargs("m")
    limits = resolve_batch_limits(config.scheduler, "cuda", H200, "llm", 4096)
    capped = builder._cap_by_state(plan, config, limits, torch.device("cuda"), None)
    assert capped.max_num_seqs == 20 * GIB // 2 // (200 * 1024**2)
    assert builder._cap_by_state(plan, config, limits, torch.device("cpu"), None) is limits
    no_prefix = EngineConfig.from_kwargs("m", enable_prefix_caching=False)
    assert builder._cap_by_state(plan, no_prefix, limits, torch.device("cuda"), None).max_num_seqs == 102
    dense = SimpleNamespace(state_groups=(), state_bytes_per_sequence=0)
    assert builder._cap_by_state(dense, config, limits, torch.device("cuda"), None) is limits
    user = resolve_batch_limits(SchedulerConfig(max_num_seqs=1024), "cuda", H200, "llm", 4096)
    assert builder._cap_by_state(plan, config, user, torch.device("cuda"), None) is user


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_bad_limits_and_contexts_are_refused(bad):
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        SchedulerConfig(max_num_seqs=bad)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        SchedulerConfig(max_num_batched_tokens=bad)


def test_an_unknown_usage_context_is_refused():
    with pytest.raises(ValueError, match="usage_context must be one of"):
        EngineConfig.from_kwargs("m", usage_context="batch")
    with pytest.raises(ValueError, match="usage_context must be one of"):
        resolve_batch_limits(SchedulerConfig(), "cpu", None, "batch", 4096)
    with pytest.raises(ValueError, match="no batch defaults for device type 'mps'"):
        resolve_batch_limits(SchedulerConfig(), "mps", None, "llm", 4096)


def test_the_cpu_engine_runs_with_the_old_defaults_and_logs_why():
    llm = LLM("attnserve-demo-gqa", load_format="dummy", kv_cache_memory=0.01, max_model_len=256)
    engine = llm.llm_engine
    sched = engine.config.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (128, 2048)
    assert engine.scheduler.config is sched and engine.config.usage_context == "llm"
    assert engine.parts.batch_limits == BatchLimits(128, 2048, "platform default for CPU, LLM class",
                                                    "platform default for CPU, LLM class")
    batch = next(line for line in engine.startup_summary() if line.startswith("batch: "))
    assert batch.startswith("batch: max_num_seqs 128, max_num_batched_tokens 2048 (platform default for CPU, "
                            "LLM class), chunked prefill on")
    assert llm.generate([[1, 2, 3]] * 3, use_tqdm=False)[0].outputs[0].token_ids


def test_the_server_engine_takes_the_server_defaults_and_a_user_value_says_so():
    config = EngineConfig.from_kwargs("attnserve-demo-gqa", usage_context="server", load_format="dummy",
                                      kv_cache_memory=0.01, max_model_len=256, max_num_batched_tokens=1024)
    engine = LLMEngine(config)
    line = next(x for x in engine.startup_summary() if x.startswith("batch: "))
    assert line.startswith("batch: max_num_seqs 128 (platform default for CPU, OpenAI server), "
                           "max_num_batched_tokens 1024 (set by the user)")


def test_the_async_engine_builds_for_the_server(monkeypatch):
    seen = {}

    class FakeEngine:
        def __init__(self, config):
            seen["config"] = config

    monkeypatch.setattr("attnserve.engine.async_engine.LLMEngine", FakeEngine)
    monkeypatch.setattr(AsyncLLMEngine, "__init__", lambda self, engine, log_stats_interval=None: None)
    AsyncLLMEngine.from_kwargs("attnserve-demo-gqa", max_num_seqs=3)
    assert seen["config"].usage_context == "server" and seen["config"].scheduler.max_num_seqs == 3


def test_inspect_shows_the_defaults_for_the_device(capsys):
    assert main(["inspect", "attnserve-demo-gqa", "--platform", "cuda", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    seqs, tokens = BATCH_DEFAULTS[("gpu-large", "llm")]
    assert f"max_num_seqs {seqs}, max_num_batched_tokens {tokens} (platform default for GPU >= 70 GiB, " \
           f"LLM class)" in out
    assert "OpenAI server" in out and "GPU < 70 GiB" not in out
    assert main(["inspect", "attnserve-demo-gqa", "--platform", "cpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["batch_limits"]
    assert [(r["usage_context"], r["max_num_seqs"], r["max_num_batched_tokens"]) for r in rows] == \
        [("llm", 128, 2048), ("server", 128, 2048)]
    assert rows[0]["max_num_seqs_reason"] == "platform default for CPU, LLM class"


def test_help_quotes_the_table():
    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    tokens = BATCH_DEFAULTS[("gpu-large", "llm")][1]
    assert f"{tokens}/{BATCH_DEFAULTS[('gpu-large', 'server')][1]}" in " ".join(text.split())
