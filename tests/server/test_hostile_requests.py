"""Requests that stalled, crowded or fooled the server (issue #39, points 2, 3 and 5).

- A 10 MB prompt and a request-sent chat template that renders 10 MB are refused from their
  length in characters, before they are tokenised (tokenising holds the GIL for seconds), and
  50,000 stop strings are over the cap: ``/health`` on the same server answers within a second
  while all three run. A long prompt that is legal (``truncate_prompt_tokens``, ``/tokenize``)
  is still served, tokenised without holding the GIL.
- Caps on stop strings (count, characters) and sequences per request (prompts x n, best_of):
  400s naming the limit and the flag that raises it.
- Constraints that leave no token to sample first are 400s, not "" or a banned token.
- Names of ignored fields reach the log escaped; a client that leaves while sending its body
  is no server error and logs one short line at most.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time

import httpx
import pytest

from attnserve.entrypoints.openai.protocol import OpenAIError, ServerLimits
from attnserve.entrypoints.openai.serving_completion import first_token_bans
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerThread, metric_value

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
_LETTERS = b"abcdefghijklmnopqrstuvwxyz     "  # a space every 6 characters or so
_TO_LETTERS = bytes(_LETTERS[b % len(_LETTERS)] for b in range(256))


def words(num_chars: int, seed: int = 0) -> str:
    """Random lowercase words: hardly two alike, so the tokenizer's word cache does not help."""
    return random.Random(seed).randbytes(num_chars).translate(_TO_LETTERS).decode()


@pytest.fixture(scope="module")
def srv(model_dir):
    srv = ServerThread(model_dir, app_kwargs={"limits": ServerLimits(trust_request_chat_template=True)},
                       **ENGINE_KWARGS)
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, headers=AUTH, json={"model": MODEL_NAME, **(body or {})},
                      timeout=60, **kw)


def _error(resp: httpx.Response, param: str, *says: str, code: str | None = None) -> dict:
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert all(s in err["message"] for s in says), err
    if code is not None:
        assert err["code"] == code, err
    return err


# --- point 2: no request stalls the others ----------------------------------------------------
def test_health_answers_while_hostile_requests_run(srv):
    attacks = [  # (path, body, the param of the 400, what its message names)
        ("/v1/completions", {"prompt": words(10_000_000), "max_tokens": 1}, "prompt", "characters"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1,  # renders 9.4 MB in a few ms
                                  "chat_template": "{{ (range(100000) | join(' ')) * 16 }}"}, "messages",
         "characters"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(50_000)]}, "stop",
         "--max-stop-strings"),
    ]
    results: dict[int, tuple[httpx.Response, float]] = {}

    def send(i: int, path: str, body: dict) -> None:
        start = time.perf_counter()
        results[i] = (_post(srv, path, body), time.perf_counter() - start)

    threads = [threading.Thread(target=send, args=(i, path, body)) for i, (path, body, *_) in enumerate(attacks)]
    for t in threads:
        t.start()
    worst, probes = 0.0, 0
    while any(t.is_alive() for t in threads):
        start = time.perf_counter()
        assert httpx.get(srv.base_url + "/health", timeout=60).status_code == 200
        worst, probes = max(worst, time.perf_counter() - start), probes + 1
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert worst < 1.0, f"/health took {worst:.2f} s (worst of {probes}) while the hostile requests ran"
    for i, (_, _, param, says) in enumerate(attacks):
        resp, seconds = results[i]
        _error(resp, param, says)
        assert seconds < 5, f"{param}: answered after {seconds:.1f} s"
    assert results[0][0].json()["error"]["code"] == "context_length_exceeded"
    srv.wait_idle()


def test_long_prompts_that_are_legal_are_still_served(srv):
    """The character bound never refuses what fits: a prompt truncated to its last tokens, a
    /tokenize count, a prompt of more characters than the model has tokens."""
    long = words(300_000, seed=1)
    out = _post(srv, "/v1/completions", {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 50})
    assert out.status_code == 200, out.text[:300]
    assert out.json()["usage"]["prompt_tokens"] == 50
    count = _post(srv, "/tokenize", {"prompt": long}).json()["count"]
    assert count > 512
    fits = " the" * 400 + " " * 1600  # 3,200 characters, about 500 tokens: fewer than the model's 512
    out = _post(srv, "/v1/completions", {"prompt": fits, "max_tokens": 2})
    assert out.status_code == 200, out.text[:300]
    assert out.json()["usage"]["prompt_tokens"] < 512 < len(fits)


# --- point 3: caps on what one request costs every step ---------------------------------------
CAPPED = [  # (body, param, the flag its message names)
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(257)]}, "stop", "--max-stop-strings"),
    ({"prompt": "hi", "stop": ["x" * 9000, "y" * 9000]}, "stop", "--max-stop-chars"),
    ({"prompt": "hi", "stop": "z" * 20000}, "stop", "--max-stop-chars"),
    ({"prompt": [[5]] * 33, "n": 128}, "n", "--max-sequences-per-request"),
    ({"prompt": "hi", "n": 129}, "n", "--max-n"),
    ({"prompt": "hi", "n": 2, "best_of": 129}, "best_of", "--max-n"),
    ({"prompt": [[5]] * 1025}, "prompt", "--max-prompts"),
]


