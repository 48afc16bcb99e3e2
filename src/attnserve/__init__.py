"""attnserve: an LLM inference engine built around attention.

Public API (vLLM-compatible): ``LLM``, ``SamplingParams``, ``RequestOutput``. They are
imported lazily so that ``attnserve inspect`` starts without loading the engine. Importing the
package configures the ``attnserve`` logger (``logger.py``: level, time and source on stderr;
``ATTNSERVE_CONFIGURE_LOGGING=0`` leaves logging to the application).
"""

from __future__ import annotations

import logging
from typing import Any

from attnserve.logger import configure_logging

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

try:
    configure_logging()
except ValueError as _bad_level:  # an import does not fail on a misspelt level: it says so, at INFO
    logging.getLogger(__name__).warning("%s: logging at INFO", _bad_level)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from attnserve.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams",):
        from attnserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from attnserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'attnserve' has no attribute '{name}'")
