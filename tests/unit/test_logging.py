"""attnserve's log (``attnserve/logger.py``): configured on import, as vLLM's, with level, time
and source; ``ATTNSERVE_LOGGING_LEVEL`` (and its older name ``ATTNSERVE_LOG_LEVEL``),
``ATTNSERVE_CONFIGURE_LOGGING=0``; Python's warnings in the same format where attnserve owns the
process; a short start-up log for ``LLM()``; and pytest still capturing the records.

The import's configuration is seen in fresh interpreters (this one's logger is the test
session's, ``tests/conftest.py``).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]:]+:\d+\] (.*)$")
_LOG_VARS = ("ATTNSERVE_LOGGING_LEVEL", "ATTNSERVE_LOG_LEVEL", "ATTNSERVE_CONFIGURE_LOGGING")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _LOG_VARS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**clean, "PYTHONPATH": str(ROOT / "src"), **env})


LOGS = """
import logging
import attnserve
log = logging.getLogger("attnserve.some.module")
log.debug("a debug line"); log.info("an info line"); log.warning("a warning line")
"""


def _lines(stderr: str) -> list[tuple[str, str]]:
    return [m.groups() for m in map(LINE.match, stderr.splitlines()) if m]


def test_the_import_configures_level_time_and_source():
    out = _python(LOGS)
    assert out.returncode == 0, out.stderr
    assert _lines(out.stderr) == [("INFO", "an info line"), ("WARNING", "a warning line")], out.stderr
    assert out.stderr.count("\n") == 2, out.stderr  # nothing else, nothing twice
    assert "[<string>:5]" in out.stderr  # the source: file and line


@pytest.mark.parametrize("env, levels", [
    ({"ATTNSERVE_LOGGING_LEVEL": "debug"}, ["DEBUG", "INFO", "WARNING"]),
    ({"ATTNSERVE_LOG_LEVEL": "WARNING"}, ["WARNING"]),  # the older name still works
    ({"ATTNSERVE_LOGGING_LEVEL": "ERROR", "ATTNSERVE_LOG_LEVEL": "DEBUG"}, []),  # the new name wins
])
def test_the_level_comes_from_the_environment(env, levels):
    out = _python(LOGS, **env)
    assert out.returncode == 0, out.stderr
    assert [level for level, _ in _lines(out.stderr)] == levels, out.stderr


def test_a_bad_level_does_not_break_the_import_but_says_so():
    out = _python(LOGS, ATTNSERVE_LOGGING_LEVEL="loud")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stderr)
    assert lines[0][0] == "WARNING" and "ATTNSERVE_LOGGING_LEVEL" in lines[0][1] and "'LOUD'" in lines[0][1]
    assert lines[1:] == [("INFO", "an info line"), ("WARNING", "a warning line")]


def test_configure_logging_0_leaves_logging_to_the_application():
    """No handler of attnserve's: the application's root handler gets the records, once."""
    app = "import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr, format='APP %(message)s')\n"
    out = _python(app + LOGS, ATTNSERVE_CONFIGURE_LOGGING="0")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["APP an info line", "APP a warning line"], out.stderr
    configured = _python(app + LOGS)  # configured: attnserve's lines only, not the root's copy
    assert [line for line in configured.stderr.splitlines() if line.startswith("APP")] == []
    assert len(_lines(configured.stderr)) == 2


def test_the_command_line_logs_python_warnings_with_level_and_time():
    code = ("import warnings\nfrom attnserve.entrypoints.cli import configure_logging\nconfigure_logging()\n"
            "warnings.warn('careful now')\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    (level, message), = _lines(out.stderr)
    assert level == "WARNING" and "UserWarning: careful now" in message, out.stderr


def test_configure_logging_is_idempotent(monkeypatch):
    from attnserve.logger import AttnserveHandler, configure_logging

    monkeypatch.setenv("ATTNSERVE_LOGGING_LEVEL", "warning")
    configure_logging()
    configure_logging()
    log = logging.getLogger("attnserve")
    assert [type(h) for h in log.handlers].count(AttnserveHandler) == 1
    assert log.level == logging.WARNING and log.propagate is False
    monkeypatch.setenv("ATTNSERVE_LOGGING_LEVEL", "nope")
    with pytest.raises(ValueError, match="ATTNSERVE_LOGGING_LEVEL must be DEBUG, INFO"):
        configure_logging()


def test_pytest_captures_attnserve_records(caplog):
    """tests/conftest.py lets the records propagate to pytest's handlers."""
    with caplog.at_level(logging.INFO, logger="attnserve"):
        logging.getLogger("attnserve.engine.something").info("captured")
    assert [r.getMessage() for r in caplog.records] == ["captured"]


def test_llm_start_up_log_is_short_and_says_what_runs():
    """``LLM()``'s INFO lines: the model (weights, architecture, dtype, device), the backend, the
    KV cache (blocks, block size, tokens, GiB) and the limits, in at most 8 lines."""
    out = _python("from attnserve import LLM\nLLM('attnserve-demo-gqa', dtype='float32')\n")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stderr)
    text = "\n".join(message for _, message in lines)
    assert 5 <= len(lines) <= 8 and {level for level, _ in lines} == {"INFO"}, out.stderr
    for needed in ("weights: attnserve-demo-gqa (LlamaForCausalLM)", "dtype float32", "on cpu", "backend ",
                   "blocks of 16 tokens", "tokens fit", "GiB", "max_model_len", "max_num_seqs",
                   "max_num_batched_tokens"):
        assert needed in text, (needed, text)
