"""The engine flags of the command line (vLLM's names), shared by generate, serve and bench,
and the argparse value types every subcommand's flags use.

``add_engine_args`` adds them to a parser, with vLLM's flags that attnserve takes only so that
vLLM's command lines run (``config.VLLM_ONLY_OPTIONS``: logged where they change nothing,
refused where they ask for what attnserve does not do); ``engine_kwargs`` turns the parsed
ones into the ``LLM(...)`` / ``EngineConfig.from_kwargs`` keywords, leaving out those not
given (so the config's defaults, which the help texts quote, apply). ``HelpFormatter`` shows every option's
default in ``--help``. The value types (``int_arg``, ``float_arg``, ``device_arg``, ...) check a
flag's value as it is parsed, so a bad one ends in argparse's one-line error naming the flag
(exit 2) before anything loads; the configs check the same keywords again for ``LLM(...)``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import fields

from attnserve.config import (
    DEVICE_PATTERN,
    KV_CACHE_DTYPES,
    CacheConfig,
    ModelConfig,
    OffloadConfig,
)

__all__ = ["HelpFormatter", "add_engine_args", "device_arg", "engine_kwargs", "existing_file_arg", "float_arg",
           "gib_size_arg", "int_arg", "kv_cache_dtype_arg", "output_file_arg"]

INT64_MAX = 2**63 - 1


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    return f" {'<' if hi_open else '<='} {hi}" if hi is not None else ""


def int_arg(lo: int | None = None, hi: int | None = INT64_MAX) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (the default ``hi``: what an int64 holds)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer{_range_text(lo, hi)}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_arg(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              hi_open: bool = False, allow_inf: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a number in the range (never NaN; infinite only with ``allow_inf``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = not math.isnan(value) and (allow_inf or math.isfinite(value))
        ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
        ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
        if not ok:
            finite = "" if allow_inf else "finite "
            raise argparse.ArgumentTypeError(f"must be a {finite}number{_range_text(lo, hi, lo_open, hi_open)}, "
                                             f"got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def device_arg(text: str) -> str:
    """An argparse ``type``: cpu, cuda or cuda:N."""
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def gib_size_arg(text: str) -> float:
    """An argparse ``type``: a positive, finite memory size in GiB (80, 80GiB, 80G, 80GB)."""
    from attnserve.entrypoints.inspect import parse_gib

    try:
        gib = parse_gib(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not math.isfinite(gib):
        raise argparse.ArgumentTypeError(f"must be a finite memory size, got {text!r}")
    return gib


def existing_file_arg(text: str) -> str:
    """An argparse ``type``: a regular file that can be read."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"no readable file {text!r}")
    return text


def output_file_arg(text: str) -> str:
    """An argparse ``type``: a file that can be written (its directory exists and is writable;
    checked now, not after a benchmark has run)."""
    parent = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or os.path.isdir(text) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write a file at {text!r} (no such writable directory, or a "
                                         "directory)")
    return text


def _generation_config_arg(text: str) -> str:
    if text not in ("auto", "vllm") and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be auto, vllm or a directory holding generation_config.json, "
                                         f"got {text!r}")
    return text


def kv_cache_dtype_arg(text: str) -> str:
    """An argparse ``type``: one of the KV cache dtype names."""
    if text.lower() not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {text!r}")
    return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: ...)" to an option's help unless the help already says its default, or
    the default is None (those options say in words what not giving them means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _default(config: type, name: str) -> object:
    return next(f.default for f in fields(config) if f.name == name)


def _defaults_text(i: int) -> str:
    """The platform defaults of one batch limit (0: max_num_seqs, 1: max_num_batched_tokens),
    as ``engine/batch_limits.BATCH_DEFAULTS`` holds them: "offline/server" per device class."""
    from attnserve.engine.batch_limits import BATCH_DEFAULTS, LARGE_GPU_GIB

    label = {"gpu-large": f"GPU >= {LARGE_GPU_GIB} GiB", "gpu": "smaller GPU", "cpu": "CPU"}
    return "; ".join(f"{label[c]} {BATCH_DEFAULTS[(c, 'llm')][i]}/{BATCH_DEFAULTS[(c, 'server')][i]}"
                     for c in label) + " (offline/server); `attnserve inspect` and the start-up log show the choice"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate, serve and bench (vLLM's names)."""
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None,
                   help="the tokenizer's directory when it is not the model's (default: the model's)")
    g.add_argument("--revision", default=None,
                   help="the revision (branch, tag or commit) of a Hugging Face hub model id; a local "
                        "directory has none (default: the hub's default branch)")
    g.add_argument("--attention-backend", default=None,
                   help="the attention backend of every layer group, e.g. TRITON_ATTN, TORCH_SDPA, "
                        "TRITON_MLA (default: the platform's first choice per group, as `attnserve "
                        "inspect` shows it)")
    g.add_argument("--disabled-kernels", default=None, metavar="NAME[,NAME...]",
                   help="kernel variants not to run, by name (gluon, cpu_ext, triton_tma, ...), "
                        "operation/name (mla.absorbed/gluon) or technology (gluon, triton, cpu_ext); "
                        "the next variant of each operation runs instead, as `attnserve inspect` "
                        "shows (default: none)")
    g.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg,
                   help="the KV cache's element type: auto (the model's dtype), fp8, bfloat16, "
                        "float16 or float32")
    g.add_argument("--block-size", type=int_arg(1, 1 << 16), default=_default(CacheConfig, "block_size"),
                   help="tokens per KV cache block (a power of two; default: 64 for MLA models on "
                        "CUDA, else 16)")
    g.add_argument("--max-model-len", type=int_arg(1, 1 << 31), default=None,
                   help="the longest sequence, prompt and output together (default: the model "
                        "config's context length)")
    g.add_argument("--max-num-seqs", type=int_arg(1, 1 << 20), default=None,
                   help=f"the most requests in one batch (default: by platform, {_defaults_text(0)})")
    g.add_argument("--max-num-batched-tokens", type=int_arg(1, 1 << 31), default=None,
                   help="the most tokens one step computes; longer prompts are prefilled in chunks "
                        f"(default: by platform, {_defaults_text(1)})")
    g.add_argument("--gpu-memory-utilization", type=float_arg(0, 1, lo_open=True), default=None,
                   help="the share of the GPU's memory the engine may use for weights, activations "
                        f"and KV cache (default: {_default(CacheConfig, 'gpu_memory_utilization')})")
    g.add_argument("--kv-cache-memory", type=float_arg(0, lo_open=True), default=None, metavar="GiB",
                   help="KV cache size in GiB (CPU; default: a share of free memory)")
    g.add_argument("--num-gpu-blocks-override", type=int_arg(2), default=None,
                   help="this many KV cache blocks instead of what memory allows (default: sized "
                        "from memory)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes already computed")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="auto, safetensors: the checkpoint's weights; dummy: seeded random weights")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="the model's dtype (auto: the checkpoint's on a GPU; on a CPU bfloat16 where it "
                        "has bf16 dot products, else float32; half: float16, float: float32, as in vLLM)")
    g.add_argument("--max-logprobs", type=int_arg(-1), default=_default(ModelConfig, "max_logprobs"),
                   help="the most logprobs (and prompt_logprobs) one request may ask for; more is "
                        "refused; -1: no cap")
    g.add_argument("--kv-offloading-size", type=float_arg(0, lo_open=True), default=None, metavar="GiB",
                   help="host memory or disk for KV blocks evicted from the device, in GiB "
                        "(default: no offloading)")
    g.add_argument("--kv-offloading-backend", default=None, choices=["host", "disk"],
                   help="where offloaded KV blocks live (default: "
                        f"{_default(OffloadConfig, 'kv_offloading_backend')})")
    g.add_argument("--kv-offloading-dir", default=None,
                   help="the directory of the disk offload tier (default: none; the disk backend "
                        "needs one)")
    g.add_argument("--kv-offload-sparse-latents", action="store_true", default=None,
                   help="sparse MLA (DSA): keep latent rows in host memory, indexer keys on the "
                        "device (default: off)")
    g.add_argument("--kv-offload-sparse-latents-size", type=float_arg(0, lo_open=True), default=None, metavar="GiB",
                   help="host memory for those latent rows (default: half of what is available)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int_arg(1, 1 << 10), default=None,
                   help="GPUs to split the model over (default: 1)")
    g.add_argument("--device", default=None, type=device_arg,
                   help="cpu, cuda or cuda:N (default: this machine's platform)")
    g.add_argument("--seed", type=int_arg(0), default=0,
                   help="the seed of unseeded sampling and of dummy weights")
    g.add_argument("--streaming-sinks", type=int_arg(0, 1 << 31), default=None,
                   help="StreamingLLM: keep the first N tokens of every sequence (with "
                        "--streaming-window; default: off)")
    g.add_argument("--streaming-window", type=int_arg(1, 1 << 31), default=None,
                   help="StreamingLLM: and the last W tokens (with --streaming-sinks; default: off)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs (default: graphs on CUDA)")
    g.add_argument("--skip-weight-check", dest="check_weights_finite", action="store_false", default=None,
                   help="load weights without checking them for NaN and Inf (default: checked, one "
                        "pass over them on the device)")
    g.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR", type=_generation_config_arg,
                   help="the model's generation_config.json: 'auto' applies its EOS ids and default "
                        "sampling (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                        "where a request sets none; 'vllm' ignores it; or a directory holding one "
                        "(default: auto)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for CUDA "
                        "where the model allows it)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill a prompt longer than --max-num-batched-tokens over several steps; "
                        "without, every prompt is prefilled in one step (the token budget is raised to "
                        "max_model_len) (default: on)")
    _add_vllm_only_args(p)


