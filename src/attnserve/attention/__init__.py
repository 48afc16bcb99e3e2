"""Attention: the backend contract, the registry and selection, metadata, the PyTorch twins;
the standard, MLA, sparse-MLA and NSA backends (``backends/``) and the state mechanisms with
theirs (``state/``)."""

from attnserve.attention.backend import AttentionBackend, Backend, BackendRequest, Capabilities
from attnserve.attention.registry import (
    BackendSelectionError,
    Selection,
    get_entry,
    list_backends,
    load_backend,
    select_backend,
    validate,
)

__all__ = [
    "AttentionBackend",
    "Backend",
    "BackendRequest",
    "BackendSelectionError",
    "Capabilities",
    "Selection",
    "get_entry",
    "list_backends",
    "load_backend",
    "select_backend",
    "validate",
]
