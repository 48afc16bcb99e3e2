"""Tensor parallelism: the sharding pass applied to a built model, and the collectives it needs.

Every rank builds the whole model and loads the whole checkpoint (one full copy of the weights
per rank while loading), then ``shard_model`` keeps the rank's share, in place:

- standard attention (``qkv_proj`` a ``QKVLinear``, ``attn`` an ``Attention``, ``o_proj``):
  query heads split; KV heads split, or one replicated per rank when there are fewer than ranks;
- MLA: query heads split (``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` by head); the latent
  projections, the full latent cache rows and the DSA indexer are replicated (same top-k);
- Gated DeltaNet: key and value heads split (projections, conv channels, ``A_log``,
  ``dt_bias``); each rank keeps the state of its heads;
- MoE: a contiguous block of the routed experts per rank, outputs all-reduced; routers and
  shared experts as elsewhere (replicated, MLP);
- MLPs: the family's ``ShardPlan`` (``arch.FAMILIES``) names the column-parallel inputs and
  row-parallel outputs; ``o_proj`` / ``out_proj`` above are row-parallel too (input features
  split, all-reduce);
- vocabulary: a masked embedding lookup of the rank's slice plus an all-reduce; the output head
  computes the rank's slice of the logits, gathered on rank 0.

``arch.shard_arch`` is the same split of a ``ModelArch`` (per-rank heads and state shapes): each
rank's KV cache is sized from it, and ``attnserve inspect`` reports per rank with it.

What it is not: process start-up and the per-step broadcast (``runner/worker.py``), pipeline
parallelism, sharded checkpoint loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from attnserve.arch import FAMILIES, ModelArch, ShardPlan, kv_head_share, shard_arch
from attnserve.layers.attention import Attention
from attnserve.layers.gdn import GatedDeltaNet
from attnserve.layers.linear import MergedLinear, QKVLinear
from attnserve.layers.mla import MLAAttention
from attnserve.layers.moe import FusedExperts

__all__ = [
    "ParallelLMHead",
    "ParallelState",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_reduce",
    "check_supported",
    "min_over_ranks",
    "shard_model",
]


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's contiguous share [lo, hi) of ``n`` equal units."""
        if n % self.world_size:
            raise ValueError(
                f"tensor parallelism: {what} ({n}) do not split over {self.world_size} ranks"
            )
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per


def _plan(model_type: str) -> ShardPlan | None:
    """The family's plan; None refuses tensor_parallel_size > 1."""
    family = FAMILIES.get(model_type)
    return family.shard_plan if family is not None else None


def _planned_classes() -> list[str]:
    return sorted({f.model.partition(":")[2] for f in FAMILIES.values() if f.shard_plan and f.model})


# --- collectives (the default process group) ---------------------------------------------


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks, in place; returns it."""
    dist.all_reduce(t)
    return t


def min_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# --- parallel layers ----------------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: this rank's slice of the input features, then an all-reduce
    (the bias is added on rank 0 only)."""

    def __init__(self, linear: nn.Linear, parallel: ParallelState):
        super().__init__()
        lo, hi = parallel.split(linear.in_features, "input features of a row-parallel linear")
        self.in_features, self.out_features = hi - lo, linear.out_features
        self.weight = nn.Parameter(linear.weight.data[:, lo:hi].clone(), requires_grad=False)
        bias = linear.bias is not None and parallel.rank == 0
        self.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (per rank), out_features={self.out_features}"


