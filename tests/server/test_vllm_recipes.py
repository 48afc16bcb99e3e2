"""vLLM's recipes run unchanged (issue #38): serve command lines and ``LLM`` code from vLLM's
quickstart and its OpenAI-compatible server docs, with the model replaced by the shipped demo
model and ``vllm`` by ``attnserve``, and the ``openai`` client calls those pages make.

Each serve line goes through the real command line (``cli.main``) up to ``run_server``, which
here builds the same engine (on a thread) and app as the real one and answers the docs' client
calls in-process instead of listening on a port. The demo model ships its chat template, so
chat needs no template flag.
"""

from __future__ import annotations

import asyncio
import shlex

import httpx
import openai
import pytest

from attnserve import LLM, SamplingParams
from attnserve.entrypoints.cli import main
from attnserve.presets import DEFAULT_MODEL

DEMO = DEFAULT_MODEL
# (the docs' command line with the demo model, the model name clients ask for, the API key)
SERVE_RECIPES = [
    # quickstart: "vllm serve Qwen/Qwen2.5-1.5B-Instruct"
    (f"serve {DEMO}", DEMO, None),
    # OpenAI-compatible server: "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123"
    (f"serve {DEMO} --dtype auto --api-key token-abc123", DEMO, "token-abc123"),
    # engine arguments as the docs spell them, the model as --model
    (f"serve --model {DEMO} --served-model-name my-model --max-model-len 1024 --gpu-memory-utilization 0.9 "
     "--trust-remote-code --enable-chunked-prefill --enable-prefix-caching -tp 1 --swap-space 4 "
     "--disable-log-requests --seed 0", "my-model", None),
    # tool calling and reasoning
    (f"serve {DEMO} --enable-auto-tool-choice --tool-call-parser hermes", DEMO, None),
    (f"serve {DEMO} --reasoning-parser deepseek_r1", DEMO, None),
    # generation config, request logging, CORS
    (f"serve {DEMO} --generation-config vllm --enable-log-requests --allowed-origins '[\"*\"]' "
     "--uvicorn-log-level warning", DEMO, None),
]


@pytest.fixture
def serve_in_process(monkeypatch):
    """``run_server`` replaced by one that builds the engine and app as it does, answers the docs'
    client calls through the ASGI transport, and records what it got."""
    import attnserve.entrypoints.openai.api_server as api_server
    from attnserve.engine.async_engine import AsyncLLMEngine
    from attnserve.tokenizer import load_chat_template

    seen = []

    def run_server(model, engine_kwargs, *, api_key=None, served_model_name=None, limits=None,
                   chat_template=None, tool_call_parser=None, cors=None, log_requests=False,
                   reasoning_parser=None, **rest):
        engine = AsyncLLMEngine.from_kwargs(model, **engine_kwargs)
        engine.start()
        try:
            app = api_server.build_app(engine, served_model_name or model, api_key, limits,
                                       load_chat_template(chat_template), tool_call_parser, cors=cors,
                                       log_requests=log_requests, reasoning_parser=reasoning_parser)
            seen.append({"model": model, "engine": engine_kwargs, "api_key": api_key, "cors": cors,
                         "served": served_model_name, **rest,
                         "answers": asyncio.run(_docs_calls(app, api_key, seen_name=served_model_name, model=model))})
        finally:
            engine.shutdown()

    monkeypatch.setattr(api_server, "run_server", run_server)
    return seen


async def _docs_calls(app, api_key, *, seen_name, model) -> dict:
    """The openai client calls of vLLM's quickstart and server docs."""
    name = (seen_name or [model])[0] if isinstance(seen_name, list) else (seen_name or model)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server")
    client = openai.AsyncOpenAI(api_key=api_key or "EMPTY", base_url="http://server/v1", http_client=http)
    async with http:
        models = await client.models.list()
        completion = await client.completions.create(model=name, prompt="San Francisco is a", max_tokens=8)
        chat = await client.chat.completions.create(model=name, max_tokens=8, messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"}])
        stream = await client.chat.completions.create(model=name, max_tokens=8, stream=True,
                                                      messages=[{"role": "user", "content": "Say hello"}])
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        response = await client.responses.create(model=name, input="Tell me a three sentence story.",
                                                 max_output_tokens=8)
    return {"models": [m.id for m in models.data], "completion": completion.choices[0].text,
            "chat": chat.choices[0].message, "stream": "".join(pieces), "response": response}


@pytest.mark.parametrize(("line", "name", "key"), SERVE_RECIPES, ids=[r[0][:60] for r in SERVE_RECIPES])
def test_serve_recipe_runs_unchanged(serve_in_process, line, name, key):
    assert main(shlex.split(line)) == 0
    (run,) = serve_in_process
    answers = run["answers"]
    assert answers["models"][0] == name
    assert answers["completion"]  # eight tokens of text
    chat = answers["chat"]
    response = answers["response"]
    assert response.status in ("completed", "incomplete")
    if "--reasoning-parser deepseek_r1" in line:  # the demo model writes no </think>: all of it is reasoning
        assert chat.content is None and chat.reasoning_content
        assert [item.type for item in response.output] == ["reasoning", "message"] and not response.output_text
    else:
        assert chat.role == "assistant" and chat.content and answers["stream"] and response.output_text
    assert run["api_key"] == key


def test_serve_recipe_from_a_config_file(serve_in_process, tmp_path):
    """The docs' ``vllm serve --config config.yaml``: flags in YAML, the command line wins."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {DEMO}\nhost: \"127.0.0.1\"\nport: 6379\nuvicorn-log-level: \"info\"\n"
                      "max-model-len: 512\nserved-model-name: from-yaml\n")
    assert main(["serve", "--config", str(config), "--port", "8001"]) == 0
    (run,) = serve_in_process
    assert run["model"] == DEMO and run["port"] == 8001 and run["engine"]["max_model_len"] == 512
    assert run["answers"]["models"] == ["from-yaml"]


def test_llm_quickstart_runs_unchanged():
    """vLLM's offline quickstart, the model replaced; then the chat and options pages' lines."""
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=DEMO)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        assert prompt in prompts and isinstance(generated_text, str)
    assert [o.prompt for o in outputs] == prompts

    llm = LLM(model=DEMO, trust_remote_code=True, max_model_len=1024, gpu_memory_utilization=0.9,
              enforce_eager=True, seed=0, tensor_parallel_size=1, dtype="auto", swap_space=4,
              enable_prefix_caching=True, quantization=None)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, SamplingParams(temperature=0.5, max_tokens=16), use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].text
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("Hello")).strip() == "Hello"
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=16, n=2, logprobs=2))
    assert len(out.outputs) == 2 and all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)
