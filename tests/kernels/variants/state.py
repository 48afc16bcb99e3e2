"""The harness of the state-layer operations (``gdn``, ``kda``, ``mamba``, ``lightning``, each
``.decode`` and ``.prefill``): the state backend that launches the variant (TRITON_GDN runs the
Triton kernels, TORCH_GDN the PyTorch forms, and so on), built with it, over a slot pool, against
each mechanism's recurrence applied token by token, in float64 on the CPU, from each request's
initial state (``_conv``, ``_delta_rule``, ``_scan``, ``_lightning`` below: the equations of
``attention/state/*.py``'s docstrings written out as loops, none of that code).

A spec maps to a step as the runner maps one (``runner/model_runner.py``): a request with cached
tokens has a state already (random rows of the pool), one without starts from zeros (its row
holds garbage that must not be read); the leading one-token requests with a state are the state
decodes (``num_state_decodes``) and every other request takes the prefill form, so the ``decode``
spec, whose first request is a one-token prompt, has prefill rows only. The whole step runs as
the backend runs it; compared are every token's output and the pool's conv and recurrent tensors
(the requests' rows must hold the reference's final states, every other row be unchanged).

Tolerance (float32 inputs, float32 states): 1e-4 of the reference's largest value, the bound
``tests/unit/test_state_ops.py`` holds the chunked forms to against the token-by-token recurrence
and the transformers oracles. The chunked prefills (the WY form's triangular solves, Mamba's
log-depth scan, lightning's blocks) and the kernels (tf32x3 dots on a GPU) sum in other orders
than a token loop; measured on CPU (Triton's interpreter) the errors stay below 1.2e-6. The
attention features (window, ALiBi, sinks, soft-cap), the fp8 cache and 64-token pages have no
meaning for a state layer: those specs return why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from attnserve.attention.backend import tensor_problem
from attnserve.attention.kernels import KernelVariant
from attnserve.attention.registry import load_backend
from attnserve.attention.state import lightning_decay_rates
from attnserve.kvcache.state import StateCache
from tests.kernels.variants import (
    BatchSpec,
    Mode,
    Result,
    backend_kernels,
    make_common,
    paged_layout,
    relative_error,
)

WIDTH = 4  # the short conv's taps
SPARE_SLOTS = 3  # pool rows no request owns (besides the null slot 0): they must stay as they were
TOLERANCE = 1e-4  # float32; see the module docstring

# (a request's token rows, its conv states, its recurrent state; float64, zeros on a first chunk)
#   -> (its outputs, its new conv states, its new recurrent state)
Reference = Callable[[slice, list[torch.Tensor], torch.Tensor],
                     tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]]


@dataclass
class _Case:
    """One mechanism's layer, per-token inputs and state cache (on the device), and its reference."""

    layer: SimpleNamespace
    inputs: tuple[torch.Tensor, ...]
    cache: StateCache
    reference: Reference
    names: tuple[str, ...]  # of the cache's tensors, for the report


# --- the references: float64 loops over one request's tokens -----------------------------------

def _conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor):
    """SiLU(causal depthwise conv) of x [L, C] after its conv state [C, K-1] (oldest first):
    (outputs [L, C], the new state: the last K-1 inputs of [state | x])."""
    full = torch.cat([state, x.T], dim=1)  # [C, K-1+L]
    k = w.shape[1]
    out = torch.stack([(full[:, t:t + k] * w).sum(1) for t in range(x.shape[0])])
    if bias is not None:
        out = out + bias
    return F.silu(out), full[:, full.shape[1] - (k - 1):]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # eps inside the root (FLA)


