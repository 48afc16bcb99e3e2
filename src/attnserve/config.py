"""Engine configuration: frozen dataclasses, composed (not inherited) into ``EngineConfig``.

Configuration is data: this module imports nothing of the engine. ``EngineConfig.from_kwargs``
takes the same keywords as ``LLM(...)`` and the command line (vLLM's names, with underscores),
and vLLM's options that attnserve has no use for (``VLLM_ONLY_OPTIONS``): accepted with one log
line where they change nothing, refused with the reason where they ask for what it does not do.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "CacheConfig",
    "DEVICE_PATTERN",
    "EngineConfig",
    "KV_CACHE_DTYPES",
    "ModelConfig",
    "OffloadConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "USAGE_CONTEXTS",
    "QUANTIZATION_METHODS",
    "VLLM_ONLY_OPTIONS",
    "VllmOnlyOption",
]

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names of two of them
# the cache dtype names (kvcache/spec.py maps each to a storage dtype)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32",
                   "float")
DEVICE_PATTERN = r"cpu|cuda(:\d+)?"
_INT64_MAX = 2**63 - 1


def _check_int(name: str, value: Any, lo: int, hi: int = _INT64_MAX, optional: bool = True) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is an int in [lo, hi] (or None)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{' (or None)' if optional else ''}, "
                         f"got {value!r}")


def _check_positive(name: str, value: Any, unit: str = "", optional: bool = True) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is a positive finite number (or None)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number{unit}, got {value!r}")


def _check_str(name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string{' (or None)' if optional else ''}, got {value!r}")


def _check_bool(name: str, value: Any, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} must be True or False, got {value!r}")
# who builds the engine: the offline ``LLM`` class (and generate, bench) or the OpenAI server;
# the batch limits' defaults depend on it (``engine/batch_limits.py``)
USAGE_CONTEXTS = ("llm", "server")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    # auto: the checkpoint's dtype; on CPU bfloat16 where the CPU has native bf16 dot products
    # (AVX512_BF16, AMX-BF16), else float32 (engine/plan.resolve_dtype): pass float32 for exactness
    dtype: str = "auto"
    load_format: str = "auto"  # auto | safetensors | dummy
    max_model_len: int | None = None
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    revision: str | None = None  # a hub model id's branch, tag or commit (None: the default branch)
    # generation_config.json: "auto" (the model's EOS ids and default sampling), "vllm" (ignored),
    # or a directory holding one
    generation_config: str = "auto"
    seed: int = 0
    device: str | None = None  # cpu | cuda | cuda:N; None: this machine's platform
    served_model_name: str | None = None
    enforce_eager: bool = False  # no CUDA graphs
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask; -1: no cap
    check_weights_finite: bool = True  # NaN/Inf in the loaded weights is an error (one pass on the device)
    # vLLM's quantization: the checkpoint's quant_method, checked against its config.json (None: any)
    quantization: str | None = None

    def __post_init__(self) -> None:
        _check_str("model", self.model, optional=False)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: attnserve loads checkpoints "
                             f"quantised with {', '.join(QUANTIZATION_METHODS)} (their quantization_config "
                             "names the method; the option may be left out), dequantised to the model dtype")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got '{self.dtype}'")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got '{self.load_format}'")
        _check_int("max_model_len", self.max_model_len, 1, 1 << 31)
        for name in ("tokenizer", "revision", "served_model_name"):
            _check_str(name, getattr(self, name))
        _check_str("generation_config", self.generation_config, optional=False)
        _check_int("seed", self.seed, -_INT64_MAX - 1, optional=False)
        if self.device is not None and not (isinstance(self.device, str) and re.fullmatch(DEVICE_PATTERN, self.device)):
            raise ValueError(f"device must be cpu, cuda or cuda:N (or None: this machine's platform), got "
                             f"{self.device!r}")
        _check_bool("enforce_eager", self.enforce_eager)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be a non-negative integer or -1 (no cap), got {self.max_logprobs!r}")
        if not isinstance(self.check_weights_finite, bool):
            raise ValueError(f"check_weights_finite must be a bool, got {self.check_weights_finite!r}")


DEFAULT_BLOCK_SIZE = 16  # tokens per block, but for MLA caches on CUDA (engine/plan.default_block_size)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    # tokens per block; None: the engine's default for the model and device (engine/plan.py
    # default_block_size: 64 for MLA caches on CUDA, where whole-page key tiles load by TMA; else 16)
    block_size: int | None = None
    kv_cache_dtype: str = "auto"  # auto | fp8 | bfloat16 | float16 | float32
    indexer_cache_dtype: str = "auto"  # auto: fp8 when kv_cache_dtype is fp8, else the model dtype
    mamba_ssm_cache_dtype: str = "float32"  # recurrent state of state layers
    num_state_snapshots: int | None = None  # state layers' prefix-cache snapshots (None: max_num_seqs)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None  # GiB for the KV cache (CPU default: a share of free memory)
    num_gpu_blocks_override: int | None = None
    attention_backend: str | None = None
    # kernel variants turned off (attention/kernels.py): a variant's name (gluon), operation and
    # name (mla.absorbed/gluon) or technology (gluon, triton, cpu_ext, torch); the plan checks them
    disabled_kernels: tuple[str, ...] = ()
    streaming_sinks: int | None = None  # StreamingLLM: keep the first N tokens ...
    streaming_window: int | None = None  # ... and the last W

    def __post_init__(self) -> None:
        if self.block_size is not None and (
                isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                or self.block_size <= 0 or self.block_size & (self.block_size - 1) or self.block_size > 1 << 16):
            raise ValueError(f"block_size must be a positive power of two (at most 65536), got {self.block_size!r}")
        for name in ("kv_cache_dtype", "indexer_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or value.lower() not in KV_CACHE_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
        if isinstance(self.gpu_memory_utilization, bool) or \
                not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check_positive("kv_cache_memory", self.kv_cache_memory, " of GiB")
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 2)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_str("attention_backend", self.attention_backend)
        if self.num_state_snapshots is not None and not (
                isinstance(self.num_state_snapshots, int) and not isinstance(self.num_state_snapshots, bool)
                and 0 <= self.num_state_snapshots <= 1 << 20):
            raise ValueError(f"num_state_snapshots must be an integer in [0, 2**20], got {self.num_state_snapshots!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is the null block)")
        if isinstance(self.disabled_kernels, str):  # one name, or a comma-separated list
            object.__setattr__(self, "disabled_kernels",
                               tuple(n.strip() for n in self.disabled_kernels.split(",") if n.strip()))
        if not isinstance(self.disabled_kernels, (tuple, list)) or not all(
                isinstance(n, str) and n for n in self.disabled_kernels):
            raise ValueError(f"disabled_kernels must be a list of kernel variant names, got {self.disabled_kernels!r}")
        object.__setattr__(self, "disabled_kernels", tuple(self.disabled_kernels))
        _check_int("streaming_sinks", self.streaming_sinks, 0, 1 << 31)
        _check_int("streaming_window", self.streaming_window, 1, 1 << 31)
        if (self.streaming_sinks is None) != (self.streaming_window is None):
            raise ValueError("streaming_sinks and streaming_window go together")
        if self.streaming_window is not None and (self.streaming_window <= 0 or self.streaming_sinks < 0):
            raise ValueError("streaming_window must be positive and streaming_sinks non-negative")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # None: the platform's default, by device memory and usage context (engine/batch_limits.py);
    # the engine runs with the resolved ints (LLMEngine.config)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # schedule and launch the next step before reading the last one back; None: on for CUDA
    # where the model allows it (LLMEngine._async_allowed), off elsewhere
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name, most in (("max_num_seqs", 1 << 20), ("max_num_batched_tokens", 1 << 31)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most):
                raise ValueError(f"{name} must be a positive integer of at most {most} (or None: the platform's "
                                 f"default), got {value!r}")
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_bool("async_scheduling", self.async_scheduling, optional=True)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) or \
                not 1 <= self.tensor_parallel_size <= 1 << 10:
            raise ValueError(f"tensor_parallel_size must be >= 1 (and at most 1024), got {self.tensor_parallel_size!r}")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    kv_offloading_size: float | None = None  # GiB
    kv_offloading_backend: str = "host"  # host | disk
    kv_offloading_dir: str | None = None
    # sparse MLA (DSA) only: latent rows live in host memory, indexer keys on the device; the
    # host store holds as many blocks as the device budget gives, capped at this many GiB
    # (default: half the host memory available)
    kv_offload_sparse_latents: bool = False
    kv_offload_sparse_latents_size: float | None = None  # GiB

    def __post_init__(self) -> None:
        if self.kv_offloading_backend not in ("host", "disk"):
            raise ValueError(f"kv_offloading_backend must be host or disk, got '{self.kv_offloading_backend}'")
        _check_positive("kv_offloading_size", self.kv_offloading_size, " of GiB")
        if self.kv_offloading_dir is not None and not isinstance(self.kv_offloading_dir, (str, os.PathLike)):
            raise ValueError(f"kv_offloading_dir must be a directory path, got {self.kv_offloading_dir!r}")
        _check_bool("kv_offload_sparse_latents", self.kv_offload_sparse_latents)
        if self.kv_offload_sparse_latents_size is not None:
            if not self.kv_offload_sparse_latents:
                raise ValueError("kv_offload_sparse_latents_size sizes the host store of "
                                 "kv_offload_sparse_latents: set that too")
            _check_positive("kv_offload_sparse_latents_size", self.kv_offload_sparse_latents_size, " of GiB")


@dataclass(frozen=True, slots=True)
class VllmOnlyOption:
    """An option of vLLM's engine that attnserve takes only so that vLLM's command lines and
    ``LLM(...)`` calls run unchanged: a value in ``accepted`` (None: any value of ``kind``) is
    taken and changes nothing (``no_effect`` says why, in one log line; None: nothing to say,
    it asks for what attnserve does anyway); any other value is refused with ``refused``."""

    kind: type | tuple[type, ...]
    no_effect: str | None = None
    accepted: tuple[Any, ...] | None = None
    refused: str = ""


VLLM_ONLY_OPTIONS = {
    "trust_remote_code": VllmOnlyOption(
        bool, "attnserve runs its own model and tokenizer code, never code that comes with a checkpoint"),
    "tokenizer_mode": VllmOnlyOption(
        str, "attnserve reads the model's tokenizer.json with the tokenizers library", accepted=("auto", "hf"),
        refused="not supported: attnserve has only the tokenizer.json (tokenizers library) tokenizer, no "
                "slow, mistral or custom ones; use tokenizer_mode auto"),
    "swap_space": VllmOnlyOption(
        (int, float), "a preempted request is recomputed, not swapped to host memory (kv_offloading_size "
        "keeps evicted prefix blocks in host memory)"),
    "max_seq_len_to_capture": VllmOnlyOption(
        int, "attnserve's CUDA graphs serve decode steps of every context length up to max_model_len"),
    "compilation_config": VllmOnlyOption(
        (str, int, dict), "attnserve does not torch.compile the model; CUDA graphs of decode steps are on "
        "unless enforce_eager"),
    "disable_custom_all_reduce": VllmOnlyOption(
        bool, "tensor parallelism all-reduces through torch.distributed (NCCL) only"),
    "distributed_executor_backend": VllmOnlyOption(
        str, "attnserve starts the processes of tensor-parallel ranks itself", accepted=("mp", "uni"),
        refused="not supported: attnserve runs tensor-parallel ranks as processes of its own (mp), or "
                "under torchrun with `python -m attnserve.entrypoints.torchrun` (docs/tensor_parallel.md)"),
    "disable_log_stats": VllmOnlyOption(
        bool, "the LLM class logs no throughput lines (the server's: attnserve serve --disable-log-stats)"),
    "pipeline_parallel_size": VllmOnlyOption(
        int, accepted=(1,), refused="pipeline parallelism is not implemented; split a model over GPUs "
                                    "with tensor_parallel_size"),
    "data_parallel_size": VllmOnlyOption(
        int, accepted=(1,), refused="data parallelism is not implemented; run one engine per replica "
                                    "(servers behind a load balancer)"),
    "speculative_config": VllmOnlyOption(
        (str, dict), accepted=(), refused="speculative decoding is not implemented"),
    "enable_lora": VllmOnlyOption(bool, accepted=(False,), refused="LoRA adapters are not supported"),
}
# quantization's values: the quant_method of a checkpoint attnserve loads (models/quantized.py)
QUANTIZATION_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "mxfp4")


def _take_vllm_only_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``kwargs`` without ``VLLM_ONLY_OPTIONS``, and a log line for each one given (not None) that
    changes nothing; a value refused is a ValueError naming the option, with the reason."""
    rest, notes = {}, []
    for key, value in kwargs.items():
        option = VLLM_ONLY_OPTIONS.get(key)
        if option is None:
            rest[key] = value
            continue
        if value is None:
            continue
        if isinstance(value, bool) != (option.kind is bool) or not isinstance(value, option.kind):
            kinds = option.kind if isinstance(option.kind, tuple) else (option.kind,)
            raise ValueError(f"{key} must be a {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if option.accepted is not None and value not in option.accepted:
            raise ValueError(f"{key}={value!r}: {option.refused}")
        if option.no_effect is not None:
            notes.append(f"{key}={value!r} (a vLLM option) changes nothing here: {option.no_effect}")
    return rest, notes


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    usage_context: str = "llm"  # one of USAGE_CONTEXTS

    def __post_init__(self) -> None:
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got '{self.usage_context}'")

    @classmethod
    def from_kwargs(cls, model: str, *, usage_context: str = "llm", **kwargs: Any) -> EngineConfig:
        """Route flat keywords (``LLM(...)`` / CLI names) to the sub-configs; unknown ones fail
        (TypeError), vLLM's options attnserve has no use for are logged or refused
        (``VLLM_ONLY_OPTIONS``). ``usage_context`` is the builder's (``LLM``: "llm", the server:
        "server"), not a user's."""
        kwargs, notes = _take_vllm_only_options(kwargs)
        if kwargs.get("dtype") in _DTYPE_ALIASES:
            kwargs["dtype"] = _DTYPE_ALIASES[kwargs["dtype"]]
        parts: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}}
        owners = {}
        for sub in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, OffloadConfig):
            for f in fields(sub):
                owners[f.name] = sub
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine option '{key}'")
            if value is None and key != "max_model_len":
                continue
            parts.setdefault(owners[key], {})[key] = value
        config = cls(
            model=ModelConfig(**parts[ModelConfig]),
            cache=CacheConfig(**parts.get(CacheConfig, {})),
            scheduler=SchedulerConfig(**parts.get(SchedulerConfig, {})),
            parallel=ParallelConfig(**parts.get(ParallelConfig, {})),
            offload=OffloadConfig(**parts.get(OffloadConfig, {})),
            usage_context=usage_context,
        )
        for note in notes:  # once the whole config is valid
            logger.info("%s", note)
        return config
