"""Block tables kept across steps: each request's row is updated, not rebuilt, every step.

vLLM's persistent input batch, for the block ids only. Every scheduled request owns a row of a
host array per KV cache group; a step copies into it only the ids appended since the request's
last step (a decode adds one block every ``block_size`` steps), then gathers the step's rows.
Rows follow the KV manager's own id lists (``KVCacheManager.live_block_ids``): the same list
object means the same blocks plus any appended, except in groups whose manager rewrites ids in
place (sliding windows and StreamingLLM put the null block where blocks were dropped), whose
rows are copied whole. A request that is not scheduled in a step gives its row back; a row is
all zeros past its request's blocks, so gathered tables are zero-padded as backends expect.

This file knows block ids and rows, not requests' tokens or tensors on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from attnserve.core.step import ScheduledRequest

__all__ = ["BlockTables"]


@dataclass(slots=True)
class _Row:
    index: int  # in every group's table
    lists: list[list[int] | None]  # per group: the manager's list last copied into the row
    counts: list[int]  # per group: how many of its ids the row holds (zeros after them)


class BlockTables:
    """One host block table per KV cache group, a row per scheduled request.

    Args:
        append_only: per group, whether its manager only ever appends to a request's id list
            (full attention); other groups' rows are copied whole every step.
        num_rows, num_cols: initial capacity; both grow on demand.
    """

    def __init__(self, append_only: list[bool], num_rows: int = 16, num_cols: int = 16):
        self.append_only = append_only
        self.tables = [np.zeros((num_rows, num_cols), dtype=np.int32) for _ in append_only]
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def update(self, scheduled: list[ScheduledRequest]) -> tuple[np.ndarray, list[int]]:
        """Bring the rows of this step's requests up to date.

        Returns:
            The row of each scheduled request ``[num_reqs]`` and, per group, the most blocks any
            of them holds (at least 1): the width of the step's block table.
        """
        current = {s.request.request_id for s in scheduled}
        for rid in self._rows.keys() - current:
            self._release(self._rows.pop(rid))
        rows = np.empty(len(scheduled), dtype=np.int64)
        widths = [1] * len(self.tables)
        for i, s in enumerate(scheduled):
            row = self._rows.get(s.request.request_id)
            if row is None:
                groups = len(self.tables)
                row = self._rows[s.request.request_id] = _Row(self._take_row(), [None] * groups, [0] * groups)
            rows[i] = row.index
            for g, ids in enumerate(s.block_ids):
                n = len(ids)
                if row.lists[g] is not ids or not self.append_only[g]:
                    self._write(g, row, ids, 0)
                elif n > row.counts[g]:
                    self._write(g, row, ids, row.counts[g])
                if n > widths[g]:
                    widths[g] = n
        return rows, widths

    def gather(self, group: int, rows: np.ndarray, width: int) -> np.ndarray:
        """``[len(rows), width]`` int32: the step's block table of one group (a copy)."""
        return self.tables[group][rows, :width]

    def slots(self, group: int, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """``[num_tokens]`` int64 slot of each token, from its request's row and its position."""
        blocks = self.tables[group][rows, positions // block_size].astype(np.int64)
        return blocks * block_size + positions % block_size

    def _write(self, g: int, row: _Row, ids: list[int], start: int) -> None:
        n, old = len(ids), row.counts[g]
        table = self.tables[g]
        if n > table.shape[1]:
            table = self.tables[g] = _grown(table, table.shape[0], max(n, 2 * table.shape[1]))
        table[row.index, start:n] = ids[start:]
        if old > n:  # fewer blocks than before (a preempted request back): zero the rest
            table[row.index, n:old] = 0
        row.lists[g], row.counts[g] = ids, n

    def _take_row(self) -> int:
        if not self._free:
            num_rows = self.tables[0].shape[0]
            self.tables = [_grown(t, 2 * num_rows, t.shape[1]) for t in self.tables]
            self._free = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free.pop()

    def _release(self, row: _Row) -> None:
        for g, table in enumerate(self.tables):
            table[row.index, : row.counts[g]] = 0
        self._free.append(row.index)


def _grown(table: np.ndarray, num_rows: int, num_cols: int) -> np.ndarray:
    out = np.zeros((num_rows, num_cols), dtype=table.dtype)
    out[: table.shape[0], : table.shape[1]] = table
    return out
