"""The wire models, request checks, stream bookkeeping and metrics text, without a server."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from attnserve.entrypoints.openai.metrics import Histogram, ServerMetrics
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
        ({"prompt": "x"}, "model", "Missing required parameter"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "Invalid value"),
        ({"model": "m", "prompt": "x", "max_tokens": "16"}, "max_tokens", "Invalid value"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "Invalid value"),
        ({"model": "m", "prompt": ["a", [1]]}, "prompt", "Invalid type"),
        (
            {"model": "m", "prompt": "x", "frobnicate": 1},
            "frobnicate",
            "Unrecognized request argument",
        ),
    ],
)
def test_validation_errors_name_the_field(body, param, words):
    err = _error_for(body)
    assert err.status == 400 and err.param == param and words in err.message


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
        ({"logprobs": 50}, "logprobs"),
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
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto"
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ):
        with pytest.raises(OpenAIError) as info:
            ChatCompletionRequest.model_validate({**base, **extra}).check_supported()
        assert info.value.param == param


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


def test_histogram_and_metrics_text():
    h = Histogram((0.1, 1.0))
    h.observe(0.05)
    h.observe(0.5, n=2)
    h.observe(5.0)
    lines = h.render("x_seconds", "help")
    assert 'x_seconds_bucket{le="0.1"} 1' in lines and 'x_seconds_bucket{le="1.0"} 3' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4' in lines and "x_seconds_count 4" in lines
    assert "x_seconds_sum 6.05" in lines

    async def stream():
        for n in (1, 2, 3):
            yield RequestOutput(
                "r",
                None,
                [1, 2, 3, 4],
                None,
                [_out("", list(range(n)), "length" if n == 3 else None)],
                n == 3,
            )

    async def main(m: ServerMetrics):
        return [o async for o in m.track(stream(), arrival=0.0)]

    from attnserve.engine.async_engine import EngineStats

    m = ServerMetrics()
    assert len(asyncio.run(main(m))) == 3
    text = m.render(EngineStats(num_running=2, kv_cache_usage=0.25))
    assert "attnserve_prompt_tokens_total 4" in text
    assert "attnserve_generation_tokens_total 3" in text
    assert 'attnserve_request_success_total{finished_reason="length"} 1' in text
    assert "attnserve_time_to_first_token_seconds_count 1" in text
    assert "attnserve_inter_token_latency_seconds_count 2" in text
    assert "attnserve_num_requests_running 2" in text
    assert "attnserve_kv_cache_usage_perc 0.25" in text
