"""Tensor parallelism, the engine's side: starting the ranks, building each one, stopping them.

``WorkerGroup.start`` (``LLM(..., tensor_parallel_size=N)``): rank 0 spawns N-1 processes with
``torch.multiprocessing`` (spawn) and meets them on a free loopback port; or, under torchrun
(``entrypoints/torchrun.py``), every rank joins the group torchrun describes. Either way rank 0
then hands every rank its ``EngineConfig`` over the step group, and each worker builds its
shard with the same builder as rank 0 (``engine/builder.run_worker``) and serves steps
(``runner/worker.serve_steps``) until rank 0 stops it.

The group uses gloo on CPU and NCCL for CUDA tensors (``cpu:gloo,cuda:nccl``). What it is not:
the per-step broadcast (``runner/worker.py``) or the sharding (``runner/parallel.py``).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnserve import env
from attnserve.config import EngineConfig
from attnserve.runner.parallel import ParallelState
from attnserve.runner.worker import StepBroadcaster, step_group

__all__ = ["WorkerGroup", "init_group", "receive_config"]

logger = logging.getLogger(__name__)

_TIMEOUT = timedelta(minutes=30)  # start-up (weights load on every rank) and in-step collectives
_START_S = 300.0  # for the spawned processes to reach the rendezvous
_JOIN_S = 30.0


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_group(
    rank: int | None = None, world_size: int | None = None, init_method: str | None = None
) -> None:
    """Join the default group (torchrun's environment when no rank is given)."""
    if rank is None:
        dist.init_process_group(_backend(), timeout=_TIMEOUT)
    else:
        dist.init_process_group(
            _backend(), init_method=init_method, rank=rank, world_size=world_size, timeout=_TIMEOUT
        )


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


def _stop(broadcaster: StepBroadcaster, processes: list, owns_group: bool, abort: bool = False) -> None:
    """Tell the workers to exit (or, aborting, terminate them), wait, and leave the group."""
    if not abort:
        abort = not broadcaster.send_stop()
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

    def __init__(self, parallel: ParallelState, broadcaster: StepBroadcaster, processes: list,
                 owns_group: bool):
        self.parallel = parallel
        self.broadcaster = broadcaster
        self.processes = processes
        # workers exit when the engine is closed or garbage collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _stop, broadcaster, processes, owns_group)
        self._owns_group = owns_group

    @classmethod
    def start(cls, config: EngineConfig, entry: Callable[[ParallelState], None]) -> WorkerGroup:
        """Spawn ranks 1..N-1 (or join torchrun's group), then hand every rank the config.

        Args:
            entry: what a spawned rank runs once it joined the group (``builder.run_worker``:
                build its shard, then serve steps); a module-level function, as spawn pickles it.
        """
        n = config.parallel.tensor_parallel_size
        processes = []
        launched = dist.is_initialized()
        if launched:  # torchrun: the other ranks run builder.run_worker already
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
                    args=(entry, r, n, init_method, ready),
                    daemon=True,
                    name=f"attnserve-tp{r}",
                )
                for r in range(1, n)
            ]
            for p in processes:
                p.start()
            try:
                _wait_ready(processes, ready)
                init_group(0, n, init_method)
            except BaseException:
                for p in processes:
                    p.terminate()
                raise
        group = step_group()
        dist.broadcast_object_list([config], src=0, group=group)
        return cls(ParallelState(0, n), StepBroadcaster(group), processes, owns_group=not launched)

    def shutdown(self) -> None:
        self._finalizer()

    def abort(self) -> None:
        """Terminate the workers without a word (rank 0 failed while they may be mid-collective)."""
        if self._finalizer.detach() is not None:
            _stop(self.broadcaster, self.processes, self._owns_group, abort=True)


# --- ranks 1..N-1 -------------------------------------------------------------------------


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank 0's config with this rank's device: CUDA rank r uses GPU r modulo the host's GPUs."""
    device = config.model.device
    if (device is None and torch.cuda.is_available()) or (device or "").startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        return replace(config, model=replace(config.model, device=device))
    return config


def receive_config(group: dist.ProcessGroup, rank: int) -> EngineConfig:
    """A worker's copy of rank 0's config (``WorkerGroup.start`` broadcasts it), on its device."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return _rank_config(box[0], rank)


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:  # the engine's process is gone: nobody will stop us
            os._exit(1)


def _spawned_main(entry: Callable[[ParallelState], None], rank: int, world_size: int, init_method: str,
                  ready) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    ready.put(rank)
    init_group(rank, world_size, init_method)
    try:
        entry(ParallelState(rank, world_size))
    finally:
        dist.destroy_process_group()


