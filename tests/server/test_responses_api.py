"""``/v1/responses`` through the official ``openai`` client (``client.responses``), against the
chat path it is built on, on the tiny llama (random weights, the demo tokenizer's chat template).

At temperature 0 a response's text is the chat completion's of the same messages
(``instructions`` a system message first); a stream's events come in OpenAI's order with
consecutive sequence numbers and deltas that add up to the text; ``previous_response_id``
continues a stored conversation; what the route does not serve is a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import ENGINE_KWARGS, MODEL_NAME, ServerThread

openai = pytest.importorskip("openai")

IGNORE_EOS = {"ignore_eos": True}  # random weights: every reply runs to its token limit
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
DONE_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def srv(model_dir):
    server = ServerThread(model_dir, api_key=None, **ENGINE_KWARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(api_key="EMPTY", base_url=srv.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c


def _chat_text(client, messages: list[dict], max_tokens: int, **extra) -> str:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                           temperature=0.0, extra_body={**IGNORE_EOS, **extra})
    return reply.choices[0].message.content


def test_response_is_the_chat_reply(client):
    resp = client.responses.create(model=MODEL_NAME, input="Name a city.", instructions="Answer briefly.",
                                   max_output_tokens=6, temperature=0.0, metadata={"k": "v"}, user="u1",
                                   extra_body=IGNORE_EOS)
    expected = _chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": "Name a city."}], 6)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL_NAME
    assert resp.output_text == expected
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    # cut by max_output_tokens: incomplete, as OpenAI reports it
    assert resp.status == "incomplete" and message.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 6 and resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0.0, 1.0, 6)
    assert resp.metadata == {"k": "v"} and resp.user == "u1" and resp.instructions == "Answer briefly."
    # input as message items with input_text parts renders the same conversation
    items = client.responses.create(
        model=MODEL_NAME, max_output_tokens=6, temperature=0.0, extra_body=IGNORE_EOS,
        input=[{"role": "system", "content": "Answer briefly."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a city."}]}])
    assert items.output_text == expected and items.usage.input_tokens == resp.usage.input_tokens


def test_stream_events(client):
    kwargs = dict(model=MODEL_NAME, input="Count to three.", max_output_tokens=8, temperature=0.0,
                  extra_body=IGNORE_EOS)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_EVENTS and kinds[-4:] == [*DONE_EVENTS, "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.usage.output_tokens == 8
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events) and final.output[0].id == item_id


def test_stop_completes(client):
    """A reply that ends on a stop string is "completed" (vLLM's ``stop`` passes through)."""
    text = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=8, temperature=0.0,
                                   extra_body=IGNORE_EOS).output_text
    stop = text[3:5]
    assert stop.strip(), text
    for stream in (False, True):
        resp = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=8, temperature=0.0,
                                       stream=stream, extra_body={**IGNORE_EOS, "stop": [stop]})
        if stream:
            events = list(resp)
            assert events[-1].type == "response.completed"
            resp = events[-1].response
        assert resp.status == "completed" and resp.incomplete_details is None
        assert resp.output_text == text[: text.index(stop)] and resp.output[0].status == "completed"


def test_logprobs(client):
    resp = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=4, temperature=0.0,
                                   include=["message.output_text.logprobs"], top_logprobs=2, extra_body=IGNORE_EOS)
    logprobs = resp.output[0].content[0].logprobs
    assert len(logprobs) == 4 and "".join(lp.token for lp in logprobs) == resp.output_text
    for lp in logprobs:
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token  # greedy: the top one
        assert lp.bytes == list(lp.token.encode())
    assert resp.top_logprobs == 2
    plain = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=4, temperature=0.0,
                                    extra_body=IGNORE_EOS)
    assert plain.output[0].content[0].logprobs is None


