"""Tensor-parallel ranks: starting them, the per-step broadcast, the worker loop, a torchrun entry.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, samples and
detokenises. Ranks 1..N-1 are workers that each own a model shard and its KV cache shard. Each
step rank 0 broadcasts a ``StepHeader`` (the step's Python metadata, with
``broadcast_object_list``) and then every input tensor ``ModelRunner._prepare`` built, packed
into one int64 tensor (``broadcast``). Every rank runs the forward in its forward context and
the output head over the rows rank 0 will read; rank 0 gathers the logits and samples.

Two ways to start the ranks:
- ``WorkerGroup.start`` (``LLM(..., tensor_parallel_size=N)``): rank 0 spawns N-1 processes
  with ``torch.multiprocessing`` (spawn) and meets them on a free loopback port;
- ``torchrun ... -m attnserve.runner.worker COMMAND ...`` (``main``): every rank joins the group
  torchrun describes; rank 0 runs the ``attnserve`` command, the others run ``run_worker``
  (``docs/tensor_parallel.md``).

The group uses gloo on CPU and NCCL for CUDA tensors (``cpu:gloo,cuda:nccl``). Rank 0's
``config`` reaches the workers through the first broadcast, so they need no arguments of their
own. What it is not: the sharding (``runner/parallel.py``), the scheduler or the sampler.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnserve import env
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.config import EngineConfig
from attnserve.runner.forward_context import ForwardContext, forward_context
from attnserve.runner.parallel import ParallelState

if TYPE_CHECKING:
    from attnserve.runner.model_runner import ModelRunner

__all__ = ["StepHeader", "WorkerGroup", "main", "run_worker"]

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(minutes=30)  # start-up (weights load on every rank) and in-step collectives
_IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the engine idles
_START_S = 300.0  # for the spawned processes to reach the rendezvous
_JOIN_S = 30.0


@dataclass(frozen=True, slots=True)
class StepHeader:
    """One step's Python metadata; the tensors follow packed in ``numel`` int64 values."""

    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) in packed order
    numel: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    num_state_decodes: int
    state_copies: tuple[tuple[int, int], ...]  # snapshot copies to run before the forward
    logit_rows: list[int]  # rows of the hidden states that go through the output head


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _init(
    rank: int | None = None, world_size: int | None = None, init_method: str | None = None
) -> None:
    """Join the default group (torchrun's environment when no rank is given)."""
    if rank is None:
        dist.init_process_group(_backend(), timeout=_TIMEOUT)
    else:
        dist.init_process_group(
            _backend(), init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT
        )


def _step_group() -> dist.ProcessGroup:
    """A gloo group for the step headers: workers may wait in it for as long as rank 0 idles."""
    return dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


# --- packing ------------------------------------------------------------------------------


