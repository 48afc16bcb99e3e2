"""The harness of the model's own operations, ``dense.small_m`` and ``moe.experts``: the layer code
that launches them (``layers/gemv.py``'s entry points, a ``FusedExperts`` layer) with the variant
forced, against float32 references on the CPU.

Each layer learns the variant as a model built by the engine does (``kernels.model_kernels``
around its construction): the torch variants run on that choice alone, the Triton ones are also
forced by the override of their dispatch (``gemv.override_impl`` / ``layers/fused.override_impl``
"triton"), without which CPU tensors never reach a kernel.

- ``dense.small_m`` (triton_gemv, torch): ``gemv.linear``, ``gemv.norm_linear`` (a plain RMSNorm,
  with and without a residual) and ``gemv.act_linear`` (every activation with a fused form),
  passed ``gemv.enabled()`` as the model's layers are, against their twins (``F.linear``,
  ``norm_linear_ref``, ``act_linear_ref``). The plan gives the op decode steps only, and the
  kernels serve one row (``gemv.MAX_M``): a decode spec runs each of its decode rows as a one-row
  step; prefill and mixed steps have more rows, so their specs do not apply.
- ``moe.experts`` (triton, torch): a ``FusedExperts`` layer (``_use_kernel`` reads its ``variant``
  and the override) over the spec's tokens (every step kind), SwiGLU without biases and GPT-OSS's
  clamped SwiGLU with biases; the reference loops over tokens and their top-k experts (gate/up,
  activation, down, weighted sum).

Which path ran is checked too (the kernels' entry points are wrapped and counted), so a silent
fallback to the PyTorch path cannot pass for the kernel. Float32, tolerance 1e-4 of the reference's
largest value: the kernels accumulate in float32 (``ieee`` dots, no TF32), and the twins' own tests
bound them within a few float32 ulps of |a| @ |W| (``tests/kernels/test_triton_gemv.py``,
``test_triton_moe.py`` at 1e-5). The attention features and the fp8 KV cache of a spec do not
concern these layers: those specs do not apply.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.attention.backend import tensor_problem
from attnserve.attention.kernels import KernelVariant, model_kernels
from attnserve.layers import fused, gemv
from attnserve.layers.activation import get_act_fn
from attnserve.layers.moe import FusedExperts
from attnserve.layers.norm import RMSNorm
from tests.kernels.variants import BatchSpec, Mode, Result, relative_error

K, N, INTER = 96, 80, 72  # none a multiple of the kernels' blocks
NUM_EXPERTS, HIDDEN, EXPERT_INTER, TOP_K = 8, 48, 40, 2
SWIGLU_LIMIT, SWIGLU_ALPHA = 3.0, 1.702  # a limit the gate/up values cross (std about 3.5)
TOL = 1e-4
_GEMV_KERNELS = ("attnserve.ops.dense.gemv_triton", ("linear", "rms_norm_linear", "act_and_mul_linear"))
_MOE_KERNELS = ("attnserve.ops.moe.experts_triton", ("fused_experts",))


@contextlib.contextmanager
def _counting(module: str, names: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Counts the calls of ``module``'s kernel entry points within the block (none without Triton)."""
    calls = dict.fromkeys(names, 0)
    try:
        mod = importlib.import_module(module)
    except ImportError:
        yield calls
        return
    with contextlib.ExitStack() as stack:
        for name in names:
            fn = getattr(mod, name)

            def counted(*args, _fn=fn, _name=name, **kwargs):
                calls[_name] += 1
                return _fn(*args, **kwargs)

            stack.enter_context(mock.patch.object(mod, name, counted))
        yield calls


def _check_path(variant: KernelVariant, calls: dict[str, int], want: dict[str, int]) -> None:
    if variant.tech == "triton":
        assert calls == want, f"{variant.key}: kernel calls {calls}, expected {want}"
    else:
        assert not any(calls.values()), f"{variant.key} launched kernels: {calls}"


def _not_applicable(spec: BatchSpec) -> str | None:
    if spec.features:
        return f"the attention features ({', '.join(sorted(spec.features))}) do not concern the model's layers"
    if spec.fp8:
        return "an fp8 KV cache does not concern the model's layers"
    return None


def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str:
    assert mode.numeric, f"{variant.key} is not Gluon: no compile run"
    why = _not_applicable(spec)
    if why:
        return why
    if variant.op == "dense.small_m":
        return _small_m(variant, spec, mode.device)
    return _experts(variant, spec, mode.device)


# --- dense.small_m ----------------------------------------------------------------------------


