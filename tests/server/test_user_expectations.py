"""What a vLLM user's ``openai`` client code expects of the server (issue #23).

Echo with logprobs on a one-token prompt; chat templates from ``--chat-template`` (a file) and
from the request (``chat_template``, only when the server trusts request templates); the
model's ``generation_config.json`` defaults for the fields a request leaves out. The second
server runs the session's tiny llama with a ``generation_config.json`` next to it.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from attnserve import SamplingParams
from attnserve.entrypoints.openai.protocol import ServerLimits
from tests.server.conftest import API_KEY, ENGINE_KWARGS, MODEL_NAME, ServerThread

MSGS = [{"role": "user", "content": "Tell me a story"}]
SERVER_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>"
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %} =>"
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 6, "top_p": 0.5}


def test_echo_logprobs_keep_a_one_token_prompt(client, reference):
    """vLLM echoes every prompt token with its logprob (None for the first), one-token prompts
    included; before, the prompt token was missing from the logprobs."""
    out = client.completions.create(model=MODEL_NAME, prompt=[300], max_tokens=3, temperature=0.0,
                                    echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]
    prompt_text = reference.get_tokenizer().decode([300], skip_special_tokens=False)
    assert lp.tokens[0] == prompt_text and out.choices[0].text.startswith(prompt_text)
    assert "".join(lp.tokens) == out.choices[0].text


def test_request_templates_are_refused_unless_trusted(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2,
                                       extra_body={"chat_template": REQUEST_TEMPLATE})
    assert err.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in err.value.body["message"]


@pytest.fixture(scope="module")
def custom_server(model_dir, tmp_path_factory):
    """The tiny llama with a generation_config.json, served with --chat-template FILE and
    --trust-request-chat-template."""
    root = tmp_path_factory.mktemp("custom")
    model = root / "model"
    shutil.copytree(model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    template_file = root / "template.jinja"
    template_file.write_text(SERVER_TEMPLATE)
    from attnserve.tokenizer import load_chat_template

    srv = ServerThread(model, app_kwargs={"limits": ServerLimits(trust_request_chat_template=True),
                                          "chat_template": load_chat_template(str(template_file))},
                       **ENGINE_KWARGS)
    with openai.OpenAI(api_key=API_KEY, base_url=srv.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c
    srv.stop()


def greedy_ids(reference, text: str, n: int) -> list[int]:
    ids = reference.get_tokenizer().encode(text, add_special_tokens=False)
    out = reference.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n))
    return out[0].outputs[0].token_ids


def test_server_and_request_chat_templates(custom_server, reference):
    tok = reference.get_tokenizer()
    for template, extra in ((SERVER_TEMPLATE, {}), (REQUEST_TEMPLATE, {"chat_template": REQUEST_TEMPLATE})):
        rendered = tok.apply_chat_template(MSGS, chat_template=template)
        out = custom_server.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=4,
                                                    temperature=0.0, extra_body=extra)
        assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
        assert out.choices[0].message.content == tok.decode(greedy_ids(reference, rendered, 4))



def test_reasoning_effort_reaches_the_chat_template(custom_server, reference):
    """The SDK's ``reasoning_effort`` is the template variable of that name (as vLLM passes it),
    and ``chat_template_kwargs`` reach the template too; the prompt length shows what was rendered."""
    template = ("{% if reasoning_effort == 'high' %}Think step by step, check every step. {% endif %}"
                "{% if greet %}Hello! {% endif %}" + REQUEST_TEMPLATE)
    tok = reference.get_tokenizer()

    def prompt_tokens(**kw) -> int:
        return custom_server.chat.completions.create(
            model=MODEL_NAME, messages=MSGS, max_tokens=1, temperature=0.0,
            extra_body={"chat_template": template, **kw.pop("extra", {})}, **kw).usage.prompt_tokens

    def expected(**variables) -> int:
        return len(tok.encode(tok.apply_chat_template(MSGS, chat_template=template, **variables),
                              add_special_tokens=False))

    assert prompt_tokens() == expected() < expected(reasoning_effort="high")
    assert prompt_tokens(reasoning_effort="high") == expected(reasoning_effort="high")
    assert prompt_tokens(reasoning_effort="low") == expected()
    assert prompt_tokens(extra={"chat_template_kwargs": {"greet": True}}) == expected(greet=True) > expected()


def test_generation_config_fills_what_the_request_leaves_out(custom_server, reference):
    """temperature 0 from the file when the request sends none (greedy), and max_new_tokens
    caps max_tokens, as vLLM's --generation-config auto; a request's own temperature wins."""
    prompt = "Once upon a time"
    ref = greedy_ids(reference, prompt, 6)
    out = custom_server.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=50,
                                           extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].text == reference.get_tokenizer().decode(ref)
    sampled = reference.generate([prompt], SamplingParams(temperature=1.0, top_p=0.5, seed=3, max_tokens=6,
                                                          ignore_eos=True))[0].outputs[0].text
    out = custom_server.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=1.0,
                                           seed=3, extra_body={"ignore_eos": True})
    assert out.choices[0].text == sampled
