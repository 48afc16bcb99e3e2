"""One CUDA-graph timing rule for the kernel benchmarks: capture the calls, replay, take the median.

Launch overhead would dominate kernels of a few microseconds timed one launch at a time; a
graph of many calls replays them back to back, as the engine's decode graphs do.
Not here: what is timed, nor CPU wall times (the benchmarks' smoke modes).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["graph_replay_us"]


def graph_replay_us(body: Callable[[], object], warm: Callable[[], object] | None = None, replays: int = 7) -> float:
    """Median microseconds of one replay of a CUDA graph capturing ``body()``.

    ``warm`` (default ``body``) runs first on a side stream, so Triton compiles and cuBLAS picks
    its kernels outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warm or body)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)
