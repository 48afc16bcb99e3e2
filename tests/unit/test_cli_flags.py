"""Issue #39: every flag of ``attnserve generate``, ``serve``, ``inspect`` and ``bench`` given a
bad value (negative, zero, huge, NaN, infinite, not a number, empty) ends in a one-line error
naming the flag, or is a value the command accepts, and never in a traceback; and it does so
before any model loads.

The flags are read from the parser itself, so a flag added later is under test too. The commands
run through ``cli.main`` up to where the engine would be built (``generate`` and ``bench``:
``LLMEngine``; ``serve``: ``run_server``, after its engine keywords are checked as the server
checks them; ``bench serve``: before its clients send anything); ``inspect`` runs whole (it
loads no weights). The budgets that need the model's block size (``--kv-cache-memory``,
``--num-gpu-blocks-override``, a host offload size) are checked by the engine before it loads the
weights: the last tests run the demo model's engine up to there. ``LLM(...)`` keywords get a
ValueError naming the keyword.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re

import pytest

from attnserve.entrypoints import cli

BAD = ["-1", "0", "1e30", "nan", "inf", "abc", "", "99999999999999999999"]
NEGATIVE_OK = {"--max-logprobs", "--top-k"}  # -1: no cap, all tokens
INFINITE_OK = {"--request-rate"}  # inf: every request at once


class _Reached(Exception):
    """The command got to building the engine (or sending requests): its values were accepted."""


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, prefix + (name,))
            return
    yield prefix, parser


def _flags() -> list[tuple[tuple[str, ...], argparse.Action]]:
    out = []
    for prefix, parser in _commands(cli.build_parser()):
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)):
                out.append((prefix, action))
    return out


FLAGS = _flags()


def _numeric(action: argparse.Action) -> str | None:
    return {"int": "int", "float": "float"}.get(getattr(action.type, "__name__", ""))


@pytest.fixture
def engine_boundary(monkeypatch, tmp_path):
    """Every way a command builds an engine or sends requests raises ``_Reached`` instead."""
    from attnserve.config import EngineConfig
    from attnserve.entrypoints import bench, inspect, llm
    from attnserve.entrypoints.openai import api_server

    def reached(*args, **kwargs):
        raise _Reached

    def run_server(model, engine_kwargs, **kwargs):
        EngineConfig.from_kwargs(model, usage_context="server", **engine_kwargs)  # as the engine's start does
        raise _Reached

    monkeypatch.setattr(llm, "LLMEngine", reached)
    monkeypatch.setattr(api_server, "run_server", run_server)
    monkeypatch.setattr(bench, "_drive_part", reached)
    monkeypatch.setattr(inspect, "plot_kv_memory", lambda report, path: None)  # its file name is checked first
    monkeypatch.chdir(tmp_path)  # --plot and --output-json values name files here


def _run(argv: list[str]) -> tuple[str, str]:
    """("refused" | "accepted", the last line on stderr); a traceback fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse: usage, then one line "...: error: argument --flag: ..."
            rc = e.code
        except _Reached:
            rc = 0
    lines = err.getvalue().strip().splitlines()
    assert rc in (0, 2), f"{argv}: exit {rc}: {err.getvalue()[-2000:]}"
    return ("accepted" if rc == 0 else "refused"), (lines[-1] if lines else "")


def _names_the_flag(line: str, action: argparse.Action) -> bool:
    words = lambda s: re.sub(r"[-_]+", " ", s.lower()).strip()  # noqa: E731
    return any(words(n) in words(line) for n in (*action.option_strings, action.dest))


@pytest.mark.parametrize("command, action", FLAGS, ids=[f"{' '.join(c)} {a.option_strings[0]}" for c, a in FLAGS])
def test_a_bad_flag_value_is_a_one_line_error_naming_the_flag(command, action, engine_boundary):
    flag = action.option_strings[0]
    base = list(command) + (["attnserve-demo-gqa"] if command == ("inspect",) else [])
    numeric = _numeric(action)
    n = action.nargs if isinstance(action.nargs, int) else 1
    for value in BAD:
        outcome, line = _run(base + [flag] + [value] * n)
        if outcome == "refused":
            assert "error" in line and _names_the_flag(line, action), f"{flag} {value!r}: {line!r}"
        if numeric is None:
            continue
        # a number flag takes no NaN, no text, no negative and no infinity unless they mean something
        # (a huge value may be a cap that means "no limit", or a budget the engine refuses later)
        must_refuse = value in ("nan", "abc", "") or (value == "-1" and flag not in NEGATIVE_OK) or \
            (value == "inf" and flag not in INFINITE_OK) or (numeric == "int" and value == "1e30")
        assert outcome == "refused" or not must_refuse, f"{' '.join(command)} {flag} {value!r} was accepted"


