"""Issue #38, points 1 and 10: a vLLM user's command lines and ``LLM(...)`` keywords work
unchanged. ``serve --model``, ``--config FILE.yaml``, CORS (``--allowed-origins`` ...),
``--enable-log-requests``, several ``--served-model-name``s; vLLM's flags that change nothing
here (one log line each, saying why) and those asking for what attnserve does not do (refused
with the reason); the same for ``LLM(...)``; ``generate``'s sampling from the model's
generation_config.json; one count of KV blocks in the start-up log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil

import httpx
import pytest

from attnserve.config import VLLM_ONLY_OPTIONS, EngineConfig
from attnserve.entrypoints.cli import build_parser, generate_sampling_params, main
from attnserve.entrypoints.engine_args import add_engine_args
from attnserve.entrypoints.llm import LLM
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME


@pytest.fixture
def served(monkeypatch):
    """``serve`` runs up to ``run_server``, which checks the engine keywords as the engine's start
    does and records what it was given."""
    import attnserve.entrypoints.openai.api_server as api_server

    seen = []

    def run_server(model, engine_kwargs, **kw):
        EngineConfig.from_kwargs(model, usage_context="server", **engine_kwargs)
        seen.append({"model": model, **engine_kwargs, **kw})

    monkeypatch.setattr(api_server, "run_server", run_server)
    return seen


class _Records(logging.Handler):
    """The records of the ``attnserve`` logger, read at the logger itself (it may not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, part: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if part in r.getMessage()]


@pytest.fixture
def log():
    logger = logging.getLogger("attnserve")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


# --- the model: positional or --model -----------------------------------------------------------
def test_serve_takes_the_model_as_vllm_does(served, capsys):
    assert main(["serve", "--model", "org/a"]) == 0 and served[-1]["model"] == "org/a"
    assert main(["serve", "org/a", "--model", "org/a"]) == 0 and served[-1]["model"] == "org/a"
    assert main(["serve", "org/a", "--model", "org/b"]) == 2
    assert "'org/a' (positional) and --model 'org/b'" in _error(capsys)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "a Hugging Face hub id" in help_text and "model directory (default" not in help_text


# --- --config FILE.yaml ------------------------------------------------------------------------
def test_config_file_gives_flags_the_command_line_overrides(served, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: org/from-file\n"
                      "max-model-len: 256\n"                # vLLM's spelling
                      "max_num_seqs: 8\n"                   # underscores
                      "--port: 9001\n"                      # with the dashes
                      "enable-prefix-caching: false\n"      # --no-enable-prefix-caching
                      "trust-remote-code: true\n"           # a switch
                      "enforce-eager: false\n"              # a switch left off
                      "served-model-name: [a, b]\n"         # several values
                      "allowed-origins: ['https://x.example']\n"  # JSON for a JSON flag
                      "uvicorn-log-level: warning\n")
    assert main(["serve", "--config", str(config), "--max-num-seqs", "4"]) == 0
    got = served[-1]
    assert got["model"] == "org/from-file" and got["port"] == 9001 and got["log_level"] == "warning"
    assert (got["max_model_len"], got["max_num_seqs"], got["enable_prefix_caching"]) == (256, 4, False)
    assert got["trust_remote_code"] is True and "enforce_eager" not in got
    assert got["served_model_name"] == ["a", "b"]
    assert got["cors"]["allow_origins"] == ["https://x.example"]
    assert main(["serve", "org/cli", "--config", str(config)]) == 0 and served[-1]["model"] == "org/cli"
    assert main(["serve", "--model", "org/cli", "--config", str(config)]) == 0
    assert served[-1]["model"] == "org/cli"