def _delta_rule(q, k, v, g, beta, s):
    """The gated delta rule with l2-normalised q, k: q, k [L, Hk, dk], v [L, Hv, dv] (value head j
    reads key head j // (Hv / Hk)), g [L, Hv, 1 or dk] log decay, beta [L, Hv], s [Hv, dk, dv]::

        S <- diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t / sqrt(dk)
    """
    group = v.shape[1] // q.shape[1]
    q, k = (_l2norm(x).repeat_interleave(group, dim=1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    outs = []
    for t in range(v.shape[0]):
        s = s * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][..., None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def _scan(x, dt, a, b, c, d, z, h):
    """Mamba-1: x, dt, z [L, Di], a [Di, N], b, c [L, N], d [Di], h [Di, N]::

        h <- exp(dt A) h + (dt x) B;  y = (C . h + D x) SiLU(z)
    """
    outs = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t][:, None] * a) * h + (dt[t] * x[t])[:, None] * b[t][None, :]
        outs.append((h @ c[t] + d * x[t]) * F.silu(z[t]))
    return torch.stack(outs), h


def _lightning(q, k, v, rates, s):
    """Lightning attention: q, k [L, H, dk], v [L, H, dv], rates [H], s [H, dk, dv]::

        S <- exp(-rate) S + k_t v_t^T;  o_t = S^T q_t
    """
    decay = torch.exp(-rates)[:, None, None]
    outs = []
    for t in range(v.shape[0]):
        s = decay * s + k[t][..., None] * v[t][:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


# --- each mechanism's layer, inputs and pool (float32; a few heads, head dims 16 to 32) ---------

def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _gdn(gen: torch.Generator, t: int, num_slots: int, device: torch.device) -> _Case:
    hk, hv, dk, dv = 2, 4, 16, 32  # two value heads a key head
    c = 2 * hk * dk + hv * dv
    w, mixed = _randn(gen, c, WIDTH, scale=0.5), _randn(gen, t, c)
    g = -F.softplus(_randn(gen, t, hv)) * 0.5  # log decay <= 0, float32 as the layer gives it
    beta = torch.sigmoid(_randn(gen, t, hv))
    conv, rec = _randn(gen, num_slots, c, WIDTH - 1), _randn(gen, num_slots, hv, dk, dv, scale=0.5)
    layer = SimpleNamespace(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, conv_weight=w.to(device))
    m64, w64, g64, b64 = (x.double() for x in (mixed, w, g, beta))

    def reference(rows, convs, state):
        x, conv_state = _conv(m64[rows], w64, None, convs[0])
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        out, state = _delta_rule(q.view(-1, hk, dk), k.view(-1, hk, dk), v.view(-1, hv, dv), g64[rows, :, None],
                                 b64[rows], state)
        return out, [conv_state], state

    inputs = tuple(x.to(device) for x in (mixed, g, beta))
    return _Case(layer, inputs, StateCache((conv.to(device),), (rec.to(device),)), reference, ("conv", "state"))


def _kda(gen: torch.Generator, t: int, num_slots: int, device: torch.device) -> _Case:
    h, d = 3, 16
    qkv = [_randn(gen, t, h * d) for _ in range(3)]
    weights = [_randn(gen, h * d, WIDTH, scale=0.5) for _ in range(3)]
    g = -F.softplus(_randn(gen, t, h, d)) * 0.5  # per key channel
    beta = torch.sigmoid(_randn(gen, t, h))
    convs = [_randn(gen, num_slots, h * d, WIDTH - 1) for _ in range(3)]
    rec = _randn(gen, num_slots, h, d, d, scale=0.5)
    layer = SimpleNamespace(num_heads=h, head_dim=d, conv_weights=tuple(w.to(device) for w in weights))
    qkv64, w64 = [x.double() for x in qkv], [w.double() for w in weights]
    g64, b64 = g.double(), beta.double()

    def reference(rows, conv_states, state):
        done = [_conv(x[rows], w, None, s) for x, w, s in zip(qkv64, w64, conv_states)]
        q, k, v = (x.view(-1, h, d) for x, _ in done)
        out, state = _delta_rule(q, k, v, g64[rows], b64[rows], state)
        return out, [s for _, s in done], state

    inputs = tuple(x.to(device) for x in (*qkv, g, beta))
    cache = StateCache(tuple(x.to(device) for x in convs), (rec.to(device),))
    return _Case(layer, inputs, cache, reference, ("conv q", "conv k", "conv v", "state"))


def _ssm_params(xc, w_dt, dt_bias, w_bc, n: int):
    """The fake layer's token-wise SSM inputs from the conv output: (dt after softplus, B, C)."""
    b, c = (xc @ w_bc).split(n, dim=-1)
    return F.softplus(xc @ w_dt + dt_bias), b, c


def _mamba(gen: torch.Generator, t: int, num_slots: int, device: torch.device) -> _Case:
    di, n = 32, 16
    x, z = _randn(gen, t, di), _randn(gen, t, di)
    w, bias = _randn(gen, di, WIDTH, scale=0.5), _randn(gen, di, scale=0.1)
    a, skip = -torch.exp(_randn(gen, di, n, scale=0.5)), _randn(gen, di)
    w_dt, dt_bias = _randn(gen, di, di, scale=0.5 * di**-0.5), _randn(gen, di, scale=0.5) - 1
    w_bc = _randn(gen, di, 2 * n, scale=di**-0.5)
    conv, rec = _randn(gen, num_slots, di, WIDTH - 1), _randn(gen, num_slots, di, n)
    dev = [p.to(device) for p in (w_dt, dt_bias, w_bc)]
    layer = SimpleNamespace(conv_weight=w.to(device), conv_bias=bias.to(device), A=a.to(device), D=skip.to(device),
                            ssm_params=lambda xc: _ssm_params(xc, *dev, n))
    x64, z64, w64, bias64, a64, skip64 = (p.double() for p in (x, z, w, bias, a, skip))
    params64 = [p.double() for p in (w_dt, dt_bias, w_bc)]

    def reference(rows, convs, state):
        xc, conv_state = _conv(x64[rows], w64, bias64, convs[0])
        dt, b, c = _ssm_params(xc, *params64, n)
        out, state = _scan(xc, dt, a64, b, c, skip64, z64[rows], state)
        return out, [conv_state], state

    inputs = (x.to(device), z.to(device))
    return _Case(layer, inputs, StateCache((conv.to(device),), (rec.to(device),)), reference, ("conv", "state"))


def _lightning_case(gen: torch.Generator, t: int, num_slots: int, device: torch.device) -> _Case:
    h, dk, dv = 3, 16, 32
    q, k, v = _randn(gen, t, h, dk, scale=0.3), _randn(gen, t, h, dk, scale=0.3), _randn(gen, t, h, dv)
    rates = lightning_decay_rates(h, 1, 4)  # MiniMax's per-head rates of layer 1 of 4
    rec = _randn(gen, num_slots, h, dk, dv, scale=0.5)
    # 16-token blocks: the 23-token prefill crosses a block of the PyTorch form
    layer = SimpleNamespace(decay_rates=rates.to(device), block_size=16)
    q64, k64, v64, rates64 = (x.double() for x in (q, k, v, rates))

    def reference(rows, convs, state):
        out, state = _lightning(q64[rows], k64[rows], v64[rows], rates64, state)
        return out, [], state

    inputs = tuple(x.to(device) for x in (q, k, v))
    return _Case(layer, inputs, StateCache((), (rec.to(device),)), reference, ("state",))


CASES: dict[str, Callable[[torch.Generator, int, int, torch.device], _Case]] = {
    "gdn": _gdn, "kda": _kda, "mamba": _mamba, "lightning": _lightning_case}


# --- the step ----------------------------------------------------------------------------------

def _state_decodes(spec: BatchSpec) -> int:
    """The leading one-token requests with a state (the runner's ``num_state_decodes``)."""
    n = 0
    for q, c in zip(spec.query_lens, spec.context_lens):
        if q != 1 or c == 0:
            break
        n += 1
    return n


def _not_applicable(spec: BatchSpec, kind: str) -> str | None:
    if spec.features:
        return f"{', '.join(sorted(spec.features))}: attention features, a state layer has none"
    if spec.fp8:
        return ("fp8 KV cache: state layers keep their conv state in the model dtype and the recurrent "
                "state in float32, whatever kv_cache_dtype is")
    if spec.block_size != 16:
        return f"{spec.block_size}-token pages: a state layer keeps one slot a request, no pages"
    nsd = _state_decodes(spec)
    if kind == "decode" and nsd == 0:
        first = "a one-token prompt" if spec.query_lens[0] == 1 else f"a {spec.query_lens[0]}-token chunk"
        return f"no state decode rows: the first request is {first}, so num_state_decodes is 0"
    if kind == "prefill" and nsd == len(spec.query_lens):
        return "no prefill rows: every request is a state decode"
    return None


def _reference(case: _Case, spec: BatchSpec, slots: list[int], before: list[torch.Tensor]):
    """Every token's reference output and the pool tensors as the step must leave them."""
    pool = [x.double().cpu() for x in before]
    num_conv = len(case.cache.conv)
    outs, start = [], 0
    for q, c, slot in zip(spec.query_lens, spec.context_lens, slots):
        init = [p[slot] if c > 0 else torch.zeros_like(p[slot]) for p in pool]
        out, convs, state = case.reference(slice(start, start + q), init[:num_conv], init[num_conv])
        for p, new in zip(pool, [*convs, state]):
            p[slot] = new
        outs.append(out)
        start += q
    return torch.cat(outs), pool


def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str:
    assert mode.numeric, f"{variant.key}: no state variant is Gluon, so no compile run reaches this harness"
    mech, _, kind = variant.op.partition(".")
    why = _not_applicable(spec, kind)
    if why is not None:
        return why
    device, gen = mode.device, spec.generator()
    _, table, kv_slots = paged_layout(spec, gen)  # the attention groups' fields (state backends read none)
    common = make_common(spec, table, kv_slots, device)
    num_reqs = len(spec.query_lens)
    num_slots = 1 + num_reqs + SPARE_SLOTS  # slot 0 is the null slot
    slots = (torch.randperm(num_slots - 1, generator=gen) + 1)[:num_reqs]
    common.state_slots = slots.to(device)
    common.has_initial_state = torch.tensor([c > 0 for c in spec.context_lens], device=device)
    common.num_state_decodes = nsd = _state_decodes(spec)
    case = CASES[mech](gen, common.num_tokens, num_slots, device)
    reasons = variant.takes(tensor_problem(case.inputs[0]))
    if reasons:
        return "; ".join(reasons)
    (backend_name,) = variant.launched_by
    backend = load_backend(backend_name)(spec.block_size, backend_kernels(variant, mode))
    # a state backend runs one fixed kernel per operation: a Triton one, or the PyTorch form (None)
    assert (getattr(backend, kind) is not None) == (variant.tech == "triton"), (backend_name, variant.key)
    before = [x.clone() for x in case.cache.tensors()]
    out = backend.forward(case.layer, case.inputs, case.cache, backend.build_metadata(common, 0))
    ref_out, ref_pool = _reference(case, spec, slots.tolist(), before)
    split = common.query_start_loc_cpu[nsd]
    errors = {name: relative_error(out[rows], ref_out[rows])
              for name, rows in (("decode rows", slice(None, split)), ("prefill rows", slice(split, None)))
              if ref_out[rows].numel()}
    errors |= {name: relative_error(got, want) for name, got, want in zip(case.names, case.cache.tensors(), ref_pool)}
    detail = ", ".join(f"{name} {err:.2g}" for name, err in errors.items())
    return Result(max(errors.values()), TOLERANCE, detail)
