"""The ``attnserve`` command: inspect, generate, serve, bench.

``attnserve ...`` and ``python -m attnserve ...`` are the same command. Subcommands import
what they need when they run, so ``inspect`` starts without loading the engine. The command
configures attnserve's log (stderr, ``ATTNSERVE_LOGGING_LEVEL``, default INFO) before it runs one:
the engine's start-up summary and the server's throughput lines are INFO records.
``generate`` and ``serve`` take vLLM's ``--config FILE.yaml``, a file of flags that the command
line overrides (``_apply_config_file``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from attnserve import __version__, env
from attnserve.entrypoints.engine_args import (
    HelpFormatter,
    add_engine_args,
    engine_kwargs,
    existing_file_arg,
    float_arg,
    gib_size_arg,
    int_arg,
    kv_cache_dtype_arg,
    output_file_arg,
)
from attnserve.logger import capture_warnings
from attnserve.logger import configure_logging as configure_package_logging
from attnserve.platforms import PLATFORM_NAMES

__all__ = ["build_parser", "configure_logging", "generate_sampling_params", "main"]

_MODEL_HELP = "a model directory, a Hugging Face hub id (org/name) or a shipped model name"


def configure_logging() -> None:
    """attnserve's log as the package configures it on import (``logger.py``: stderr at
    ``ATTNSERVE_LOGGING_LEVEL``, default INFO), again, so that a bad level is an error here, and
    Python's warnings in the same format (the command's process is attnserve's)."""
    configure_package_logging()
    capture_warnings()


def _inspect_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="mechanism, KV memory and backend choice of a model, without weights")
    p.add_argument("model", help="a model directory, its config.json, a Hugging Face hub id (org/name: "
                                 "only its config.json is read) or a shipped config name (e.g. "
                                 "deepseek-ai/DeepSeek-V3)")
    p.add_argument("--platform", choices=PLATFORM_NAMES, default=None, help="default: this machine")
    p.add_argument("--compute-capability", default=None, type=_capability_arg,
                   help="e.g. 9.0 (cuda/rocm without a device)")
    p.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg,
                   help="the KV cache's element type: auto (the model's dtype), fp8, bfloat16, float16 "
                        "or float32")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the model's dtype (auto: the checkpoint's on a GPU; on a CPU bfloat16 where it "
                        "has bf16 dot products, else float32)")
    p.add_argument("--attention-backend", default=None,
                   help="check this backend for every layer group (exits non-zero with every reason "
                        "it does not fit); default: the platform's first choice per group")
    p.add_argument("--block-size", type=int_arg(1, 1 << 16), default=None,
                   help="tokens per KV cache block (default: 64 for MLA models on CUDA, else 16)")
    p.add_argument("--disabled-kernels", default="", metavar="NAME[,NAME...]",
                   help="kernel variants the engine would not run (gluon, cpu_ext, mla.absorbed/gluon, "
                        "...): the report shows what runs instead")
    p.add_argument("--memory", type=float_arg(0, lo_open=True), default=None, metavar="GiB",
                   help="a KV cache budget: how many tokens and sequences it holds (default: not asked)")
    p.add_argument("--device-memory", "--gpu-memory", dest="device_memory", default=None, metavar="SIZE",
                   type=gib_size_arg,
                   help="a whole device's memory (80, 80GiB, 80GB): tokens that fit once the weights "
                        "(computed from the config, quantisation included) are loaded")
    p.add_argument("--gpu-memory-utilization", type=float_arg(0, 1, lo_open=True), default=0.9,
                   help="the share of --device-memory the engine may use (default: 0.9)")
    p.add_argument("--revision", default=None, help="a Hugging Face model id's branch, tag or commit")
    p.add_argument("--max-model-len", type=int_arg(1, 1 << 31), default=None,
                   help="the sequence length one sequence's bytes are given for (default: the "
                        "model config's context length, RoPE scaling applied)")
    p.add_argument("--tensor-parallel-size", type=int_arg(1, 1 << 10), default=1,
                   help="report one rank's KV bytes, state and sequences (--memory is per rank)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE.png", type=output_file_arg,
                   help="also draw KV memory per sequence against its length, as configured and as MHA / "
                        "GQA / MQA / MLA, into this PNG (the plot extra: matplotlib)")
    p.set_defaults(func=_run_inspect)


