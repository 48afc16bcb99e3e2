"""The only reader (and writer) of ``os.environ`` in attnserve: a short, typed list of debug switches.

Engine knobs live in ``EngineConfig`` (a kernel variant is turned off by the engine option
``disabled_kernels``, not here); these variables exist for debugging, logging and the server's
secrets. At most ten ``ATTNSERVE_*`` names (``tests/unit/test_env.py`` counts them).
"""

from __future__ import annotations

import os

__all__ = [
    "ATTNSERVE_VARIABLES",
    "api_key",
    "cache_root",
    "configure_logging",
    "cpu_isa",
    "cpu_threads",
    "disable_nccl_multicast",
    "engine_profile",
    "force_platform",
    "hf_hub_cache",
    "hf_hub_offline",
    "log_level",
    "log_stats_interval",
    "mla_disabled",
    "triton_interpret",
]

# every ATTNSERVE_* variable read here, with what it does (the README's list)
ATTNSERVE_VARIABLES = {
    "ATTNSERVE_MLA_DISABLE": "run MLA models with an expanded K/V cache",
    "ATTNSERVE_ENGINE_PROFILE": "a file for the engine process's cProfile stats",
    "ATTNSERVE_API_KEY": "the server's API key when --api-key is not given",
    "ATTNSERVE_LOGGING_LEVEL": "the level of the attnserve logger (default INFO)",
    "ATTNSERVE_LOG_LEVEL": "the older name of ATTNSERVE_LOGGING_LEVEL",
    "ATTNSERVE_CONFIGURE_LOGGING": "0: attnserve installs no log handler, the application configures logging",
    "ATTNSERVE_LOG_STATS_INTERVAL": "seconds between the server's throughput lines",
    "ATTNSERVE_PLATFORM": "override platform detection",
    "ATTNSERVE_CPU_THREADS": "torch's intra-op threads on CPU",
    "ATTNSERVE_CPU_ISA": "treat the CPU as having at most avx2, avx512 or avx512_bf16 (dtype auto, the decode kernel)",
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def mla_disabled() -> bool:
    """``ATTNSERVE_MLA_DISABLE=1``: run MLA models with an expanded K/V cache."""
    return _flag("ATTNSERVE_MLA_DISABLE")


def engine_profile() -> str | None:
    """``ATTNSERVE_ENGINE_PROFILE``: a file the engine process writes its loop's cProfile stats
    to when it stops (``engine/engine_process.py``), with the sender thread's time per phase in
    its log; unset: no profiling."""
    return os.environ.get("ATTNSERVE_ENGINE_PROFILE", "").strip() or None


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through the interpreter."""
    return _flag("TRITON_INTERPRET")


def api_key() -> str | None:
    """``ATTNSERVE_API_KEY``: the server's API key when ``--api-key`` is not given (unset or
    empty: none)."""
    return os.environ.get("ATTNSERVE_API_KEY") or None


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    """``ATTNSERVE_LOGGING_LEVEL`` (or its older name ``ATTNSERVE_LOG_LEVEL``): the level of the
    ``attnserve`` logger (DEBUG, INFO, WARNING, ERROR, CRITICAL; default INFO).

    Raises:
        ValueError: a value that names no level (the message names the variable).
    """
    for name, value in (("ATTNSERVE_LOGGING_LEVEL", os.environ.get("ATTNSERVE_LOGGING_LEVEL", "")),
                        ("ATTNSERVE_LOG_LEVEL", os.environ.get("ATTNSERVE_LOG_LEVEL", ""))):
        value = value.strip().upper()
        if value:
            if value not in _LEVELS:
                raise ValueError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got '{value}'")
            return value
    return "INFO"


def configure_logging() -> bool:
    """``ATTNSERVE_CONFIGURE_LOGGING`` (default 1): whether attnserve configures its logger
    (``logger.py``); 0 leaves logging to the application, as vLLM's ``VLLM_CONFIGURE_LOGGING``."""
    return os.environ.get("ATTNSERVE_CONFIGURE_LOGGING", "").strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> str:
    """attnserve's own cache directory: ``$XDG_CACHE_HOME/attnserve``, by default
    ``~/.cache/attnserve`` (the CPU decode kernel's builds, ``ops/cpu/paged_decode.py``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.expanduser(base), "attnserve")


def log_stats_interval() -> float:
    """``ATTNSERVE_LOG_STATS_INTERVAL``: seconds between the server's throughput lines
    (default 10)."""
    value = os.environ.get("ATTNSERVE_LOG_STATS_INTERVAL", "").strip()
    try:
        seconds = float(value) if value else 10.0
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"ATTNSERVE_LOG_STATS_INTERVAL must be positive seconds, got {value!r}")
    return seconds


def force_platform() -> str | None:
    """``ATTNSERVE_PLATFORM=cpu|cuda|rocm``: override platform detection (tests, debugging)."""
    value = os.environ.get("ATTNSERVE_PLATFORM", "").strip().lower()
    return value or None


def cpu_threads() -> int | None:
    """``ATTNSERVE_CPU_THREADS``: torch intra-op threads on CPU (default: torch's choice)."""
    value = os.environ.get("ATTNSERVE_CPU_THREADS", "").strip()
    return int(value) if value else None


def cpu_isa() -> str | None:
    """``ATTNSERVE_CPU_ISA=avx2|avx512|avx512_bf16``: treat the CPU as having at most that
    instruction set, its flags above it ignored (``platforms/cpu_info.py``): ``dtype="auto"``
    and the C++ decode kernel's path then choose as on such a CPU (debugging, benchmarks);
    unset: what the CPU has."""
    value = os.environ.get("ATTNSERVE_CPU_ISA", "").strip().lower()
    if value and value not in ("avx2", "avx512", "avx512_bf16"):
        raise ValueError(f"ATTNSERVE_CPU_ISA must be avx2, avx512 or avx512_bf16, got {value!r}")
    return value or None


def hf_hub_offline() -> bool:
    """``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``): Hugging Face model ids resolve from
    the local cache only, nothing is downloaded (read when a model is resolved, not at import)."""
    return _flag("HF_HUB_OFFLINE") or _flag("TRANSFORMERS_OFFLINE")


def hf_hub_cache() -> str:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it: ``HF_HUB_CACHE``, else
    ``$HF_HOME/hub`` (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, then
    ``~/.cache/huggingface``)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def disable_nccl_multicast() -> None:
    """Set ``NCCL_NVLS_ENABLE=0`` for this process and the ranks it spawns: NVLink multicast
    (NVLS) is off on the lent multi-GPU hosts, and NCCL would otherwise try it."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
