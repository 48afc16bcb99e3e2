"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis (issue #39, point 7).

The server publishes each POST route's body (``protocol.openapi_body``: the request models'
JSON schemas), so schemathesis generates requests for every route and method in the schema:
bodies that fit it (with the served model's name, so that they reach the engine) and bodies
that break it. Each is sent over HTTP to a real server (uvicorn on loopback, an engine thread).
Whatever it sends: never a 5xx; every error in OpenAI's shape (``{"error": {"message", "type",
"param", "code"}}``); a stream ends with ``[DONE]`` (``/v1/responses``: numbered typed events,
the last one ending the response); the engine holds nothing once the answer is in; after the
run ``/health`` answers at once and a fixed greedy request still gets its exact output.
Derandomized and bounded (a few hundred requests, seconds); which bodies are drawn varies with
the tests run before it in the process.
``test_fuzz_protocol.py`` fuzzes the bodies from the models' fields instead; SamplingParams is
fuzzed in ``tests/unit/test_fuzz_sampling_params.py``.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from attnserve.entrypoints.openai.protocol import ServerLimits
from tests.server.conftest import MODEL_NAME, ServerThread

REFERENCE = {"model": MODEL_NAME, "prompt": [17, 400, 93, 1200, 5], "max_tokens": 8, "temperature": 0}
LIMITS = ServerLimits(max_n=4, max_prompts=4, max_sequences_per_request=8, max_stop_strings=8, max_stop_chars=256)


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    srv = ServerThread(model_dir, api_key=None, app_kwargs={"limits": LIMITS}, kv_cache_memory=0.01,
                       max_num_seqs=32, max_model_len=96)
    yield srv
    srv.stop()


def _served_model_only(raw: dict) -> dict:
    """The schema with every body's ``model`` set to the served name, so that the bodies that
    fit it reach the engine (schemathesis's negative cases still send any other value)."""
    for item in raw["paths"].values():
        for operation in item.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            for schema in (body or {}).get("anyOf", [body] if body else []):
                if "model" in schema.get("properties", {}):
                    schema["properties"]["model"] = {"type": "string", "enum": [MODEL_NAME]}
    return raw


def _check(srv, resp, path: str) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error", err
    elif "text/event-stream" in str(resp.headers.get("content-type")) and path == "/v1/responses":
        # typed events, numbered in order, no [DONE]; the last one ends the response
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and [e["sequence_number"] for e in events] == list(range(len(events))), resp.text[-300:]
        ends = ("response.completed", "response.incomplete", "response.failed")
        assert events[-1]["type"] in ends or resp.stream_cut_short, resp.text[-300:]
    elif "text/event-stream" in str(resp.headers.get("content-type")):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        # schemathesis reads 20 events of a stream at most, then hangs up (the server aborts)
        assert events and (events[-1] == "[DONE]" or resp.stream_cut_short), resp.text[-300:]
        events = events[:-1] if events[-1] == "[DONE]" else events
        for event in map(json.loads, events):
            assert "error" not in event or set(event["error"]) == {"message", "type", "param", "code"}, event


def _reference(srv) -> dict:
    resp = httpx.post(srv.base_url + "/v1/completions", json=REFERENCE, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_schema_fuzz_never_hurts_the_server(fuzz_server):
    raw = httpx.get(fuzz_server.base_url + "/openapi.json").json()
    routes = {(method.upper(), path) for path, item in raw["paths"].items() for method in item}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
            ("POST", "/detokenize"), ("GET", "/health")} <= routes
    assert "requestBody" in raw["paths"]["/v1/completions"]["post"]  # the bodies are in the schema
    schema = schemathesis.openapi.from_dict(_served_model_only(raw))
    # the operations that take a body (the probes and GET routes have nothing to fuzz, and each
    # one would take its share of the examples)
    bodies = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"}
    operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path in bodies]
    assert {op.path for op in operations} == bodies
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    before = _reference(fuzz_server)
    seen: dict[tuple[str, int], int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def call(case):
        resp = case.call(base_url=fuzz_server.base_url, timeout=60)
        seen[(case.operation.path, resp.status_code)] = seen.get((case.operation.path, resp.status_code), 0) + 1
        _check(fuzz_server, resp, case.operation.path)
        fuzz_server.wait_idle(timeout=5)

    call()
    start = time.perf_counter()
    assert httpx.get(fuzz_server.base_url + "/health", timeout=5).status_code == 200
    assert time.perf_counter() - start < 1.0
    assert _reference(fuzz_server) == before
    # the fuzz got past the validation: bodies drawn from the schema rarely fit the tiny model's
    # limits (a 96-token context, token ids below 2048, n <= 4), and which ones schemathesis
    # draws varies with the tests run before it in the process, so a completion the engine
    # answered is not always among them (none in one full-suite run); the tokenizer routes'
    # 200s always are. Bodies that reach the engine are fuzzed by tests/server/test_fuzz_protocol.py.
    served = sum(n for (path, status), n in seen.items() if status == 200)
    assert served >= 5, sorted(seen.items())
