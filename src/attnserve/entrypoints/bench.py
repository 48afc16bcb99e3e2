"""``attnserve bench latency|throughput|serve``: vLLM's three end-to-end benchmarks.

- latency: one batch of fixed input and output lengths, run ``--num-iters`` times after a
  warm-up; average latency and percentiles.
- throughput: ``--num-prompts`` requests of random token ids, lengths fixed or uniform in
  ``[len * (1 - r), len * (1 + r)]``, ``ignore_eos``, all submitted at once; requests/s, tokens/s.
- serve: drives a running server with concurrent streaming clients at a request rate (Poisson
  arrivals, or all at once for ``inf``); TTFT, TPOT, ITL and end-to-end latency (mean, median,
  std, p99) and throughput. Its flags are ``vllm bench serve``'s: ``--backend openai|vllm|openai-chat``,
  ``--endpoint``, ``--dataset-name random|sharegpt`` with ``--dataset-path`` (a local ShareGPT
  JSON), ``--random-input-len``/``--random-output-len``/``--random-range-ratio``, ``--save-result``
  with ``--result-dir``/``--result-filename`` (vLLM's result keys); the older ``--input-len``,
  ``--output-len``, ``--range-ratio`` are aliases.

All three print a summary and write it with ``--output-json FILE``. latency and throughput
prompts are random token ids (no dataset, no tokenizer needed); serve sends random ids to the
completions endpoint as ids, and tokenizes text (ShareGPT, or decoded ids for the chat endpoint)
with the server's ``/tokenize``/``/detokenize`` or ``--tokenizer DIR``. Not here: kernel
benchmarks (``benchmarks/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from attnserve.entrypoints.engine_args import (
    add_engine_args,
    existing_file_arg,
    float_arg,
    int_arg,
    output_file_arg,
)

__all__ = ["add_bench_subparsers", "random_lengths", "random_prompts", "run_bench"]

_MAX_TOKENS = 1 << 26  # random prompt tokens one run builds in memory (a list of Python ints)


# --- shared -------------------------------------------------------------------------------------
def random_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """``n`` lengths, each ``mean`` or uniform in ``[mean * (1 - r), mean * (1 + r)]``, at least 1."""
    lo, hi = (
        max(1, math.floor(mean * (1 - range_ratio))),
        max(1, math.ceil(mean * (1 + range_ratio))),
    )
    return [rng.randint(lo, hi) for _ in range(n)]


def random_prompts(lengths: list[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def _percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _finish(result: dict[str, Any], args: argparse.Namespace, lines: list[str]) -> int:
    print("\n".join(lines))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.output_json}")
    return 0


def _llm(args: argparse.Namespace):
    from attnserve.entrypoints.engine_args import engine_kwargs
    from attnserve.entrypoints.llm import LLM

    return LLM(model=args.model, **engine_kwargs(args))


# --- latency ------------------------------------------------------------------------------------
def bench_latency(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from attnserve.sampling_params import SamplingParams

    llm = _llm(args)
    rng = random.Random(args.seed)
    vocab = llm.llm_engine.arch.vocab_size
    prompts = random_prompts([args.input_len] * args.batch_size, vocab, rng)
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    for _ in tqdm(range(args.num_iters_warmup), desc="Warm-up iterations"):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in tqdm(range(args.num_iters), desc="Timed iterations"):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    pcts = {str(p): _percentile(latencies, p) for p in (10, 25, 50, 75, 90, 99)}
    result = {
        "avg_latency": statistics.fmean(latencies),
        "latencies": latencies,
        "percentiles": pcts,
    }
    lines = [
        f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
        f"{args.num_iters} iterations",
        f"Avg latency: {result['avg_latency']:.4f} s",
    ]
    lines += [f"{p}% percentile latency: {v:.4f} s" for p, v in pcts.items()]
    return _finish(result, args, lines)


# --- throughput ---------------------------------------------------------------------------------
def bench_throughput(args: argparse.Namespace) -> int:
    from attnserve.sampling_params import SamplingParams

    llm = _llm(args)
    rng = random.Random(args.seed)
    in_lens = random_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
    out_lens = random_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
    prompts = random_prompts(in_lens, llm.llm_engine.arch.vocab_size, rng)
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n) for n in out_lens
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = sum(in_lens) + num_out
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(prompts),
        "total_num_tokens": total,
        "total_input_tokens": sum(in_lens),
        "total_output_tokens": num_out,
        "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": num_out / elapsed,
    }
    lines = [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({len(prompts)} requests in {elapsed:.2f} s)"
    ]
    return _finish(result, args, lines)


# --- serve --------------------------------------------------------------------------------------
@dataclass(slots=True)
class _RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# A request to send: the prompt (token ids, or text for a dataset or the chat endpoint), its
# length in tokens (as reported: the dataset's count, not the chat template's) and max tokens.
ServeRequest = tuple["list[int] | str", int, int]

# compact JSON (as pydantic writes it): a chunk with choices, usage, an error; another spelling
# is parsed in full, which is slower but still right
_TOKEN_EVENT, _USAGE, _ERROR = '"choices":[{', '"usage":{', 'data: {"error"'
# chat: the first event carries the assistant role and no token (sent before any is made): it is
# not timed; every later event with choices is a step's text, as in the completions stream
_ROLE = '"role":"'
_BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# vLLM's ShareGPT filter: prompt and output at least 4 tokens, prompt at most 1024, both 2048
_SHAREGPT_MIN, _SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048


def _is_role_event(chunk: dict) -> bool:
    return any((c.get("delta") or {}).get("role") for c in chunk.get("choices") or ())


async def _one_request(client: Any, model: str, endpoint: str, chat: bool, prompt: list[int] | str,
                       prompt_len: int, max_tokens: int) -> _RequestResult:
    res = _RequestResult(prompt_len=prompt_len)
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        payload.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens)
    else:
        payload.update(prompt=prompt, max_tokens=max_tokens)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                fast = _TOKEN_EVENT in line and _USAGE not in line and not line.startswith(_ERROR)
                if chat:
                    fast = fast and _ROLE not in line
                if fast:
                    # the common event, a choice's next text: timed, not parsed (the client
                    # must keep up with the server, tens of thousands of events a second)
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and not (chat and _is_role_event(chunk)):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        res.error = repr(e)
    return res


def serve_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """The (prompt ids, max tokens) of each request: read from ``--requests-file`` (a JSON list
    of such pairs), or random: lengths from ``--input-range``/``--output-range`` (uniform,
    inclusive) or ``--random-input-len``/``--random-output-len`` with ``--random-range-ratio``,
    ids uniform in ``[0, --vocab-size)``."""
    if args.requests_file:
        with open(args.requests_file, encoding="utf-8") as f:
            data = json.load(f)

        def valid(item) -> bool:  # [[token id, ...], max tokens]
            return (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and len(item[0]) > 0
                    and all(type(t) is int and t >= 0 for t in item[0]) and type(item[1]) is int and item[1] >= 1)

        if not isinstance(data, list) or not data or not all(valid(x) for x in data):
            raise ValueError(f"{args.requests_file}: a JSON list of [prompt token ids, max tokens] pairs, each "
                             "with at least one non-negative integer id and max tokens >= 1")
        return [(list(p), n) for p, n in data]
    rng = random.Random(args.seed)

    def lengths(mean: int, span: list[int] | None) -> list[int]:
        if span is None:
            return random_lengths(args.num_prompts, mean, args.range_ratio, rng)
        if not 1 <= span[0] <= span[1]:
            raise ValueError(f"a length range needs 1 <= LO <= HI, got {span}")
        return [rng.randint(*span) for _ in range(args.num_prompts)]

    in_lens, out_lens = lengths(args.input_len, args.input_range), lengths(args.output_len, args.output_range)
    return list(zip(random_prompts(in_lens, args.vocab_size, rng), out_lens))


class _Tokenizer:
    """Text <-> token ids for the ShareGPT dataset and the chat endpoint: ``--tokenizer DIR``
    (a local tokenizer.json) or the server's own ``/tokenize`` and ``/detokenize``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._local = self._client = None
        self._base = _base_url(args)
        if args.tokenizer:
            from attnserve.tokenizer import load_tokenizer

            self._local = load_tokenizer(args.tokenizer)
        else:
            import httpx

            self._client = httpx.Client(base_url=self._base, headers=_headers(args), timeout=120)

    def _post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the server at {self._base} to tokenize the prompts ({e!r}); "
                             "start it, or pass --tokenizer DIR") from None
        if resp.status_code != 200:
            raise ValueError(f"the server's {path} answered HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    def encode(self, text: str, special: bool) -> list[int]:
        if self._local is not None:
            return self._local.encode(text, add_special_tokens=special)
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"]

    def decode(self, ids: list[int]) -> str:
        if self._local is not None:
            return self._local.decode(ids, skip_special_tokens=False)
        return self._post("/detokenize", {"tokens": ids})["prompt"]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def sharegpt_requests(args: argparse.Namespace, tok: Any) -> list[ServeRequest]:
    """vLLM's ShareGPT sampling from the local ``--dataset-path``: conversations shuffled with
    ``--seed``; each one's first human turn is the prompt, the next gpt turn's token count the
    output length (or ``--sharegpt-output-len``); prompts or outputs under 4 tokens, prompts over
    1024 or both over 2048 are skipped; too few valid ones are repeated (oversampled)."""
    path = args.dataset_path
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of "
                         '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}')
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        turns = [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]
        ask = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if ask is None:
            continue
        answer = next((t for t in turns[ask + 1:] if t.get("from") in ("gpt", "assistant", "chatgpt")), None)
        if answer is not None:
            pairs.append((turns[ask]["value"], answer["value"]))
    random.Random(args.seed).shuffle(pairs)
    fixed = args.sharegpt_output_len
    out: list[ServeRequest] = []
    for prompt, completion in pairs:
        if len(out) >= args.num_prompts:
            break
        prompt_len = len(tok.encode(prompt, True))
        output_len = fixed or len(tok.encode(completion, False))
        if prompt_len < _SHAREGPT_MIN or (fixed is None and output_len < _SHAREGPT_MIN) or \
                prompt_len > _SHAREGPT_MAX_PROMPT or prompt_len + output_len > _SHAREGPT_MAX_TOTAL:
            continue
        out.append((prompt, prompt_len, output_len))
    if not out:
        raise ValueError(f"--dataset-path {path}: no conversation with a human turn then a gpt turn of "
                         f"{_SHAREGPT_MIN} to {_SHAREGPT_MAX_PROMPT} prompt tokens and at most "
                         f"{_SHAREGPT_MAX_TOTAL} in all")
    if len(out) < args.num_prompts:
        print(f"{len(out)} valid conversations in {path}: oversampled to {args.num_prompts} requests",
              file=sys.stderr)
        rng = random.Random(args.seed)
        out += [rng.choice(out) for _ in range(args.num_prompts - len(out))]
    return out


