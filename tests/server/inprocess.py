"""The server's app over an engine thread, reached in-process through httpx's ASGI transport.

No socket and no lifespan (so structured output's import is not paid up front): the engine is
started here, and the app is called as uvicorn would call it, with ``http.disconnect`` coming
after the response. Used by the fuzzer and the fault-injected load test, which check after
every request what the engine still holds.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME


def engine_holdings(engine) -> dict:
    """Block-pool integrity checked, and what ``engine`` (an ``LLMEngine``) still holds:
    requests, blocks, state slots, offload tier holds and reservations. Module-level, so an
    engine process can run it too (``EngineProcessClient.call``)."""
    manager = engine.kv_manager
    manager.check_integrity()
    pool, states = manager.pool, manager.state_pool
    offload = getattr(engine.runner, "offload", None)
    tier = offload.tier if offload is not None else None
    return {
        "unfinished": engine.has_unfinished_requests(),
        "scheduler_requests": len(engine.scheduler.requests),
        "engine_requests": len(engine.states),
        "blocks_held": pool.num_blocks - 1 - pool.num_free_blocks,
        "state_slots": len(states.slot_of) if states is not None else 0,
        "tier_holds": sum(getattr(tier, "held", {}).values()) + len(getattr(tier, "reserved", {})),
    }


IDLE = {"unfinished": False, "scheduler_requests": 0, "engine_requests": 0, "blocks_held": 0,
        "state_slots": 0, "tier_holds": 0}


def wait_engine_idle(client, timeout: float = 10.0) -> dict:
    """Wait until the engine behind ``client`` (an engine thread or process) holds nothing;
    return the last state (AssertionError if it never does)."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.call(engine_holdings).result(timeout=10)
        if state == IDLE:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {state}")
        time.sleep(0.02)


class InProcessServer:
    def __init__(self, model_dir: Path, app_kwargs: dict | None = None, **engine_kwargs):
        from attnserve.engine.async_engine import AsyncLLMEngine
        from attnserve.entrypoints.openai.api_server import build_app

        # float32 unless a test asks: the tests compare greedy outputs across batch compositions,
        # which bf16 (the CPU's "auto" where it has AVX512_BF16) does not keep bit-exact
        engine_kwargs.setdefault("dtype", "float32")
        self.engine = AsyncLLMEngine.from_kwargs(str(model_dir), **engine_kwargs)
        self.engine.start()
        self.app = build_app(self.engine, MODEL_NAME, None, **(app_kwargs or {}))

    def client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://fuzz",
                                 timeout=timeout)

    def stop(self) -> None:
        self.engine.shutdown()

    def engine_state(self) -> dict:
        """Block-pool integrity checked on the engine thread, and what the engine still holds."""
        return self.engine.call(engine_holdings).result(timeout=10)

    IDLE = IDLE

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine holds nothing; return the last state (AssertionError if it never does)."""
        return wait_engine_idle(self.engine, timeout)
