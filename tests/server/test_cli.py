"""``attnserve serve`` as a real subprocess, and ``attnserve bench latency|throughput|serve``."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from attnserve.entrypoints.bench import random_lengths
from attnserve.entrypoints.cli import build_parser, main
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, base_install_only_prelude


def test_serve_defaults_to_loopback_and_the_demo_model():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)
    args = build_parser().parse_args(
        [
            "serve",
            "some/dir",
            "--port",
            "9",
            "--api-key",
            "k",
            "--served-model-name",
            "n",
            "--max-num-seqs",
            "4",
        ]
    )
    assert (args.model, args.port, args.api_key, args.served_model_name, args.max_num_seqs) == (
        "some/dir",
        9,
        "k",
        ["n"],  # several names may follow, as in vLLM
        4,
    )


def test_serve_takes_the_api_key_from_the_environment(monkeypatch):
    """``ATTNSERVE_API_KEY`` when ``--api-key`` is not given (so the key is not in the process
    list); the flag wins when both are set."""
    import attnserve.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: seen.append(kw["api_key"]))
    monkeypatch.setenv("ATTNSERVE_API_KEY", "from-env")
    assert main(["serve"]) == 0
    assert main(["serve", "--api-key", "from-flag"]) == 0
    monkeypatch.setenv("ATTNSERVE_API_KEY", "")
    assert main(["serve"]) == 0
    assert seen == ["from-env", "from-flag", None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess(model_dir, reference, tmp_path):
    """``attnserve serve`` in a process where nothing outside the base install can be imported
    (what ``pip install -e .`` gives), through the openai client; it logs its start-up summary."""
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    run_cli = "from attnserve.entrypoints.cli import main; import httpx, tqdm; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            base_install_only_prelude() + run_cli,
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--api-key",
            "s3cret",
            "--served-model-name",
            "served",
            "--kv-cache-memory",
            "0.01",
            "--uvicorn-log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**{k: v for k, v in os.environ.items() if k != "ATTNSERVE_LOG_LEVEL"}, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.get(base + "/v1/models").status_code == 401
        with openai.OpenAI(api_key="s3cret", base_url=base + "/v1", max_retries=0) as c:
            assert [m.id for m in c.models.list().data] == ["served"]
            resp = c.completions.create(
                model="served", prompt="hello", max_tokens=6, temperature=0.0
            )
            # structured output is an extra (xgrammar): without it, a 400 naming the extra
            with pytest.raises(openai.BadRequestError, match=r"pip install 'attnserve\[structured\]'"):
                c.completions.create(model="served", prompt="hello", max_tokens=2,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        ref = reference.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert resp.choices[0].text == ref.outputs[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    log_text = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, log_text
    # the start-up summary, logged at INFO (ATTNSERVE_LOG_LEVEL's default)
    assert "INFO" in log_text and "backend " in log_text, log_text
    assert "tokens fit" in log_text and "max_num_seqs" in log_text, log_text


def test_random_lengths():
    rng = random.Random(0)
    assert random_lengths(5, 10, 0.0, rng) == [10] * 5
    lens = random_lengths(200, 10, 0.5, rng)
    assert min(lens) >= 5 and max(lens) <= 15 and len(set(lens)) > 5


def test_bench_latency(model_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(
        [
            "bench",
            "latency",
            "--model",
            str(model_dir),
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "3",
            "--kv-cache-memory",
            "0.01",
            "--output-json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and len(result["latencies"]) == 3 and result["avg_latency"] > 0
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    err = capsys.readouterr().err  # progress bars on stderr, one per phase, none per batch
    assert "Warm-up iterations" in err and "Timed iterations" in err
    assert "Processed prompts" not in err


def _expected_lengths(n: int, input_len: int, output_len: int, ratio: float, seed: int = 0):
    rng = random.Random(seed)
    return random_lengths(n, input_len, ratio, rng), random_lengths(n, output_len, ratio, rng)


def test_bench_throughput(model_dir, tmp_path, capsys):
    out = tmp_path / "thr.json"
    rc = main(
        [
            "bench",
            "throughput",
            "--model",
            str(model_dir),
            "--num-prompts",
            "16",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--range-ratio",
            "0.5",
            "--kv-cache-memory",
            "0.01",
            "--output-json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    ins, outs = _expected_lengths(16, 16, 8, 0.5)
    assert rc == 0 and result["num_requests"] == 16
    assert result["total_input_tokens"] == sum(ins)
    assert result["total_output_tokens"] == sum(outs)  # ignore_eos: every request runs to its end
    assert result["requests_per_second"] == pytest.approx(16 / result["elapsed_time"])
    assert "Processed prompts" in capsys.readouterr().err


def test_bench_serve(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(
        [
            "bench",
            "serve",
            "--port",
            str(server.port),
            "--api-key",
            API_KEY,
            "--num-prompts",
            "24",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--range-ratio",
            "0.5",
            "--request-rate",
            "100",
            "--max-concurrency",
            "8",
            "--vocab-size",
            "2048",
            "--output-json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    ins, outs = _expected_lengths(24, 16, 6, 0.5)
    assert rc == 0 and result["completed"] == 24 and result["failed"] == 0, result["errors"]
    assert result["total_input_tokens"] == sum(ins)
    assert result["total_output_tokens"] == sum(outs)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert "Request throughput" in capsys.readouterr().out
    server.wait_idle()


def test_bench_serve_requests_file_and_clients(server, tmp_path):
    """``--requests-file`` sends exactly those requests; ``--num-clients`` splits them over processes;
    ``--input-range``/``--output-range`` draw lengths uniform in the range."""
    reqs = [[[random.Random(i).randrange(2048) for _ in range(4 + i)], 2 + i % 3] for i in range(10)]
    (tmp_path / "reqs.json").write_text(json.dumps(reqs))
    common = ["bench", "serve", "--port", str(server.port), "--api-key", API_KEY]
    assert main([*common, "--requests-file", str(tmp_path / "reqs.json"), "--num-clients", "2",
                 "--request-rate", "200", "--output-json", str(tmp_path / "a.json")]) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["completed"] == 10 and result["failed"] == 0, result["errors"]
    assert result["total_input_tokens"] == sum(len(p) for p, _ in reqs)
    assert result["total_output_tokens"] == sum(n for _, n in reqs)
    assert main([*common, "--num-prompts", "6", "--input-range", "3", "5", "--output-range", "2", "4",
                 "--vocab-size", "2048", "--output-json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["completed"] == 6 and 6 * 3 <= result["total_input_tokens"] <= 6 * 5
    assert 6 * 2 <= result["total_output_tokens"] <= 6 * 4
    server.wait_idle()


@pytest.mark.parametrize("content", ["{}", "[]", "[[[1, 2], 0]]", "[[[], 3]]", "[[[1, 2.5], 3]]", "[[1, 3]]",
                                     "[[[1], 2, 3]]"])
def test_bench_serve_refuses_a_malformed_requests_file(tmp_path, content):
    from attnserve.entrypoints.bench import serve_requests

    path = tmp_path / "reqs.json"
    path.write_text(content)
    args = argparse.Namespace(requests_file=str(path))
    with pytest.raises(ValueError, match="prompt token ids, max tokens"):
        serve_requests(args)
    path.write_text("[[[1, 2], 3]]")
    assert serve_requests(args) == [([1, 2], 3)]


# --- bench serve with vLLM's flag names (issue #38) ---------------------------------------------
VLLM_RESULT_KEYS = {
    "date", "backend", "model_id", "num_prompts", "request_rate", "max_concurrency", "duration", "completed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}


def _sharegpt(path, n_long: int = 3) -> list[tuple[str, str]]:
    """A ShareGPT file: ``n_long`` usable conversations, plus ones vLLM skips (a one-turn one, a
    gpt-first one, a two-word answer) and a system turn before the human one."""
    words = "the quick brown fox jumps over the lazy dog while seven cats watch it from a wall".split()
    usable = [(" ".join(words[i: i + 8]), " ".join(reversed(words[: 6 + i]))) for i in range(n_long)]
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
             for i, (q, a) in enumerate(usable)]
    convs[0]["conversations"].insert(0, {"from": "system", "value": "be brief"})
    convs += [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "a question with no answer here"}]},
        {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "hello"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "say something short please now"},
                                          {"from": "gpt", "value": "ok"}]},
    ]
    path.write_text(json.dumps(convs))
    return usable


def test_bench_serve_takes_vllm_flag_names_and_the_old_ones():
    common = ["bench", "serve", "--num-prompts", "3"]
    new = build_parser().parse_args([*common, "--random-input-len", "7", "--random-output-len", "5",
                                     "--random-range-ratio", "0.25", "--backend", "openai-chat",
                                     "--dataset-name", "random", "--save-result", "--result-dir", "d",
                                     "--result-filename", "r.json", "--ignore-eos"])
    old = build_parser().parse_args([*common, "--input-len", "7", "--output-len", "5", "--range-ratio", "0.25",
                                     "--output-json", "x.json"])
    for args in (new, old):
        assert (args.input_len, args.output_len, args.range_ratio) == (7, 5, 0.25)
    assert (new.backend, new.endpoint, new.save_result, new.result_dir, new.result_filename) == \
        ("openai-chat", None, True, "d", "r.json")
    assert (old.backend, old.dataset_name, old.save_result, old.output_json) == ("openai", "random", False, "x.json")


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--endpoint /v1/completions does not fit"),
    (["--endpoint", "/v1/chat/completions"], "does not fit --backend openai"),
    (["--sharegpt-output-len", "4"], "--sharegpt-output-len is for --dataset-name sharegpt"),
])
def test_bench_serve_refuses_flags_that_do_not_go_together(argv, message, capsys):
    assert main(["bench", "serve", "--port", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_sharegpt_and_save_result(server, model_dir, tmp_path, monkeypatch):
    """``--dataset-name sharegpt``: the first human turn is the prompt, the gpt turn's token count the
    output length; conversations vLLM skips are skipped, the rest oversampled to ``--num-prompts``;
    ``--save-result`` writes vLLM's keys to ``--result-dir`` under vLLM's file name."""
    from attnserve.tokenizer import load_tokenizer

    usable = _sharegpt(tmp_path / "sharegpt.json")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "serve", "--backend", "vllm", "--port", str(server.port), "--api-key", API_KEY,
                 "--model", "tiny", "--dataset-name", "sharegpt", "--dataset-path", "sharegpt.json",
                 "--num-prompts", "5", "--max-concurrency", "4", "--save-result", "--result-dir", "out"]) == 0
    [path] = list((tmp_path / "out").iterdir())
    assert path.name.startswith("vllm-infqps-concurrency4-tiny-") and path.suffix == ".json"
    result = json.loads(path.read_text())
    assert VLLM_RESULT_KEYS <= set(result), VLLM_RESULT_KEYS - set(result)
    assert result["completed"] == 5 and not any(result["errors"]), result["errors"]
    tok = load_tokenizer(model_dir)
    lens = {(len(tok.encode(q)), len(tok.encode(a, add_special_tokens=False))) for q, a in usable}
    assert set(zip(result["input_lens"], result["output_lens"])) <= lens
    assert len(set(result["input_lens"])) > 1  # more than one conversation was sampled
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 4
    server.wait_idle()


def test_bench_serve_chat_backend(server, model_dir, tmp_path):
    """``--backend openai-chat`` drives /v1/chat/completions (the tiny model's chat template): random
    ids are decoded to text; every request gets its max tokens; TTFT is the first text, not the role."""
    usable = _sharegpt(tmp_path / "sharegpt.json", n_long=2)
    common = ["bench", "serve", "--backend", "openai-chat", "--port", str(server.port), "--api-key", API_KEY,
              "--num-prompts", "4", "--save-result"]
    assert main([*common, "--random-input-len", "12", "--random-output-len", "5", "--vocab-size", "2048",
                 "--result-filename", str(tmp_path / "chat.json")]) == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    assert result["completed"] == 4 and result["backend"] == "openai-chat", result["errors"]
    assert result["endpoint"] == "/v1/chat/completions" and result["output_lens"] == [5] * 4
    assert all(n > 0 for n in result["input_lens"]) and all(len(itl) == 4 for itl in result["itls"])
    assert 0 < result["median_ttft_ms"] < result["median_e2el_ms"]
    assert main([*common, "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"),
                 "--sharegpt-output-len", "3", "--tokenizer", str(model_dir),
                 "--result-filename", str(tmp_path / "chat2.json")]) == 0
    result = json.loads((tmp_path / "chat2.json").read_text())
    assert result["completed"] == 4 and result["output_lens"] == [3] * 4, result["errors"]
    # with a fixed output length the two-word answer is kept too (vLLM skips that check then)
    assert len(usable) == 2 and len(set(result["input_lens"])) == 3
    server.wait_idle()