@pytest.mark.parametrize("content, message", [
    ("max-model-len: 256\nno-such-flag: 1\n",
     "unknown key 'no-such-flag': `attnserve serve` has no flag --no-such-flag"),
    ("port: not-a-port\n", "argument --port: must be an integer"),
    ("trust-remote-code: 1\n", "trust-remote-code is a switch: true or false, got 1"),
    ("- port\n", "expected a mapping of flag names to values, got list"),
    ("port: [\n", "cannot read YAML"),
    ("config: other.yaml\n", "unknown key 'config'"),
])
def test_config_file_errors_name_the_file_and_the_key(content, message, served, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    assert main(["serve", "--config", str(config)]) == 2
    line = _error(capsys)
    assert line.startswith(f"error: --config {config}: ") and message in line, line
    assert not served


def test_generate_takes_a_config_file(tmp_path, monkeypatch):
    import attnserve.entrypoints.llm as llm

    seen = []

    class Stop(Exception):
        pass

    def engine(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(llm, "LLMEngine", engine)
    config = tmp_path / "gen.yaml"
    config.write_text("model: org/m\nprompt: [a, b]\nmax-tokens: 3\nswap_space: 4\nno-enable-chunked-prefill: true\n")
    with pytest.raises(Stop):
        main(["generate", "--config", str(config)])
    assert seen[0].model.model == "org/m" and seen[0].scheduler.enable_chunked_prefill is False


# --- vLLM's flags that change nothing here, and those refused ----------------------------------
def test_flags_that_change_nothing_are_logged_once_each(served, log):
    argv = ["serve", "--trust-remote-code", "--swap-space", "4", "--disable-custom-all-reduce",
            "--max-seq-len-to-capture", "8192", "--distributed-executor-backend", "mp", "--tokenizer-mode", "auto",
            "-O", "3", "--pipeline-parallel-size", "1", "-dp", "1", "--dtype", "half"]
    assert main(argv) == 0
    lines = log.messages("(a vLLM option) changes nothing here")
    names = sorted(line.split("=")[0] for line in lines)
    assert names == sorted(["trust_remote_code", "swap_space", "disable_custom_all_reduce", "max_seq_len_to_capture",
                            "distributed_executor_backend", "tokenizer_mode", "compilation_config"])
    assert all(r.levelno == logging.INFO for r in log.records if "vLLM option" in r.getMessage())
    assert served[-1]["dtype"] == "half"  # vLLM's name of float16
    assert EngineConfig.from_kwargs("m", dtype="half").model.dtype == "float16"


def test_chunked_prefill_is_a_real_flag(served):
    assert main(["serve", "--no-enable-chunked-prefill"]) == 0 and served[-1]["enable_chunked_prefill"] is False
    config = EngineConfig.from_kwargs("m", **{k: v for k, v in served[-1].items() if k == "enable_chunked_prefill"})
    assert config.scheduler.enable_chunked_prefill is False


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2: pipeline parallelism is not implemented"),
    (["-pp", "4"], "pipeline_parallel_size=4: pipeline parallelism is not implemented"),
    (["--data-parallel-size", "2"], "data_parallel_size=2: data parallelism is not implemented"),
    (["--speculative-config", '{"method": "ngram"}'], "speculative decoding is not implemented"),
    (["--enable-lora"], "enable_lora=True: LoRA adapters are not supported"),
    (["-q", "awq"], "quantization='awq' is not supported: attnserve loads checkpoints quantised with fp8"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode='mistral': not supported"),
    (["--distributed-executor-backend", "ray"], "distributed_executor_backend='ray': not supported"),
    (["--allowed-methods", '["GET"]'], "--allowed-methods need --allowed-origins"),
    (["--allow-credentials"], "--allow-credentials need --allowed-origins"),
])
def test_flags_for_what_attnserve_does_not_do_are_refused(argv, message, served, capsys):
    assert main(["serve", *argv]) == 2
    line = _error(capsys)
    assert line.startswith("error: ") and message in line, line
    assert not served


@pytest.mark.parametrize("argv, message", [
    (["--allowed-origins", "*"], "argument --allowed-origins: must be a JSON list of strings"),
    (["--allowed-origins", '"https://a"'], "argument --allowed-origins: must be a JSON list of strings"),
    (["--swap-space", "-1"], "argument --swap-space: must be a finite number >= 0"),
    (["--pipeline-parallel-size", "0"], "argument --pipeline-parallel-size/-pp: must be an integer in [1, 1024]"),
    (["--tokenizer-mode", "fast"], "argument --tokenizer-mode: invalid choice"),
])
def test_bad_values_of_vllm_flags_are_parse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and message in _error(capsys)


def test_every_vllm_only_option_has_its_flag():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    dests = {a.dest for a in p._actions}
    assert set(VLLM_ONLY_OPTIONS) - {"disable_log_stats"} <= dests  # the server's is its own flag


# --- LLM(...) keywords ----------------------------------------------------------------------------
def test_llm_takes_vllm_keywords(model_dir, log):
    """vLLM's keywords build the same engine, each no-op logged once; the KV block count of the
    allocation log line and of the start-up summary agree."""
    llm = LLM(str(model_dir), trust_remote_code=True, swap_space=4, quantization=None, pipeline_parallel_size=1,
              enable_lora=False, disable_log_stats=True, **ENGINE_KWARGS)
    records = log.messages()
    for name in ("trust_remote_code", "swap_space", "disable_log_stats"):
        assert sum(m.startswith(f"{name}=") for m in records) == 1, name
    assert not any(m.startswith(("quantization", "pipeline_parallel_size", "enable_lora")) for m in records)
    usable = llm.llm_engine.kv_manager.pool.num_blocks - 1
    counts = [m for m in records if m.startswith("KV cache: ")]
    assert len(counts) == 2 and all(m.startswith(f"KV cache: {usable:,} blocks of ") for m in counts), counts
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, error, message", [
    ({"pipeline_parallel_size": 2}, ValueError, "pipeline_parallel_size=2: pipeline parallelism"),
    ({"quantization": "gptq"}, ValueError, "quantization='gptq' is not supported"),
    ({"enable_lora": True}, ValueError, "enable_lora=True: LoRA adapters are not supported"),
    ({"speculative_config": {"method": "eagle"}}, ValueError, "speculative decoding is not implemented"),
    ({"trust_remote_code": "yes"}, ValueError, "trust_remote_code must be a bool, got 'yes'"),
    ({"swap_space": "4"}, ValueError, "swap_space must be a int or float, got '4'"),
    ({"not_an_option": 1}, TypeError, "unknown engine option 'not_an_option'"),
])
def test_llm_refuses_what_it_cannot_do_before_loading(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        LLM("no/such-model", **kwargs)


# --- the server: CORS, the request log, several served names --------------------------------------
@pytest.fixture(scope="module")
def engine(model_dir):
    from attnserve.engine.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine.from_kwargs(str(model_dir), **ENGINE_KWARGS)
    eng.start()
    yield eng
    eng.shutdown()


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_cors_headers_only_with_allowed_origins(engine):
    from attnserve.entrypoints.openai.api_server import build_app

    origin = {"Origin": "https://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    plain = build_app(engine, MODEL_NAME, api_key="k")
    assert "access-control-allow-origin" not in _call(plain, "GET", "/health", headers=origin).headers
    assert _call(plain, "OPTIONS", "/v1/completions", headers=preflight).status_code in (401, 405)
    cors = {"allow_origins": ["https://app.example"], "allow_methods": ["*"], "allow_headers": ["*"],
            "allow_credentials": False}
    app = build_app(engine, MODEL_NAME, api_key="k", cors=cors)
    answer = _call(app, "OPTIONS", "/v1/completions", headers=preflight)  # no key: preflights carry none
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    refused = _call(app, "GET", "/v1/models", headers=origin)  # a 401 the page can read
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    other = _call(app, "GET", "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_cors_flags_reach_the_server(served):
    assert main(["serve"]) == 0 and served[-1]["cors"] is None
    assert main(["serve", "--allowed-origins", '["*"]', "--allow-credentials", "--allowed-headers", '["x-a"]']) == 0
    assert served[-1]["cors"] == {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["x-a"],
                                  "allow_credentials": True}


def test_request_log(engine, served, log):
    from attnserve.entrypoints.openai.api_server import build_app

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}
    assert _call(build_app(engine, MODEL_NAME), "POST", "/v1/completions", json=body).status_code == 200
    assert not log.messages("Received request")
    app = build_app(engine, MODEL_NAME, log_requests=True)
    assert _call(app, "POST", "/v1/completions", json=body).status_code == 200
    lines = log.messages("Received request")
    assert len(lines) == 1 and "prompt 3 tokens" in lines[0] and "max_tokens=2" in lines[0], lines
    assert main(["serve"]) == 0 and served[-1]["log_requests"] is False
    assert main(["serve", "--enable-log-requests"]) == 0 and served[-1]["log_requests"] is True
    assert main(["serve", "--disable-log-requests"]) == 0 and served[-1]["log_requests"] is False


def test_several_served_model_names(engine, served, capsys):
    from attnserve.entrypoints.openai.api_server import build_app

    app = build_app(engine, ["tiny", "org/alias"])
    assert [m["id"] for m in _call(app, "GET", "/v1/models").json()["data"]] == ["tiny", "org/alias"]
    assert _call(app, "GET", "/v1/models/org/alias").json()["id"] == "org/alias"
    body = {"model": "org/alias", "prompt": "x", "max_tokens": 1}
    answer = _call(app, "POST", "/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == "tiny"  # the first name, as vLLM reports
    assert _call(app, "POST", "/v1/completions", json={**body, "model": "other"}).status_code == 404
    assert main(["serve", "m", "--served-model-name", "a", "b"]) == 0 and served[-1]["served_model_name"] == ["a", "b"]
    assert main(["serve", "--served-model-name", "a", "m"]) == 2  # the names took the model in
    assert "give it before --served-model-name" in _error(capsys)


# --- generate: the model's generation_config.json ---------------------------------------------------
def test_generate_sampling_defaults_come_from_the_model():
    args = argparse.Namespace(max_tokens=None, temperature=None, top_p=None, top_k=None, ignore_eos=False, seed=0)
    assert (generate_sampling_params(args, {}).max_tokens, generate_sampling_params(args, {}).temperature) == (32, 0.0)
    model = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 7}
    p = generate_sampling_params(args, model)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.6, 0.95, 7)
    args.temperature, args.max_tokens = 0.0, 3
    p = generate_sampling_params(args, model)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 0.95, 3)


def test_generate_applies_generation_config(model_dir, reference, tmp_path, capsys):
    """A model whose generation_config.json asks for greedy decoding of 5 tokens: ``generate``
    without sampling flags gives the reference's greedy 5 tokens; ``--max-tokens 2`` wins."""
    model = tmp_path / "with-generation-config"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    prompt = "def fibonacci(n):"
    ref = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    flags = ["--dtype", "float32", "--kv-cache-memory", "0.01", "--ignore-eos"]
    assert main(["generate", "--model", str(model), "--prompt", prompt, *flags]) == 0
    assert capsys.readouterr().out.splitlines()[1:-1] == (prompt + ref).splitlines()
    ref2 = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    assert main(["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "2", *flags]) == 0
    assert capsys.readouterr().out.splitlines()[1:-1] == (prompt + ref2).splitlines()