def sample_requests(args: argparse.Namespace) -> list[ServeRequest]:
    """Every request of the run as (prompt, prompt tokens, max tokens): ShareGPT conversations,
    a ``--requests-file`` or random ids; for the chat endpoint the ids are decoded to text and
    counted again (the count of that text, not of the chat template around it)."""
    needs_tok = args.dataset_name == "sharegpt" or args.backend == "openai-chat"
    tok = _Tokenizer(args) if needs_tok else None
    try:
        if args.dataset_name == "sharegpt":
            return sharegpt_requests(args, tok)
        reqs: list[ServeRequest] = [(p, len(p), n) for p, n in serve_requests(args)]
        if args.backend == "openai-chat":
            texts = [tok.decode(p) for p, _, _ in reqs]
            reqs = [(t, len(tok.encode(t, False)), n) for t, (_, _, n) in zip(texts, reqs)]
        return reqs
    finally:
        if tok is not None:
            tok.close()


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _drive(args: argparse.Namespace, reqs: list[ServeRequest], rate: float,
                 seed: int, show: bool) -> tuple[list[_RequestResult], float, float]:
    """Send ``reqs`` at ``rate`` (Poisson); the results, the start and end times."""
    import asyncio

    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    chat = args.backend == "openai-chat"
    async with httpx.AsyncClient(
        base_url=_base_url(args), headers=_headers(args), timeout=None, limits=limits
    ) as client:
        model = args.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)
        limit = asyncio.Semaphore(args.max_concurrency or max(len(reqs), 1))
        bar = tqdm(total=len(reqs), desc="Requests", unit="req", disable=not show)

        async def run(prompt: list[int] | str, prompt_len: int, max_tokens: int) -> _RequestResult:
            async with limit:
                result = await _one_request(client, model, args.endpoint, chat, prompt, prompt_len, max_tokens)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(run(*req)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
        bar.close()
        return list(results), start, end


def _drive_part(args: argparse.Namespace, reqs: list[ServeRequest], rate: float,
                seed: int, show: bool) -> tuple[list[_RequestResult], float, float]:
    import asyncio

    return asyncio.run(_drive(args, reqs, rate, seed, show))


def _drive_all(args: argparse.Namespace) -> tuple[list[_RequestResult], float]:
    """All requests, from ``--num-clients`` processes (each its own share of the requests and of
    the rate: a Python client parses a few tens of thousands of events a second at most)."""
    reqs = sample_requests(args)
    k = max(1, min(args.num_clients, len(reqs)))
    if k == 1:
        results, start, end = _drive_part(args, reqs, args.request_rate, args.seed, True)
        return results, end - start
    from concurrent.futures import ProcessPoolExecutor

    # clocks: perf_counter is system-wide on Linux (CLOCK_MONOTONIC), so the parts' times compare
    with ProcessPoolExecutor(k) as pool:
        parts = list(pool.map(_drive_part, [args] * k, [reqs[i::k] for i in range(k)],
                              [args.request_rate / k] * k, [args.seed + i for i in range(k)],
                              [i == 0 for i in range(k)]))
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts)


