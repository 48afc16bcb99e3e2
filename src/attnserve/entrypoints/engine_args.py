"""The engine flags of the command line (vLLM's names), shared by generate, serve and bench.

``add_engine_args`` adds them to a parser; ``engine_kwargs`` turns the parsed ones into the
``LLM(...)`` / ``EngineConfig.from_kwargs`` keywords, leaving out those not given.
"""

from __future__ import annotations

import argparse

__all__ = ["add_engine_args", "engine_kwargs"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate, serve and bench (vLLM's names)."""
    g = p.add_argument_group("engine")
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GiB",
                   help="KV cache size in GiB (CPU; default: a share of free memory)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB")
    g.add_argument("--kv-offloading-backend", default=None, choices=["host", "disk"])
    g.add_argument("--kv-offloading-dir", default=None)
    g.add_argument("--kv-offload-sparse-latents", action="store_true", default=None,
                   help="sparse MLA (DSA): keep latent rows in host memory, indexer keys on the device")
    g.add_argument("--kv-offload-sparse-latents-size", type=float, default=None, metavar="GiB",
                   help="host memory for those latent rows (default: half of what is available)")
    g.add_argument("--tensor-parallel-size", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--revision", default=None,
                   help="a Hugging Face model id's branch, tag or commit (default: the default branch)")
    g.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="the model's generation_config.json: 'auto' applies its EOS ids and default "
                        "sampling (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                        "where a request sets none; 'vllm' ignores it; or a directory holding one "
                        "(default: auto)")
    g.add_argument("--streaming-sinks", type=int, default=None)
    g.add_argument("--streaming-window", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for CUDA "
                        "where the model allows it)")


_ENGINE_KEYS = ("attention_backend", "kv_cache_dtype", "block_size", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory",
                "num_gpu_blocks_override", "enable_prefix_caching", "load_format", "dtype",
                "kv_offloading_size", "kv_offloading_backend", "kv_offloading_dir",
                "kv_offload_sparse_latents", "kv_offload_sparse_latents_size", "tensor_parallel_size",
                "device", "seed", "streaming_sinks", "streaming_window", "enforce_eager",
                "async_scheduling", "revision", "generation_config")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k, None) is not None}
