"""What a vLLM user expects of the offline API and of a model directory (issue #23).

Through ``LLM`` on a tiny llama with a real tokenizer and chat template (the server tests'
model): prompt logprobs of a one-token prompt, ``LLM.chat`` outputs and chat templates,
``generation_config.json`` (EOS ids and default sampling, ``generation_config='vllm'``),
Hugging Face hub ids resolved from a local cache built here (``HF_HUB_OFFLINE``: nothing is
downloaded), and a model directory without ``tokenizer.json``.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from attnserve import LLM, SamplingParams
from attnserve.entrypoints.cli import main
from attnserve.tokenizer import FastTokenizer, load_tokenizer
from tests.server.conftest import build_tiny_llama

KW = {"kv_cache_memory": 0.01, "max_num_seqs": 8}
MSGS = [{"role": "user", "content": "hi there"}]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny), **KW)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


# --- small bugs ------------------------------------------------------------------------------


def test_prompt_logprobs_of_a_one_token_prompt(llm):
    """vLLM's shape: one entry per prompt token, the first None; a one-token prompt gives [None]."""
    assert llm.generate([[5]], greedy(1, prompt_logprobs=2))[0].prompt_logprobs == [None]
    two = llm.generate([[5, 6]], greedy(1, prompt_logprobs=2))[0].prompt_logprobs
    assert len(two) == 2 and two[0] is None and 6 in two[1]
    assert llm.generate([[5]], greedy(1))[0].prompt_logprobs is None  # not asked for


def test_chat_outputs_carry_the_rendered_prompt(llm):
    tok = llm.get_tokenizer()
    out = llm.chat(MSGS, greedy(2))[0]
    assert out.prompt == tok.apply_chat_template(MSGS) and out.prompt.startswith("<|im_start|>user")
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)



def test_structured_output_without_xgrammar_names_the_extra(tiny, monkeypatch):
    """xgrammar is the ``structured`` extra, not the base install: a structured request is
    refused before anything is queued, with the command that installs it."""
    from attnserve.engine.engine import PromptError
    from attnserve.sampling_params import StructuredOutputsParams

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what the base install gives
    llm = LLM(str(tiny), **KW)
    assert llm.llm_engine.structured.warm_up() is False
    with pytest.raises(PromptError, match=r"pip install 'attnserve\[structured\]'"):
        llm.generate(["a", "b"], [greedy(2), greedy(2, structured_outputs=StructuredOutputsParams(choice=["x"]))])
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["a"], greedy(2))[0].outputs[0].token_ids  # the engine still serves


# --- chat templates --------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_chat_template_as_a_string_or_a_file(llm, tmp_path):
    out = llm.chat(MSGS, greedy(3), chat_template=TEMPLATE)[0]
    assert out.prompt == "[user] hi there\n"
    # the same tokens as generating from the rendered text
    ref = llm.generate([{"prompt_token_ids": llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)}],
                       greedy(3))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert llm.chat(MSGS, greedy(1), chat_template=str(path))[0].prompt == "[user] hi there\n"
    with pytest.raises(ValueError, match="neither a readable file nor a template"):
        llm.chat(MSGS, greedy(1), chat_template=str(tmp_path / "missing.jinja"))



def test_chat_template_kwargs_and_tools_reach_the_template(llm):
    """vLLM's ``LLM.chat(..., chat_template_kwargs=, tools=)``: both are template variables."""
    template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% if enable_thinking %}<think>{% endif %}" + TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = llm.chat(MSGS, greedy(1), chat_template=template)[0]
    assert plain.prompt == "[user] hi there\n"
    out = llm.chat([MSGS, MSGS], greedy(1), chat_template=template, tools=tools,
                   chat_template_kwargs={"enable_thinking": True})
    assert [o.prompt for o in out] == ["TOOLS get_weather\n<think>[user] hi there\n"] * 2


def test_a_model_without_a_template_names_the_ways_to_give_one(tiny, tmp_path):
    d = copy_model(tiny, tmp_path / "no_template", skip=("tokenizer_config.json",))
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(d)
    with pytest.raises(ValueError, match="no chat template") as err:
        tok.apply_chat_template(MSGS)
    for option in ("--chat-template", "chat_template=", "--trust-request-chat-template"):
        assert option in str(err.value)
    assert tok.apply_chat_template(MSGS, chat_template=TEMPLATE) == "[user] hi there\n"


# --- generation_config.json ------------------------------------------------------------------