def _add_vllm_only_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine flags that attnserve takes only so that vLLM's command lines run unchanged
    (``config.VLLM_ONLY_OPTIONS``): those that change nothing here are logged, once, with why;
    those that ask for what attnserve does not do are refused with the reason."""
    g = p.add_argument_group("vLLM's flags that change nothing here (logged) or are refused")
    g.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="changes nothing: attnserve never runs code that comes with a checkpoint "
                        "(default: off)")
    g.add_argument("--tokenizer-mode", default=None, choices=["auto", "hf", "slow", "mistral", "custom"],
                   help="auto and hf change nothing (the model's tokenizer.json); slow, mistral and custom "
                        "are refused (default: auto)")
    g.add_argument("--swap-space", type=float_arg(0), default=None, metavar="GiB",
                   help="changes nothing: preempted requests are recomputed, not swapped (--kv-offloading-"
                        "size keeps evicted prefix blocks in host memory) (default: none)")
    g.add_argument("--max-seq-len-to-capture", type=int_arg(1, 1 << 31), default=None,
                   help="changes nothing: CUDA graphs serve every context length (default: max_model_len)")
    g.add_argument("--compilation-config", "-O", default=None, metavar="JSON_OR_LEVEL",
                   help="changes nothing: attnserve does not torch.compile the model (default: none)")
    g.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                   help="changes nothing: tensor parallelism all-reduces through NCCL only (default: off)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "uni", "ray", "external_launcher"],
                   help="mp and uni change nothing (attnserve starts its ranks' processes itself); ray and "
                        "external_launcher are refused (torchrun: python -m attnserve.entrypoints.torchrun) "
                        "(default: mp)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int_arg(1, 1 << 10), default=None,
                   help="1 only: pipeline parallelism is not implemented (default: 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int_arg(1, 1 << 10), default=None,
                   help="1 only: data parallelism is not implemented; run one server per replica (default: 1)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="refused: speculative decoding is not implemented (default: none)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="refused: LoRA adapters are not supported (default: off)")
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="the checkpoint's quantisation method, checked against its config.json: fp8, "
                        "fbgemm_fp8, compressed-tensors or mxfp4 (loaded dequantised to --dtype); attnserve "
                        "does not quantise an unquantised checkpoint as it loads (default: the checkpoint's own)")


_ENGINE_KEYS = ("tokenizer", "revision", "attention_backend", "disabled_kernels", "kv_cache_dtype", "block_size", "max_model_len",
                "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory",
                "num_gpu_blocks_override", "enable_prefix_caching", "load_format", "dtype", "max_logprobs",
                "kv_offloading_size", "kv_offloading_backend", "kv_offloading_dir",
                "kv_offload_sparse_latents", "kv_offload_sparse_latents_size", "tensor_parallel_size",
                "device", "seed", "streaming_sinks", "streaming_window", "enforce_eager", "check_weights_finite",
                "async_scheduling", "generation_config", "enable_chunked_prefill",
                # vLLM's flags of config.VLLM_ONLY_OPTIONS
                "trust_remote_code", "tokenizer_mode", "swap_space", "max_seq_len_to_capture",
                "compilation_config", "disable_custom_all_reduce", "distributed_executor_backend",
                "pipeline_parallel_size", "data_parallel_size", "speculative_config", "enable_lora",
                "quantization")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k, None) is not None}