def test_json_schema_text_format(client):
    """``text.format`` json_schema constrains the output as chat's ``response_format`` does."""
    pytest.importorskip("xgrammar")
    schema = {"type": "string", "enum": ["yes", "no"]}
    resp = client.responses.create(model=MODEL_NAME, input="Yes or no?", max_output_tokens=8, temperature=0.0,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert json.loads(resp.output_text) in ("yes", "no") and resp.status == "completed"
    assert resp.text.format.type == "json_schema"


def test_previous_response_and_store(client, srv):
    first = client.responses.create(model=MODEL_NAME, input="Name a city.", instructions="Be brief.",
                                    max_output_tokens=4, temperature=0.0, extra_body=IGNORE_EOS)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=MODEL_NAME, input="Another one.", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0.0, extra_body=IGNORE_EOS)
    # the stored conversation, its reply, then the new input; the old instructions are not carried
    conversation = [{"role": "user", "content": "Name a city."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Another one."}]
    count = httpx.post(srv.base_url + "/tokenize", json={"messages": conversation}).json()["count"]
    assert second.usage.input_tokens == count and second.previous_response_id == first.id
    assert second.output_text == _chat_text(client, conversation, 4)
    # store=False keeps nothing; a deleted or unknown id is an OpenAI 404
    unstored = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    for rid in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(rid)
        assert e.value.body["message"] == f"Response with id '{rid}' not found."
    r = httpx.delete(srv.base_url + f"/v1/responses/{first.id}")
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "response", "deleted": True}
    assert httpx.get(srv.base_url + f"/v1/responses/{first.id}").status_code == 404
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "word " * 2000}, "input"),  # longer than the model
    ({"model": "other"}, "model"),
])
def test_refused(srv, body, param):
    r = httpx.post(srv.base_url + "/v1/responses", json={"input": "hi", **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert srv.wait_idle()["blocks_held"] == 0


def _fuzzed_bodies():
    from hypothesis import strategies as st

    from attnserve.entrypoints.openai.responses_api import ResponsesRequest

    text = st.one_of(st.text(max_size=8), st.sampled_from(["", "\x00", "\ud800", "<|im_start|>", "{{ x }}"]))
    values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 30), st.floats(), text),
                          lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
                          max_leaves=8)
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                                 optional={"text": values})
    item = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])},
                                 optional={"type": st.sampled_from(["message", "function_call"]),
                                           "content": st.one_of(text, st.lists(part, max_size=2), values)})
    typed = {"input": st.one_of(text, st.lists(item, max_size=3)), "include": st.lists(st.sampled_from(
        ["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2),
        "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
            optional={"schema": st.sampled_from([{"type": "string", "enum": ["a"]}, {}, 3])})}),
        "top_logprobs": st.integers(-1, 25), "max_output_tokens": st.integers(-1, 4), "stream": st.booleans(),
        "temperature": st.floats(-1, 3), "previous_response_id": st.sampled_from(["resp_x", None])}
    fields = sorted(ResponsesRequest.model_fields)

    @st.composite
    def body(draw) -> dict:
        out = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3, "stream": draw(st.booleans())}
        for name in draw(st.lists(st.sampled_from(fields + ["unknown"]), unique=True, max_size=4)):
            out[name] = draw(typed.get(name, values) if draw(st.booleans()) else values)
        if not isinstance(out.get("max_output_tokens"), int) or out["max_output_tokens"] > 4:
            out["max_output_tokens"] = 3  # short replies: random weights never end on their own
        return out

    return body()


def test_fuzzed_requests_never_hurt_the_server(srv):
    """Bodies mutated field by field: never a 5xx, every error in OpenAI's shape, every stream's
    events numbered in order up to a final one, and the engine idle after each answer."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_fuzzed_bodies())
    def call(body):
        r = httpx.post(srv.base_url + "/v1/responses", content=json.dumps(body), timeout=60,  # NaN too
                       headers={"Content-Type": "application/json"})
        assert r.status_code < 500, r.text[:300]
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
        srv.wait_idle(timeout=5)

    call()


def test_store_is_bounded():
    from attnserve.entrypoints.openai.protocol import ChatMessage
    from attnserve.entrypoints.openai.responses_api import (
        ResponseOutputMessage,
        ResponseOutputText,
        ResponsesResponse,
    )
    from attnserve.entrypoints.openai.serving_responses import ResponseStore

    def response(rid: str, text: str) -> ResponsesResponse:
        return ResponsesResponse(id=rid, status="completed", model="m", temperature=1.0, top_p=1.0, output=[
            ResponseOutputMessage(id="msg_1", status="completed", content=[ResponseOutputText(text=text)])])

    store = ResponseStore(max_responses=2, max_chars=10)
    for rid in ("a", "b", "c"):  # the oldest goes first
        assert store.put(response(rid, "xy"), [ChatMessage(role="user", content="z")])
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    assert store.put(response("d", "x" * 7), [])  # 3 + 3 + 7 > 10 characters: "b" goes
    assert [rid for rid in "abcd" if store.get(rid)] == ["c", "d"]
    assert not store.put(response("e", "x" * 11), []) and store.get("e") is None  # too large alone
    assert store.delete("d") and not store.delete("d") and len(store) == 1
