"""The wire models, request checks, stream bookkeeping and metrics text, without a server."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from pydantic import ValidationError

from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_context,
    validation_error,
)
from attnserve.entrypoints.openai.serving_completion import StreamProgress, merge, stop_holdback
from attnserve.outputs import CompletionOutput, RequestOutput


def _error_for(body: dict, model=CompletionRequest) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"model": "m"}, "prompt", "Missing required parameter"),  # model may be left out (vLLM)
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "Invalid value"),
        ({"model": "m", "prompt": "x", "max_tokens": "16"}, "max_tokens", "Invalid value"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "Invalid value"),
        ({"model": "m", "prompt": ["a", [1]]}, "prompt", "Invalid type"),
    ],
)
def test_validation_errors_name_the_field(body, param, words):
    err = _error_for(body)
    assert err.status == 400 and err.param == param and words in err.message


def test_unknown_fields_are_named_and_ignored_unless_they_change_the_result():
    """What the OpenAI SDKs and vLLM clients send beyond what this server knows is ignored (the
    server logs the names); a field whose neglect would change the output is refused."""
    req = ChatCompletionRequest.model_validate({
        "model": "m", "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "priority": 3,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}],
                      "reasoning_content": "kept for the template"}],
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "modalities": ["text"], "use_beam_search": False, "reasoning_effort": "low",
    })
    assert sorted(req.ignored_fields()) == sorted([
        "store", "metadata", "service_tier", "priority", "modalities", "use_beam_search",
        "messages.content.cache_control", "stream_options.continuous_usage_stats"])
    assert req.messages[0].for_template()["reasoning_content"] == "kept for the template"
    assert CompletionRequest(model="m", prompt="x").ignored_fields() == []
    for field, value in (("use_beam_search", True), ("modalities", ["audio"]), ("functions", [{}]),
                         ("echo", True)):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
        with pytest.raises(OpenAIError) as info:
            ChatCompletionRequest.model_validate(body).ignored_fields()
        assert info.value.param == field and info.value.status == 400


def test_chat_message_checks():
    err = _error_for({"model": "m", "messages": []}, ChatCompletionRequest)
    assert err.param == "messages"
    err = _error_for(
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, ChatCompletionRequest
    )
    assert err.param == "messages"
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    )
    assert req.messages[0].for_template() == {"role": "user", "content": "ab"}


def test_prompt_forms():
    def prompts(p):
        return CompletionRequest(model="m", prompt=p).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_sampling_values_become_400(kw, param):
    req = CompletionRequest(model="m", prompt="x", **kw)
    with pytest.raises(OpenAIError) as info:
        req.to_sampling_params(4)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": -1}, "logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "guided_regex"),
        ({"structured_outputs": {"json": "{", "regex": None}}, "structured_outputs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_parameters(kw, param):
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(model="m", prompt="x", **kw).check_supported()
    assert info.value.param == param


def test_chat_unsupported_parameters():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ):
        with pytest.raises(OpenAIError) as info:
            ChatCompletionRequest.model_validate({**base, **extra}).check_supported()
        assert info.value.param == param
    # "auto" (the default with tools) is the serving layer's to refuse or parse
    auto = ChatCompletionRequest.model_validate({**base, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert auto.tool_call_mode() == ("auto", None) and auto.output_constraint() == (None, None)


def test_check_context():
    assert check_context(10, 5, 100) == 5
    assert check_context(10, None, 100) == 90
    assert check_context(99, 1, 100) == 1
    for prompt_len, max_tokens, param in (
        (100, 1, "prompt"),
        (90, 11, "max_tokens"),
        (5, 0, "max_tokens"),
    ):
        with pytest.raises(OpenAIError) as info:
            check_context(prompt_len, max_tokens, 100)
        assert info.value.param == param and info.value.status == 400


def _out(text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=finish)


def test_stream_progress_holds_back_possible_stop_strings():
    hold = stop_holdback(["STOP"])
    assert hold == 3 and stop_holdback(None) == 0
    p = StreamProgress()
    assert p.advance(_out("abcde", [1, 2]), hold) == ("ab", 0, 2)
    assert p.advance(_out("abcdeST", [1, 2, 3]), hold) == ("cd", 2, 3)
    # the engine found "STOP" and cut it: nothing sent was part of it
    assert p.advance(_out("abcde", [1, 2, 3, 4], "stop"), hold) == ("e", 3, 4)
    assert p.done


def test_merge_interleaves_and_closes_sources():
    closed = []

    async def source(name: str, n: int, delay: float):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def main():
        got = [x async for x in merge([source("a", 3, 0.001), source("b", 2, 0.002)])]
        stream = merge([source("c", 100, 0.001), source("d", 100, 0.001)])
        await stream.__anext__()
        await stream.aclose()
        return got

    got = asyncio.run(main())
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b", "c", "d"]


def test_metrics_page_parses_with_vllm_names():
    from prometheus_client.parser import text_string_to_metric_families

    from attnserve.engine.async_engine import EngineStats
    from attnserve.entrypoints.openai.metrics import token_buckets

    assert token_buckets(60) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)

    async def stream(n_last: int):
        for n in range(1, n_last + 1):
            yield RequestOutput(
                "r", None, [1, 2, 3, 4], None,
                [_out("", list(range(n)), "length" if n == 3 else None)], n == 3,
            )

    async def main(m: ServerMetrics):
        done = [o async for o in m.track(stream(3), arrival=0.0)]
        async with contextlib.aclosing(m.track(stream(3), arrival=0.0)) as s:  # left after one
            await s.__anext__()
        return done

    m = ServerMetrics("tiny", lambda: EngineStats(num_running=2, kv_cache_usage=0.25, num_preemptions=4),
                      max_model_len=64, cache_info={"block_size": "16"})
    assert len(asyncio.run(main(m))) == 3
    m.record_error(413)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    label = (("model_name", "tiny"),)

    def value(name: str, *extra: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted(label + extra)))]

    assert value("vllm:prompt_tokens_total") == 8
    assert value("vllm:generation_tokens_total") == 4
    assert value("vllm:request_success_total", ("finished_reason", "length")) == 1
    assert value("vllm:request_success_total", ("finished_reason", "abort")) == 1
    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds_count") == 2
    assert value("vllm:request_generation_tokens_bucket", ("le", "2.0")) == 0
    assert value("vllm:request_generation_tokens_bucket", ("le", "5.0")) == 1
    assert value("vllm:num_requests_running") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25
    assert value("vllm:num_preemptions_total") == 4
    assert value("vllm:cache_config_info", ("block_size", "16")) == 1
    assert value("attnserve:request_errors_total", ("status", "413")) == 1


def test_completion_chunk_sse_is_pydantics_json():
    """The direct writer of a stream's text chunks writes what pydantic writes, byte for byte."""
    import random

    from attnserve.entrypoints.openai.protocol import (
        CompletionChoice,
        CompletionResponse,
        completion_chunk_head,
        completion_chunk_sse,
        sse,
    )

    rng = random.Random(0)
    chars = 'ab"\\/\n\t\x00\x1f\x7f\u2028é日😀\ufffd<>&\''
    for _ in range(300):
        choices = [
            CompletionChoice(index=rng.randrange(5), text="".join(rng.choices(chars, k=rng.randrange(6))),
                             finish_reason=rng.choice([None, "stop", "length"]),
                             stop_reason=rng.choice([None, 3, "</s>", 'a"b']))
            for _ in range(rng.randint(1, 3))
        ]
        expected = sse(CompletionResponse(id='cmpl-x"y', created=17, model="m/é", choices=choices))
        assert completion_chunk_sse(completion_chunk_head('cmpl-x"y', 17, "m/é"), choices) == expected
