"""Errors as the OpenAI API gives them, the API key, and clients that go away.

Every refused request must come back as ``{"error": {"message", "type", "param", "code"}}`` with
the right 4xx status, leave nothing in the engine, and not disturb a request that runs at the
same time. A client that disconnects (mid-stream, or while waiting for a whole response) must
have its request aborted and its KV blocks freed: the pool's integrity check passes and no
block stays held.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME, metric_value

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]


def _post(server, path: str, **kw) -> httpx.Response:
    kw.setdefault("timeout", 30)
    return httpx.post(server.base_url + path, headers=kw.pop("headers", AUTH), **kw)


def _assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


COMPLETION_CASES = [  # (body, status, param)
    ({"model": 7, "prompt": "x"}, 400, "model"),  # left out it is the served model (vLLM); not a string: a 400
    ({"model": MODEL_NAME}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 1.5}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": {"text": "x"}}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": [7] * 600}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": [7] * 512, "max_tokens": 1}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": [5, 99999]}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": [[]]}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": []}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL_NAME, "prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL_NAME, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL_NAME, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": MODEL_NAME, "prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 30}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": MODEL_NAME, "prompt": "x", "best_of": 3}, 400, "best_of"),
    # unknown fields are ignored (tests/server/test_vllm_compat.py), but not those whose neglect
    # would change the result
    ({"model": MODEL_NAME, "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ({"model": MODEL_NAME, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),  # > max_logprobs
    ({"model": MODEL_NAME, "prompt": "x", "logit_bias": {"5000": 10}}, 400, "logit_bias"),  # > vocab
    ({"model": MODEL_NAME, "prompt": "x", "allowed_token_ids": [1, 4096]}, 400, "allowed_token_ids"),
    ({"model": MODEL_NAME, "prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex"),
    ({"model": MODEL_NAME, "prompt": "x", "structured_outputs": {"json": {"type": "objec"}}}, 400,
     "structured_outputs"),
    # values that once failed inside an engine step (killing the engine thread) or came back as
    # 200 / 500: an int64 overflow in the sampler's tensors, NaN sampling floats, a huge seed,
    # logprobs beyond the vocabulary, stop tokens outside it
    ({"model": MODEL_NAME, "prompt": "x", "top_k": 10**19}, 400, "top_k"),
    ({"model": MODEL_NAME, "prompt": "x", "min_tokens": 2, "stop_token_ids": [10**19]}, 400, "stop_token_ids"),
    ({"model": MODEL_NAME, "prompt": "x", "min_tokens": 2, "stop_token_ids": [5000]}, 400, "stop_token_ids"),
    ({"model": MODEL_NAME, "prompt": "x", "seed": 10**30}, 400, "seed"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "repetition_penalty": float("nan")}, 400, "repetition_penalty"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": float("inf")}, 400, "top_p"),
    # the server's own limits (ServerLimits: `attnserve serve --max-n / --max-prompts`)
    ({"model": MODEL_NAME, "prompt": "x", "n": 5000}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": ["x"] * 2000}, 400, "prompt"),
    (
        {"model": MODEL_NAME, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
]

CHAT_CASES = [
    ({"model": MODEL_NAME}, 400, "messages"),
    ({"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ({"model": MODEL_NAME, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL_NAME, "messages": [{"role": "user"}], "max_tokens": 3}, 400, "messages"),
    (
        {
            "model": MODEL_NAME,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
        },
        400,
        "messages",
    ),
    ({"model": "nope", "messages": MSG}, 404, "model"),
    ({"model": MODEL_NAME, "messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    (
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "messages",
    ),
    ({"model": MODEL_NAME, "messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ({"model": MODEL_NAME, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        {
            "model": MODEL_NAME,
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tool_choice",  # "auto" by default: no tool-call parser
    ),
    (
        {"model": MODEL_NAME, "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
        400,
        "response_format",
    ),
    ({"model": MODEL_NAME, "messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
    # a template sent in the request is refused unless the server trusts them
    ({"model": MODEL_NAME, "messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 'x' * 10**8 }}"}},
     400, "chat_template_kwargs"),
    ({"model": MODEL_NAME, "messages": MSG, "n": 5000}, 400, "n"),
    ({"model": MODEL_NAME, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL_NAME, "messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities"),
    ({"model": MODEL_NAME, "messages": MSG, "stream": True,
      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 400, "stream_options"),
]


def test_errors_do_not_disturb_a_running_request(server, reference):
    """Every error case while a streamed request runs; that request's output stays exact."""
    prompt = "Once upon a time"
    ref = (
        reference.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        )[0]
        .outputs[0]
        .text
    )
    result: dict = {}

    def run_good():
        with openai.OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0) as c:
            stream = c.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=40,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            result["text"] = "".join(ch.choices[0].text for ch in stream if ch.choices)

    good = threading.Thread(target=run_good)
    good.start()
    for body, status, param in COMPLETION_CASES:  # as text: Python's json writes NaN, as clients can
        _assert_error(_post(server, "/v1/completions", content=json.dumps(body).encode(),
                            headers={**AUTH, "Content-Type": "application/json"}), status, param)
    for body, status, param in CHAT_CASES:
        _assert_error(_post(server, "/v1/chat/completions", json=body), status, param)
    good.join(60)
    assert result["text"] == ref
    state = server.wait_idle()
    assert state["scheduler_requests"] == 0


