"""Tensor parallelism, the runner's side: the per-step broadcast and the worker's step loop.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, samples and
detokenises. Ranks 1..N-1 are workers that each own a model shard and its KV cache shard. Each
step rank 0 broadcasts a ``StepHeader`` (the step's Python metadata, with
``broadcast_object_list``) and then every input tensor ``ModelRunner._prepare`` built, packed
into one int64 tensor (``broadcast``). Every rank runs the forward in its forward context and
the output head over the rows rank 0 will read; rank 0 gathers the logits and samples.

``StepBroadcaster`` is rank 0's end (held by its ``ModelRunner``); ``serve_steps`` is a worker's
loop, which ends when rank 0 broadcasts the stop header (``StepBroadcaster.send_stop``). What it
is not: starting the ranks and stopping them (``engine/tensor_parallel.py``), the torchrun entry
(``entrypoints/torchrun.py``), the sharding (``runner/parallel.py``), the scheduler or the sampler.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.core.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from attnserve.runner.model_runner import ModelRunner

__all__ = ["StepBroadcaster", "StepHeader", "serve_steps", "step_group"]

logger = logging.getLogger(__name__)

_IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the engine idles
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
    logit_rows: list[list[int]]  # rows of the hidden states through the output head, one list a call


def step_group() -> dist.ProcessGroup:
    """A gloo group for the step headers: workers may wait in it for as long as rank 0 idles.
    Every rank creates it (a collective), right after joining the default group."""
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


class StepBroadcaster:
    """Rank 0's end of the step broadcast: every step's inputs, then the stop header."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def broadcast_step(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        state_copies: tuple[tuple[int, int], ...],
        logit_rows: list[list[int]],
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
            [list(rows) for rows in logit_rows],
        )
        dist.broadcast_object_list([header], src=0, group=self.group)
        dist.broadcast(flat, src=0)

    def send_stop(self) -> bool:
        """Broadcast the stop header; False when it failed or did not go out within ``_JOIN_S``
        (a worker stuck in another collective never reads it)."""
        return _send_stop(self.group)


def _send_stop(group) -> bool:
    """Broadcast the stop header; False when it failed or did not go out within ``_JOIN_S``
    (a worker stuck in another collective never reads it)."""
    sent = threading.Event()

    def send() -> None:
        try:
            dist.broadcast_object_list([None], src=0, group=group)
            sent.set()
        except Exception as e:  # noqa: BLE001 - a dead worker must not keep the others alive
            logger.warning("could not tell the tensor-parallel workers to stop: %s", e)

    sender = threading.Thread(target=send, name="attnserve-tp-stop", daemon=True)
    sender.start()
    sender.join(_JOIN_S)
    return sent.is_set()


# --- ranks 1..N-1 -------------------------------------------------------------------------


def _receive(group, device: torch.device) -> tuple[StepHeader, dict[str, torch.Tensor]] | None:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group)
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
    for rows in header.logit_rows:  # each a collective: rank 0 gathers every rank's vocabulary slice
        runner.model.compute_logits(hidden[rows])


def serve_steps(runner: ModelRunner, group: dist.ProcessGroup) -> None:
    """A worker's loop: run each step rank 0 broadcasts on this rank's shard, until the stop."""
    while (step := _receive(group, runner.device)) is not None:
        _execute(runner, *step)
