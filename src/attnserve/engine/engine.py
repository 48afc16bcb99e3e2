"""LLMEngine: the step loop. Requests in, ``RequestOutput`` objects out.

``add_request`` validates and queues a request; ``step`` schedules, runs the model once,
updates the scheduler and turns new tokens into outputs; ``abort_request`` stops requests and
frees their blocks at once. The engine knows requests, the scheduler and the runner; it never
touches model code and knows no server.

With async scheduling (on by default on CUDA where the model allows it) a step schedules and
launches the next forward before it reads back the one before, so the host's scheduling,
input preparation and output processing run while the device computes: ``step`` returns the
outputs of the previous forward. Where a request's sampling needs its latest tokens on the
host (penalties, ``min_tokens``, a grammar, bad words of several tokens) only the sampling
waits, as in vLLM: the step's forward is launched, the previous one read back and processed
(matchers advanced), then the bitmask filled and the step sampled. A running request whose
prompt logprobs are still being computed has the step before read back before the launch.

Structured output: a request with ``structured_outputs`` gets a matcher per completion
(``engine/structured_output.py``). Each step the forward is launched first and the bitmask of
the constrained requests that sample in it is filled while the device computes, as vLLM does
(``ModelRunner.launch`` calls ``_grammar_bitmask`` between the forward and the sampling);
after the step each matcher advances by the appended token. A matcher that refuses a token
finishes its request with "error"; one that reaches the end of its grammar (its stop token
taken) finishes it with "stop". Such a request needs its latest token on the host before its
next mask, so with async scheduling its step's sampling waits for the step before (above).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from typing import Any

from attnserve.config import EngineConfig
from attnserve.core.request import Request, RequestStatus
from attnserve.core.step import GrammarBitmask, RunnerOutput, SchedulerOutput
from attnserve.engine.builder import EngineParts, build_engine_parts
from attnserve.engine.output_deltas import RequestDelta
from attnserve.engine.output_processor import CompletionState, RequestState, make_detokenizer
from attnserve.engine.scheduler import Scheduler
from attnserve.engine.structured_output import StructuredOutputManager
from attnserve.generation_config import load_generation_config
from attnserve.outputs import RequestOutput
from attnserve.runner.model_runner import StepHandle
from attnserve.sampling_params import SamplingParams

__all__ = ["ITERATION_TOKEN_BUCKETS", "LLMEngine", "PromptError", "check_params_for_model",
           "truncate_prompt_ids"]

logger = logging.getLogger(__name__)
# the upper bounds of vLLM's vllm:iteration_tokens_total buckets (tokens per engine step)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PromptError(ValueError):
    """A prompt the engine cannot serve (empty, too long, bad token ids)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        self.parts = parts or build_engine_parts(config)
        self.config = self.parts.config  # ``config`` with its batch limits resolved
        self.arch = self.parts.arch
        self.tokenizer = self.parts.tokenizer
        self.max_model_len = self.parts.max_model_len
        # generation_config.json: its EOS ids stop generation too; its sampling defaults are
        # applied by LLM.generate and the server (where the request sets none)
        self.generation_config = load_generation_config(config.model.generation_config, self.parts.model_dir)
        rope = next((s.rope for s in self.arch.layers if s.rope is not None), None)
        # prefix hits are off where a cached block's meaning depends on more than its tokens:
        # length-dependent RoPE, and StreamingLLM (what was dropped before a block)
        self._uncacheable = (rope is not None and rope.rope_type in ("dynamic", "longrope")) \
            or config.cache.streaming_window is not None
        recompute = None
        if rope is not None and rope.rope_type == "longrope" and rope.original_max_position_embeddings:
            recompute = rope.original_max_position_embeddings + 1
        self.scheduler = Scheduler(self.config.scheduler, self.parts.kv_manager, self.max_model_len, recompute,
                                   offload=self.parts.runner.offload)
        self.runner = self.parts.runner
        self.workers = self.parts.workers  # tensor parallel (rank 0): the ranks it started
        self.states: dict[str, RequestState] = {}
        self._child_to_state: dict[str, tuple[RequestState, CompletionState]] = {}
        self._ids = itertools.count()
        self.async_scheduling = self._async_allowed(config.scheduler.async_scheduling)
        self._pending: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not read back
        # cumulative, for throughput figures: prompt tokens of requests that got their first
        # token (prefix-cache hits included, as vLLM counts them), and tokens sampled
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # steps by the tokens they added to those two counts (vLLM's iteration tokens): [i] counts
        # those with ITERATION_TOKEN_BUCKETS[i - 1] < tokens <= ITERATION_TOKEN_BUCKETS[i]; the
        # last, those above every bucket
        self.iteration_token_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.step_seconds = 0.0  # wall time inside ``step`` (the host's work plus its waits)
        if logger.isEnabledFor(logging.INFO):
            for line in self.startup_summary():
                logger.info("%s", line)
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
        self._constrained: set[str] = set()  # live requests (completions) with a grammar

    def _async_allowed(self, wanted: bool | None) -> bool:
        """Async scheduling needs a forward whose outcome depends only on what the device has:
        not with offloading (copies are planned from finished steps), tensor parallelism,
        length-dependent RoPE or streaming. State layers take part: a slot's state follows the
        tokens the scheduler has counted, and snapshot copies run in stream order
        (``Scheduler._save_state``)."""
        parts = self.parts
        blockers = [why for why, bad in (
            ("KV offloading", parts.runner.offload is not None),
            ("tensor parallelism", parts.workers is not None),
            ("a length-dependent RoPE or StreamingLLM", self._uncacheable),
            ("host-resident sparse latents", self.config.offload.kv_offload_sparse_latents)) if bad]
        if wanted and blockers:
            raise ValueError(f"async_scheduling is not supported with {', '.join(blockers)}")
        return not blockers if wanted is None and parts.device.type == "cuda" else bool(wanted)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The config's EOS ids and those generation_config.json adds: every one stops a request."""
        return tuple(dict.fromkeys(self.arch.eos_token_ids + self.generation_config.eos_token_ids))

    @property
    def kv_manager(self):
        return self.parts.kv_manager

    def startup_summary(self) -> list[str]:
        """What the engine runs with, as ``serve`` and ``generate`` log it at start: the model,
        dtypes and device, each cache group's backend and kernel variants, the KV blocks and
        tokens that fit, the batch limits."""
        parts, cfg, plan = self.parts, self.config, self.parts.plan
        a = self.arch
        tp = f", tensor parallel {cfg.parallel.tensor_parallel_size}" if cfg.parallel.tensor_parallel_size > 1 else ""
        lines = [f"model {cfg.model.model} ({a.model_type}, {a.num_layers} layers, {a.mechanism.value}) on "
                 f"{parts.device} ({parts.platform.label}), dtype {parts.dtype}, KV cache dtype "
                 f"{plan.kv_cache_dtype}{tp}"]
        for g in plan.groups:
            layers = sorted({e.layer for e in g.group.entries})
            kinds = "/".join(sorted({plan.layers[i].kind.value for i in layers}))
            window = f" {g.group.window}" if g.group.window else ""
            span = (f"layer {layers[0]}" if len(layers) == 1 else "layers " + ", ".join(map(str, layers))
                    if len(layers) <= 4 else f"layers {layers[0]}..{layers[-1]}")
            kernels = ", ".join(f"{op} {c.variant}" for op, c in g.kernel_choices.items())
            lines.append(f"cache group {g.group.group_id} ({g.group.policy.value}{window}): {len(layers)} {kinds} "
                         f"layers ({span}): backend {g.backend.name}" + (f"; kernels {kernels}" if kernels else ""))
        kv, block = self.kv_manager, cfg.cache.block_size
        usable = kv.pool.num_blocks - 1  # block 0 is the null block
        lo, hi = 0, usable * block  # the longest sequence the pool holds (windows applied)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kv.num_blocks_for_tokens(mid) <= usable else (lo, mid - 1)
        per_seq = kv.num_blocks_for_tokens(self.max_model_len)
        line = (f"KV cache: {usable:,} blocks of {block} tokens; {lo:,} tokens fit; a sequence of max_model_len {self.max_model_len:,} holds {per_seq:,} "
                f"blocks: {usable / per_seq:.2f}x that length at once")
        if kv.state_pool is not None:
            line += f"; {kv.state_pool.num_slots} state slots"
        lines.append(line)
        sched = cfg.scheduler
        lines.append(f"batch: {parts.batch_limits.describe()}, chunked prefill {_on(sched.enable_chunked_prefill)}, "
                     f"prefix caching {_on(cfg.cache.enable_prefix_caching)}, async scheduling "
                     f"{_on(self.async_scheduling)}, CUDA graphs {_on(self.runner.graphs is not None)}")
        return lines

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # and its text, when given (LLM.chat passes both)
                text = prompt["prompt"] if isinstance(prompt.get("prompt"), str) else None
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer: pass prompt_token_ids")
            try:
                prompt.encode()
            except UnicodeEncodeError as e:  # a lone surrogate, which the tokenizer cannot take
                raise PromptError(f"the prompt is not valid Unicode: {e.reason} at character {e.start}") from None
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise PromptError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                              f"'prompt_token_ids', got {type(prompt).__name__}")
        return text, list(prompt)

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams | None = None) -> str:
        """Tokenise, check and queue one prompt; returns its request id (a fresh one for None)."""
        text, ids = self.tokenize(prompt)
        return self.add_tokenized_request(request_id, text, ids, params)

    def add_tokenized_request(self, request_id: str | None, prompt: str | None, prompt_token_ids: list[int],
                              params: SamplingParams | None = None) -> str:
        """Check and queue a prompt that ``tokenize`` turned into ``(prompt, prompt_token_ids)``
        (``prompt``: its text, or None); the outputs carry that text."""
        params = params or SamplingParams()
        text, ids = prompt, self.truncate_prompt(prompt_token_ids, params)
        self.check_prompt(ids, params)
        if len(ids) < len(prompt_token_ids):  # the outputs carry the text of what was kept
            text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else None
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.states:
            raise ValueError(f"request id '{request_id}' is already in use")
        bad_words = self.bad_words_token_ids(params)
        completions = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = SamplingParams(**{**_params_dict(params), "n": 1, "seed": params.child_seed(i)})
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, ids, child_params, eos_token_ids=self.eos_token_ids,
                          block_size=self.config.cache.block_size, prompt=text,
                          cacheable=not self._uncacheable, bad_words_token_ids=bad_words)
            if params.structured_outputs is not None:  # compiled (or found) by check_prompt
                req.grammar = self.structured.grammar_for(params.structured_outputs)
                self._constrained.add(child_id)
            completions.append(CompletionState(req, i, make_detokenizer(self.tokenizer, req)))
        # vLLM's shape: one entry per prompt token, the first None (a one-token prompt: [None])
        first = [None] if params.prompt_logprobs is not None else None
        state = RequestState(request_id, text, ids, completions, self.tokenizer, prompt_logprobs=first)
        self.states[request_id] = state
        for c in completions:
            self._child_to_state[c.request.request_id] = (state, c)
            self.scheduler.add_request(c.request)
        return request_id

    def truncate_prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        return truncate_prompt_ids(ids, params.truncate_prompt_tokens, self.max_model_len)

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``bad_words`` as token sequences, as vLLM tokenises them: each word without its leading
        spaces, and with one space before it where that starts with another token of the
        same count (a word inside a text)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise PromptError("bad_words needs the model's tokenizer, and this model has none")
        sequences: list[list[int]] = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise PromptError(f"bad_words: {word!r} is no token at all")
            sequences.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raises PromptError for a request the engine cannot serve: prompt token ids empty, out of
        the vocabulary or with no room for a generated token within ``max_model_len`` (after
        ``truncate_prompt_tokens``); sampling parameters that only this model bounds
        (``logprobs`` and ``prompt_logprobs`` above the vocabulary size, token ids outside it);
        ``bad_words`` this tokenizer cannot encode; a ``structured_outputs`` constraint that
        does not compile (compiled here, then found in the cache). ``SamplingParams`` checked
        the rest."""
        vocab = self.arch.vocab_size
        check_params_for_model(params, vocab, self.config.model.max_logprobs)
        ids = self.truncate_prompt(ids, params)
        self.bad_words_token_ids(params)
        if params.structured_outputs is not None:
            try:
                self.structured.compile(params.structured_outputs)
            except ValueError as e:
                raise PromptError(str(e)) from e
        if not ids:
            raise PromptError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise PromptError("prompt token ids must be integers")
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise PromptError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise PromptError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                              f"(the prompt and at least one generated token must fit)")

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.states.pop(rid, None)
            if state is None:
                continue
            for c in state.completions:
                self.scheduler.finish(c.request.request_id, RequestStatus.FINISHED_ABORTED)
                self._forget(c.request.request_id)
        if not self.states and self._pending is not None:  # the step in flight ran only these
            self._finish_pending(False)

    def _forget(self, child_id: str) -> None:
        self._child_to_state.pop(child_id, None)
        self._constrained.discard(child_id)
        self.scheduler.release(child_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (garbage collection also stops them)."""
        if self.workers is not None:
            self.workers.shutdown()

    # --- the step ---------------------------------------------------------------------------
    def step(self, final_only: bool = False, deltas: bool = False) -> list[RequestOutput] | list[RequestDelta]:
        """Run one step; returns the (cumulative) output of every request that got a token, or
        with ``final_only`` of every request that finished (``LLM.generate`` reads no others).
        With ``deltas``: each such request's ``RequestDelta`` instead (what is new since its last
        delta, keyed by request id: ``RequestState.to_delta``), and no cumulative output is built
        (the engine process's mode).

        With async scheduling the outputs are those of the forward launched by the call before,
        read back while this call's forward runs."""
        t0 = time.perf_counter()
        touched = {id(state): state for state in self._step(final_only)}.values()  # once each
        outputs = [state.to_delta() for state in touched] if deltas else [state.to_output() for state in touched]
        self.step_seconds += time.perf_counter() - t0
        return outputs

    def _step(self, final_only: bool) -> list[RequestState]:
        """``step``'s work; returns the requests whose outputs it reports."""
        if not self.async_scheduling:
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                return []
            try:
                run_out = self.runner.execute(sched_out, self._grammar_bitmask)
            except Exception as exc:  # noqa: BLE001 - contained: see _step_failed
                return self._step_failed([sched_out], exc)
            return self._process(sched_out, run_out, final_only)
        outputs = []
        if self._pending is not None and any(r.needs_host_tokens_to_launch for r in self.scheduler.running):
            outputs = self._finish_pending(final_only)  # this step's inputs need those tokens
            if not self.async_scheduling:  # its read-back failed: recovery goes step by step
                return outputs
        sched_out = self.scheduler.schedule()
        # a request whose sampling reads its latest tokens on the host: the forward goes now,
        # the sampling once the step before is back (and its matchers advanced)
        defer = self._pending is not None and any(s.samples and s.request.needs_host_tokens
                                                  for s in sched_out.scheduled)
        handle = None
        if not sched_out.is_empty:
            try:
                handle = (self.runner.launch_forward(sched_out) if defer
                          else self.runner.launch(sched_out, self._grammar_bitmask))
            except Exception as exc:  # noqa: BLE001 - contained: see _step_failed
                failed = [sched_out] + ([self._pending[0]] if self._pending is not None else [])
                self._pending = None
                return outputs + self._step_failed(failed, exc)
        if self._pending is not None:  # read back the previous forward while this one runs
            outputs = self._finish_pending(final_only)
            if not self.async_scheduling and handle is not None:
                # that read-back failed, and the step just launched ran on its tokens: rerun it
                # too (its writes land before any later step's, in stream order)
                return outputs + self._step_failed([sched_out], None)
        if handle is not None and defer:
            try:
                self.runner.sample(handle, self._grammar_bitmask(sched_out))
            except Exception as exc:  # noqa: BLE001 - contained: see _step_failed
                return outputs + self._step_failed([sched_out], exc)
        if handle is not None:
            self._pending = (sched_out, handle)
            if not self.states:  # every request it ran has ended: nothing of it will be read
                self._finish_pending(final_only)
        return outputs

    def _grammar_bitmask(self, sched_out: SchedulerOutput) -> GrammarBitmask | None:
        """The bitmask of each constrained request that samples in ``sched_out``, or None. Called
        once the step's forward is queued (by the runner, or with async scheduling by ``step``
        after the step before is read back: the matchers are current): on CUDA the host fills
        it while the device computes the forward; on CPU the forward has run by then."""
        if not self._constrained:
            return None
        # a request that finished on the step before's token (sampled after it was read back)
        # gets no row: its token here is dropped
        reqs = [s.request for s in sched_out.scheduled
                if s.samples and s.request.grammar is not None and not s.request.is_finished]
        if not reqs:
            return None
        bitmask = self.structured.fill_bitmask([r.grammar for r in reqs])
        return GrammarBitmask(tuple(r.request_id for r in reqs), bitmask)

    def _advance_grammar(self, req: Request) -> None:
        """Feed the request's new output token to its matcher; finish it on a refused token
        ("error") or once the grammar is complete ("stop")."""
        error = req.grammar.advance(req.output_token_ids)
        if error is not None:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR, error)
        elif req.grammar.terminated:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _finish_pending(self, final_only: bool) -> list[RequestState]:
        sched_out, handle = self._pending
        self._pending = None
        try:
            run_out = self.runner.collect(handle)
        except Exception as exc:  # noqa: BLE001
            return self._step_failed([sched_out], exc)
        return self._process(sched_out, run_out, final_only)

    def _step_failed(self, steps: list[SchedulerOutput], exc: BaseException | None) -> list[RequestState]:
        """Contain a step that raised: the engine and the requests it did not run go on.

        A step with one request in it failed because of that request: it finishes with
        ``finish_reason`` "error" (the message in ``stop_reason``). Otherwise every request of the
        failed steps is rerun from scratch, one at a time (``Scheduler.reset_after_fault``), so a
        request that fails again alone is found and the others finish exactly. Async scheduling
        is turned off for the rest of the engine's life (a failed read-back leaves the step
        launched after it with tokens that never came)."""
        if exc is not None:
            logger.error("a step failed (%s requests): %r", sum(len(s.scheduled) for s in steps), exc,
                         exc_info=exc)
        if self.async_scheduling:
            self.async_scheduling = False
            logger.warning("async scheduling is off after a failed step")
        offload = self.scheduler.offload
        for out in steps:  # tier loads the failed step never issued hold their blobs: release them
            if offload is not None and out.offload is not None:
                offload.cancel_loads(out.offload[1])
        requests = list({id(s.request): s.request for out in steps for s in out.scheduled}.values())
        live = [r for r in requests if not r.is_finished]
        if len(live) == 1 and len(requests) == 1 and exc is not None:
            return self._fail_request(live[0], exc)
        self.scheduler.reset_after_fault(live)
        return []

    def _fail_request(self, req, exc: BaseException) -> list[RequestState]:
        """Finish one request whose step failed with it alone; returns it once it has finished."""
        self.scheduler.fail_after_fault(req, f"{type(exc).__name__}: {exc}")
        state, c = self._child_to_state[req.request_id]
        state.finish(c)
        if not state.finished:
            return []
        del self.states[state.request_id]
        for child in state.completions:
            self._forget(child.request.request_id)
        return [state]

    def _output_failed(self, c: CompletionState, exc: BaseException) -> None:
        """Finish completion ``c``, whose output processing raised, with "error" (the message in
        ``stop_reason``, as for a failed step); its blocks are freed at once."""
        logger.error("output processing failed for request %s: %r", c.request.request_id, exc, exc_info=exc)
        message = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(c.request.request_id, RequestStatus.FINISHED_ERROR, message)
        c.finish_reason, c.stop_reason = RequestStatus.FINISHED_ERROR.value, message

    def _process(self, sched_out: SchedulerOutput, run_out: RunnerOutput, final_only: bool) -> list[RequestState]:
        """Scheduler update and output processing of one executed step; returns the requests
        that got a token (with ``final_only``: that finished).

        Output processing (detokenising, logprob entries, stop strings, the grammar) runs per
        completion: one that raises finishes that completion alone with "error"
        (``_output_failed``); the others and the engine go on."""
        touched: dict[str, RequestState] = {}
        for rid, entries in run_out.prompt_logprobs.items():
            if rid not in self._child_to_state:  # aborted while its step ran
                continue
            state, c = self._child_to_state[rid]
            c.request.num_prompt_logprobs_done += len(entries)
            if c.index == 0 and c.finish_reason is None:
                try:
                    state.add_prompt_logprobs(entries)
                except Exception as exc:  # noqa: BLE001 - contained: this request alone fails
                    self._output_failed(c, exc)
                    touched[state.request_id] = state
        progressed = self.scheduler.update(sched_out, run_out.sampled)
        counted = self.num_prompt_tokens + self.num_generation_tokens
        self.num_generation_tokens += len(progressed)
        for req in progressed:
            state, c = self._child_to_state[req.request_id]
            if req.num_output_tokens == 1 and c.index == 0:  # a request's prompt, once for n > 1
                self.num_prompt_tokens += req.num_prompt_tokens
            touched[state.request_id] = state
            if c.finish_reason is not None:  # its output processing failed (prompt logprobs)
                continue
            try:
                stop = state.add_token(c, run_out.logprobs.get(req.request_id))
                if stop is not None and not req.is_finished:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
                if req.grammar is not None and not req.is_finished:
                    self._advance_grammar(req)
                if req.is_finished:
                    state.finish(c)
            except Exception as exc:  # noqa: BLE001 - contained: this request alone fails
                self._output_failed(c, exc)
        step_tokens = self.num_prompt_tokens + self.num_generation_tokens - counted
        self.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, step_tokens)] += 1
        outputs = []
        for rid, state in touched.items():
            finished = state.finished
            if finished or not final_only:
                outputs.append(state)
            if finished:
                del self.states[rid]
                for c in state.completions:
                    self._forget(c.request.request_id)
        return outputs


def truncate_prompt_ids(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last ``keep`` tokens of the prompt (``truncate_prompt_tokens``; -1: the last
    ``max_model_len - 1``, room for one generated token); all of it for None."""
    if keep is None:
        return ids
    keep = max_model_len - 1 if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def check_params_for_model(params: SamplingParams, vocab_size: int, max_logprobs: int = -1) -> None:
    """Raises PromptError for sampling parameters this model cannot honour (``SamplingParams``
    checks what holds for any model): ``logprobs`` or ``prompt_logprobs`` above the engine's
    ``max_logprobs`` (-1: no cap) or the vocabulary size, stop token ids outside the vocabulary.
    The message starts with the field's name."""
    if not isinstance(params, SamplingParams):
        raise PromptError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and 0 <= max_logprobs < value:
            raise PromptError(f"{name} is {value}, above this engine's max_logprobs of {max_logprobs} "
                              "(the max_logprobs engine option raises it)")
        if value is not None and value > vocab_size:
            raise PromptError(f"{name} is {value}, more than the vocabulary's {vocab_size} tokens")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise PromptError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _params_dict(p: SamplingParams) -> dict[str, Any]:
    return {k: getattr(p, k) for k in p.__dataclass_fields__ if not k.startswith("_")}