@pytest.mark.parametrize("body,param,flag", CAPPED, ids=[f"{c[2]}-{i}" for i, c in enumerate(CAPPED)])
def test_caps_name_the_limit_and_the_flag(srv, body, param, flag):
    _error(_post(srv, "/v1/completions", {**body, "max_tokens": 1}), param, flag, "limit")


def test_caps_apply_to_chat_and_leave_requests_within_them_alone(srv):
    _error(_post(srv, "/v1/chat/completions", {"messages": MSG, "stop": [f"s{i}" for i in range(300)]}),
           "stop", "--max-stop-strings")
    _error(_post(srv, "/v1/chat/completions", {"messages": MSG, "n": 200}), "n", "--max-n")
    ok = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(256)]})
    assert ok.status_code == 200, ok.text[:300]
    limits = ServerLimits()
    limits.check(n=128, num_prompts=32, stop=["x" * 64] * 256)  # 4,096 sequences, 16 Ki characters
    small = ServerLimits(max_sequences_per_request=10, max_stop_strings=2, max_stop_chars=5)
    with pytest.raises(OpenAIError, match="--max-sequences-per-request"):
        small.check(n=1, num_prompts=1, best_of=11)
    with pytest.raises(ValueError, match="max_stop_chars"):
        ServerLimits(max_stop_chars=0)


# --- point 5: contradictions and quiet failures ------------------------------------------------
CONSTRAINING = ("allowed_token_ids", "guided_choice", "bad_words", "min_tokens", "response_format")


def test_constraints_that_leave_no_first_token_are_400s(srv):
    tok = srv.engine.tokenizer
    eos = tok.eos_token_id
    # every token that can start "yes" or "no", banned one by one
    starts = [w for w in ("y", "ye", "yes", "n", "no") if len(tok.encode(w, add_special_tokens=False)) == 1]
    cases = [
        ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [eos], "min_tokens": 2}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"], "allowed_token_ids": [17]},
         "allowed_token_ids"),
        ("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"], "bad_words": starts}, "bad_words"),
        ("/v1/chat/completions", {"messages": MSG, "allowed_token_ids": [eos], "min_tokens": 1,
                                  "stop_token_ids": [eos]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"},
                                  "allowed_token_ids": tok.encode("hello", add_special_tokens=False)},
         "allowed_token_ids"),
    ]
    for path, body, param in cases:
        err = _error(_post(srv, path, {**body, "max_tokens": 4}), param, "no token can be generated",
                     code="conflicting_constraints")
        assert param in err["message"] and all(f in err["message"] for f in body if f in CONSTRAINING), err
    # the same constraints without the contradiction are served
    fine = [
        {"prompt": "hi", "allowed_token_ids": [eos], "min_tokens": 0},
        {"prompt": "hi", "allowed_token_ids": [eos, 17], "min_tokens": 2},
        {"prompt": "hi", "allowed_token_ids": [eos], "min_tokens": 2, "ignore_eos": True},
        {"prompt": "hi", "guided_choice": ["yes", "no"], "bad_words": starts[:1]},
    ]
    for body in fine:
        out = _post(srv, "/v1/completions", {**body, "max_tokens": 4})
        assert out.status_code == 200, (body, out.text[:300])
    srv.wait_idle()


def test_first_token_bans_are_the_engines(srv):
    words = ["yes", "no", " no", "hello", "y", "the", " the", "\u00e9", "<|endoftext|>"]

    def engine_bans(engine) -> set[int]:
        return {seq[0] for seq in engine.bad_words_token_ids(SamplingParams(bad_words=words)) if len(seq) == 1}

    expected = srv.engine.call(engine_bans).result(timeout=10)
    assert expected and set(first_token_bans(srv.engine.tokenizer, words)) == expected


def test_ignored_field_names_are_escaped_in_the_log(srv, caplog):
    forged = "x\nINFO 01-01 00:00:00 [api_server.py:1] forged line \x1b[31mred\x1b[0m \u202eevil"
    with caplog.at_level(logging.WARNING, logger="attnserve"):
        out = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1, forged: 1, "y" * 5000: 2})
    assert out.status_code == 200, out.text[:300]
    lines = [r.getMessage() for r in caplog.records if "ignoring request fields" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and "\x1b" not in line and "\u202e" not in line, repr(line)
    assert "x\\nINFO" in line and "\\x1b[31m" in line and "\\u202e" in line, line
    assert len(line) < 400 and "5000 characters" in line, line  # a long name is cut


def test_client_that_drops_while_uploading_is_no_server_error(srv, caplog):
    def errors_500() -> float:
        page = httpx.get(srv.base_url + "/metrics", headers=AUTH).text
        return metric_value(page, "attnserve:request_errors_total", status="500")

    before = errors_500()
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                          + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                          + b'{"model": "tiny", "prompt": "' + b"a" * 5000)
                time.sleep(0.1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sum("disconnected" in r.getMessage() for r in caplog.records) < 3:
            time.sleep(0.05)
    assert errors_500() == before
    server_lines = [r for r in caplog.records if r.name.startswith(("attnserve", "uvicorn"))]
    assert len(server_lines) == 3, [r.getMessage() for r in server_lines]  # one line each, no traceback
    assert all(r.levelno == logging.DEBUG and "\n" not in r.getMessage() for r in server_lines)
    assert httpx.get(srv.base_url + "/health").status_code == 200
