"""What a server uses of a running engine, whichever way it runs: the ``EngineClient`` protocol.

Two classes keep it: ``AsyncLLMEngine`` (``async_engine.py``: the engine on a thread of the
server's process) and ``EngineProcessClient`` (``engine_process.py``: the engine in a process
of its own). Both are built from the same ``EngineFacts`` (the model's read-only facts the
server reads), publish the same ``EngineStats``, fail with the same ``EngineDeadError``, and
hand each request's cumulative outputs to its event loop the same way (``OutputSink``,
``put_all``: one wake-up per event loop per batch of outputs, and a consumer that falls behind
gets only the latest output).

Not here: running the engine (the two modules above), HTTP (``entrypoints/openai``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from attnserve.generation_config import GenerationDefaults
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from attnserve.engine.engine import LLMEngine
    from attnserve.engine.structured_output import StructuredOutputManager

__all__ = ["END", "EngineClient", "EngineDeadError", "EngineFacts", "EngineStats", "OutputSink", "put_all",
           "stream_outputs"]


class EngineDeadError(RuntimeError):
    """The engine stopped (an error in a step, its process died, or shutdown); no request can be
    served."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot the engine publishes after every step (counters are cumulative)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks held by requests
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    offload_hits: int = 0  # tokens loaded back from the offload tier
    offload_bytes_stored: int = 0  # bytes copied to the offload tier
    offload_bytes_loaded: int = 0  # bytes copied back from it
    offload_seconds: float = 0.0  # time spent in those copies
    offload_failed_stores: int = 0  # blocks the offload tier could not keep (a full or unwritable disk)
    num_preemptions: int = 0
    num_steps: int = 0
    num_aborted: int = 0  # requests aborted while the engine still held them
    prompt_tokens: int = 0  # prompt tokens of requests that got their first token
    generation_tokens: int = 0  # tokens sampled
    step_seconds: float = 0.0  # wall time inside the engine's steps
    device_wait_seconds: float = 0.0  # of that, blocked on the device (CUDA: the host ran ahead)
    iteration_tokens: tuple[int, ...] = ()  # steps per bucket of their tokens (LLMEngine.iteration_token_counts)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The read-only facts of a built engine a server needs (picklable: an engine process sends
    them to its frontend once it is ready)."""

    model: str  # the model option, as given
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    stop_token_ids: tuple[int, ...]  # the config's EOS ids (what structured output stops on)
    tokenizer_dir: str  # where the engine's tokenizer was loaded from
    generation_config: GenerationDefaults
    cache_info: dict[str, str]  # vllm:cache_config_info's labels

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        cache = engine.config.cache
        return cls(model=engine.config.model.model, max_model_len=engine.max_model_len,
                   vocab_size=engine.arch.vocab_size, max_logprobs=engine.config.model.max_logprobs,
                   stop_token_ids=tuple(engine.arch.eos_token_ids), tokenizer_dir=str(engine.parts.tokenizer_dir),
                   generation_config=engine.generation_config,
                   cache_info={"block_size": str(cache.block_size),
                               "num_gpu_blocks": str(engine.kv_manager.pool.num_blocks),
                               "cache_dtype": engine.parts.plan.kv_cache_dtype,
                               "enable_prefix_caching": str(cache.enable_prefix_caching)})


class EngineClient(Protocol):
    """What the server (``entrypoints/openai``) uses of an engine."""

    tokenizer: Any
    structured: StructuredOutputManager  # compile() validates a constraint before submitting
    model: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    cache_info: dict[str, str]
    generation_config: GenerationDefaults  # the model's sampling defaults

    @property
    def is_alive(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def start(self) -> None: ...

    def warm_up(self) -> None: ...  # every step shape once, before the server answers /health

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def stats(self) -> EngineStats: ...

    def generate(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


class OutputSink:
    """One request's outputs (or the error that ends it), delivered onto the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:  # called off the caller's loop (the engine's thread)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def put_nowait(self, item: Any) -> None:  # called on the caller's loop
        self.queue.put_nowait(item)

    async def get(self) -> Any:
        item = await self.queue.get()
        # outputs are cumulative: when several wait, the latest says everything
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()
        return item


END = object()  # a stream ends without a finished output (aborted by someone else)


def _deliver(batch: list[tuple[OutputSink, Any]]) -> None:
    for sink, out in batch:
        sink.put_nowait(out)


def put_all(batch: list[tuple[OutputSink, Any]]) -> None:
    """Hand a step's outputs (or errors) to their callers: one wake-up per event loop, not one per
    request (at a few hundred streams, per-request wake-ups cost more than the step's output
    processing)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, Any]]] = {}
    for sink, out in batch:
        by_loop.setdefault(sink.loop, []).append((sink, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


async def stream_outputs(submit: Callable[[OutputSink], None],
                         abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """``submit(sink)`` the request with a sink on the running loop, then yield the outputs put
    into it until the finished one; an error put into it is raised. If the consumer stops early
    (closes the iterator, is cancelled), ``abort()`` is called. Nothing runs before the first
    ``__anext__``."""
    sink = OutputSink(asyncio.get_running_loop())
    submit(sink)
    finished = False
    try:
        while not finished:
            item = await sink.get()
            if isinstance(item, BaseException):
                finished = True  # the engine never held it, or no longer does
                raise item
            if item is END:
                finished = True
                return
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
