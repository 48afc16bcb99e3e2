"""What every state backend shares: the step's decode/prefill split and one base class.

Each step's requests are split at ``num_state_decodes``: the leading requests (one new token and
a state already in their slot) take the recurrent one-token forms; the rest (first chunks, later
chunks, one-token prompts) take the varlen prefill forms, which read the state only where
``has_initial_state`` says so. ``StateMetadata`` is that split, built once per step and group.

``StateBackend`` is the contract of the state layers (Gated DeltaNet, Mamba, lightning, KDA):
``forward(layer, inputs, state_cache, metadata)``, where ``inputs`` are the mechanism's own
tensors (``steps.py`` documents each) and ``state_cache`` the layer's slot tensors. A concrete
backend names its mechanism's ``step`` and, optionally, kernels that replace PyTorch forms (the
TRITON_* backends): ``decode`` the recurrent step, ``prefill`` the chunked form, ``conv_update`` and
``conv_prefill`` the short conv's two forms.

What it is not: the layers (``layers/gdn.py``, ...), the arithmetic (the other modules of this
package), or a kernel (``ops/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnserve.attention.backend import Backend

if TYPE_CHECKING:
    from attnserve.attention.metadata import CommonAttentionMetadata
    from attnserve.kvcache.state import StateCache

__all__ = ["StateBackend", "StateMetadata", "build_state_metadata"]


@dataclass(slots=True)
class StateMetadata:
    """One step of a state group, split into the decode part and the prefill part.

    Tokens ``[:num_decodes]`` belong to the decode requests (one each, in request order), tokens
    ``[num_decodes:]`` to the prefill requests, laid out by ``prefill_query_start_loc``.
    """

    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, from 0
    prefill_slots: torch.Tensor  # [num_prefills] int64
    prefill_has_initial_state: torch.Tensor  # [num_prefills] bool
    max_prefill_len: int = 0  # new tokens of the longest prefill request

    @property
    def num_prefills(self) -> int:
        return self.prefill_slots.shape[0]

    def split(self, decode: Callable[[slice], torch.Tensor], prefill: Callable[[slice], torch.Tensor]
              ) -> torch.Tensor:
        """``decode(tokens)`` on the decode tokens and ``prefill(tokens)`` on the prefill tokens
        (each given the slice of the step's tokens it owns), outputs in token order."""
        nd = self.num_decodes
        outs = []
        if nd:
            outs.append(decode(slice(None, nd)))
        if self.num_prefills:
            outs.append(prefill(slice(nd, None)))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def prefill_args(self) -> dict[str, torch.Tensor]:
        """The keyword arguments every chunked prefill form takes from the step."""
        return dict(query_start_loc=self.prefill_query_start_loc, state_indices=self.prefill_slots,
                    has_initial_state=self.prefill_has_initial_state)

    def chunk_size(self, largest: int) -> int:
        """Tokens per chunk (block) of a prefill form: ``largest``, or the power of two that
        covers the longest prefill when that is shorter (padding to a chunk is wasted work; the
        chunk size does not change the result)."""
        return min(largest, 1 << max(self.max_prefill_len - 1, 0).bit_length())


def build_state_metadata(common: CommonAttentionMetadata) -> StateMetadata:
    """The decode/prefill split of one step from ``CommonAttentionMetadata`` (``state_slots``,
    ``has_initial_state``, ``num_state_decodes``, ``query_start_loc``)."""
    if common.state_slots is None or common.has_initial_state is None:
        raise ValueError("a step with state layers needs state_slots and has_initial_state")
    nd = common.num_state_decodes
    qsl = common.query_start_loc
    if common.query_start_loc_cpu[nd] != nd:
        raise ValueError(
            f"the first {nd} requests are state decodes but do not have one token each"
        )
    slots = common.state_slots.long()
    q = common.query_start_loc_cpu
    return StateMetadata(
        num_decodes=nd,
        decode_slots=slots[:nd],
        prefill_query_start_loc=(qsl[nd:] - qsl[nd]).to(torch.int32),
        prefill_slots=slots[nd:],
        prefill_has_initial_state=common.has_initial_state[nd:].bool(),
        max_prefill_len=max((q[i + 1] - q[i] for i in range(nd, len(q) - 1)), default=0),
    )


class StateBackend(Backend):
    """A state mechanism over a slot pool: PyTorch forms unless the backend names kernels.

    Subclasses set ``name``, ``step`` (the mechanism's layer step, ``steps.py``) and, for a fused
    decode kernel, ``decode`` (called as the PyTorch one-token form it replaces); for a prefill
    kernel, ``prefill`` (called as the PyTorch chunked form it replaces); for the short conv,
    ``conv_update`` and ``conv_prefill`` (called as ``causal_conv1d_update`` and
    ``causal_conv1d_prefill``). None keeps the PyTorch form.

    CUDA graphs: a backend sets ``cuda_graph_safe`` when its decode path (conv update and
    ``decode``) is. A captured batch's metadata is the default ``build_graph_metadata``:
    ``build_state_metadata`` over the graph runner's views, so ``decode_slots`` is a view of its
    int64 slot buffer (``.long()`` copies nothing), every request is a decode and the prefill part
    is empty; a replay reads the step's slots from that buffer and no host value.
    """

    step: ClassVar[Callable[..., torch.Tensor]]
    decode: ClassVar[Callable[..., torch.Tensor] | None] = None
    prefill: ClassVar[Callable[..., torch.Tensor] | None] = None
    conv_update: ClassVar[Callable[..., torch.Tensor] | None] = None
    conv_prefill: ClassVar[Callable[..., torch.Tensor] | None] = None

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> StateMetadata:
        return build_state_metadata(common)

    def forward(self, layer: Any, inputs: tuple[torch.Tensor, ...], state_cache: StateCache,
                metadata: StateMetadata) -> torch.Tensor:
        """Advance the layer's states over the step's tokens and return its output.

        Args:
            layer: the state layer (its weights and dims, as ``step`` documents).
            inputs: the mechanism's per-token tensors, in ``step``'s order (decode tokens first).
            state_cache: the layer's ``conv`` and ``recurrent`` slot tensors, updated in place.
            metadata: the step's ``StateMetadata``.
        Returns:
            The mechanism's output per token (``step`` gives its shape).
        """
        kernels = {name: fn for name in ("decode", "prefill", "conv_update", "conv_prefill")
                   if (fn := getattr(self, name)) is not None}
        return self.step(layer, *inputs, state_cache, metadata, **kernels)
