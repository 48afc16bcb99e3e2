"""Attention: the backend contract, the registry and selection, metadata, the PyTorch twin."""

from attnserve.attention.backend import AttentionBackend, BackendRequest, Capabilities
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
