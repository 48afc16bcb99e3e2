"""The tensor-parallel split of a ``ModelArch``: what one rank of ``world_size`` holds.

Query heads split evenly; KV heads split, or one is replicated per rank when there are fewer KV
heads than ranks; MLA keeps the full latent rows on every rank; state layers split their
heads and state channels. Each rank's KV cache is sized from its share, and ``attnserve
inspect`` reports per rank with it. Also ``ShardPlan``, a family's MLP projections by name (each
family's plan is in the ``FAMILIES`` table). Pure arithmetic and data: the sharding of a built
model is ``runner/parallel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attnserve.arch.model_arch import LayerSpec, ModelArch, StateDims

__all__ = ["ShardPlan", "kv_head_share", "shard_arch"]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """A family's MLP projections by attribute name (attention, MLA, GDN and experts are found by
    their module types)."""

    column: tuple[str, ...] = ("gate_up_proj",)  # output features split
    row: tuple[str, ...] = ("down_proj",)  # input features split, outputs all-reduced


def kv_head_share(num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, KV heads) of ``rank``: a split, or one replicated head per rank.

    Raises:
        ValueError: the KV heads neither split over nor replicate onto the ranks.
    """
    w = world_size
    if num_kv_heads % w == 0:
        n = num_kv_heads // w
        return rank * n, n
    if w % num_kv_heads == 0:
        return rank * num_kv_heads // w, 1
    raise ValueError(
        f"tensor parallelism: {num_kv_heads} KV heads neither split over nor replicate "
        f"onto {w} ranks"
    )


def _split_state(state: StateDims, w: int, layer: int) -> StateDims:
    """Each state shape split along its leading (channel or head) dimension."""

    def split(shapes):
        for s in shapes:
            if s[0] % w:
                raise ValueError(
                    f"tensor parallelism: layer {layer}: state dimension {s[0]} does not "
                    f"split over {w} ranks"
                )
        return tuple((s[0] // w, *s[1:]) for s in shapes)

    return StateDims(conv=split(state.conv), recurrent=split(state.recurrent))


def _split_layer(s: LayerSpec, w: int) -> LayerSpec:
    if s.num_heads % w:
        raise ValueError(
            f"tensor parallelism: layer {s.index} has {s.num_heads} heads, which do not "
            f"split over {w} ranks"
        )
    heads = s.num_heads // w
    if s.kind.is_mla:  # every rank keeps the full latent rows
        return replace(s, num_heads=heads)
    if s.kind.is_attention:
        return replace(s, num_heads=heads, num_kv_heads=kv_head_share(s.num_kv_heads, w, 0)[1])
    state = _split_state(s.state, w, s.index) if s.state is not None else None
    return replace(s, num_heads=heads, state=state)


def shard_arch(arch: ModelArch, world_size: int) -> ModelArch:
    """The architecture one rank of ``world_size`` holds: its heads, KV heads and state shapes.

    Raises:
        ValueError: heads (or KV heads, or state channels) that do not split over the ranks.
    """
    if world_size == 1:
        return arch
    return replace(arch, layers=tuple(_split_layer(s, world_size) for s in arch.layers))