def test_large_bodies_get_a_413_and_tokenising_leaves_the_loop_free(server):
    """A body over the limit (16 MiB by default) is refused while it arrives; a large prompt
    under it is tokenised off the event loop, so /health answers at once meanwhile."""
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (17 << 20) + b'"}'
    _assert_error(_post(server, "/v1/completions", content=huge,
                        headers={**AUTH, "Content-Type": "application/json"}), 413, code="request_too_large")
    result = {}
    big = {"model": MODEL_NAME, "prompt": "word " * 400_000, "max_tokens": 1}  # 2 MB: seconds to tokenise

    def send():
        result["resp"] = _post(server, "/v1/completions", json=big, timeout=120)

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)
    worst = 0.0
    while t.is_alive():
        start = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.05)
    t.join()
    _assert_error(result["resp"], 400, "prompt", "context_length_exceeded")  # far over the context
    assert worst < 1.0, f"/health took {worst:.2f} s while a prompt was tokenised"


def test_malformed_bodies_and_routes(server):
    err = _assert_error(_post(server, "/v1/completions", content=b"{not json"), 400)
    assert "JSON" in err["message"]
    _assert_error(_post(server, "/v1/completions", content=b"[1, 2]"), 400)
    _assert_error(_post(server, "/v1/chat/completions", content=b"\xff\xfe"), 400)
    resp = httpx.get(server.base_url + "/v1/nothing", headers=AUTH)
    assert resp.status_code == 404 and "error" in resp.json()
    resp = httpx.get(server.base_url + "/v1/completions", headers=AUTH)
    assert resp.status_code == 405 and "error" in resp.json()


def test_context_length_errors_carry_the_code(server):
    body = {"model": MODEL_NAME, "prompt": [7] * 600}
    _assert_error(
        _post(server, "/v1/completions", json=body), 400, "prompt", "context_length_exceeded"
    )
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 100000}
    _assert_error(
        _post(server, "/v1/completions", json=body), 400, "max_tokens", "context_length_exceeded"
    )
    _assert_error(
        _post(server, "/v1/completions", json={"model": "m", "prompt": "x"}),
        404,
        "model",
        "model_not_found",
    )


def test_openai_client_sees_typed_errors(server):
    with openai.OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="missing", prompt="x")
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=MODEL_NAME, prompt="x", temperature=-2)
        assert info.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL_NAME, messages=MSG, stream=True, top_p=7)
    with openai.OpenAI(api_key="wrong", base_url=server.base_url + "/v1", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            c.models.list()
        assert info.value.body["code"] == "invalid_api_key"


def test_api_key_guards_every_route_but_the_probes(server):
    base = server.base_url
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/ping").status_code == 200
    assert httpx.post(base + "/ping").status_code == 200
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
            resp = httpx.request(method, base + path, headers=headers, json={})
            _assert_error(resp, 401, code="invalid_api_key")
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200


@contextlib.contextmanager
def slow_steps(server, seconds: float):
    """Make every engine step last at least ``seconds`` (so a request cannot finish early)."""

    def install(engine):
        original = engine.runner.execute

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return original(*args, **kwargs)

        engine.runner.execute = slow
        return original

    original = server.engine.call(install).result(10)
    try:
        yield
    finally:
        server.engine.call(lambda e: setattr(e.runner, "execute", original)).result(10)


def _aborted(server) -> tuple[int, float]:
    text = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    aborted = metric_value(text, "vllm:request_success_total", finished_reason="abort")
    return server.engine.stats().num_aborted, aborted


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    server.wait_idle()
    before = _aborted(server)
    with (
        slow_steps(server, 0.005),
        openai.OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0) as c,
    ):
        for endpoint in ("completions", "chat"):
            if endpoint == "completions":
                stream = c.completions.create(
                    model=MODEL_NAME,
                    prompt="tell me a story",
                    max_tokens=450,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            else:
                stream = c.chat.completions.create(
                    model=MODEL_NAME,
                    messages=MSG,
                    max_tokens=450,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            for i, _ in enumerate(stream):
                if i == 2:
                    break
            assert server.engine.stats().num_running == 1
            stream.close()
            server.wait_idle(timeout=2.0)  # long before 450 slowed steps could end
    after = _aborted(server)
    assert after[0] - before[0] == 2 and after[1] - before[1] == 2


def test_disconnect_while_waiting_for_whole_response(server):
    server.wait_idle()
    before = _aborted(server)
    with slow_steps(server, 0.005):
        with pytest.raises(httpx.ReadTimeout):
            _post(
                server,
                "/v1/completions",
                timeout=0.5,
                json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 450, "ignore_eos": True},
            )
        server.wait_idle(timeout=2.0)
    after = _aborted(server)
    assert after[0] - before[0] == 1 and after[1] - before[1] == 1


def test_many_disconnects_leak_nothing(server):
    with (
        slow_steps(server, 0.002),
        openai.OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0) as c,
    ):
        streams = [
            c.completions.create(
                model=MODEL_NAME,
                prompt=[11 + i] * (5 + 9 * i),
                max_tokens=300,
                n=1 + i % 3,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(8)
        ]
        for s in streams:
            next(iter(s))
        for s in streams:
            s.close()
        state = server.wait_idle(timeout=5.0)
    assert state == {"unfinished": False, "scheduler_requests": 0, "blocks_held": 0}