def _vocab_slice(vocab: int, parallel: ParallelState) -> tuple[int, int, int]:
    """(lo, hi, rows): this rank's vocabulary [lo, hi), padded to ``rows`` = ceil(V / ranks)."""
    rows = -(-vocab // parallel.world_size)
    lo = min(vocab, parallel.rank * rows)
    return lo, min(vocab, lo + rows), rows


def _padded_rows(t: torch.Tensor, lo: int, hi: int, rows: int) -> nn.Parameter:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device)
    out[: hi - lo] = t[lo:hi]
    return nn.Parameter(out, requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """Embedding of this rank's vocabulary slice: other ids give zeros; the ranks' rows are summed."""

    def __init__(self, embedding: nn.Embedding, parallel: ParallelState):
        super().__init__()
        self.vocab_start, self.vocab_end, rows = _vocab_slice(embedding.num_embeddings, parallel)
        self.weight = _padded_rows(embedding.weight.data, self.vocab_start, self.vocab_end, rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # [T, D]
        return all_reduce(out)


class ParallelLMHead(nn.Module):
    """The output head over this rank's vocabulary slice; rank 0 gathers the full logits.

    ``forward`` is a collective: every rank calls it with the same rows. Rank 0 gets
    [N, vocab]; the other ranks get their own (padded) slice [N, ceil(vocab / ranks)].
    """

    def __init__(
        self, linear: nn.Linear, parallel: ParallelState, weight: nn.Parameter | None = None
    ):
        super().__init__()
        self.vocab_size = linear.out_features
        lo, hi, rows = _vocab_slice(self.vocab_size, parallel)
        self.is_first = parallel.rank == 0
        self.world_size = parallel.world_size
        self.weight = (
            weight if weight is not None else _padded_rows(linear.weight.data, lo, hi, rows)
        )
        self.bias = None if linear.bias is None else _padded_rows(linear.bias.data, lo, hi, rows)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight, self.bias).contiguous()  # [N, rows]
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(local, parts, dst=0)
        if not self.is_first:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # [N, V]


# --- the sharding pass --------------------------------------------------------------------


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Keep the output features ``rows`` (a column-parallel shard), in place."""
    rows = rows.to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, rows), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows), requires_grad=False)
    linear.out_features = rows.numel()


def _share(offset: int, size: int, parallel: ParallelState, what: str) -> torch.Tensor:
    """Indices of this rank's contiguous share of [offset, offset + size)."""
    lo, hi = parallel.split(size, what)
    return torch.arange(offset + lo, offset + hi)


def _kv_heads(num_kv_heads: int, parallel: ParallelState) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: a split, or one replicated head per rank."""
    return kv_head_share(num_kv_heads, parallel.world_size, parallel.rank)


def _shard_qkv_attention(mod: nn.Module, p: ParallelState) -> None:
    attn: Attention = mod.attn
    qkv: QKVLinear = mod.qkv_proj
    lo, hi = p.split(attn.num_heads, f"layer {attn.layer_id}: attention heads")
    kv_lo, kv_n = _kv_heads(attn.num_kv_heads, p)
    d, dv, q_size = attn.head_size, attn.head_size_v, qkv.sizes["q"]
    q = _share(0, q_size, p, "query features")  # [q | gate] per head stays together
    k = torch.arange(q_size + kv_lo * d, q_size + (kv_lo + kv_n) * d)
    v_off = q_size + qkv.sizes["k"]
    v = torch.arange(v_off + kv_lo * dv, v_off + (kv_lo + kv_n) * dv)
    _keep_rows(qkv, torch.cat([q, k, v]))
    qkv.sizes = {"q": q.numel(), "k": k.numel(), "v": v.numel()}
    mod.o_proj = RowParallelLinear(mod.o_proj, p)
    for m in (mod, attn):
        if hasattr(m, "num_heads"):
            m.num_heads, m.num_kv_heads = hi - lo, kv_n
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(attn.sinks.data[lo:hi].clone(), requires_grad=False)
    if attn.alibi_slopes is not None:
        attn.alibi_slopes = attn.alibi_slopes[lo:hi].clone()


def _shard_mla(m: MLAAttention, p: ParallelState) -> None:
    lo, hi = p.split(m.num_heads, "MLA heads")
    qk, kv = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
    _keep_rows(m.q_b_proj if m.q_lora_rank else m.q_proj, torch.arange(lo * qk, hi * qk))
    _keep_rows(m.kv_b_proj, torch.arange(lo * kv, hi * kv))
    m.o_proj = RowParallelLinear(m.o_proj, p)
    m.num_heads = hi - lo
    if not m.use_latent_cache:  # MLA disabled: expanded per-head K/V in a standard layer
        m.attn.num_heads = m.attn.num_kv_heads = hi - lo


def _shard_gdn(g: GatedDeltaNet, p: ParallelState) -> None:
    k_lo, k_hi = p.split(g.num_k_heads, f"layer {g.layer_id}: GDN key heads")
    v_lo, v_hi = p.split(g.num_v_heads, f"layer {g.layer_id}: GDN value heads")
    dk, dv, kd, vd, hv = g.head_k_dim, g.head_v_dim, g.key_dim, g.value_dim, g.num_v_heads
    q = torch.arange(k_lo * dk, k_hi * dk)
    v = torch.arange(2 * kd + v_lo * dv, 2 * kd + v_hi * dv)
    conv = torch.cat([q, q + kd, v])  # the conv channels: [q | k | v]
    _keep_rows(g.in_proj_qkvz, torch.cat([conv, v + vd]))  # z follows v
    b = torch.arange(v_lo, v_hi)
    _keep_rows(g.in_proj_ba, torch.cat([b, b + hv]))
    w = g.conv1d.weight.data  # [C, 1, K]
    g.conv1d.weight = nn.Parameter(w.index_select(0, conv.to(w.device)), requires_grad=False)
    g.conv1d.in_channels = g.conv1d.out_channels = g.conv1d.groups = conv.numel()
    g.dt_bias = nn.Parameter(g.dt_bias.data[v_lo:v_hi].clone(), requires_grad=False)
    g.A_log = nn.Parameter(g.A_log.data[v_lo:v_hi].clone(), requires_grad=False)
    g.out_proj = RowParallelLinear(g.out_proj, p)
    g.num_k_heads, g.num_v_heads = k_hi - k_lo, v_hi - v_lo
    g.key_dim, g.value_dim, g.conv_dim = q.numel(), v.numel(), conv.numel()
    g.in_proj_qkvz.out_sizes = [g.conv_dim, g.value_dim]
    g.in_proj_ba.out_sizes = [g.num_v_heads, g.num_v_heads]


def _shard_experts(e: FusedExperts, p: ParallelState) -> None:
    """A contiguous block of experts per rank (uneven counts allowed)."""
    n, w = e.num_experts, p.world_size
    lo, hi = p.rank * n // w, (p.rank + 1) * n // w
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        t = getattr(e, name)
        if t is not None:
            setattr(e, name, nn.Parameter(t.data[lo:hi].clone(), requires_grad=False))
    e.num_experts, e.first_expert, e.all_reduce = hi - lo, lo, all_reduce


def _shard_mlp(module: nn.Module, plan: ShardPlan, p: ParallelState) -> None:
    for name in plan.column:
        child = getattr(module, name, None)
        if isinstance(child, MergedLinear):
            rows = [
                _share(sum(child.out_sizes[:i]), s, p, f"{name} block {i}")
                for i, s in enumerate(child.out_sizes)
            ]
            _keep_rows(child, torch.cat(rows))
            child.out_sizes = [r.numel() for r in rows]
        elif isinstance(child, nn.Linear):
            _keep_rows(child, _share(0, child.out_features, p, name))
    for name in plan.row:
        child = getattr(module, name, None)
        if isinstance(child, nn.Linear):
            setattr(module, name, RowParallelLinear(child, p))


def _shard_vocab(model: nn.Module, p: ParallelState) -> None:
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear):
        raise NotImplementedError(
            f"{type(model).__name__}: tensor parallelism expects embed_tokens "
            f"(nn.Embedding) and lm_head (nn.Linear)"
        )
    tied = head.weight is embed.weight
    model.embed_tokens = VocabParallelEmbedding(embed, p)
    model.lm_head = ParallelLMHead(head, p, weight=model.embed_tokens.weight if tied else None)


def check_supported(arch: ModelArch, model_cls: type, world_size: int) -> None:
    """Raise (before any process starts) when this model cannot run on ``world_size`` ranks."""
    if _plan(arch.model_type) is None:
        raise NotImplementedError(
            f"tensor parallelism has no sharding plan for {arch.model_type} "
            f"({model_cls.__name__}); planned: {', '.join(_planned_classes())}"
        )
    shard_arch(arch, world_size)


def shard_model(model: nn.Module, p: ParallelState) -> None:
    """Keep this rank's shard of every parameter, in place (see the module docstring)."""
    arch = getattr(model, "arch", None)
    plan = _plan(arch.model_type) if isinstance(arch, ModelArch) else None
    if plan is None:
        raise NotImplementedError(
            f"tensor parallelism has no sharding plan for {type(model).__name__}"
        )
    done: set[int] = set()
    for module in list(model.modules()):
        if isinstance(module, MLAAttention):
            _shard_mla(module, p)
        elif isinstance(module, GatedDeltaNet):
            _shard_gdn(module, p)
        elif isinstance(module, FusedExperts):
            _shard_experts(module, p)
        elif isinstance(getattr(module, "attn", None), Attention) and isinstance(
            getattr(module, "qkv_proj", None), QKVLinear
        ):
            _shard_qkv_attention(module, p)
        else:
            _shard_mlp(module, plan, p)
            continue
        done.update(id(m) for m in module.modules())
    missed = [
        type(m).__name__ for m in model.modules() if isinstance(m, Attention) and id(m) not in done
    ]
    if missed:
        raise NotImplementedError(
            f"tensor parallelism: {len(missed)} attention layers of "
            f"{type(model).__name__} have no sharding rule"
        )
    _shard_vocab(model, p)


# --- per-rank architecture ----------------------------------------------------------------
