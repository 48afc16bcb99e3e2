"""Fixtures for the server tests: a tiny llama, a real server on a loopback port, references.

The model is built here (random weights with a wide spread, so that greedy outputs depend on
the whole prompt) with the shipped demo model's tokenizer and chat template. One server runs
for the whole session, in a thread (uvicorn on a socket bound to port 0), with an API key;
``LLM.generate`` on the same directory is the reference for greedy outputs.
"""

from __future__ import annotations

import functools
import json
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

API_KEY = "test-key"
MODEL_NAME = "tiny"
ENGINE_KWARGS = {"kv_cache_memory": 0.01, "max_num_seqs": 128, "dtype": "float32"}  # float32: see ServerThread


def build_tiny_llama(out_dir: Path, seed: int = 0, std: float = 0.2) -> Path:
    """A 2-layer llama (hidden 64, vocab 2048) with the demo model's tokenizer."""
    from safetensors.torch import save_file

    from attnserve.presets import resolve_model_preset

    out_dir.mkdir(parents=True, exist_ok=True)
    src = resolve_model_preset("attnserve-tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out_dir / name)
    cfg = json.loads((src / "config.json").read_text())
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    cfg.update(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
    )
    (out_dir / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": rand(inter, hidden),
                p + "mlp.up_proj.weight": rand(inter, hidden),
                p + "mlp.down_proj.weight": rand(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir


class ServerThread:
    """uvicorn serving ``build_app`` in a daemon thread on a free loopback port."""

    def __init__(self, model_dir: Path, api_key: str | None = API_KEY, app_kwargs: dict | None = None,
                 **engine_kwargs):
        import uvicorn

        from attnserve.engine.async_engine import AsyncLLMEngine
        from attnserve.entrypoints.openai.api_server import build_app

        # float32 unless a test asks: the tests compare greedy outputs across batch compositions,
        # which bf16 (the CPU's "auto" where it has AVX512_BF16) does not keep bit-exact
        engine_kwargs.setdefault("dtype", "float32")
        self.engine = AsyncLLMEngine.from_kwargs(str(model_dir), **engine_kwargs)
        self.app = build_app(self.engine, MODEL_NAME, api_key, **(app_kwargs or {}))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def engine_state(self) -> dict:
        """Block-pool integrity checked on the engine thread, and what the engine still holds."""

        def check(engine):
            engine.kv_manager.check_integrity()
            pool = engine.kv_manager.pool
            return {
                "unfinished": engine.has_unfinished_requests(),
                "scheduler_requests": len(engine.scheduler.requests),
                "blocks_held": pool.num_blocks - 1 - pool.num_free_blocks,
            }

        return self.engine.call(check).result(timeout=10)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine holds no request and no block; return the last state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if (
                not state["unfinished"]
                and not state["blocks_held"]
                and not state["scheduler_requests"]
            ):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {state}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def server(model_dir):
    srv = ServerThread(model_dir, **ENGINE_KWARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reference(model_dir):
    """The offline engine on the same model: the oracle for greedy outputs."""
    from attnserve.entrypoints.llm import LLM

    return LLM(str(model_dir), **ENGINE_KWARGS)


@pytest.fixture()
def client(server):
    from openai import OpenAI

    with OpenAI(api_key=API_KEY, base_url=server.base_url + "/v1", max_retries=0, timeout=60) as c:
        yield c


@functools.cache
def modules_outside_the_base_install() -> tuple[str, ...]:
    """Top-level modules of the installed distributions that attnserve's base install
    (``[project] dependencies`` and theirs, recursively) does not bring (none on Python 3.10,
    which has no ``tomllib``)."""
    from importlib.metadata import PackageNotFoundError, distribution, packages_distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ImportError:  # Python 3.10
        return ()
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    closure, stack = set(), [Requirement(r).name for r in project["project"]["dependencies"]]
    while stack:
        name = canonicalize_name(stack.pop())
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        stack += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return tuple(sorted(
        module
        for module, dists in packages_distributions().items()
        if module != "attnserve" and module not in sys.stdlib_module_names
        and not {canonicalize_name(d) for d in dists} & closure
    ))


def base_install_only_prelude() -> str:
    """Python source that, run first in a process, makes every module outside the base install
    unimportable: the process has what ``pip install -e .`` gives, nothing of the test extras."""
    return f"""import importlib.abc, sys
BLOCKED = set({json.dumps(modules_outside_the_base_install())})
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the base install)", name=name)
sys.meta_path.insert(0, _NotInstalled())
"""


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``, in a Prometheus
    text page (read with ``prometheus_client``'s parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )
