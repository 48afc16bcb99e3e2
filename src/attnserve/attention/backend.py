"""The backend contract: ``Capabilities`` + ``build_metadata`` + ``forward`` + CUDA-graph hooks.

A backend declares what it can run (``Capabilities``, kept in the registry table so that
selection never imports optional libraries), builds its metadata once per batch and KV cache
group, and runs ``forward`` per layer. It knows nothing of requests or model families.

``Backend`` is what every backend shares: the metadata builder and the hooks a CUDA graph needs.
Its two kinds differ only in what ``forward`` takes: ``AttentionBackend`` (queries, keys and
values over a paged cache) here, and ``StateBackend`` (a state mechanism's inputs over a slot
pool, ``attention/state/base.py``).

CUDA graphs (``runner/cuda_graph.py``): the graph runner owns persistent copies of the step's
common device inputs (token ids, positions, ``CommonAttentionMetadata``'s tensors) and, per
batch-size bucket, asks each backend once for the metadata of a captured decode batch
(``build_graph_metadata``, built over views of those buffers with the capture's host bounds).
Before every replay it copies the step into its buffers, then lets each backend refresh the
persistent buffers it owns (``refresh_graph_metadata``). A backend takes part only when
``cuda_graph_safe`` says its decode forward launches the same work for any values in those
tensors: no host synchronisation, no host branching on device data.

Kernels: a backend launches the operations its registry entry names (``attention/kernels.py``),
each by the variant the engine's plan chose for its group (``Backend(block_size, kernels)``;
``Backend.kernel`` returns it). A backend built without choices (tests, benchmarks) picks on its
first call, from that call's tensors, through the same table.

RoPE: the model's layer normally rotates q and k before ``forward``. A backend with
``fuses_rope`` also takes ``forward_rope``: q and k arrive unrotated with a ``RopeTable``, and
the backend rotates them on the way (TRITON_ATTN: in the kernel that writes the cache). The
layer uses it only for a RoPE whose rotation depends on the position alone (``RopeTable``).
A ``RopeTable`` may also carry a per-head RMSNorm of q and k (Qwen3's q_norm/k_norm), which
``forward_rope`` applies before the rotation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from attnserve.arch import LayerKind
from attnserve.attention import kernels
from attnserve.attention.kernels import KernelProblem, KernelVariant

if TYPE_CHECKING:
    import torch

    from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["AttentionBackend", "Backend", "BackendRequest", "Capabilities", "FEATURES", "RopeTable",
           "layer_features", "tensor_problem"]

FEATURES = ("sliding_window", "alibi", "sinks", "softcap", "streaming")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can run. ``None`` for head or block sizes means any."""

    layer_kinds: frozenset[LayerKind]
    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[str]
    platforms: Mapping[str, tuple[int, int] | None]  # platform -> minimum compute capability
    features: frozenset[str] = frozenset()
    head_sizes: frozenset[int] | None = None
    block_size_multiple: int = 1
    requires: tuple[str, ...] = ()  # optional Python modules (flash_attn, flashinfer, ...)


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """What one group of layers needs from a backend."""

    kind: LayerKind
    head_size: int
    dtype: str
    kv_cache_dtype: str  # the resolved storage dtype (fp8 or a float dtype)
    block_size: int
    features: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RopeTable:
    """A RoPE that one table row per position describes: what ``forward_rope`` applies."""

    cos_sin_table: torch.Tensor  # [max_pos, rotary_dim] float32: cos | sin halves of each row
    positions: torch.Tensor  # [num_tokens] int32/int64, each below max_pos
    rotary_dim: int  # the leading dims of each q/k head that rotate
    interleaved: bool  # GPT-J adjacent pairs if True, else NeoX halves
    # RMSNorm of each q and k head before the rotation: (q_weight [D], k_weight [D], q_eps, k_eps),
    # weights in q's dtype, plain (not zero-centred); None: no norm
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return "fp8" if name.startswith("float8") or name == "uint8" else name


def layer_features(layer: Any) -> frozenset[str]:
    """The attention features of a layer object (``LayerSpec.features`` as the layer holds them)."""
    out = set()
    if getattr(layer, "window", None) is not None:
        out.add("sliding_window")
    if getattr(layer, "alibi_slopes", None) is not None:
        out.add("alibi")
    if getattr(layer, "sinks", None) is not None:
        out.add("sinks")
    if getattr(layer, "softcap", None) is not None:
        out.add("softcap")
    if getattr(layer, "streaming", None) is not None:
        out.add("streaming")
    return frozenset(out)


def tensor_problem(q: torch.Tensor, cache: torch.Tensor | None = None, **fields: Any) -> KernelProblem:
    """A kernel problem from the tensors of a call: the device and dtype of ``q``, the dtype
    ("fp8" for float8 or uint8 byte rows) and page size of ``cache`` [num_blocks, block_size, ...],
    and the given fields (the plan builds the same record from the layer's spec)."""
    import torch

    device = q.device
    if device.type == "cuda":
        name = "rocm" if torch.version.hip else "cuda"
        capability = torch.cuda.get_device_capability(device)
    else:
        name, capability = device.type, None
    if cache is not None:
        fields.setdefault("cache_dtype", _dtype_name(cache.dtype))
        fields.setdefault("block_size", cache.shape[1])
    return KernelProblem(platform=name, capability=capability, dtype=_dtype_name(q.dtype), **fields)


