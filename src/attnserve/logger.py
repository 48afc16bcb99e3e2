"""attnserve's log: the ``attnserve`` logger, configured when the package is imported (as vLLM's
``vllm/logger.py`` configures ``vllm``).

``configure_logging()`` gives the ``attnserve`` logger one stderr handler (``AttnserveHandler``)
whose lines carry the level, the time and the source::

    INFO 12-08 01:55:25 [engine.py:90] model attnserve-demo-gqa (llama, 6 layers, GQA) on cpu ...

at ``ATTNSERVE_LOGGING_LEVEL`` (``ATTNSERVE_LOG_LEVEL`` is its older name; default INFO), and
stops its records there (``propagate = False``), so an application's root handlers do not print
them twice. ``attnserve/__init__.py`` calls it once on import and the command line calls it
again (idempotent); ``ATTNSERVE_CONFIGURE_LOGGING=0`` makes it do nothing: logging is then left
to the application (records propagate to its handlers, as any library's do).
``capture_warnings()`` sends Python's warnings through ``logging`` with the same format: the
command line and the engine process do it (their process is attnserve's); an import does not
(the application's warnings are its own).

Not here: what is logged (each module's ``logging.getLogger(__name__)``), the environment
(``env.py``), the engine process's copy of its frontend's set-up (``engine/engine_process.py``).
"""

from __future__ import annotations

import logging
import sys

from attnserve import env

__all__ = ["AttnserveHandler", "FORMAT", "DATE_FORMAT", "capture_warnings", "configure_logging", "LOGGER_NAME"]

LOGGER_NAME = "attnserve"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class AttnserveHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (not the one at creation: pytest
    and notebooks swap it), in attnserve's format."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _ensure_handler(log: logging.Logger) -> None:
    if not any(isinstance(h, AttnserveHandler) for h in log.handlers):
        log.addHandler(AttnserveHandler())


def configure_logging() -> None:
    """The ``attnserve`` logger on stderr at ``ATTNSERVE_LOGGING_LEVEL`` (default INFO), not
    propagating; idempotent. Nothing when ``ATTNSERVE_CONFIGURE_LOGGING=0``.

    Raises:
        ValueError: the level names no level (the handler is installed first, at INFO).
    """
    if not env.configure_logging():
        return
    log = logging.getLogger(LOGGER_NAME)
    _ensure_handler(log)
    log.propagate = False
    try:
        level = env.log_level()
    except ValueError:
        log.setLevel(logging.INFO)
        raise
    log.setLevel(level)


def capture_warnings() -> None:
    """Python's warnings (``warnings.warn``) as WARNING records with attnserve's format: the
    ``py.warnings`` logger gets the same handler. For processes attnserve owns (the command
    line, the engine process); nothing when ``ATTNSERVE_CONFIGURE_LOGGING=0``."""
    if not env.configure_logging():
        return
    logging.captureWarnings(True)
    warnings_log = logging.getLogger("py.warnings")
    _ensure_handler(warnings_log)
    warnings_log.propagate = False
