"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` as in vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attnserve.config import EngineConfig
from attnserve.engine.engine import LLMEngine
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

__all__ = ["LLM", "GenerateStats"]

PromptType = str | list[int] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class GenerateStats:
    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    elapsed: float

    @property
    def prompt_throughput(self) -> float:
        return self.prompt_tokens / self.elapsed if self.elapsed else 0.0

    @property
    def generation_throughput(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed else 0.0


class LLM:
    """An engine for offline batches. Every engine flag is a keyword (vLLM's names)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        if model is None:
            from attnserve.presets import DEFAULT_MODEL

            model = DEFAULT_MODEL
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, usage_context="llm", **kwargs))
        self.last_stats: GenerateStats | None = None

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params: ``SamplingParams()`` with
        the model's generation_config.json defaults (none with ``generation_config='vllm'``)."""
        return self.llm_engine.generation_config.default_sampling_params()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers now (garbage collection does it otherwise)."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is validated before any is queued, so a bad prompt leaves nothing half-done.
        ``use_tqdm``: a progress bar on stderr (as vLLM's, on by default), or the ``tqdm``-like
        class to draw it with.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        tokenized = [engine.tokenize(p) for p in prompts]
        for (_, ids), p in zip(tokenized, params):
            engine.check_prompt(ids, p)
        start = time.perf_counter()
        order = [engine.add_tokenized_request(None, text, ids, p) for (text, ids), p in zip(tokenized, params)]
        finals: dict[str, RequestOutput] = {}
        bar = _progress(len(order), use_tqdm) if use_tqdm else None
        generated = 0
        while engine.has_unfinished_requests():
            for out in engine.step(final_only=True):
                if out.finished:
                    finals[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"gen {generated / (time.perf_counter() - start):.1f} tok/s")
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - start
        self.last_stats = GenerateStats(len(order), sum(len(ids) for _, ids in tokenized), generated, elapsed)
        return [finals[rid] for rid in order]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool | Callable[..., Any] = True,
             add_generation_prompt: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Render each conversation with a chat template and generate, as vLLM's ``LLM.chat``.

        Args:
            messages: one conversation (a list of messages) or a list of them.
            chat_template: a template (Jinja source, or the path of a file holding one) instead
                of the model's own; the only way to chat with a model that has none.
            chat_template_kwargs: further template variables (``enable_thinking``, ...).
            tools: tool JSON schemas, handed to the template.
        Returns:
            One output per conversation; its ``prompt`` is the rendered text.
        """
        from attnserve.tokenizer import load_chat_template

        tok = self.get_tokenizer()
        template = load_chat_template(chat_template)
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [tok.apply_chat_template(m, add_generation_prompt=add_generation_prompt, tools=tools,
                                           chat_template=template, **(chat_template_kwargs or {}))
                   for m in batch]
        return self.generate([{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)}
                              for p in prompts], sampling_params, use_tqdm=use_tqdm)


def _progress(total: int, bar: bool | Callable[..., Any]):
    if not callable(bar):
        from tqdm import tqdm as bar

    return bar(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
