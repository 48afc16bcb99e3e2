"""Continuous batching with a token budget, chunked prefill, prefix caching and preemption.

Each step the scheduler gives every running request its next tokens (a decode token or the
next prefill chunk), in admission order, then admits waiting requests while the budget, the
sequence limit and the KV cache allow. When the cache cannot hold a running request's next
tokens, the most recently admitted request is preempted by recompute: its blocks are freed
and it rejoins the front of the queue, to recompute prompt and output when it resumes.

A scheduled step's tokens count as computed at once, and a step that samples leaves one token
in flight (``Request.num_inflight``) until ``update`` appends it. So the next step can be
scheduled before the last one's tokens are back (async scheduling): a request whose token is in
flight gets that token as its next input, unless it is known to end there (``max_tokens``,
``max_model_len``); one that ends on a stop token is scheduled once more and its extra token
dropped. Hybrid models' state snapshots are saved by the same count: a running request whose
computed tokens end on a full block is snapshotted when it is scheduled (and after a step), the
copy riding on the next forward, so saves and prefix-hit restores are exact however the steps
overlap (``_save_state``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnserve.core.request import Request, RequestStatus
from attnserve.core.step import ScheduledRequest, SchedulerOutput
from attnserve.kvcache.manager import KVCacheManager
from attnserve.kvcache.offload.manager import OffloadManager, TierHit

if TYPE_CHECKING:
    from attnserve.config import SchedulerConfig

__all__ = ["Scheduler", "SchedulerStats"]


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    offload_hit_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    history: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 rope_recompute_len: int | None = None, offload: OffloadManager | None = None):
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            raise ValueError("the scheduler runs with resolved batch limits (engine/batch_limits.py), "
                             f"got max_num_seqs={config.max_num_seqs}, "
                             f"max_num_batched_tokens={config.max_num_batched_tokens}")
        self.config = config
        self.kv = kv
        self.offload = offload
        self.max_model_len = max_model_len
        # longrope switches to its long factors once a sequence is longer than the original
        # context; like transformers, recompute the whole sequence with them at that point
        self.rope_recompute_len = rope_recompute_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests of a failed step, to rerun one at a time (``reset_after_fault``)
        self.suspects: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        focus = self._focus()
        snapshots = self.kv.snapshots_enabled
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if focus is not None and req is not focus:
                i += 1  # a suspect runs alone: the others wait a step
                continue
            if req.num_inflight and self._ends_with_inflight(req):
                i += 1  # its last token is in flight: nothing left to compute
                continue
            if snapshots:  # on a block boundary: keep the state there before this step moves on
                self._save_state(req)
            num_new = min(req.num_known_tokens - req.num_computed_tokens, budget)
            if snapshots:
                num_new = self._align(req, req.num_computed_tokens, num_new)
            if len(self.running) == 1 or focus is not None:  # alone: a smaller chunk may fit
                num_new = self._fit(req, num_new)
            if not num_new or not self.kv.allocate_slots(req, num_new):
                victim = self._preempt_for(req, spare=focus)
                preempted.extend(victim)
                if req.request_id in victim:
                    break
                i = self.running.index(req)  # the victim may have stood before it
                continue  # retry the same request with the freed blocks
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            i += 1
        if focus is not None and focus.status is not RequestStatus.RUNNING and not scheduled:
            preempted.extend(self._admit_alone(focus, scheduled, budget))
        elif focus is None and not preempted:
            budget = self._admit(scheduled, budget)
        self.stats.steps += 1
        jobs = self.offload.take_jobs() if self.offload is not None else None
        return SchedulerOutput(tuple(scheduled), tuple(preempted), self.kv.take_state_copies(), jobs)

    def schedule_after_context(self, req: Request, context: int) -> SchedulerOutput:
        """The profiling pass's long step: ``req`` runs alone, its first ``context`` tokens
        counted as computed (their blocks allocated, never written: the pass measures memory,
        not values), then its next chunk of up to ``max_num_batched_tokens`` tokens over them.

        Raises:
            ValueError: ``context`` leaves no token of ``req`` to compute.
            RuntimeError: the pool cannot hold the request.
        """
        num_new = min(req.num_tokens - context, self.config.max_num_batched_tokens)
        if context < 0 or num_new < 1:
            raise ValueError(f"a context of {context} leaves nothing of {req.num_tokens} tokens to compute")
        if not self.kv.allocate_slots(req, context + num_new):
            raise RuntimeError(f"the pool of {self.kv.pool.num_free_blocks} free blocks cannot hold "
                               f"{context + num_new} tokens")
        if req in self.waiting:
            self.waiting.remove(req)
        req.num_computed_tokens = context
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return SchedulerOutput((self._scheduled(req, num_new),))

    # --- failed steps ------------------------------------------------------------------------
    def reset_after_fault(self, requests: list[Request]) -> None:
        """Undo what a failed step scheduled for ``requests`` and queue them to rerun alone.

        Each loses its blocks, which also leave the prefix-cache index (the step may have left
        them half written), and goes back to the front of the queue to recompute its prompt and
        the tokens it has (as a preempted request does); the step's in-flight token is dropped, and
        a seeded request's generator goes back to where it was before that token's draw.
        Then ``schedule`` runs them one at a time, each until it samples a token (``suspects``):
        a step that fails with one request in it is that request's fault (``finish`` it with
        ``FINISHED_ERROR``); the others go on with outputs as exact as after a preemption.
        """
        for req in reversed(requests):
            if req.is_finished:
                continue
            self._detach_faulted(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            for made, state in req.rng_checkpoints:  # undo the draws of samples never appended
                if made == req.num_output_tokens:
                    req.generator.set_state(state)
            req.rng_checkpoints = []
            self.waiting.appendleft(req)
        self.suspects.extend(r for r in requests if not r.is_finished and r not in self.suspects)

    def fail_after_fault(self, req: Request, message: str) -> None:
        """Finish ``req``, whose step failed with it alone, with ``FINISHED_ERROR``."""
        self._detach_faulted(req)
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = message

    def _detach_faulted(self, req: Request) -> None:
        """Take a request of a failed step out of the running list or the queue: its blocks are
        freed and leave the prefix-cache index, its in-flight token is dropped."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req, uncache=True)
        if self.offload is not None:
            self.offload.forget(req.request_id)
        req.num_inflight = 0

    def _focus(self) -> Request | None:
        """The suspect to run alone this step, or None (finished ones are dropped)."""
        while self.suspects and self.suspects[0].is_finished:
            self.suspects.popleft()
        return self.suspects[0] if self.suspects else None

    def _admit_alone(self, req: Request, scheduled: list[ScheduledRequest], budget: int) -> list[str]:
        """Admit the suspect ``req`` on its own (not limited by ``max_num_seqs``), preempting the
        most recent running requests when the cache cannot hold it; returns those preempted."""
        preempted = []
        num_new = self._align(req, 0, min(req.num_tokens, budget))
        while True:
            fitted = self._fit(req, num_new)
            if fitted and self.kv.allocate_slots(req, fitted):
                break
            if not self.running:
                return preempted  # not even alone: it waits (allocation failures are not faults)
            preempted.append(self._preempt_last(queue_at=1))  # behind the suspect
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(self._scheduled(req, fitted))
        return preempted

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        """The step's entry for ``req``; its tokens count as computed from now on."""
        if req.first_scheduled_time is None:  # the end of its queue time (metrics)
            req.first_scheduled_time = time.monotonic()
        rid = req.request_id
        start = req.num_computed_tokens
        samples = start + num_new >= req.num_known_tokens
        if samples and req.generator is not None:  # before this step draws (it draws at launch)
            made = req.num_output_tokens
            req.rng_checkpoints = [c for c in req.rng_checkpoints if c[0] >= made]
            req.rng_checkpoints.append((made + req.num_inflight, req.generator.get_state()))
        req.num_computed_tokens = start + num_new
        req.num_inflight += samples
        return ScheduledRequest(req, num_new, self.kv.live_block_ids(rid), self.kv.state_slot(rid), start, samples)

    def _ends_with_inflight(self, req: Request) -> bool:
        """Whether the token in flight is the request's last one, by length."""
        p = req.sampling_params
        return (p.max_tokens is not None and req.num_output_tokens + req.num_inflight >= p.max_tokens) \
            or req.num_known_tokens >= self.max_model_len

    def _align(self, req: Request, start: int, num_new: int) -> int:
        """Hybrid models keep state snapshots at block boundaries, so a prefill step ends on one:
        a chunk that stops early ends on its last boundary, and one that finishes the prompt
        first stops at the prompt's last boundary (the rest runs next step)."""
        if not self.kv.snapshots_enabled or num_new <= 1 or not req.cacheable:
            return num_new
        bs = self.kv.block_size
        end = start + num_new
        boundary = (end // bs) * bs if end < req.num_tokens else ((req.num_tokens - 1) // bs) * bs
        return boundary - start if boundary > start else num_new

    def _fit(self, req: Request, num_new: int, num_cached: int = 0, hits=None, loaded: int = 0) -> int:
        """The largest chunk (halving from ``num_new``) the free blocks can hold; 0 if none."""
        while num_new > 0 and not self.kv.can_allocate(req, loaded + num_new, num_cached, hits):
            num_new //= 2
        return num_new

    def _offload_lookup(self, req: Request, num_cached: int) -> TierHit | None:
        """Blocks right after the device hit that the offload tier holds, or None."""
        if self.offload is None or req.skip_prefix_cache:
            return None
        bs = self.kv.block_size
        start = num_cached // bs
        hit = self.offload.lookup(req.block_hashes, start, (req.num_tokens - 1) // bs - start)
        return hit if hit.num_blocks else None

    def _preempt_for(self, req: Request, spare: Request | None = None) -> list[str]:
        """Preempt the lowest-priority running request (the last admitted) to free blocks. A
        suspect running alone (``spare``) gives way last: the others wait this step anyway, and
        a suspect that preempted itself would recompute from scratch every step, for ever, while
        they kept their blocks (a livelock the fault-injected load test found)."""
        index = len(self.running) - 1
        if spare is not None and index > 0 and self.running[index] is spare:
            index -= 1
        return [self._preempt_last(queue_at=0, index=index)]

    def _preempt_last(self, queue_at: int, index: int = -1) -> str:
        """Preempt the running request at ``index`` (the last admitted) by recompute, queued at
        ``queue_at``."""
        victim = self.running.pop(index)
        self.kv.free(victim)
        if self.offload is not None:
            self.offload.forget(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.insert(queue_at, victim)
        return victim.request_id

    def _admit(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_cached = self.kv.get_computed_blocks(req)
            tier_hit = self._offload_lookup(req, num_cached)
            loaded = tier_hit.num_blocks * self.kv.block_size if tier_hit else 0
            if tier_hit:  # sliding groups keep the null block where their window does not reach
                hits = self.kv.with_null_blocks(hits, [tier_hit.num_null_blocks(g) for g in range(len(hits))])
            num_new = req.num_tokens - num_cached - loaded
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._align(req, num_cached + loaded, min(num_new, budget))
            if not self.running and self.config.enable_chunked_prefill:
                # nothing runs that could free blocks: take the largest chunk that fits
                num_new = self._fit(req, num_new, num_cached, hits, loaded)
            if loaded:
                self.kv.discard_restore(req.request_id)  # the tier brings the state too
            if not num_new or not self.kv.allocate_slots(req, loaded + num_new, num_cached, hits):
                break
            self.waiting.popleft()
            if tier_hit:
                self.offload.prepare_load(req.request_id, tier_hit, self.kv.live_block_ids(req.request_id),
                                          num_cached // self.kv.block_size, self.kv.state_slot(req.request_id))
                self.stats.offload_hit_tokens += loaded
            req.num_computed_tokens = num_cached + loaded
            if req.num_cached_tokens < 0:  # as vLLM: device hits and tokens the offload tier brings
                req.num_cached_tokens = num_cached + loaded
                self.stats.prefix_hit_tokens += num_cached
                self.stats.prompt_tokens += req.num_prompt_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Account for an executed step: advance computed tokens, append sampled tokens, stop
        finished requests and free their blocks. Returns the requests that got a token."""
        progressed = []
        snapshots = self.kv.snapshots_enabled
        for s in output.scheduled:
            req = s.request
            req.num_inflight -= s.samples
            if req.status is RequestStatus.PREEMPTED and req.request_id in sampled:
                # preempted by a step scheduled while this one ran: keep its token, which the
                # recompute then includes (num_computed_tokens is already 0)
                self._append(req, sampled[req.request_id], progressed)
                continue
            if req.status is not RequestStatus.RUNNING:  # finished (aborted, stopped) or preempted
                continue
            if snapshots:
                self._save_state(req)
            if self.offload is not None and req.cacheable:
                self.offload.prepare_store(req.request_id, req.block_hashes, self.kv.live_block_ids(req.request_id),
                                           req.num_computed_tokens)
            if req.request_id not in sampled:
                continue
            self._append(req, sampled[req.request_id], progressed)
            if not req.is_finished and req.num_tokens == self.rope_recompute_len:
                self.kv.free(req)
                req.num_computed_tokens = 0
        return progressed

    def _save_state(self, req: Request) -> None:
        """Snapshot ``req``'s state if its computed tokens end on a full block whose hash is known
        (``KVCacheManager.snapshot_state``), and offer the snapshot to the offload tier.

        Right at any time: once every launched forward has run, the request's slot holds the
        state of its ``num_computed_tokens`` tokens (a step counts them when it is scheduled),
        and the copy runs before the next forward. ``update`` calls it after a step; with async
        scheduling the next step is already counted by then, its input token still in flight,
        so that block has no hash yet, and ``schedule`` saves it on the way in instead."""
        snapshot = self.kv.snapshot_state(req)
        if snapshot is not None and self.offload is not None:
            self.offload.prepare_state_store(*snapshot)

    def _append(self, req: Request, token: int, progressed: list[Request]) -> None:
        req.append_output_token(token)
        self.kv.cache_known_blocks(req)  # before a stop frees the blocks
        progressed.append(req)
        if self.suspects and self.suspects[0] is req:  # it ran alone to a new token: cleared
            self.suspects.popleft()
        self._check_stop(req)
        if req.is_finished:
            self._remove(req)

    def _check_stop(self, req: Request) -> None:
        params = req.sampling_params
        token = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return
        if (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) \
                or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    def finish(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish a request from outside (abort, stop string); frees its blocks at once."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        self._remove(req)
        req.status = status
        req.stop_reason = stop_reason

    def _remove(self, req: Request) -> None:
        """Take a request out of the running list (freeing its blocks) or the queue."""
        if req in self.running:
            self._remove_running(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def _remove_running(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        if self.offload is not None:
            self.offload.forget(req.request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request once its output has been delivered."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