def _step_tensors(input_ids: torch.Tensor, ctx: ForwardContext) -> dict[str, torch.Tensor]:
    c = ctx.common
    out = {
        "input_ids": input_ids,
        "query_start_loc": c.query_start_loc,
        "seq_lens": c.seq_lens,
        "positions": c.positions,
    }
    for g, (table, slots) in enumerate(zip(c.block_tables, c.slot_mappings)):
        out[f"block_tables.{g}"], out[f"slot_mappings.{g}"] = table, slots
    optional = {
        "state_slots": c.state_slots,
        "has_initial_state": c.has_initial_state,
        "token_seq_lens": ctx.token_seq_lens,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def _pack(
    tensors: dict[str, torch.Tensor],
) -> tuple[tuple[tuple[str, tuple[int, ...], str], ...], torch.Tensor]:
    layout = tuple(
        (k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()
    )
    return layout, torch.cat([t.reshape(-1).to(torch.int64) for t in tensors.values()])


def _unpack(layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, shape, dtype in layout:
        n = 1
        for s in shape:
            n *= s
        out[name] = flat[start : start + n].view(shape).to(getattr(torch, dtype))
        start += n
    return out


def _context(header: StepHeader, t: dict[str, torch.Tensor], runner: ModelRunner) -> ForwardContext:
    """A worker's forward context, its backends' metadata built from the broadcast tensors."""
    groups = range(len(runner.groups))
    common = CommonAttentionMetadata(
        query_start_loc=t["query_start_loc"],
        seq_lens=t["seq_lens"],
        positions=t["positions"],
        block_tables=[t[f"block_tables.{g}"] for g in groups],
        slot_mappings=[t[f"slot_mappings.{g}"] for g in groups],
        query_start_loc_cpu=header.query_start_loc_cpu,
        seq_lens_cpu=header.seq_lens_cpu,
        num_decodes=header.num_decodes,
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        state_slots=t.get("state_slots"),
        has_initial_state=t.get("has_initial_state"),
        num_state_decodes=header.num_state_decodes,
    )
    metas = [b.build_metadata(common, g) for g, b in enumerate(runner.backends)]
    return ForwardContext(
        common=common, attn_metadata=metas, token_seq_lens=t.get("token_seq_lens")
    )


# --- rank 0 -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(processes: list, ready) -> None:
    """Wait for every spawned worker to reach the rendezvous; fail early if one died."""
    deadline, waiting = time.monotonic() + _START_S, len(processes)
    while waiting:
        try:
            ready.get(timeout=0.5)
            waiting -= 1
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(processes, start=1):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker {rank} exited with code {p.exitcode} during start-up "
                    f"(its error is printed above). Workers are spawned: they re-import the main "
                    f"script, so a script must build its LLM under `if __name__ == '__main__':`"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start within {_START_S:.0f} s")


def _send_stop(step_group) -> bool:
    """Broadcast the stop header; False when it failed or did not go out within ``_JOIN_S``
    (a worker stuck in another collective never reads it)."""
    sent = threading.Event()

    def send() -> None:
        try:
            dist.broadcast_object_list([None], src=0, group=step_group)
            sent.set()
        except Exception as e:  # noqa: BLE001 - a dead worker must not keep the others alive
            logger.warning("could not tell the tensor-parallel workers to stop: %s", e)

    sender = threading.Thread(target=send, name="attnserve-tp-stop", daemon=True)
    sender.start()
    sender.join(_JOIN_S)
    return sent.is_set()


def _stop(step_group, processes: list, owns_group: bool, abort: bool = False) -> None:
    """Tell the workers to exit (or, aborting, terminate them), wait, and leave the group."""
    if not abort:
        abort = not _send_stop(step_group)
    for p in processes:
        if abort:
            p.terminate()
        p.join(_JOIN_S)
        if p.is_alive():
            logger.warning("tensor-parallel worker pid %d did not exit; killing it", p.pid)
            p.kill()
            p.join()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


class WorkerGroup:
    """Rank 0's side of the group: the step broadcast, and the workers it started (if any)."""

    def __init__(self, parallel: ParallelState, step_group, processes: list, owns_group: bool):
        self.parallel = parallel
        self.step_group = step_group
        self.processes = processes
        # workers exit when the engine is closed or garbage collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _stop, step_group, processes, owns_group)
        self._owns_group = owns_group

    @classmethod
    def start(cls, config: EngineConfig) -> WorkerGroup:
        """Spawn ranks 1..N-1 (or join torchrun's group), then hand every rank the config."""
        n = config.parallel.tensor_parallel_size
        processes = []
        launched = dist.is_initialized()
        if launched:  # torchrun: the other ranks run run_worker already
            if dist.get_rank() != 0 or dist.get_world_size() != n:
                raise ValueError(
                    f"tensor_parallel_size={n}, but this process is rank {dist.get_rank()} "
                    f"of {dist.get_world_size()} (the engine runs on rank 0 of N)"
                )
        else:
            env.disable_nccl_multicast()  # the spawned ranks inherit the environment
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            ready = ctx.Queue()
            processes = [
                ctx.Process(
                    target=_spawned_main,
                    args=(r, n, init_method, ready),
                    daemon=True,
                    name=f"attnserve-tp{r}",
                )
                for r in range(1, n)
            ]
            for p in processes:
                p.start()
            try:
                _wait_ready(processes, ready)
                _init(0, n, init_method)
            except BaseException:
                for p in processes:
                    p.terminate()
                raise
        step_group = _step_group()
        dist.broadcast_object_list([config], src=0, group=step_group)
        return cls(ParallelState(0, n), step_group, processes, owns_group=not launched)

    def broadcast_step(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        state_copies: tuple[tuple[int, int], ...],
        logit_rows: list[int],
    ) -> None:
        """Send one step's inputs to the workers (they then run the same forward)."""
        layout, flat = _pack(_step_tensors(input_ids, ctx))
        c = ctx.common
        header = StepHeader(
            layout,
            flat.numel(),
            c.query_start_loc_cpu,
            c.seq_lens_cpu,
            c.num_decodes,
            c.max_query_len,
            c.max_seq_len,
            c.num_state_decodes,
            tuple(state_copies),
            list(logit_rows),
        )
        dist.broadcast_object_list([header], src=0, group=self.step_group)
        dist.broadcast(flat, src=0)

    def shutdown(self) -> None:
        self._finalizer()

    def abort(self) -> None:
        """Terminate the workers without a word (rank 0 failed while they may be mid-collective)."""
        if self._finalizer.detach() is not None:
            _stop(self.step_group, self.processes, self._owns_group, abort=True)


# --- ranks 1..N-1 -------------------------------------------------------------------------


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank 0's config with this rank's device: CUDA rank r uses GPU r modulo the host's GPUs."""
    device = config.model.device
    if (device is None and torch.cuda.is_available()) or (device or "").startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        return replace(config, model=replace(config.model, device=device))
    return config


def _receive(step_group, device: torch.device) -> tuple[StepHeader, dict[str, torch.Tensor]] | None:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=step_group)
    header = box[0]
    if header is None:
        return None
    flat = torch.empty(header.numel, dtype=torch.int64, device=device)
    dist.broadcast(flat, src=0)
    return header, _unpack(header.tensors, flat)


@torch.inference_mode()
def _execute(runner: ModelRunner, header: StepHeader, tensors: dict[str, torch.Tensor]) -> None:
    runner._copy_states(header.state_copies)
    ctx = _context(header, tensors, runner)
    with forward_context(ctx):
        hidden = runner.model(tensors["input_ids"], ctx.common.positions)
    if header.logit_rows:  # a collective: rank 0 gathers every rank's vocabulary slice
        runner.model.compute_logits(hidden[header.logit_rows])


def run_worker(parallel: ParallelState) -> None:
    """A rank > 0 after joining the group: build its shard, run steps until rank 0 stops it."""
    from attnserve.runner.builder import build_engine_parts

    step_group = _step_group()
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=step_group)
    config = _rank_config(box[0], parallel.rank)
    runner = build_engine_parts(config, parallel).runner
    logger.info(
        "tensor-parallel rank %d of %d ready on %s",
        parallel.rank,
        parallel.world_size,
        runner.device,
    )
    while (step := _receive(step_group, runner.device)) is not None:
        _execute(runner, *step)


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:  # the engine's process is gone: nobody will stop us
            os._exit(1)


def _spawned_main(rank: int, world_size: int, init_method: str, ready) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    ready.put(rank)
    _init(rank, world_size, init_method)
    try:
        run_worker(ParallelState(rank, world_size))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m attnserve.runner.worker COMMAND ARGS``: rank 0 runs ``attnserve COMMAND
    ARGS`` (with ``--tensor-parallel-size`` equal to the world size); the others are its workers."""
    env.disable_nccl_multicast()  # on every rank
    _init()
    try:
        if dist.get_rank() == 0:
            from attnserve.entrypoints.cli import main as cli_main

            code = cli_main(argv)
            gc.collect()  # an engine held by a reference cycle stops its workers now
            return code
        run_worker(ParallelState(dist.get_rank(), dist.get_world_size()))
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
