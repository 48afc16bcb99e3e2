"""Hugging Face hub model ids (``Qwen/Qwen3-0.6B``): the local cache first, a download when online.

What this file is: the one place attnserve talks to ``huggingface_hub``. ``resolve_hub_model``
turns a model id (and a revision: a branch, tag or commit) into the directory of its snapshot
in the Hugging Face cache (``HF_HUB_CACHE``, or ``$HF_HOME/hub``), as vLLM and transformers do:
1. a snapshot already in the cache is used as it is, without asking the network;
2. otherwise, unless ``HF_HUB_OFFLINE`` is set, the files attnserve reads (JSON configs and
   tokenizer, chat templates, safetensors weights) are downloaded into the cache;
3. otherwise the error names the id, the revision and the cache that was searched.
``resolve_hub_file`` does the same for one file (``inspect`` reads only ``config.json``).

What it is not: local directories and the models and configs shipped with the package are
resolved before this file is asked (``engine/builder.py``, ``presets``); credentials are
``huggingface_hub``'s own (``HF_TOKEN``, ``hf auth login``); ``*.bin`` / ``*.pt`` weights are
never fetched (attnserve loads safetensors only).
"""

from __future__ import annotations

import logging
from pathlib import Path

from attnserve import env

__all__ = ["is_hub_id", "resolve_hub_file", "resolve_hub_model"]

logger = logging.getLogger(__name__)

# what the engine reads of a model repository; weights only when they will be loaded
_CONFIG_FILES = ["*.json", "*.jinja", "additional_chat_templates/*.jinja"]
_WEIGHT_FILES = ["*.safetensors"]


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a hub model id (``name`` or ``org/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _describe(repo_id: str, revision: str | None) -> str:
    return f"'{repo_id}'" + (f" (revision '{revision}')" if revision else "")


def _offline_error(repo_id: str, revision: str | None, cache: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"model {_describe(repo_id, revision)}: {what} is not in the Hugging Face cache {cache}, and "
        f"HF_HUB_OFFLINE is set, so nothing is downloaded. Download it where the hub is reachable "
        f"(`hf download {repo_id}`), point HF_HOME or HF_HUB_CACHE at a cache that holds it, or "
        f"pass a local model directory")


def _download_error(repo_id: str, revision: str | None, cache: str, exc: Exception) -> FileNotFoundError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return FileNotFoundError(
        f"model {_describe(repo_id, revision)} is not a local directory, not in the Hugging Face cache "
        f"{cache}, and could not be downloaded ({type(exc).__name__}: {reason}). Check the id and "
        f"your network (gated models need `hf auth login` or HF_TOKEN), or pass a local model "
        f"directory")


def resolve_hub_model(repo_id: str, revision: str | None = None, *, weights: bool = True) -> Path:
    """The snapshot directory of a hub model: from the cache, else downloaded (see the module
    docstring).

    Args:
        repo_id: ``org/name`` (or ``name``).
        revision: a branch, tag or commit hash; None: the default branch.
        weights: also fetch ``*.safetensors`` when downloading (False for ``load_format='dummy'``).
    Raises:
        FileNotFoundError: not cached and offline, not downloadable, or no ``config.json`` in
            the snapshot; the message names the id, the revision and the cache directory.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = env.hf_hub_cache()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        path = None
    if path is not None and _complete(path, weights):
        logger.info("model %s: %s (from the Hugging Face cache)", _describe(repo_id, revision), path)
        return path
    if env.hf_hub_offline():
        # a snapshot may hold only some files (``inspect`` fetches config.json alone)
        what = "its snapshot (with a config.json)" if path is None or not (path / "config.json").is_file() \
            else f"the safetensors weights of its cached snapshot {path}"
        raise _offline_error(repo_id, revision, cache, what)
    logger.warning("model %s: downloading into %s", _describe(repo_id, revision), cache)
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=_CONFIG_FILES + (_WEIGHT_FILES if weights else [])))
    except Exception as exc:  # noqa: BLE001 - network, auth, missing repo or revision: one clear error
        raise _download_error(repo_id, revision, cache, exc) from exc
    if not _complete(path, weights):
        raise FileNotFoundError(f"model {_describe(repo_id, revision)}: the snapshot {path} has no "
                                "config.json" + (" or no *.safetensors weights" if weights else "")
                                + " (not a transformers model repository in safetensors?)")
    return path


def _complete(path: Path, weights: bool) -> bool:
    """A snapshot the engine can load: a config.json, and safetensors weights when asked."""
    return (path / "config.json").is_file() and (not weights or any(path.glob("*.safetensors")))


def resolve_hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of a hub repository (``config.json``): from the cache, else downloaded.

    Raises:
        FileNotFoundError: as ``resolve_hub_model``.
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = env.hf_hub_cache()
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache,
                                    local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if env.hf_hub_offline():
        raise _offline_error(repo_id, revision, cache, filename)
    # snapshot_download asks the hub once and fails at once when it is unreachable, where
    # hf_hub_download retries a network error five times (26 s) before it gives up
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=[filename]))
    except Exception as exc:  # noqa: BLE001 - as in resolve_hub_model
        raise _download_error(repo_id, revision, cache, exc) from exc
    if not (path / filename).is_file():
        raise FileNotFoundError(f"model {_describe(repo_id, revision)}: the repository has no {filename}")
    return path / filename
