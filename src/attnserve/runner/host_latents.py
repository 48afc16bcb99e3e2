"""Host-resident sparse-MLA latents (``kv_offload_sparse_latents``): checks, sizing, wiring.

With the flag, every sparse-MLA (DSA) layer's latent cache is allocated in host memory (pinned
on CUDA) with the same block ids as the device caches, and its KV cache group's backend is
wrapped in ``HostLatentSparseBackend``, which stages the selected rows on the device each step.
The device budget then pays only for what stays there (indexer keys, any other entry) and for
the staging buffers, so it holds about ``(latent + indexer) / indexer`` times more tokens
(DeepSeek-V3.2 in fp8: 788 / 132 = 6x).

Host capacity: the host store has as many blocks as the device budget gives, capped at
``kv_offload_sparse_latents_size`` GiB, or, without it, at half the host memory available
when the engine starts (the "device" cache counted too on CPU, where both are host memory).
A size above what is available, or a host store that cannot hold one ``max_model_len``
sequence, is an error that says so; so are a model without sparse-MLA layers, tensor
parallelism and prefix offloading (``kv_offloading_size``), which this does not support yet.
The staging reserve covers one layer's rows for ``max_num_seqs`` decodes and one whole
``max_model_len`` sequence; a step with several long prefills stages more, transiently.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from attnserve.arch import LayerKind, ModelArch
from attnserve.attention.backend import AttentionBackend
from attnserve.attention.backends.host_latent_sparse import HostLatentSparseBackend
from attnserve.config import EngineConfig
from attnserve.kvcache.groups import KVCacheGroup, KVCacheLayout, sparse_latent_entries
from attnserve.runner.cache_allocation import host_available_bytes

__all__ = ["HostLatentPlan", "check_host_latents", "plan_host_latents", "wrap_backends"]

logger = logging.getLogger(__name__)
GIB = 1024**3
_HOST_SHARE = 0.5  # of the available host memory, when no size is given


@dataclass(frozen=True, slots=True)
class HostLatentPlan:
    entries: frozenset[tuple[int, str]]  # (layer, "latent") of every sparse-MLA layer
    groups: frozenset[int]  # the KV cache groups that hold them
    device_bytes_per_block: int  # what one block id costs on the device
    host_bytes_per_block: int  # and in host memory
    staging_bytes: int  # device staging of one layer at most (decodes' rows + one sequence)
    size_gib: float | None  # kv_offload_sparse_latents_size

    def host_blocks(self, num_blocks: int, blocks_per_sequence: int, device: torch.device) -> int:
        """``num_blocks`` (the null block included) capped by the host store.

        Raises:
            ValueError: the size asked for exceeds the host memory available, or the store
                cannot hold one sequence of ``max_model_len`` tokens.
        """
        available = host_available_bytes()
        if device.type == "cpu":  # the "device" cache is host memory too
            available -= num_blocks * self.device_bytes_per_block
        if self.size_gib is not None:
            budget = int(self.size_gib * GIB)
            if budget > available:
                raise ValueError(f"kv_offload_sparse_latents_size is {self.size_gib} GiB, but only "
                                 f"{max(available, 0) / GIB:.2f} GiB of host memory is available")
        else:
            budget = int(max(available, 0) * _HOST_SHARE)
        cap = budget // self.host_bytes_per_block
        if cap - 1 < blocks_per_sequence:
            raise ValueError(
                f"host memory for sparse-MLA latents ({budget / GIB:.2f} GiB: "
                f"{'kv_offload_sparse_latents_size' if self.size_gib else 'half of what is available'}) "
                f"holds {max(cap - 1, 0)} blocks of {self.host_bytes_per_block} bytes, but one sequence "
                f"of max_model_len needs {blocks_per_sequence}; lower max_model_len or give it more")
        if cap < num_blocks:
            logger.info("sparse-MLA latents: host memory (%.2f GiB) limits the cache to %d blocks "
                        "(the device budget holds %d)", budget / GIB, cap, num_blocks)
        return min(num_blocks, cap)


def check_host_latents(config: EngineConfig, arch: ModelArch) -> None:
    """Combinations that do not work, before anything is built (tensor-parallel ranks included)."""
    if not config.offload.kv_offload_sparse_latents:
        return
    if not any(s.kind is LayerKind.SPARSE_MLA for s in arch.layers):
        raise ValueError(
            f"kv_offload_sparse_latents keeps the latent cache of sparse-MLA (DSA) layers in host "
            f"memory, but this model ({arch.model_type}) has no sparse-MLA layers")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("kv_offload_sparse_latents is not supported with tensor_parallel_size > 1 yet")
    if config.offload.kv_offloading_size is not None:
        raise ValueError("kv_offload_sparse_latents cannot be combined with kv_offloading_size yet: the "
                         "prefix offload tier copies whole device blocks, and the latent rows are already "
                         "in host memory; use one or the other")


def plan_host_latents(config: EngineConfig, arch: ModelArch, layout: KVCacheLayout,
                      max_model_len: int, max_num_seqs: int) -> HostLatentPlan | None:
    """Which entries go to host memory and what a block costs on each side; None when off.
    ``max_num_seqs``: the resolved batch limit (the staging holds rows for that many decodes)."""
    if not config.offload.kv_offload_sparse_latents:
        return None
    check_host_latents(config, arch)
    entries = sparse_latent_entries(arch, [e for g in layout.groups for e in g.entries])
    host = sum(e.spec.page_size_bytes for e in entries)
    block = config.cache.block_size
    topk = max(s.indexer.topk for s in arch.layers if s.indexer is not None)
    row = max(e.spec.bytes_per_token for e in entries)
    # one layer's staging: K rows for each decode, one whole sequence, the null page
    pages = max_num_seqs * math.ceil(topk / block) + math.ceil(max_model_len / block) + 1
    return HostLatentPlan(
        entries=frozenset((e.layer, e.name) for e in entries),
        groups=frozenset(g.group_id for g in layout.groups if any(e in entries for e in g.entries)),
        device_bytes_per_block=layout.bytes_per_block - host,
        host_bytes_per_block=host,
        staging_bytes=pages * block * row,
        size_gib=config.offload.kv_offload_sparse_latents_size,
    )


def wrap_backends(plan: HostLatentPlan | None, groups: list[KVCacheGroup], backends: list[AttentionBackend],
                  device: torch.device) -> list[AttentionBackend]:
    """The groups holding host-resident latents get their backend wrapped."""
    if plan is None:
        return backends
    return [HostLatentSparseBackend(b, g.block_size, device) if g.group_id in plan.groups else b
            for g, b in zip(groups, backends)] + backends[len(groups):]
