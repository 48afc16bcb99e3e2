"""The torchrun entry of tensor parallelism: ``torchrun --nproc-per-node N -m attnserve.entrypoints.torchrun
COMMAND ARGS``.

Every rank joins the group torchrun describes; rank 0 runs ``attnserve COMMAND ARGS`` (with
``--tensor-parallel-size`` equal to the world size) and the others are its workers
(``engine/builder.run_worker``). See ``docs/tensor_parallel.md``.
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist

from attnserve import env
from attnserve.engine.builder import run_worker
from attnserve.engine.tensor_parallel import init_group
from attnserve.runner.parallel import ParallelState

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Rank 0 runs the ``attnserve`` command ``argv``; ranks 1..N-1 serve its steps."""
    env.disable_nccl_multicast()  # on every rank
    init_group()
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
