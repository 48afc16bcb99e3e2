"""What a vLLM user expects of the server and the command line (issue #23): fields the OpenAI
SDKs send ignored with a warning, ``/tokenize``, ``/detokenize``, ``/version``, ``/ping``,
``max_logprobs``, ``--tokenizer`` / ``--revision``, the start-up summary and throughput log,
progress bars, documented flags, and the server in the base install.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shutil

import httpx
import openai
import pytest

from attnserve import __version__
from attnserve.engine.async_engine import AsyncLLMEngine, EngineStats, ThroughputLogger
from attnserve.entrypoints.cli import build_parser, main
from attnserve.entrypoints.engine_args import HelpFormatter, add_engine_args, engine_kwargs
from attnserve.entrypoints.llm import LLM
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import (
    API_KEY,
    ENGINE_KWARGS,
    MODEL_NAME,
    modules_outside_the_base_install,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "What is a list?"}]


# --- requests -----------------------------------------------------------------------------------
def test_sdk_fields_are_ignored_with_a_warning(client, caplog):
    """``store``, ``metadata``, ``service_tier``, ``reasoning_effort`` (the SDK's) and vLLM's
    ``priority`` / ``request_id`` change nothing; the unknown ones are named in a warning."""
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=8, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="attnserve"):
        extra = client.chat.completions.create(
            model=MODEL_NAME, messages=MSG, max_tokens=8, temperature=0.0, store=True,
            metadata={"team": "a"}, service_tier="auto", reasoning_effort="low",
            extra_body={"priority": 0, "request_id": "abc"})
        done = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, user="u",
                                         extra_body={"cache_salt": "s"})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert done.choices[0].finish_reason is not None
    warnings = [r.getMessage() for r in caplog.records if "ignoring request fields" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("/v1/chat/completions")
    assert all(name in warnings[0] for name in ("store", "metadata", "service_tier", "priority", "request_id"))
    assert "reasoning_effort" not in warnings[0]  # known: it reaches the chat template
    assert "cache_salt" in warnings[1]


def test_fields_that_would_change_the_result_are_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                  extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search"
    assert "not supported" in info.value.body["message"]


def test_max_logprobs_caps_requests(client):
    ok = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, logprobs=20, temperature=0.0)
    # keyed by decoded text, so tokens that decode alike share a key
    assert 1 < len(ok.choices[0].logprobs.top_logprobs[0]) <= 21
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs" and "limit of 20" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MSG, logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs" and "max-logprobs" in info.value.body["message"]


# --- endpoints ----------------------------------------------------------------------------------
def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, headers=AUTH, json=body, timeout=30)


def test_tokenize_and_detokenize(server, client, reference):
    tok = reference.get_tokenizer()
    text = "def add(a, b):\n    return a + b"
    r = _post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.max_model_len and r["token_strs"] is None
    r2 = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r2["tokens"] == tok.encode(text, add_special_tokens=False)
    assert r2["token_strs"] == tok.convert_ids_to_tokens(r2["tokens"])
    # messages are rendered as the chat endpoint renders them: the count is its prompt usage
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=1)
    r3 = _post(server, "/tokenize", {"model": MODEL_NAME, "messages": MSG}).json()
    assert r3["count"] == chat.usage.prompt_tokens
    back = _post(server, "/detokenize", {"model": MODEL_NAME, "tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)}
    for path, body, status, param in (
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
    ):
        resp = _post(server, path, body)
        assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text


def test_version_and_ping(server):
    assert httpx.get(server.base_url + "/version", headers=AUTH).json() == {"version": __version__}
    for method in ("GET", "POST"):  # a probe: no key needed
        assert httpx.request(method, server.base_url + "/ping").status_code == 200


# --- engine options -----------------------------------------------------------------------------
def test_tokenizer_revision_and_max_logprobs_options(model_dir, reference, tmp_path, caplog, capsys):
    """A model directory without a tokenizer served with ``tokenizer=`` another directory;
    ``revision`` of a local directory is ignored with a warning; ``max_logprobs`` caps
    ``LLM.generate`` too; the start-up summary is logged; ``generate`` shows a progress bar
    unless ``use_tqdm=False``."""
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / f, bare / f)
    with caplog.at_level(logging.INFO, logger="attnserve"):
        llm = LLM(str(bare), tokenizer=str(model_dir), revision="main", max_logprobs=3, **ENGINE_KWARGS)
    logged = caplog.text
    assert "revision 'main' is ignored" in logged
    assert "tokens fit" in logged and "backend " in logged and "max_num_seqs 128" in logged
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    capsys.readouterr()
    out = llm.generate(["def fibonacci(n):"], params)[0]
    assert "Processed prompts" in capsys.readouterr().err  # vLLM's default: a progress bar
    ref = reference.generate(["def fibonacci(n):"], params, use_tqdm=False)[0]
    assert capsys.readouterr().err == ""
    assert out.outputs[0].text == ref.outputs[0].text and out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="max_logprobs of 3"):
        llm.generate(["x"], SamplingParams(max_tokens=2, logprobs=4))
    with pytest.raises(ValueError, match="prompt_logprobs is 5"):
        llm.generate(["x"], SamplingParams(max_tokens=2, prompt_logprobs=5))


def test_startup_summary(reference):
    engine = reference.llm_engine
    lines = engine.startup_summary()
    usable = engine.kv_manager.pool.num_blocks - 1
    assert lines[0].startswith(f"model {engine.config.model.model} (llama, 2 layers, GQA) on cpu")
    assert "dtype" in lines[0] and "KV cache dtype" in lines[0]
    kernels = engine.parts.plan.groups[0].kernel_names()  # the variants the backend was built with
    assert kernels == engine.runner.backends[0].kernels
    assert lines[1] == ("cache group 0 (full): 2 full layers (layers 0, 1): backend " + engine.parts.backend_names[0]
                        + f"; kernels attention.decode {kernels['attention.decode']}, attention.prefill torch")
    per_seq = -(-engine.max_model_len // 16)
    assert f"{usable:,} blocks of 16 tokens" in lines[2] and f"{usable * 16:,} tokens fit" in lines[2]
    assert f"holds {per_seq:,} blocks: {usable / per_seq:.2f}x" in lines[2]
    assert lines[3].startswith("batch: max_num_seqs 128 (set by the user), max_num_batched_tokens 2048 "
                               "(platform default for CPU, LLM class), ")


def test_throughput_logger_reports_while_busy_and_once_after():
    log = ThroughputLogger(10.0)
    assert log.observe(EngineStats(), 0.0) is None and log.next_due(EngineStats()) is None
    busy = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prompt_tokens=400,
                       generation_tokens=100, num_steps=50, prefix_cache_queries=400, prefix_cache_hits=100,
                       step_seconds=0.5, device_wait_seconds=0.2)
    assert log.next_due(busy) == 10.0 and log.observe(busy, 5.0) is None  # not yet due
    line = log.observe(busy, 10.0)
    assert line == ("prompt throughput 40.0 tokens/s, generation throughput 10.0 tokens/s, requests running 2, "
                    "waiting 1, KV cache usage 50.0%, prefix cache hit rate 25.0%, 50 steps of 10.00 ms "
                    "(40% waiting on the device)")
    done = EngineStats(prompt_tokens=400, generation_tokens=150, num_steps=60, num_preemptions=2,
                       step_seconds=0.55, device_wait_seconds=0.2)  # 10 steps, no wait (the CPU's)
    line = log.observe(done, 20.0)
    assert line.startswith("prompt throughput 0.0 tokens/s, generation throughput 5.0") and "2 preemptions" in line
    assert "10 steps of 5.00 ms, 2 preemptions" in line
    assert log.observe(done, 25.0) is None  # not due again yet
    quiet = log.observe(done, 30.0)  # the interval after the work stopped: one quiet line
    assert quiet is not None and "generation throughput 0.0" in quiet
    assert log.next_due(done) is None and log.observe(done, 45.0) is None  # idle: nothing


def test_serving_engine_logs_throughput(model_dir, caplog):
    engine = AsyncLLMEngine.from_kwargs(str(model_dir), log_stats_interval=0.2, **ENGINE_KWARGS)

    async def run():
        async for _ in engine.generate("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4)):
            pass
        await asyncio.sleep(0.5)  # the line after the work stopped comes while the engine idles

    try:
        with caplog.at_level(logging.INFO, logger="attnserve.engine.async_engine"):
            asyncio.run(run())
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage()]
    assert lines and "generation throughput 0.0 tokens/s" in lines[-1], lines
    rates = [float(re.search(r"generation throughput ([\d.]+)", line).group(1)) for line in lines]
    assert any(rate > 0 for rate in rates), lines


# --- command line -------------------------------------------------------------------------------
def _all_parsers(parser: argparse.ArgumentParser, name: str = "attnserve"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_flag_is_documented_with_its_default():
    """Every engine flag has help text that shows its default; every option of generate, serve,
    bench and inspect has help text; the engine flags are exactly the engine options they set."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    formatter = HelpFormatter("x")
    engine_actions = [a for a in p._actions if a.option_strings and a.dest != "help"]
    for a in engine_actions:
        assert a.help, a.option_strings
        assert "default" in formatter._get_help_string(a), a.option_strings
    from attnserve.config import EngineConfig

    EngineConfig.from_kwargs("m", **engine_kwargs(p.parse_args([])))  # the defaults are valid
    EngineConfig.from_kwargs("m", **{a.dest: None for a in engine_actions})  # every flag is an option
    assert set(engine_kwargs(argparse.Namespace(**{a.dest: 1 for a in engine_actions}))) == \
        {a.dest for a in engine_actions}
    for name, parser in _all_parsers(build_parser()):
        assert parser.formatter_class is HelpFormatter, name
        for a in parser._actions:
            if a.option_strings and a.dest not in ("help", "version"):
                assert a.help, (name, a.option_strings)
    serve = dict(_all_parsers(build_parser()))["attnserve serve"].format_help()
    assert "--max-logprobs MAX_LOGPROBS" in serve and "(default: 20)" in serve
    assert "--tokenizer" in serve and "--revision" in serve


def test_version_flag_and_log_level(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"attnserve {__version__}"
    import attnserve.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda model, kwargs, **kw: seen.append((kwargs, kw)))
    monkeypatch.setenv("ATTNSERVE_LOG_LEVEL", "debug")
    assert main(["serve", "--revision", "v1", "--tokenizer", "tok", "--max-logprobs", "5"]) == 0
    assert logging.getLogger("attnserve").level == logging.DEBUG
    kwargs, kw = seen[0]
    assert kw["log_stats_interval"] == 10.0
    assert {k: kwargs[k] for k in ("revision", "tokenizer", "max_logprobs")} == \
        {"revision": "v1", "tokenizer": "tok", "max_logprobs": 5}
    assert main(["serve", "--disable-log-stats"]) == 0 and seen[1][1]["log_stats_interval"] is None
    monkeypatch.setenv("ATTNSERVE_LOG_LEVEL", "loud")
    assert main(["serve"]) == 2
    assert "ATTNSERVE_LOG_LEVEL" in capsys.readouterr().err


# --- install ------------------------------------------------------------------------------------
def test_the_server_is_in_the_base_install():
    """fastapi, uvicorn, httpx and prometheus_client are base dependencies, and nothing the
    test extras bring is: ``test_serve_subprocess`` serves with every module outside the base
    install made unimportable (``conftest.base_install_only_prelude``)."""
    pytest.importorskip("tomllib")
    blocked = set(modules_outside_the_base_install())
    assert {"openai", "transformers", "pytest", "matplotlib"} <= blocked
    assert not {"fastapi", "uvicorn", "httpx", "prometheus_client", "starlette", "pydantic", "torch"} & blocked


def test_startup_summary_of_a_sliding_window_model(tmp_path):
    """Alternating sliding and full layers: the sliding group holds at most its window's blocks,
    so the tokens that fit are the full group's share of the pool."""
    from attnserve.config import EngineConfig
    from attnserve.engine.engine import LLMEngine
    from attnserve.presets import resolve_model_preset

    cfg = json.loads((resolve_model_preset("attnserve-tiny-llama") / "config.json").read_text())
    cfg.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
               sliding_window=64, max_position_embeddings=1024, query_pre_attn_scalar=16,
               attn_logit_softcapping=None, final_logit_softcapping=None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig.from_kwargs(str(tmp_path), load_format="dummy", dtype="float32",
                                                num_gpu_blocks_override=200))
    lines = engine.startup_summary()
    assert lines[1].startswith("cache group 0 (sliding 64): 2 sliding layers (layers 0, 2): backend ")
    assert lines[2].startswith("cache group 1 (full): 2 full layers (layers 1, 3): backend ")
    # 199 usable blocks; a sequence's sliding group holds at most 64 / 16 + 1 = 5 of them
    assert "199 blocks of 16 tokens; 3,104 tokens fit;" in lines[3]
    assert "max_model_len 1,024 holds 69 blocks: 2.88x" in lines[3]
