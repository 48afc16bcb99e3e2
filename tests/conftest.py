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

Importing ``attnserve`` configures its logger (``attnserve/logger.py``: a stderr handler, a
level, records that do not propagate); here the handler and the level are taken off and the
records propagate, so that pytest captures them (``caplog``, the "Captured log" sections) and the test log stays
quiet. ``attnserve.entrypoints.cli.main`` configures the logger again (and Python's warnings);
each test gets the logger and the warnings back as it found them, so one test's command line
does not make later tests log.

``HF_HUB_OFFLINE=1``: a Hugging Face model id is resolved from a local cache only, so that no
test can download anything.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

from attnserve.logger import LOGGER_NAME, AttnserveHandler

os.environ.setdefault("TRITON_INTERPRET", "1")  # the only place a test sets it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # hub model ids resolve from the cache only: nothing downloads
sys.modules.setdefault("fla", None)
_log = logging.getLogger(LOGGER_NAME)  # configured by the import above: records to pytest instead
_log.handlers[:] = [h for h in _log.handlers if not isinstance(h, AttnserveHandler)]
_log.propagate = True
_log.setLevel(logging.NOTSET)  # the root's level, which caplog.at_level sets


@pytest.fixture(autouse=True)
def _attnserve_logger_restored():
    log, py_warnings = logging.getLogger(LOGGER_NAME), logging.getLogger("py.warnings")
    level, handlers, propagate = log.level, list(log.handlers), log.propagate
    warning_handlers, warnings_propagate, showwarning = list(py_warnings.handlers), py_warnings.propagate, \
        warnings.showwarning
    yield
    log.setLevel(level)
    log.handlers[:] = handlers
    log.propagate = propagate
    if warnings.showwarning is not showwarning:  # a command line captured the warnings
        logging.captureWarnings(False)
        warnings.showwarning = showwarning
    py_warnings.handlers[:] = warning_handlers
    py_warnings.propagate = warnings_propagate
