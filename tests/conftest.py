"""Test-session setup shared by every test directory.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and any test may import it first
(transformers does), so the interpreter is switched on here, before any test module loads, and
nowhere else: the kernel tests run Triton kernels on CPU tensors. On a GPU machine
``TRITON_INTERPRET=0 python -m pytest tests/kernels/...`` runs the compiled kernels instead
(the tests that need a GPU skip without one). The one other setter is the NSA oracle
(``tests/models/fla_nsa_oracle.py``), a program of its own that runs fla's kernels on CPU tensors.

flash-linear-attention (``fla``) is installed for the NSA oracle, which runs it in a process
of its own (``tests/models/fla_nsa_oracle.py``). The test process must not import it:
transformers runs qwen3_next's and kimi_linear's delta rules through fla's Triton kernels
whenever it can import ``fla`` (their autotuners do not run on CPU), and fla registers its own
``mamba``/``mamba2``/``bitnet`` configs with transformers. ``sys.modules["fla"] = None`` makes
every ``import fla`` here fail, so transformers keeps its PyTorch reference paths.

``attnserve.entrypoints.cli.main`` configures the ``attnserve`` logger (level, a stderr
handler); each test gets the logger back as it found it, so one test's command line does not
make later tests log.

``HF_HUB_OFFLINE=1``: a Hugging Face model id is resolved from a local cache only, so that no
test can download anything.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the only place a test sets it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # hub model ids resolve from the cache only: nothing downloads
sys.modules.setdefault("fla", None)


@pytest.fixture(autouse=True)
def _attnserve_logger_restored():
    log = logging.getLogger("attnserve")
    level, handlers = log.level, list(log.handlers)
    yield
    log.setLevel(level)
    log.handlers[:] = handlers
