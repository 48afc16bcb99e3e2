"""A request that fails inside the engine is an HTTP error, not an empty success (issue #24).

A fault is injected into the runner for the requests with a marker seed, once each has two
output tokens: the engine fails that request alone (finish reason "error"), and the server
answers a whole-response request with a 500 (a ``PromptError``, the client's fault, with a 400)
in OpenAI's error shape, and a stream with an ``{"error": ...}`` event after the text it sent,
then ``[DONE]``. A streamed greedy request running meanwhile keeps its exact output, and the
engine holds nothing afterwards.
"""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import openai

from attnserve.engine.engine import PromptError
from attnserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_FAULT_SEED, CLIENT_FAULT_SEED = 424242, 424243


@contextlib.contextmanager
def faulty_runner(server):
    """The runner raises in a step with a marker-seeded request that has 2 output tokens."""

    def install(engine):
        original = engine.runner.execute

        def execute(sched_out, *args, **kwargs):
            for s in sched_out.scheduled:
                seed, made = s.request.sampling_params.seed, s.request.num_output_tokens
                if seed == SERVER_FAULT_SEED and made >= 2:
                    raise RuntimeError("injected kernel fault")
                if seed == CLIENT_FAULT_SEED and made >= 2:
                    raise PromptError("injected: the request asks for what this model cannot do")
            return original(sched_out, *args, **kwargs)

        engine.runner.execute = execute
        return original

    original = server.engine.call(install).result(10)
    try:
        yield
    finally:
        server.engine.call(lambda e: setattr(e.runner, "execute", original)).result(10)


def _events(resp: httpx.Response) -> list:
    assert resp.status_code == 200, resp.text
    data = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_engine_failures_are_http_errors(server, reference):
    prompt = "Once upon a time"
    ref = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    result: dict = {}

    def run_good():
        with openai.OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0) as c:
            stream = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0.0,
                                          stream=True, extra_body={"ignore_eos": True})
            result["text"] = "".join(ch.choices[0].text for ch in stream if ch.choices)

    base = {"max_tokens": 8, "temperature": 0.8, "ignore_eos": True}
    bodies = {"/v1/completions": {"model": MODEL_NAME, "prompt": "hello there", **base},
              "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **base}}
    with faulty_runner(server):
        good = threading.Thread(target=run_good)
        good.start()
        for path, body in bodies.items():
            for seed, status, kind in ((SERVER_FAULT_SEED, 500, "server_error"),
                                       (CLIENT_FAULT_SEED, 400, "invalid_request_error")):
                resp = httpx.post(server.base_url + path, headers=AUTH, json={**body, "seed": seed}, timeout=30)
                assert resp.status_code == status, resp.text
                err = resp.json()["error"]
                assert err["type"] == kind and "injected" in err["message"], err
                assert set(err) == {"message", "type", "param", "code"}
            # n = 2: one completion's failure fails the whole response (its sibling is aborted)
            resp = httpx.post(server.base_url + path, headers=AUTH, json={**body, "seed": SERVER_FAULT_SEED, "n": 2},
                              timeout=30)
            assert resp.status_code == 500 and "injected kernel fault" in resp.json()["error"]["message"]
            # streamed: the text so far, then an error event and [DONE]; no finish_reason "error"
            resp = httpx.post(server.base_url + path, headers=AUTH,
                              json={**body, "seed": SERVER_FAULT_SEED, "stream": True}, timeout=30)
            events = _events(resp)
            assert "error" in events[-1] and "injected kernel fault" in events[-1]["error"]["message"]
            assert events[-1]["error"]["type"] == "server_error"
            chunks = events[:-1]
            assert chunks and all("error" not in e for e in chunks)
            assert all(ch["finish_reason"] is None for e in chunks for ch in e["choices"])
        good.join(60)
    assert result["text"] == ref[0].outputs[0].text
    assert httpx.get(server.base_url + "/health").status_code == 200
    server.wait_idle()
