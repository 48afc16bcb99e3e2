"""The per-step forward context: what attention layers read during one model forward.

Set by the model runner around ``model.forward`` with ``forward_context(ctx)``; read by layers
with ``get_forward_context()``. It does not nest, and nothing outside a forward can see it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["ForwardContext", "forward_context", "get_forward_context"]


@dataclass(slots=True)
class ForwardContext:
    common: CommonAttentionMetadata
    attn_metadata: list[Any]  # per KV cache group, built by that group's backend
    token_seq_lens: Any = None  # [T] int64: the sequence length each token's request reaches this step


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("attnserve_forward", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("forward contexts do not nest")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("attention ran outside a forward context (the model runner sets one per step)")
    return ctx