def _randn(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _linear(gen: torch.Generator, k: int, device: torch.device) -> nn.Linear:
    layer = nn.Linear(k, N, device=device)
    with torch.no_grad():
        layer.weight.copy_(_randn(gen, N, k, std=k**-0.5))
        layer.bias.copy_(_randn(gen, N))
    return layer


def _forced(variant: KernelVariant) -> str | None:
    """The override of the layers' dispatch: the kernels for a Triton variant, else none."""
    return "triton" if variant.tech == "triton" else None


def _small_m_row(gen: torch.Generator, device: torch.device, variant: KernelVariant) -> tuple[list, list]:
    """One one-row step: every entry point as a model built with ``variant`` runs it, and its twin
    (on the CPU)."""
    with model_kernels({variant.op: variant.name}):
        on = gemv.enabled()  # what the model's layers read when they are built
    lin, down = _linear(gen, K, device), _linear(gen, INTER, device)
    norm = RMSNorm(K, eps=1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(K, generator=gen) + 0.5)
    x, res, gate_up = _randn(gen, 1, K), _randn(gen, 1, K), _randn(gen, 1, 2 * INTER)
    xd, rd, gd = x.to(device), res.to(device), gate_up.to(device)
    cpu = {n: p.detach().cpu() for n, p in [("w", lin.weight), ("b", lin.bias), ("nw", norm.weight),
                                             ("dw", down.weight), ("db", down.bias)]}
    with torch.no_grad(), gemv.override_impl(_forced(variant)):
        got = [gemv.linear(xd, lin, on), *gemv.norm_linear(norm, xd, rd, lin, on),
               *gemv.norm_linear(norm, xd, None, lin, on)]
        got += [gemv.act_linear(gd, get_act_fn(a), down, on) for a in fused.FUSED_ACTS]
    want = [F.linear(x, cpu["w"], cpu["b"]), *gemv.norm_linear_ref(x, cpu["nw"], 1e-6, cpu["w"], cpu["b"], res),
            gemv.norm_linear_ref(x, cpu["nw"], 1e-6, cpu["w"], cpu["b"]), x]
    want += [gemv.act_linear_ref(gate_up, a, cpu["dw"], cpu["db"]) for a in fused.FUSED_ACTS]
    return got, want


def _small_m(variant: KernelVariant, spec: BatchSpec, device: torch.device) -> Result | str:
    if spec.kind == "prefill":
        return "dense.small_m serves one-row steps"
    if spec.kind == "mixed":
        return "dense.small_m serves one-row steps: the plan gives it decode steps, a mixed one has more rows"
    reasons = variant.takes(tensor_problem(torch.empty(1, K, device=device)))
    if reasons:
        return "; ".join(reasons)
    gen = spec.generator()
    err = 0.0
    for _ in range(spec.num_decodes):  # each decode row a one-row step of its own
        with _counting(*_GEMV_KERNELS) as calls:
            got, want = _small_m_row(gen, device, variant)
        _check_path(variant, calls, {"linear": 1, "rms_norm_linear": 2, "act_and_mul_linear": len(fused.FUSED_ACTS)})
        err = max(err, *(relative_error(g, w) for g, w in zip(got, want, strict=True)))
    return Result(err, TOL, f"({spec.num_decodes} one-row steps)")


# --- moe.experts ------------------------------------------------------------------------------


def _experts_layer(gen: torch.Generator, clamped: bool, device: torch.device) -> FusedExperts:
    if clamped:
        layer = FusedExperts(NUM_EXPERTS, HIDDEN, EXPERT_INTER, bias=True, swiglu_limit=SWIGLU_LIMIT,
                             swiglu_alpha=SWIGLU_ALPHA)
    else:
        layer = FusedExperts(NUM_EXPERTS, HIDDEN, EXPERT_INTER)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(_randn(gen, *p.shape, std=0.5 if clamped else 0.3))
    return layer.to(device)


def _activate(gate: torch.Tensor, up: torch.Tensor, clamped: bool) -> torch.Tensor:
    if not clamped:
        return gate * torch.sigmoid(gate) * up  # SwiGLU
    gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (up + 1)  # GPT-OSS


def reference_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: FusedExperts,
                      clamped: bool) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), a token and an expert at a time, float32 on the CPU."""
    w13, w2 = layer.w13.detach().float().cpu(), layer.w2.detach().float().cpu()
    b13 = layer.w13_bias.detach().float().cpu() if clamped else torch.zeros(w13.shape[:2])
    b2 = layer.w2_bias.detach().float().cpu() if clamped else torch.zeros(w2.shape[:2])
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t] + b13[e]
            a = _activate(h[:EXPERT_INTER], h[EXPERT_INTER:], clamped)
            out[t] += weights[t, j] * (w2[e] @ a + b2[e])
    return out


def _experts(variant: KernelVariant, spec: BatchSpec, device: torch.device) -> Result | str:
    gen = spec.generator()
    tokens = sum(spec.query_lens)
    err = 0.0
    for clamped in (False, True):
        with model_kernels({variant.op: variant.name}):  # the layer reads the plan's choice
            layer = _experts_layer(gen, clamped, device)
        assert layer.variant == variant.name
        act = "swiglu_clamped" if clamped else "silu"
        reasons = variant.takes(tensor_problem(torch.empty(1, HIDDEN, device=device), activation=act))
        if reasons:
            return "; ".join(reasons)
        x = _randn(gen, tokens, HIDDEN)
        # top-k of the first E - 1 experts: the last one gets no token
        ids = _randn(gen, tokens, NUM_EXPERTS - 1).topk(TOP_K, dim=-1).indices
        weights = torch.rand(tokens, TOP_K, generator=gen)
        with torch.no_grad(), fused.override_impl(_forced(variant)), _counting(*_MOE_KERNELS) as calls:
            out = layer(x.to(device), weights.to(device), ids.to(device))
        _check_path(variant, calls, {"fused_experts": 1})
        err = max(err, relative_error(out, reference_experts(x, weights, ids, layer, clamped)))
    return Result(err, TOL, f"({tokens} tokens, top-{TOP_K} of {NUM_EXPERTS})")