def test_generation_config_eos_ids_and_default_sampling(tiny, llm, tmp_path):
    ref = llm.generate(["hello"], greedy(8, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])  # first unrepeated token
    d = copy_model(tiny, tmp_path / "with_generation_config")
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ref[stop_at], 1], "temperature": 0.0, "top_k": 7, "max_new_tokens": 6,
         "do_sample": True}))
    auto = LLM(str(d), **KW)
    defaults = auto.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 6)
    out = auto.generate(["hello"])[0].outputs[0]  # the model's defaults: greedy, stops at its EOS
    assert out.token_ids == ref[: stop_at + 1] and out.finish_reason == "stop"
    assert auto.generate(["hello"], greedy(8, ignore_eos=True))[0].outputs[0].token_ids == ref
    # 'vllm' ignores the file: vLLM's defaults, the config's EOS only
    plain = LLM(str(d), generation_config="vllm", **KW)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert plain.generate(["hello"], greedy(8))[0].outputs[0].token_ids == ref
    # a directory holding one; a bad value names the file
    assert LLM(str(tiny), generation_config=str(d), **KW).get_default_sampling_params().top_k == 7
    (d / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        LLM(str(d), **KW)
    with pytest.raises(FileNotFoundError, match="no generation_config.json"):
        LLM(str(tiny), generation_config=str(tmp_path), **KW)


# --- Hugging Face hub ids --------------------------------------------------------------------


def hub_cache(root: Path, repo: str, model: Path, commit: str = COMMIT) -> Path:
    """The hub cache layout: models--org--name/snapshots/<commit>/ and refs/main."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = copy_model(model, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))  # the cache is $HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache.mkdir(parents=True)
    return cache


def test_hub_id_resolves_from_the_local_cache(tiny, llm, offline_cache, capsys):
    snapshot = hub_cache(offline_cache, "org/tiny", tiny)
    hub = LLM("org/tiny", **KW)
    assert hub.llm_engine.parts.model_dir == snapshot
    assert hub.generate(["hello"], greedy(4))[0].outputs[0].token_ids == \
        llm.generate(["hello"], greedy(4))[0].outputs[0].token_ids
    assert LLM("org/tiny", revision=COMMIT, load_format="dummy", **KW).llm_engine.parts.model_dir == snapshot
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        LLM("org/tiny", revision="v2", **KW)
    # the command line: inspect reads the cached config.json
    assert main(["inspect", "org/tiny", "--platform", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "org/tiny"


def test_hub_id_not_cached_while_offline_is_a_clear_error(offline_cache, capsys):
    with pytest.raises(FileNotFoundError) as err:
        LLM("org/missing", **KW)
    for part in ("'org/missing'", str(offline_cache), "HF_HUB_OFFLINE"):
        assert part in str(err.value)
    assert main(["generate", "--model", "org/missing", "--prompt", "x"]) == 2
    assert "org/missing" in capsys.readouterr().err


def test_hub_snapshot_without_weights(tiny, offline_cache):
    """A cached snapshot with only config.json (what ``inspect`` fetches): enough for dummy
    weights; otherwise the error says the weights are missing (online they are downloaded)."""
    skip = tuple(f.name for f in tiny.iterdir() if f.name != "config.json")
    snapshot = hub_cache(offline_cache, "org/config-only", tiny)
    for name in skip:
        (snapshot / name).unlink()
    assert LLM("org/config-only", load_format="dummy", **KW).llm_engine.parts.model_dir == snapshot
    with pytest.raises(FileNotFoundError, match="safetensors weights of its cached snapshot"):
        LLM("org/config-only", **KW)
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        LLM("./no/such/dir", **KW)



def test_hub_id_downloads_when_online(tiny, offline_cache, monkeypatch):
    """Online (no HF_HUB_OFFLINE) and not cached: ``snapshot_download`` is asked for the files the
    engine reads (safetensors only when the weights will be loaded) and its snapshot is served;
    a failed download is one error naming the id, the revision and the cache. The hub itself is
    replaced by a fake that writes the snapshot the way a download would."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False,
                               allow_patterns=None):
        calls.append((repo_id, local_files_only, allow_patterns))
        assert cache_dir == str(offline_cache)
        snapshot = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        if local_files_only:
            if snapshot.is_dir():
                return str(snapshot)
            raise LocalEntryNotFoundError("not cached")
        if repo_id == "org/unreachable":
            raise ConnectionError("connection refused\nsecond line")
        hub_cache(Path(cache_dir), repo_id, tiny)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    llm = LLM("org/remote", **KW)
    assert llm.llm_engine.parts.model_dir == offline_cache / "models--org--remote" / "snapshots" / COMMIT
    assert [c[:2] for c in calls] == [("org/remote", True), ("org/remote", False)]
    assert "*.safetensors" in calls[1][2] and "*.json" in calls[1][2]
    calls.clear()
    LLM("org/remote", **KW)  # cached now: the network is not asked again
    assert [c[:2] for c in calls] == [("org/remote", True)]
    calls.clear()
    LLM("org/remote-dummy", load_format="dummy", **KW)
    assert "*.safetensors" not in calls[1][2]  # dummy weights: only configs and tokenizer
    with pytest.raises(FileNotFoundError) as err:
        LLM("org/unreachable", revision="v2", **KW)
    for part in ("'org/unreachable' (revision 'v2')", str(offline_cache), "could not be downloaded",
                 "ConnectionError: connection refused"):
        assert part in str(err.value)
    assert "second line" not in str(err.value)


# --- a model directory without a tokenizer ---------------------------------------------------


def test_no_tokenizer_json_warns_and_the_tokenizer_option_fixes_it(tiny, tmp_path, caplog):
    d = copy_model(tiny, tmp_path / "weights_only", skip=("tokenizer.json", "tokenizer_config.json"))
    with caplog.at_level(logging.WARNING, logger="attnserve.tokenizer"):
        load_tokenizer(d)
    assert "has no tokenizer.json" in caplog.text and "--tokenizer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attnserve.tokenizer"):
        fixed = LLM(str(d), tokenizer=str(tiny), **KW)
    assert isinstance(fixed.get_tokenizer(), FastTokenizer) and "tokenizer.json" not in caplog.text
