"""attnserve: an LLM inference engine built around attention.

Public API (vLLM-compatible): ``LLM``, ``SamplingParams``, ``RequestOutput``. They are
imported lazily so that ``attnserve inspect`` starts without loading the engine.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


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
