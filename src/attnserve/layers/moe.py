"""Mixture-of-experts layers: routing, the grouped expert computation and the MoE blocks.

What this file is:
- ``select_experts``: every router in use, from router logits to (weights, expert ids):
  softmax or sigmoid scores; greedy top-k, DeepSeek-V2 ``group_limited_greedy`` and DeepSeek-V3
  ``noaux_tc`` (selection on sigmoid scores plus a correction bias inside the best groups,
  weights from the scores without it); optional renormalisation and routed scaling; and the
  GPT-OSS order (top-k of the logits, softmax over the selected).
- ``FusedExperts``: all experts of a layer in two stacked weights, ``w13`` [E, 2I, H]
  ([gate | up] per expert) and ``w2`` [E, H, I], run as one grouped computation: token-expert
  pairs are sorted by expert and each expert's rows go through one matrix product. SwiGLU (or
  another gated activation) and GPT-OSS's clamped SwiGLU. On CUDA, SwiGLU and the clamped form
  run two grouped Triton kernels with no host sync (``ops/moe/experts_triton.py``) at every batch size,
  decode (CUDA-graphed) and prefill chunks alike, with tile sizes picked per batch.
- ``GatedMLP`` (dense layers, shared experts), ``SparseMoE`` (router + experts: Mixtral,
  Qwen3-MoE, GPT-OSS) and ``DeepseekMoE`` (fp32 router with an optional correction bias,
  routed experts and shared experts: DeepSeek V2/V3, GLM-4.5, Kimi).

What it is not: no expert parallelism (tensor parallelism splits the experts over the ranks:
``runner/parallel.py``), no quantised expert
compute (FP8 block scales, MXFP4: ``models/gpt_oss.py`` dequantises MXFP4 when loading), no
load-balancing losses, no Qwen2-MoE sigmoid-gated shared expert.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.attention import kernels
from attnserve.layers import gemv
from attnserve.layers.activation import gated, get_act_fn
from attnserve.layers.fused import forced_impl, uses_kernel
from attnserve.layers.linear import MergedLinear, Target, gate_up_rename, prefixed

if TYPE_CHECKING:
    from attnserve.arch import ModelArch, MoESpec

__all__ = ["DeepseekMoE", "FusedExperts", "GatedMLP", "SparseMoE", "select_experts"]

# --- routing ------------------------------------------------------------------------------


def select_experts(
    router_logits: torch.Tensor,
    spec: MoESpec,
    *,
    correction_bias: torch.Tensor | None = None,
    softmax_after_topk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``spec.top_k`` experts per token and their weights.

    Args:
        router_logits: [T, E] router outputs (computed in float32 from here on).
        spec: the model's ``MoESpec``: ``scoring`` (softmax | sigmoid), ``topk_method``
            (greedy | group_limited_greedy | noaux_tc), ``n_group``/``topk_group`` (the groups
            limit the choice only for the two grouped methods), ``norm_topk_prob`` and
            ``routed_scaling_factor`` (applied after any renormalisation).
        correction_bias: [E] added to the scores for choosing experts only (DeepSeek-V3's
            ``e_score_correction_bias``); the weights come from the scores without it.
        softmax_after_topk: GPT-OSS order: top-k of the raw logits, then a softmax over the
            selected ones (``scoring`` and ``norm_topk_prob`` are then not used).
    Returns:
        (topk_weights [T, k] float32, topk_ids [T, k] int64), highest choice score first.
    """
    logits = router_logits.float()
    k = spec.top_k
    if softmax_after_topk:
        top, ids = logits.topk(k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        scores = _scores(logits, spec.scoring)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if spec.n_group > 1 and spec.topk_method in ("group_limited_greedy", "noaux_tc"):
            choice = _limit_to_groups(choice, spec)
        elif spec.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported MoE topk_method '{spec.topk_method}'")
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids.long()


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"unsupported MoE scoring function '{scoring}' (softmax | sigmoid)")


def _limit_to_groups(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Keep the experts of the ``topk_group`` best groups; the others get -inf.

    A group's score is its best expert (``group_limited_greedy``, DeepSeek-V2) or the sum of
    its two best (``noaux_tc``, DeepSeek-V3, bias included).
    """
    t, e = choice.shape
    g = spec.n_group
    if e % g:
        raise ValueError(f"{e} experts do not split into n_group={g} groups")
    if spec.top_k > spec.topk_group * (e // g):
        allowed = spec.topk_group * (e // g)
        raise ValueError(f"top_k={spec.top_k} exceeds the {allowed} experts of topk_group groups")
    grouped = choice.view(t, g, e // g)  # [T, G, E/G]
    if spec.topk_method == "noaux_tc":
        group_scores = grouped.topk(min(2, e // g), dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)  # [T, G]
    best = group_scores.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


# --- experts ------------------------------------------------------------------------------


@functools.cache
def _moe_kernels():
    """``ops/moe/experts_triton``, imported on first use; None where Triton is missing."""
    try:
        from attnserve.ops.moe import experts_triton as triton_moe
    except ImportError:
        return None
    return triton_moe


_EXPERT_NAME = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)$")
_SHARD_ALIASES = dict(
    w1="gate", w3="up", w2="down", gate_proj="gate", up_proj="up", down_proj="down"
)
_W13_SHARDS = ("gate", "up", "gate_up", "gate_up_interleaved")
_W2_SHARDS = ("down", "down_transposed")


class FusedExperts(nn.Module):
    """The routed experts of one layer, stacked: ``w13`` [E, 2I, H], ``w2`` [E, H, I] (+ biases).

    Checkpoint shards (``load_expert_weight``; the parameters' ``weight_loader`` takes the
    shard as ``(expert, shard)``):
    - per expert (``expert`` an int): ``gate``/``up`` [I, H] (bias [I]) and ``down`` [H, I]
      (bias [H]); aliases ``w1``/``w3``/``w2`` (Mixtral) and ``*_proj``;
    - all experts at once (``expert`` None): ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]
      (transformers' in-memory layout), or GPT-OSS's ``gate_up_interleaved`` [E, H, 2I] with
      gate/up in even/odd columns and ``down_transposed`` [E, I, H]; biases [E, 2I] (same
      interleaving) and [E, H].
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        act: str = "silu",
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        if bias:
            self.w13_bias = nn.Parameter(
                torch.zeros(num_experts, 2 * intermediate), requires_grad=False
            )
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        else:
            self.w13_bias = self.w2_bias = None
        for p in self.parameters():
            p.weight_loader = self._weight_loader
        self.act = get_act_fn(act)
        self.swiglu_limit = swiglu_limit
        # the engine's choice of moe.experts variant (attention/kernels.py); None outside an
        # engine's build: the kernels wherever Triton runs them
        self.variant = kernels.model_kernel("moe.experts")
        self.swiglu_alpha = 1.702 if swiglu_alpha is None else swiglu_alpha
        # tensor parallelism (runner/parallel.py): this rank holds experts [first_expert,
        # first_expert + num_experts) and sums the ranks' partial outputs with ``all_reduce``
        self.first_expert = 0
        self.total_experts = num_experts  # over all ranks (sizes the kernels' tiles)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def extra_repr(self) -> str:
        clamp = f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit is not None else ""
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}, bias={self.w13_bias is not None}{clamp}"
        )

    # --- compute --------------------------------------------------------------------------
    @property
    def kernel_act(self) -> str | None:
        """The activation's name in ``ops/moe/experts_triton.py``, None where the kernel lacks it."""
        if self.swiglu_limit is not None:
            return "swiglu_clamped"
        return "silu" if self.act is F.silu else None

    def graph_safe(self, device: torch.device) -> bool:
        """Whether the experts run without host syncs on ``device`` (the Triton kernels)."""
        return device.type == "cuda" and self.kernel_act is not None and _moe_kernels() is not None

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], topk_weights [T, k], topk_ids [T, k] -> sum_j w_j * expert_j(x), [T, H].

        On CUDA (or under ``override_impl("triton")``) the two grouped Triton kernels of
        ``ops/moe/experts_triton.py``; else ``_forward_torch``, their twin."""
        if self._use_kernel(x):
            acc = _moe_kernels().fused_experts(
                x, self.w13, self.w2, topk_weights, topk_ids - self.first_expert, act=self.kernel_act,
                w13_bias=self.w13_bias, w2_bias=self.w2_bias, swiglu_limit=self.swiglu_limit or 0.0,
                swiglu_alpha=self.swiglu_alpha, num_global_experts=self.total_experts)
            if self.all_reduce is not None:
                acc = self.all_reduce(acc)
            return acc.to(x.dtype)
        return self._forward_torch(x, topk_weights, topk_ids)

    def _use_kernel(self, x: torch.Tensor) -> bool:
        """The kernels at every chunk size (decode batches and long prefill chunks alike: the
        kernels pick taller tiles for prefill), wherever Triton runs and has the activation.
        The loop, with its host sync and 2E launches, is the CPU path and the kernels' twin."""
        if self.variant == "torch" and forced_impl() is None:
            return False
        return uses_kernel(x) and self.kernel_act is not None and _moe_kernels() is not None

    def _forward_torch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Pairs sorted by expert, one loop iteration per expert (sizes read on the host)."""
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1) - self.first_expert  # [T*k] local expert ids
        if self.all_reduce is None:
            order = torch.argsort(flat_ids, stable=True)  # token-expert pairs grouped by expert
        else:  # tensor parallel: only the pairs routed to this rank's experts
            mine = ((flat_ids >= 0) & (flat_ids < self.num_experts)).nonzero().squeeze(1)
            order = mine[torch.argsort(flat_ids[mine], stable=True)]
        token = order // k  # [P] the token of each sorted pair
        counts = torch.bincount(flat_ids[order], minlength=self.num_experts).tolist()
        rows = x.index_select(0, token)  # [T*k, H]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self._expert(e, rows[start : start + n])
                start += n
        weights = topk_weights.reshape(-1).index_select(0, order).float()  # [T*k]
        acc = torch.zeros(t, self.hidden, dtype=torch.float32, device=x.device)
        acc.index_add_(0, token, out.float() * weights[:, None])
        if self.all_reduce is not None:
            acc = self.all_reduce(acc)
        return acc.to(x.dtype)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert on its rows: [n, H] -> [n, H]."""
        b13 = self.w13_bias[e] if self.w13_bias is not None else None
        b2 = self.w2_bias[e] if self.w2_bias is not None else None
        h = F.linear(rows, self.w13[e], b13)  # [n, 2I]
        return F.linear(self._activate(h), self.w2[e], b2)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] as [gate | up] -> [n, I]."""
        if self.swiglu_limit is None:
            return gated(gate_up, self.act)
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return gate * torch.sigmoid(self.swiglu_alpha * gate) * (up + 1)

    # --- loading --------------------------------------------------------------------------
    @staticmethod
    def checkpoint_target(suffix: str) -> tuple[str, tuple[int, str]] | None:
        """A per-expert checkpoint name under ``experts.`` -> (parameter, (expert, shard)).

        ``"3.gate_proj.weight"`` -> ``("w13", (3, "gate"))``; ``"0.w2.weight"`` -> ``("w2", (0,
        "down"))``; None for a name that is not a per-expert tensor.
        """
        m = _EXPERT_NAME.match(suffix)
        if m is None:
            return None
        shard = _SHARD_ALIASES[m.group(2)]
        param = "w13" if shard in _W13_SHARDS else "w2"
        return (param + ("_bias" if m.group(3) == "bias" else ""), (int(m.group(1)), shard))

    def load_expert_weight(
        self, name: str, tensor: torch.Tensor, expert: int | None, shard: str
    ) -> None:
        """Put one checkpoint tensor in place (see the class docstring for the shards).

        Args:
            name: the checkpoint name; a name ending in ``bias`` loads a bias.
            tensor: the checkpoint tensor.
            expert: the expert index, or None for a tensor that holds every expert.
            shard: gate | up | down (or w1 | w3 | w2, *_proj), gate_up, gate_up_interleaved,
                down_transposed.
        Raises:
            ValueError: an unknown shard, a missing bias parameter or a shape mismatch.
        """
        shard = _SHARD_ALIASES.get(shard, shard)
        if shard not in _W13_SHARDS + _W2_SHARDS:
            raise ValueError(f"{name}: unknown expert shard '{shard}'")
        param = ("w13" if shard in _W13_SHARDS else "w2") + (
            "_bias" if name.endswith("bias") else ""
        )
        target = getattr(self, param)
        if target is None:
            raise ValueError(f"{name}: these experts have no biases")
        try:
            self._weight_loader(target, tensor, (expert, shard))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    def _weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, str]
    ) -> None:
        expert, kind = shard
        kind = _SHARD_ALIASES.get(kind, kind)
        loaded = loaded.to(param.dtype)
        i = self.intermediate
        if expert is None:
            target = param.data
            if kind == "gate_up_interleaved":  # [E, H, 2I] or [E, 2I]: gate even, up odd columns
                loaded = torch.cat([loaded[..., 0::2], loaded[..., 1::2]], dim=-1)
                loaded = loaded.transpose(1, 2) if loaded.dim() == 3 else loaded  # [E, 2I, H]
            elif kind == "down_transposed" and loaded.dim() == 3:
                loaded = loaded.transpose(1, 2)  # [E, I, H] -> [E, H, I]
            elif kind not in ("gate_up", "down", "down_transposed"):
                raise ValueError(f"shard '{kind}' needs an expert index")
        elif not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (num_experts={self.num_experts})")
        elif kind in ("gate", "up"):
            target = param.data[expert].narrow(0, 0 if kind == "gate" else i, i)
        elif kind == "down":
            target = param.data[expert]
        else:
            raise ValueError(f"shard '{kind}' holds every expert: pass expert=None")
        if target.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for expert shard '{kind}': expected {tuple(target.shape)}, "
                f"checkpoint {tuple(loaded.shape)}"
            )
        target.copy_(loaded)


# --- blocks -------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with [gate | up] fused: dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = get_act_fn(act)
        self.small_m_gemv = gemv.enabled()  # decode sizes: small-M kernels, activation fused into down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gemv.linear(x, self.gate_up_proj, self.small_m_gemv))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(act(gate) * up) from the gate_up projection [T, 2I]."""
        return gemv.act_linear(gate_up, self.act, self.down_proj, self.small_m_gemv)

    @staticmethod
    def rename(suffix: str) -> Target:
        """``gate_proj.weight`` -> (``gate_up_proj.weight``, 0), ``up_proj.*`` -> shard 1."""
        return gate_up_rename(suffix)


class SparseMoE(nn.Module):
    """A router (a linear layer in the model dtype) over routed experts, no shared expert.

    Mixtral and Qwen3-MoE (softmax, top-k, optional renormalisation) and GPT-OSS (router bias,
    softmax over the top-k logits). Parameters: ``gate.weight`` [E, H] (+ ``gate.bias``),
    ``experts.*``.
    """

    def __init__(
        self,
        spec: MoESpec,
        experts: FusedExperts,
        *,
        router_bias: bool = False,
        softmax_after_topk: bool = False,
    ):
        super().__init__()
        self.spec = spec
        self.softmax_after_topk = softmax_after_topk
        self.gate = nn.Linear(experts.hidden, spec.num_experts, bias=router_bias)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.gate(x), self.spec, softmax_after_topk=self.softmax_after_topk
        )
        return self.experts(x, weights, ids)

    @staticmethod
    def rename(suffix: str) -> Target:
        """A checkpoint name under the block (``gate.weight``, ``experts.N.w1.weight``, ...)."""
        if suffix.startswith("experts."):
            target = FusedExperts.checkpoint_target(suffix[len("experts.") :])
            if target is not None:
                return "experts." + target[0], target[1]
        return suffix  # unchanged: a name the block lacks is reported by the loader


class _Router(nn.Module):
    """DeepSeek's gate: float32 ``weight`` [E, H] and, for noaux_tc, ``e_score_correction_bias``."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False
        )
        bias = torch.zeros(num_experts, dtype=torch.float32)
        self.e_score_correction_bias = (
            nn.Parameter(bias, requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [T, E] float32, as DeepSeek/GLM route


class DeepseekMoE(nn.Module):
    """DeepSeek-style MoE: float32 gate (+ correction bias), routed experts, shared experts.

    Reads ``arch.moe`` (routing) and ``arch.hidden_act``. Checkpoint names under
    ``mlp.``: ``gate.weight``, ``gate.e_score_correction_bias``,
    ``experts.N.{gate,up,down}_proj.weight``, ``shared_experts.{gate,up,down}_proj.weight``;
    ``rename`` maps them to this module's parameters.
    """

    def __init__(self, arch: ModelArch):
        super().__init__()
        spec = arch.moe
        if spec is None:
            raise ValueError(f"{arch.model_type}: DeepseekMoE needs arch.moe")
        act = arch.hidden_act
        self.spec = spec
        self.gate = _Router(arch.hidden_size, spec.num_experts, spec.topk_method == "noaux_tc")
        self.experts = FusedExperts(
            spec.num_experts, arch.hidden_size, spec.intermediate_size, act=act
        )
        self.shared_experts = None
        if spec.num_shared_experts:
            inter = (
                spec.shared_intermediate_size or spec.num_shared_experts * spec.intermediate_size
            )
            self.shared_experts = GatedMLP(arch.hidden_size, inter, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = select_experts(
            self.gate(x), self.spec, correction_bias=self.gate.e_score_correction_bias
        )
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @staticmethod
    def rename(suffix: str) -> Target:
        """A checkpoint name under ``mlp.`` -> this module's parameter (and shard), or None.

        A model's own rename calls this for the names of its MoE layers and passes the result,
        prefixed, to ``models.weights.load_named_weights``.
        """
        if suffix.startswith("shared_experts."):
            return prefixed("shared_experts.", GatedMLP.rename(suffix[len("shared_experts.") :]))
        return SparseMoE.rename(suffix)
