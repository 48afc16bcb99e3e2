"""A model's ``generation_config.json``: its extra EOS ids and its default sampling, as vLLM reads it.

What this file is: ``load_generation_config`` reads the file of a model directory (engine option
``generation_config``: "auto", the default; "vllm" ignores the file; a directory reads that
directory's file) into a ``GenerationDefaults``:
- ``eos_token_ids``: the file's ``eos_token_id`` (one id or a list); the engine stops on them
  besides the config's own EOS ids (``ignore_eos`` and ``min_tokens`` apply to them all).
- ``sampling``: the model creator's recommended sampling, vLLM's ``generation_config="auto"``
  keys: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
  ``max_new_tokens`` (as ``max_tokens``). ``LLM.generate`` without sampling params starts from
  them (``default_sampling_params``); the server fills each field a request does not set
  (``apply``), and caps ``max_tokens`` with ``max_new_tokens``, as vLLM does.

What it is not: transformers' ``GenerationConfig`` (no beam search, no ``do_sample`` switch:
vLLM ignores it too, a temperature is used as given); the engine's own config (``config.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnserve.sampling_params import SamplingParams

__all__ = ["GenerationDefaults", "load_generation_config"]

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list)
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a model's ``generation_config.json`` asks of generation (empty: nothing)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    source: str | None = None  # the file read

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's defaults (``LLM.generate`` without params)."""
        return SamplingParams(**self.sampling)

    def apply(self, params: SamplingParams, explicit: Collection[str]) -> SamplingParams:
        """``params`` with each default whose field is not in ``explicit`` (the fields a request
        set); ``max_tokens`` is capped by the model's ``max_new_tokens`` either way."""
        changes = {k: v for k, v in self.sampling.items() if k != "max_tokens" and k not in explicit}
        cap = self.sampling.get("max_tokens")
        if cap is not None and (params.max_tokens is None or params.max_tokens > cap):
            changes["max_tokens"] = cap
        if not changes:
            return params
        if "max_tokens" in changes and params.min_tokens > changes["max_tokens"]:
            changes["min_tokens"] = changes["max_tokens"]
        return dataclasses.replace(params, **changes)


def load_generation_config(setting: str, model_dir: str | Path) -> GenerationDefaults:
    """The generation defaults for engine option ``generation_config`` (see the module docstring).

    Raises:
        FileNotFoundError: ``setting`` is a directory without a ``generation_config.json``.
        ValueError: the file is not JSON, or a value is of the wrong type or range (naming it).
    """
    if setting == "vllm":
        return GenerationDefaults()
    folder = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    path = folder / FILE_NAME
    if not path.is_file():
        if setting != "auto":
            raise FileNotFoundError(f"generation_config '{setting}': no {FILE_NAME} in that directory "
                                    "(use 'auto' for the model's own, 'vllm' for none)")
        return GenerationDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    defaults = GenerationDefaults(_eos_ids(data.get("eos_token_id"), path), _sampling(data, path), str(path))
    if defaults.sampling:
        logger.warning("default sampling parameters from %s: %s (requests that set a field keep theirs; "
                       "--generation-config vllm ignores the file)", path, defaults.sampling)
    return defaults


def _eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(ids))


def _sampling(data: dict[str, Any], path: Path) -> dict[str, Any]:
    sampling = {field: data[key] for key, field in _SAMPLING_KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**sampling)  # the same checks as a request's
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return sampling