def _summary(name: str, values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": _percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
        f"p99_{name}_ms": _percentile(ms, 99),
    }


def _model_id(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    import httpx

    try:
        with httpx.Client(base_url=_base_url(args), headers=_headers(args), timeout=30) as client:
            return client.get("/v1/models").json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - only a name for the result file
        return "model"


def _result_path(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's ``--save-result`` file: ``--result-filename`` or
    ``BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json``, in ``--result-dir`` when given."""
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = f"{args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


def bench_serve(args: argparse.Namespace) -> int:
    now = datetime.now()
    results, duration = _drive_all(args)
    ok = [r for r in results if r.ok]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    model_id = _model_id(args) if args.save_result else args.model
    result: dict[str, Any] = {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint": args.endpoint,
        "dataset_name": args.dataset_name,
        "model_id": model_id,
        "num_prompts": len(results),
        "request_rate": args.request_rate if args.request_rate != math.inf else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
        **_summary("ttft", [r.ttft for r in ok]),
        **_summary("tpot", tpots),
        **_summary("itl", [x for r in ok for x in r.itl]),
        **_summary("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    errors = sorted({r.error for r in results if not r.ok})[:10]
    lines = [
        f"Successful requests: {len(ok)} (failed {result['failed']}) in {duration:.2f} s",
        f"Request throughput: {result['request_throughput']:.2f} req/s, output "
        f"{result['output_throughput']:.2f} tok/s, total {result['total_token_throughput']:.2f} tok/s",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(
            f"{name.upper():>5} ms: mean {result[f'mean_{name}_ms']:.2f}, median "
            f"{result[f'median_{name}_ms']:.2f}, p99 {result[f'p99_{name}_ms']:.2f}"
        )
    lines += [f"error: {e}" for e in errors]
    if args.save_result:
        path = _result_path(args, model_id, result["date"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        lines.append(f"results written to {path}")
    return _finish(result, args, lines)


# --- command line -------------------------------------------------------------------------------
def _lengths_args(p: argparse.ArgumentParser, prompts: int, vllm_names: bool) -> None:
    """``--num-prompts`` and the random lengths; ``bench serve`` names them as ``vllm bench serve``
    does (``--random-input-len``, ...), with the older names kept as aliases."""
    def names(flag: str) -> list[str]:
        return [f"--random-{flag}", f"--{flag}"] if vllm_names else [f"--{flag}", f"--random-{flag}"]

    p.add_argument("--num-prompts", type=int_arg(1, _MAX_TOKENS), default=prompts, help="requests to send")
    p.add_argument(*names("input-len"), dest="input_len", type=int_arg(1, _MAX_TOKENS), default=128,
                   help="prompt tokens per request (random dataset)")
    p.add_argument(*names("output-len"), dest="output_len", type=int_arg(1, _MAX_TOKENS), default=128,
                   help="tokens to generate per request (random dataset)")
    p.add_argument(
        *names("range-ratio"),
        dest="range_ratio",
        type=float_arg(0, 1, hi_open=True),
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)] (0: fixed)",
    )


def _endpoint_arg(text: str) -> str:
    if not text.startswith("/") or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be a URL path starting with /, got {text!r}")
    return text


def _name_arg(text: str) -> str:
    if not text.strip() or text.endswith(("/", os.sep)) or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a file name, got {text!r}")
    return text


def _dir_arg(text: str) -> str:
    if not text.strip() or (os.path.exists(text) and not os.path.isdir(text)) or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a directory (made if missing), got {text!r}")
    return text


def _existing_dir_arg(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no directory {text!r}")
    return text


def _serve_args(srv: argparse.ArgumentParser) -> None:
    _lengths_args(srv, 200, vllm_names=True)
    srv.add_argument("--backend", choices=sorted(_BACKENDS), default="openai",
                     help="openai (or vllm): /v1/completions; openai-chat: /v1/chat/completions")
    srv.add_argument("--endpoint", type=_endpoint_arg, default=None,
                     help="the API path (default: /v1/completions, /v1/chat/completions for openai-chat)")
    srv.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random",
                     help="random token ids, or ShareGPT conversations from --dataset-path")
    srv.add_argument("--dataset-path", type=existing_file_arg, default=None, metavar="FILE",
                     help="a local ShareGPT JSON: a list of {\"conversations\": [{\"from\": \"human\", "
                          "\"value\": ...}, {\"from\": \"gpt\", ...}]} (for --dataset-name sharegpt)")
    srv.add_argument("--sharegpt-output-len", type=int_arg(1, _MAX_TOKENS), default=None,
                     help="tokens to generate for every ShareGPT request (default: its gpt turn's length)")
    srv.add_argument("--tokenizer", type=_existing_dir_arg, default=None, metavar="DIR",
                     help="a local directory with tokenizer.json to count ShareGPT tokens and decode "
                          "chat prompts (default: the server's /tokenize and /detokenize)")
    srv.add_argument("--ignore-eos", action="store_true",
                     help="accepted for vLLM's command lines: every request here ignores EOS")
    srv.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    srv.add_argument("--host", default="127.0.0.1", help="the server's address")
    srv.add_argument("--port", type=int_arg(1, 65535), default=8000, help="the server's port")
    srv.add_argument("--model", default=None, help="default: the server's first model")
    srv.add_argument("--api-key", default=None, help="the server's API key (default: none)")
    srv.add_argument(
        "--request-rate",
        type=float_arg(0, lo_open=True, allow_inf=True),
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    srv.add_argument("--max-concurrency", type=int_arg(1, 1 << 20), default=None,
                     help="the most requests in flight at once (default: no limit)")
    srv.add_argument(
        "--vocab-size", type=int_arg(1, 1 << 31), default=1000, help="prompt token ids are drawn from [0, N)"
    )
    srv.add_argument("--seed", type=int_arg(0), default=0, help="the seed of prompts, lengths and arrivals")
    for which in ("input", "output"):
        srv.add_argument(f"--{which}-range", type=int_arg(1, _MAX_TOKENS), nargs=2, default=None, metavar=("LO", "HI"),
                         help=f"{which} lengths uniform in [LO, HI] (instead of --random-{which}-len, "
                              "--random-range-ratio)")
    srv.add_argument("--requests-file", default=None, metavar="FILE", type=existing_file_arg,
                     help="a JSON list of [prompt token ids, max tokens] pairs to send (instead of random ones)")
    srv.add_argument("--num-clients", type=int_arg(1, 1 << 10), default=1,
                     help="client processes, each sending its share of the requests at its share of the rate")
    srv.add_argument("--save-result", action="store_true",
                     help="write the results as JSON (vLLM's keys) to --result-dir/--result-filename")
    srv.add_argument("--result-dir", type=_dir_arg, default=None, metavar="DIR",
                     help="where --save-result writes (made if missing; default: the current directory)")
    srv.add_argument("--result-filename", type=_name_arg, default=None, metavar="NAME",
                     help="the --save-result file (default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    srv.set_defaults(bench_func=bench_serve)


def add_bench_subparsers(bench: argparse.ArgumentParser) -> None:
    """The ``latency``, ``throughput`` and ``serve`` subcommands of ``attnserve bench``."""
    sub = bench.add_subparsers(dest="bench_command", required=True)
    lat = sub.add_parser("latency", help="latency of one batch, repeated")
    lat.add_argument("--batch-size", type=int_arg(1, _MAX_TOKENS), default=8, help="prompts in the batch")
    lat.add_argument("--input-len", type=int_arg(1, _MAX_TOKENS), default=32, help="prompt tokens per request")
    lat.add_argument("--output-len", type=int_arg(1, _MAX_TOKENS), default=128, help="tokens to generate per request")
    lat.add_argument("--num-iters-warmup", type=int_arg(0, 1 << 20), default=3, help="untimed runs first")
    lat.add_argument("--num-iters", type=int_arg(1, 1 << 20), default=10, help="timed runs")
    thr = sub.add_parser("throughput", help="offline throughput of random-token requests")
    _lengths_args(thr, 1000, vllm_names=False)
    for p, func in ((lat, bench_latency), (thr, bench_throughput)):
        p.add_argument("--model", default=None, help="model directory (default: the demo model)")
        p.set_defaults(bench_func=func)
        add_engine_args(p)  # includes --seed
    srv = sub.add_parser("serve", help="drive a running server with streaming clients (vLLM's flag names)")
    _serve_args(srv)
    for p in (lat, thr, srv):
        p.add_argument("--output-json", default=None, metavar="FILE", type=output_file_arg,
                       help="also write the results to FILE as JSON (default: none)")


def run_bench(args: argparse.Namespace) -> int:
    _check_sizes(args)
    if args.bench_func is bench_serve:
        _check_serve(args)
    return args.bench_func(args)


def _check_serve(args: argparse.Namespace) -> None:
    """The flags of ``bench serve`` that go together, checked before anything is sent; sets the
    default ``--endpoint`` of the backend."""
    chat = args.backend == "openai-chat"
    if args.endpoint is None:
        args.endpoint = _BACKENDS[args.backend]
    elif chat != args.endpoint.rstrip("/").endswith("chat/completions") or \
            not args.endpoint.rstrip("/").endswith("completions"):
        raise ValueError(f"--endpoint {args.endpoint} does not fit --backend {args.backend} (openai, vllm: "
                         "/v1/completions; openai-chat: /v1/chat/completions)")
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a local ShareGPT JSON)")
        if args.requests_file:
            raise ValueError("--requests-file and --dataset-name sharegpt both give the requests: pass one")
    elif args.dataset_path is not None:
        raise ValueError("--dataset-path is read with --dataset-name sharegpt only")
    elif args.sharegpt_output_len is not None:
        raise ValueError("--sharegpt-output-len is for --dataset-name sharegpt only")
    if args.save_result:
        if args.result_dir:
            try:
                os.makedirs(args.result_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"--result-dir {args.result_dir}: cannot make it ({e.strerror})") from None
        target = _result_path(args, "model", "date") if args.result_filename else \
            os.path.join(args.result_dir or ".", "probe.json")
        try:
            output_file_arg(target)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--result-dir/--result-filename: {e}") from None
    elif args.result_dir or args.result_filename:
        print("note: --result-dir and --result-filename apply with --save-result only", file=sys.stderr)


def _check_sizes(args: argparse.Namespace) -> None:
    """The random prompts are built in memory: refuse more tokens than ``_MAX_TOKENS`` in all,
    naming the flags, before anything loads."""
    if args.bench_func is bench_latency:
        total, flags = args.batch_size * args.input_len, "--batch-size x --input-len"
    elif args.bench_func is bench_serve and (args.requests_file or args.dataset_name == "sharegpt"):
        return
    else:
        most = args.input_range[1] if getattr(args, "input_range", None) else \
            math.ceil(args.input_len * (1 + args.range_ratio))
        total, flags = args.num_prompts * most, "--num-prompts x --input-len"
        if args.bench_func is bench_serve:
            flags = "--num-prompts x --random-input-len"
    if total > _MAX_TOKENS:
        raise ValueError(f"{flags} ask for up to {total} prompt tokens; this benchmark builds at most "
                         f"{_MAX_TOKENS} in memory")