def test_the_loop_covers_every_subcommand_and_the_flags_of_the_issue():
    covered = {(" ".join(c), a.option_strings[0]) for c, a in FLAGS}
    for command in ("generate", "serve", "inspect", "bench latency", "bench throughput", "bench serve"):
        assert any(c == command for c, _ in covered), command
    for flag in ("--kv-cache-memory", "--num-gpu-blocks-override", "--device", "--kv-offloading-size"):
        assert ("generate", flag) in covered and ("serve", flag) in covered


@pytest.mark.parametrize("argv, message", [
    (["--device", "nonsense"], "argument --device: must be cpu, cuda or cuda:N"),
    (["--num-gpu-blocks-override", "1e10"], "argument --num-gpu-blocks-override: must be an integer"),
    (["--kv-cache-memory", "nan"], "argument --kv-cache-memory: must be a finite number > 0"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: must be one of auto, fp8"),
    (["--prompts-file", "/"], "argument --prompts-file: no readable file"),
])
def test_parse_errors_name_the_flag(argv, message, engine_boundary, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def no_weights(monkeypatch):
    """The demo model's engine is built up to its weights, which must not be reached."""
    from attnserve.engine import builder

    def build_model(*args, **kwargs):
        raise AssertionError("the weights were loaded before the bad budget was refused")

    monkeypatch.setattr(builder, "_build_model", build_model)


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "1e9"], r"kv_cache_memory is 1e\+09 GiB, more than the .* GiB of host memory"),
    (["--num-gpu-blocks-override", str(10**10)], r"num_gpu_blocks_override=10000000000 blocks of \d+ bytes"),
    (["--kv-offloading-size", "1e6"], r"kv_offloading_size is 1e\+06 GiB of host memory, but only"),
])
def test_budgets_larger_than_the_machine_are_refused_before_the_weights(argv, message, no_weights, capsys):
    assert cli.main(["generate", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(message, err[-1]) and err[-1].startswith("error: "), err[-1]


@pytest.mark.parametrize("kwargs, name", [
    ({"kv_cache_memory": math.nan}, "kv_cache_memory"),
    ({"kv_cache_memory": "4"}, "kv_cache_memory"),
    ({"num_gpu_blocks_override": 1e10}, "num_gpu_blocks_override"),
    ({"device": "nonsense"}, "device"),
    ({"gpu_memory_utilization": math.inf}, "gpu_memory_utilization"),
    ({"kv_offloading_size": -1.0}, "kv_offloading_size"),
    ({"kv_offloading_size": math.nan}, "kv_offloading_size"),
    ({"tensor_parallel_size": 2.0}, "tensor_parallel_size"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_num_seqs": 1 << 40}, "max_num_seqs"),
    ({"block_size": 1 << 20}, "block_size"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"seed": "x"}, "seed"),
    ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"streaming_sinks": -1, "streaming_window": 8}, "streaming_sinks"),
])
def test_llm_keywords_are_checked_by_name(kwargs, name):
    from attnserve import LLM

    with pytest.raises(ValueError, match=rf"^{name} "):
        LLM(**kwargs)  # the config is checked before anything is read


def test_a_huge_disk_offload_budget_is_accepted(no_weights, tmp_path, capsys):
    """The disk tier's size is a cap, held lazily: a budget beyond the disk is not refused
    (its files come as blocks are stored); the engine gets past the budget checks to the weights."""
    with pytest.raises(AssertionError, match="weights were loaded"):
        cli.main(["generate", "--device", "cpu", "--kv-offloading-size", "1000", "--kv-offloading-backend", "disk",
                  "--kv-offloading-dir", str(tmp_path)])
