"""The commands an engine's host hands its step loop: add a request, abort one, call a
function on the engine, stop.

Both hosts speak this vocabulary: ``AsyncLLMEngine`` (``async_engine.py``) puts commands on its
thread's queue, and ``EngineProcessClient`` (``engine_process.py``) pickles the same commands
through the pipe to the engine process, whose reader thread queues them for the loop there. An
add's and a call's ``reply`` is where their answer goes: in the loop, an ``OutputSink`` and a
``concurrent.futures.Future``; on the pipe, the frontend's number for the request or the call,
which the engine process's reader binds to its outbox before the loop sees the command.

Not here: what goes back (outputs through sinks; the engine process's own messages, its outbox
and per-step deltas are ``engine_process.py``'s and ``output_deltas.py``'s), how a command is
handled (``AsyncLLMEngine._apply``), any wire format beyond pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from attnserve.engine.engine import LLMEngine
    from attnserve.sampling_params import SamplingParams

__all__ = ["AbortRequest", "AddRequest", "Command", "EngineCall", "Stop"]

R = TypeVar("R")  # where a command's answer goes (see the module docstring)


@dataclass(frozen=True, slots=True)
class AddRequest(Generic[R]):
    """Start a request; its outputs, or why it was refused, go to ``reply``."""

    request_id: str
    prompt: Any  # as LLMEngine.add_request takes it
    params: SamplingParams
    reply: R


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request and free its blocks; an unknown id is ignored."""

    request_id: str


@dataclass(frozen=True, slots=True)
class EngineCall(Generic[R]):
    """Run ``fn(engine)`` between steps; its result or exception goes to ``reply``."""

    fn: Callable[[LLMEngine], Any]
    reply: R


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the loop; requests still running end with ``EngineDeadError``."""


Command = AddRequest[Any] | AbortRequest | EngineCall[Any] | Stop