def _capability_arg(text: str) -> tuple[int, int]:
    """``--compute-capability``: MAJOR.MINOR, e.g. 9.0."""
    major, _, minor = text.strip().partition(".")
    if not (major.isdigit() and (minor.isdigit() or not minor)) or not 1 <= int(major) <= 99 or int(minor or 0) > 99:
        raise argparse.ArgumentTypeError(f"must be MAJOR.MINOR, such as 9.0, got {text!r}")
    return int(major), int(minor or 0)


def _tool_call_parser_arg(text: str) -> str:
    from attnserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    if text not in TOOL_PARSERS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(sorted(TOOL_PARSERS))}, got {text!r}")
    return text


def _reasoning_parser_arg(text: str) -> str:
    from attnserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    if text not in REASONING_PARSERS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(sorted(REASONING_PARSERS))}, got {text!r}")
    return text


def _run_inspect(args: argparse.Namespace) -> int:
    from attnserve import env
    from attnserve.entrypoints.inspect import build_report, dumps, plot_kv_memory
    from attnserve.platforms import current_platform, get_platform

    cc = args.compute_capability  # (major, minor), parsed by _capability_arg
    platform = get_platform(args.platform, cc) if args.platform else current_platform()
    device_gib = args.device_memory  # GiB, parsed by gib_size_arg
    # a backend that does not fit (BackendSelectionError) is a ValueError: main prints it, exit 2
    report = build_report(args.model, platform, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          attention_backend=args.attention_backend, memory_gib=args.memory,
                          max_model_len=args.max_model_len, block_size=args.block_size,
                          use_mla=not env.mla_disabled(), tensor_parallel_size=args.tensor_parallel_size,
                          device_memory_gib=device_gib, gpu_memory_utilization=args.gpu_memory_utilization,
                          revision=args.revision, disabled_kernels=args.disabled_kernels)
    print(dumps(report) if args.json else report.render())
    if args.plot:
        plot_kv_memory(report, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline batch)")
    p.add_argument("--model", default=None, help=f"{_MODEL_HELP} (default: the shipped demo model)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt; repeat for a batch")
    p.add_argument("--prompts-file", default=None, type=existing_file_arg, help="a file with one prompt per line")
    # sampling: a flag given, else the model's generation_config.json, else _GENERATE_FALLBACKS
    p.add_argument("--max-tokens", type=int_arg(1), default=None,
                   help="tokens to generate per prompt (default: the model's max_new_tokens, else 32)")
    p.add_argument("--temperature", type=float_arg(0), default=None,
                   help="sampling temperature, 0: greedy (default: the model's, else 0)")
    p.add_argument("--top-p", type=float_arg(0, 1, lo_open=True), default=None,
                   help="nucleus sampling: the smallest set of tokens of this total probability "
                        "(default: the model's, else 1)")
    p.add_argument("--top-k", type=int_arg(-1), default=None,
                   help="sample among the k likeliest tokens, 0 or -1: all (default: the model's, else all)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="with --chat: this template (a file, or the Jinja template itself) instead of "
                        "the model's own")
    _add_config_arg(p)
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


# generate's sampling where neither a flag nor the model's generation_config.json sets it
_GENERATE_FALLBACKS = {"max_tokens": 32, "temperature": 0.0}


def generate_sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any]):
    """The flags given, over the model's generation_config.json defaults (``--generation-config
    vllm``: none), over ``_GENERATE_FALLBACKS``: what the generation_config warning promises."""
    from attnserve.sampling_params import SamplingParams

    flags = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k")
             if getattr(args, k) is not None}
    return SamplingParams(**{**_GENERATE_FALLBACKS, **model_defaults, **flags}, ignore_eos=args.ignore_eos,
                          seed=args.seed)