class Backend(ABC):
    """What every backend of a KV cache group provides: metadata per step, graph hooks, and the
    kernel variant of each operation it launches.

    Subclasses set ``name``; their capabilities are the registry entry of that name.
    """

    name: ClassVar[str] = ""
    # the decode forward can be captured in a CUDA graph (see the module docstring)
    cuda_graph_safe: ClassVar[bool] = False

    def __init__(self, block_size: int, kernels: Mapping[str, str] | None = None):
        """Args:
            block_size: tokens a page.
            kernels: operation -> the variant's name, as the plan chose it for this group; an
                operation left out is picked on its first call (``kernel``).
        """
        self.block_size = block_size
        self.kernels: dict[str, str] = dict(kernels or {})
        self._variants: dict[str, KernelVariant] = {}
        self._launches: dict[str, Callable[..., Any]] = {}

    def kernel(self, op: str, problem: Callable[[], KernelProblem]) -> KernelVariant:
        """The variant this backend runs ``op`` with: the plan's choice, or, for a backend built
        without one, the table's pick for ``problem()`` (called once; the variant is prepared)."""
        variant = self._variants.get(op)
        if variant is None:
            name = self.kernels.get(op)
            if name is None:
                name = kernels.pick_prepared(op, problem(), self.name).variant
                self.kernels[op] = name
            variant = kernels.get_variant(op, name)
            if self.name not in variant.launched_by:
                raise kernels.KernelError(f"{self.name} does not launch {variant.key} (its launchers: "
                                          f"{', '.join(sorted(variant.launched_by))})")
            self._variants[op] = variant
        return variant

    def launch(self, op: str, problem: Callable[[], KernelProblem]) -> Callable[..., Any]:
        """The launch function of ``kernel(op, problem)``, imported once."""
        fn = self._launches.get(op)
        if fn is None:
            fn = self._launches[op] = self.kernel(op, problem).load()
        return fn

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> Any:
        """Turn the step's common metadata into this backend's own, once per batch and group."""

    # --- CUDA graphs ---------------------------------------------------------------------
    def build_graph_metadata(self, common: CommonAttentionMetadata, group_id: int) -> Any:
        """The metadata of a captured decode batch, built once per batch-size bucket.

        Args:
            common: views of the graph runner's persistent buffers for ``num_reqs`` decode
                requests (one token each); its host fields are the capture's bounds
                (``max_seq_len`` and every ``seq_lens_cpu`` entry are ``max_model_len``).
            group_id: the KV cache group.
        Returns:
            Metadata whose device tensors are views of ``common``'s or persistent buffers this
            backend allocates here and refreshes in ``refresh_graph_metadata``; its host values
            hold for every replay. The default is ``build_metadata`` over the views, right for a
            backend whose metadata only slices ``common`` and keeps host values as bounds.
        """
        return self.build_metadata(common, group_id)

    def refresh_graph_metadata(self, metadata: Any, common: CommonAttentionMetadata) -> None:
        """Before a replay: bring the persistent buffers this backend owns in ``metadata``
        (from ``build_graph_metadata``) up to date with the step's ``common`` (eager, unpadded;
        the runner has already copied it into its own buffers). Default: none to refresh."""
        return None


class AttentionBackend(Backend):
    """One implementation of attention over a paged cache (standard, MLA, sparse MLA, NSA)."""

    # forward_rope is implemented: RoPE can be left to the backend (see the module docstring)
    fuses_rope: ClassVar[bool] = False

    def forward_rope(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: Any, metadata: Any, rope: RopeTable) -> torch.Tensor:
        """``forward`` with q and k not yet rotated: the same result as normalising them by
        ``rope.qk_norm`` (if any, ``layers.fused.rms_norm``) and rotating them by ``rope``
        (``layers.fused.rotary``) first, then ``forward``. Only where ``fuses_rope``."""
        raise NotImplementedError(f"{self.name} does not fuse RoPE (fuses_rope is False)")

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: Any, metadata: Any) -> torch.Tensor:
        """Write the new tokens' K/V into ``kv_cache`` and attend.

        Args:
            layer: the attention layer (scale, window, ALiBi slopes, sinks, soft-cap, heads).
            q: [num_tokens, num_heads, head_size] queries of the tokens scheduled this step.
            k, v: [num_tokens, num_kv_heads, head_size(_v)] their keys and values.
            kv_cache: this layer's cache tensors.
            metadata: what ``build_metadata`` returned for the layer's group.
        Returns:
            [num_tokens, num_heads, head_size_v] attention output.

        MLA backends take the same call with MLA meanings: ``q`` is [T, H, qk_nope + qk_rope]
        (q_nope, then the rotated q_pe), ``k`` the new latent rows [T, kv_lora_rank + qk_rope]
        (c_kv after its norm, k_pe after RoPE), ``v`` None, and the output [T, H, v_head_dim].
        """