def _run_generate(args: argparse.Namespace) -> int:
    from attnserve.entrypoints.llm import LLM
    from attnserve.presets import DEFAULT_MODEL

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = ["def fibonacci(n):"]
    llm = LLM(model=args.model or DEFAULT_MODEL, **engine_kwargs(args))
    params = generate_sampling_params(args, llm.llm_engine.generation_config.sampling)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1,
                        chat_template=args.chat_template)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outs):
        print(f"--- prompt: {prompt!r}")
        print(prompt + out.outputs[0].text if not args.chat else out.outputs[0].text)
    s = llm.last_stats
    print(f"Throughput: {s.num_requests} requests in {s.elapsed:.2f} s, prompt {s.prompt_throughput:.1f} tok/s, "
          f"generation {s.generation_throughput:.1f} tok/s")
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, ...)")
    p.add_argument("model", nargs="?", default=None,
                   help=f"{_MODEL_HELP} (default: the shipped demo model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as vLLM's --model: the same as the positional MODEL (default: that)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int_arg(0, 65535), default=8000, help="the port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /ping (default: "
                        "$ATTNSERVE_API_KEY, which other users of the machine cannot read in the "
                        "process list)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may ask for; the first is the one the server reports "
                        "(default: MODEL)")
    p.add_argument("--max-request-body-bytes", type=int_arg(1), default=16 << 20,
                   help="larger request bodies get a 413 (default: 16 MiB)")
    p.add_argument("--max-n", type=int_arg(1), default=128,
                   help="the most completions one request may ask per prompt (default: 128)")
    p.add_argument("--max-prompts", type=int_arg(1), default=1024,
                   help="the most prompts one completion request may carry (default: 1024)")
    p.add_argument("--max-sequences-per-request", type=int_arg(1), default=4096,
                   help="the most sequences one request may ask for: prompts x n (or x best_of) "
                        "(default: 4096)")
    p.add_argument("--max-stop-strings", type=int_arg(1), default=256,
                   help="the most stop strings one request may carry (default: 256)")
    p.add_argument("--max-stop-chars", type=int_arg(1), default=16 << 10,
                   help="the most characters a request's stop strings may have in all (default: 16 Ki)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates sent in requests (chat_template, or "
                        "chat_template_kwargs.chat_template), bounded by the three flags below")
    p.add_argument("--max-chat-template-bytes", type=int_arg(1), default=64 << 10,
                   help="a larger template sent in a request gets a 400 (default: 64 KiB)")
    p.add_argument("--chat-template-timeout", type=float_arg(0, lo_open=True), default=2.0, metavar="SECONDS",
                   help="rendering a template sent in a request stops with a 400 after this long "
                        "(default: 2)")
    p.add_argument("--max-chat-template-output-chars", type=int_arg(1), default=16 << 20,
                   help="a template sent in a request may build no value and no output longer than "
                        "this, in characters (default: 16 Mi)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a chat template (a file, or the Jinja template itself) used instead of the "
                        "model's own (default: the model's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request has tools): the model '
                        "writes its calls in its own format and --tool-call-parser finds them (default: "
                        '"auto" is refused; "required" and named functions are served either way)')
    p.add_argument("--tool-call-parser", default=None, metavar="NAME", type=_tool_call_parser_arg,
                   help="the model's tool-call format, for --enable-auto-tool-choice: hermes "
                        "(<tool_call>{...}</tool_call>: Hermes 2 Pro/3, Qwen2.5, Qwen3), llama3_json "
                        "(Llama 3.x/4 JSON; llama4_json too), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]: "
                        "Llama 3.2/4 pythonic), deepseek_v3, qwen3_coder (<function=...>: Qwen3-Coder, "
                        "Qwen3.5), openai (GPT-OSS harmony) (default: none)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME", type=_reasoning_parser_arg,
                   help="split the model's reasoning off chat outputs into reasoning_content: deepseek_r1 "
                        "(<think>...</think>, the <think> optional: DeepSeek R1, QwQ), qwen3 (Qwen3, "
                        "Qwen3.5: no <think> and none opened by the prompt, no reasoning), openai_gptoss "
                        "(GPT-OSS harmony's analysis channel) (default: none)")
    p.add_argument("--max-connections", type=int_arg(1), default=4096,
                   help="the most open connections; past it a new one replaces the oldest idle one (no "
                        "request in flight), or is closed when all are busy; lowered to what the "
                        "open-file limit (RLIMIT_NOFILE) leaves room for (default: 4096)")
    p.add_argument("--header-timeout", type=float_arg(0, lo_open=True), default=10.0, metavar="SECONDS",
                   help="a connection that has not sent a whole request head this long after it opened "
                        "(or after the first byte of its next request) is closed (default: 10)")
    p.add_argument("--body-timeout", type=float_arg(0, lo_open=True), default=60.0, metavar="SECONDS",
                   help="a request body not received whole this long after its head gets a 408 "
                        "(default: 60)")
    p.add_argument("--timeout-keep-alive", type=float_arg(0, lo_open=True), default=5.0, metavar="SECONDS",
                   help="an idle connection is closed after waiting this long for its next request "
                        "(default: 5)")
    p.add_argument("--shutdown-timeout", type=float_arg(0), default=5.0, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, running requests get this long to finish; then streams "
                        "end with an error event and [DONE], other requests with a 503 (default: 5; "
                        "0: at once)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's log level (attnserve's own: $ATTNSERVE_LOGGING_LEVEL)")
    p.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="run the engine on a thread of the server's process (default: in a process of "
                        "its own, so HTTP and the engine's host work do not share one core)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no throughput lines in the log (default: one every "
                        "$ATTNSERVE_LOG_STATS_INTERVAL seconds, 10, while serving)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one INFO line per request the engine starts: its id, prompt length and "
                        "sampling params (default: off)")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=False,
                   help="vLLM's older spelling of the default: no request lines")
    p.add_argument("--allowed-origins", type=_json_list_arg, default=None, metavar="JSON",
                   help='CORS: the origins whose web pages may call the API, a JSON list: \'["https://'
                        'app.example"]\', or \'["*"]\' for every one (default: none, no CORS headers; '
                        "vLLM's default is every origin)")
    p.add_argument("--allowed-methods", type=_json_list_arg, default=None, metavar="JSON",
                   help='CORS, with --allowed-origins: the methods allowed, a JSON list (default: ["*"])')
    p.add_argument("--allowed-headers", type=_json_list_arg, default=None, metavar="JSON",
                   help='CORS, with --allowed-origins: the request headers allowed, a JSON list '
                        '(default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS, with --allowed-origins: pages may send cookies and Authorization "
                        "(default: off)")
    _add_config_arg(p)
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _json_list_arg(text: str) -> list[str]:
    """An argparse ``type``: a JSON list of strings (vLLM's CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise argparse.ArgumentTypeError(f'must be a JSON list of strings, such as \'["*"]\', got {text!r}')
    return value


def _cors(args: argparse.Namespace) -> dict[str, Any] | None:
    """The CORS middleware's settings (starlette's ``CORSMiddleware`` keywords), or None: no CORS
    headers, unless --allowed-origins names the origins (vLLM allows every one by default)."""
    if args.allowed_origins is None:
        given = [f for f, v in (("--allowed-methods", args.allowed_methods), ("--allowed-headers",
                 args.allowed_headers), ("--allow-credentials", args.allow_credentials or None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --allowed-origins: without it the server sends no "
                             "CORS headers (vLLM's default origins are every one: --allowed-origins '[\"*\"]')")
        return None
    return {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods or ["*"],
            "allow_headers": args.allowed_headers or ["*"], "allow_credentials": args.allow_credentials}


def _serve_model(args: argparse.Namespace) -> str | None:
    """The positional MODEL or vLLM's --model (None: neither); both, differing, is an error, and
    so are several served names without a model (the names may have taken MODEL in)."""
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"two models: '{args.model}' (positional) and --model '{args.model_flag}'; give one")
    model = args.model or args.model_flag
    if model is None and len(args.served_model_name or ()) > 1:
        raise ValueError(f"--served-model-name {' '.join(args.served_model_name)} and no model: if the last "
                         "name is the model, give it before --served-model-name (or as --model)")
    return model


def _run_serve(args: argparse.Namespace) -> int:
    from attnserve.entrypoints.openai.api_server import run_server
    from attnserve.entrypoints.openai.connections import ConnectionLimits
    from attnserve.entrypoints.openai.protocol import ServerLimits
    from attnserve.presets import DEFAULT_MODEL

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("attnserve serve: --enable-auto-tool-choice needs --tool-call-parser NAME "
                         "(the model's tool-call format, e.g. hermes)")
    model, cors = _serve_model(args), _cors(args)
    run_server(model or DEFAULT_MODEL, engine_kwargs(args), host=args.host, port=args.port,
               api_key=args.api_key or env.api_key(), served_model_name=args.served_model_name,
               log_level=args.uvicorn_log_level,
               limits=ServerLimits(args.max_request_body_bytes, args.max_n, args.max_prompts,
                                   args.trust_request_chat_template, args.max_chat_template_bytes,
                                   args.chat_template_timeout, args.max_chat_template_output_chars,
                                   max_sequences_per_request=args.max_sequences_per_request,
                                   max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars),
               log_stats_interval=None if args.disable_log_stats else env.log_stats_interval(),
               chat_template=args.chat_template,
               tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
               reasoning_parser=args.reasoning_parser,
               frontend_multiprocessing=not args.disable_frontend_multiprocessing,
               connection_limits=ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout,
                                                  args.timeout_keep_alive, args.shutdown_timeout),
               cors=cors, log_requests=args.enable_log_requests)
    return 0


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE.yaml", type=existing_file_arg,
                   help="flags from a YAML file, as vLLM's --config: each key a flag's name (max-model-len, "
                        "max_model_len or --max-model-len) and its value; flags on the command line win "
                        "(default: none)")


def _config_flags(path: str, data: object, sub: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """The command-line flags a --config file's mapping stands for, and its model (None: none).

    A true boolean gives the flag (``--no-X`` for a false ``--X/--no-X`` one; false leaves a plain
    switch off); a list gives one value each to a flag of several values, else JSON, as a dict
    does; null leaves the flag out. A key that names no flag of the command is an error."""
    if data is None:
        return [], None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    flags: list[str] = []
    model = None
    for key, value in data.items():
        name = "--" + str(key).lstrip("-").replace("_", "-")
        action = sub._option_string_actions.get(name)
        if name == "--model":
            model = None if value is None else str(value)
            continue
        if action is None or name in ("--config", "--help"):
            raise ValueError(f"--config {path}: unknown key '{key}': `{sub.prog}` has no flag {name}")
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} is a switch: true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):  # --X or --no-X, whichever the key is
                on, off = action.option_strings
                flags.append(on if value == (name == on) else off)
            elif value:
                flags.append(name)
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            flags += [name, *map(str, value)]
        elif isinstance(value, list) and isinstance(action, argparse._AppendAction):  # --prompt A --prompt B
            flags += [part for v in value for part in (name, str(v))]
        elif isinstance(value, (list, dict)):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    return flags, model


def _apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       argv: list[str]) -> argparse.Namespace:
    """``args`` with the flags of ``--config FILE.yaml`` where the command line gives none (vLLM's
    semantics): the file's values are checked as flags are, then become the subcommand's
    defaults and ``argv`` is parsed again."""
    import yaml

    path = args.config
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read YAML: {' '.join(str(e).split())}") from None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    flags, model = _config_flags(path, data, sub)
    sub.exit_on_error = False  # a bad value in the file: an ArgumentError, said with the file's name
    try:
        from_file = sub.parse_args(flags)
    except argparse.ArgumentError as e:
        raise ValueError(f"--config {path}: {e}") from None
    finally:
        sub.exit_on_error = True
    dests = {sub._option_string_actions[f].dest for f in flags if f in sub._option_string_actions}
    sub.set_defaults(**{d: getattr(from_file, d) for d in dests})
    args = parser.parse_args(argv)
    if model is not None and args.model is None and getattr(args, "model_flag", None) is None:
        args.model = model
    return args


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from attnserve.entrypoints.bench import add_bench_subparsers  # argparse only at import

    p = sub.add_parser("bench", help="benchmarks: latency, throughput (offline), serve (a server)")
    add_bench_subparsers(p)
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from attnserve.entrypoints.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description="attnserve: an attention-first LLM engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _inspect_parser(sub)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _set_formatter(parser)
    return parser


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's --help shows the options' defaults."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                _set_formatter(p)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            args = _apply_config_file(parser, args, argv)
        configure_logging()
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
