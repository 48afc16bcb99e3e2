"""State-layer math (conv, Gated DeltaNet, Mamba, lightning, KDA) against the transformers oracles.

Every mechanism is wrapped in a ``Case`` (token inputs, prefill, decode, oracle) and runs through
the same checks: prefill of a varlen batch == the oracle per sequence (out-of-order state rows,
some sequences new and some continuing); chunked prefill == the per-token decode recurrence;
prefill split into pieces == one shot; decode after prefill == the oracle's recurrence; the
chunk size does not matter; one sequence's inputs do not reach another's outputs or state.
float32 throughout; "close" means max |error| <= 1e-4 * max |reference| per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import MiniMaxConfig
from transformers.models.jamba.modeling_jamba import (
    mamba_selective_scan,
    mamba_selective_state_update,
)
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from attnserve.attention.state import (
    causal_conv1d_prefill,
    gated_delta_decode,
    gated_delta_prefill,
    kda_decode,
    kda_prefill,
    lightning_attention_decode,
    lightning_attention_prefill,
    lightning_decay_rates,
    selective_scan_decode,
    selective_scan_prefill,
)
from attnserve.attention.state import causal_conv1d_update as conv_update

Tokens = dict[str, torch.Tensor]  # per-token inputs, token dim first


@dataclass
class Case:
    name: str
    state_shape: tuple[int, ...]  # per sequence
    make: Callable[[torch.Generator, int], Tokens]
    prefill: Callable[..., torch.Tensor]  # (tok, state, qsl, idx, has_init, chunk) -> out
    decode: Callable[..., torch.Tensor]  # (tok, state, idx) -> out
    oracle: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (tok, init|None, recurrent)


def _rn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _one(tok: Tokens) -> Tokens:
    return {n: t[None] for n, t in tok.items()}  # add a batch dim of 1


def _meta(qsl, idx, init):
    return {"query_start_loc": qsl, "state_indices": idx, "has_initial_state": init}


def _chunk(kw: str, chunk: int | None) -> dict:
    return {} if chunk is None else {kw: chunk}


def _conv_case() -> Case:
    gen = torch.Generator().manual_seed(1)
    w, b = _rn(gen, 12, 4) * 0.5, _rn(gen, 12)

    def prefill(tok, state, qsl, idx, init, chunk=None):
        return causal_conv1d_prefill(tok["x"], w, b, state, silu=True, **_meta(qsl, idx, init))

    def oracle(tok, init, recurrent):
        s = torch.zeros(1, 12, 3) if init is None else init[None].clone()
        out = causal_conv1d_update(tok["x"].T[None], s, w, b, activation="silu")  # [1, C, L]
        return out[0].T, s[0]

    return Case(
        "conv",
        (12, 3),
        lambda g, n: {"x": _rn(g, n, 12)},
        prefill,
        lambda tok, state, idx: conv_update(tok["x"], w, b, state, state_indices=idx, silu=True),
        oracle,
    )


def _delta_case(name: str, hk: int, hv: int, per_channel: bool) -> Case:
    """Gated DeltaNet (per-head decay, hk key heads shared by hv value heads) or KDA."""
    kda = (kda_prefill, kda_decode, chunk_kimi_delta_attention, recurrent_kimi_delta_attention)
    gdn = (
        gated_delta_prefill,
        gated_delta_decode,
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
    prefill_fn, decode_fn, chunk_fn, step_fn = kda if per_channel else gdn
    g_shape = (hv, 16) if per_channel else (hv,)

    def make(g, n):
        q, k, v = _rn(g, n, hk, 16), _rn(g, n, hk, 16), _rn(g, n, hv, 8)
        decay, beta = -F.softplus(_rn(g, n, *g_shape)) * 0.5, torch.sigmoid(_rn(g, n, hv))
        return {"q": q, "k": k, "v": v, "g": decay, "beta": beta}

    def prefill(tok, state, qsl, idx, init, chunk=None):
        kw = _chunk("chunk_size", chunk) | _meta(qsl, idx, init)
        return prefill_fn(**tok, state=state, use_qk_l2norm=True, **kw)

    def decode(tok, state, idx):
        return decode_fn(**tok, state=state, state_indices=idx, use_qk_l2norm=True)

    def oracle(tok, init, recurrent):
        t = _one(tok)
        init = None if init is None else init[None]
        kw = {"initial_state": init, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        fn = step_fn if recurrent else chunk_fn
        out, s = fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], **kw)
        return out[0], s[0]

    return Case(name, (hv, 16, 8), make, prefill, decode, oracle)


def _mamba_case() -> Case:
    gen = torch.Generator().manual_seed(2)
    a, d = -torch.exp(_rn(gen, 16, 8) * 0.5), _rn(gen, 16)

    def make(g, n):
        return {
            "x": _rn(g, n, 16),
            "dt": F.softplus(_rn(g, n, 16) - 1),
            "B": _rn(g, n, 8),
            "C": _rn(g, n, 8),
            "z": _rn(g, n, 16),
        }

    def args(tok):
        return tok["x"], tok["dt"], a, tok["B"], tok["C"], d, tok["z"]

    def prefill(tok, state, qsl, idx, init, chunk=None):
        kw = _chunk("chunk_size", chunk) | _meta(qsl, idx, init)
        return selective_scan_prefill(*args(tok), state, **kw)

    def decode(tok, state, idx):
        return selective_scan_decode(*args(tok), state, state_indices=idx)

    def oracle(tok, init, recurrent):
        if init is None and not recurrent:  # the HF scan always starts from zeros
            t = {n: x.T[None] for n, x in tok.items()}  # [1, D or N, L]
            out, s = mamba_selective_scan(
                t["x"], t["dt"], a, t["B"], t["C"], d, t["z"], return_last_state=True
            )
            return out[0].T, s[0]
        s = torch.zeros(1, 16, 8) if init is None else init[None].clone()
        x, dt, _, b, c, _, z = (t[:, None] for t in args(tok))  # one token at a time
        outs = [
            mamba_selective_state_update(s, x[i], dt[i], a, b[i], c[i], d, z=z[i])
            for i in range(len(x))
        ]
        return torch.cat(outs), s[0]

    return Case("mamba", (16, 8), make, prefill, decode, oracle)


class _LinearCacheStub:
    """Just enough of a transformers Cache for MiniMaxLightningAttention's recurrent branch."""

    def __init__(self, state: torch.Tensor):
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.state = state


def _lightning_case() -> Case:
    torch.manual_seed(3)  # the HF module draws its weights from the global generator
    cfg = MiniMaxConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
        block_size=16,
    )
    hf = MiniMaxLightningAttention(cfg, layer_idx=1).eval()
    rates = lightning_decay_rates(4, 1, 4)
    captured: list[torch.Tensor] = []
    hf.norm.register_forward_hook(lambda m, args, out: captured.append(args[0]))

    def make(g, n):
        h = _rn(g, n, 32)
        qkv = F.silu(hf.qkv_proj(h)).detach().view(n, 4, 24)  # per head [q 8 | k 8 | v 8]
        return {"h": h, "q": qkv[..., :8], "k": qkv[..., 8:16], "v": qkv[..., 16:]}

    def prefill(tok, state, qsl, idx, init, chunk=None):
        kw = _chunk("block_size", chunk) | _meta(qsl, idx, init)
        return lightning_attention_prefill(tok["q"], tok["k"], tok["v"], rates, state, **kw)

    def decode(tok, state, idx):
        return lightning_attention_decode(
            tok["q"], tok["k"], tok["v"], rates, state, state_indices=idx
        )

    def oracle(tok, init, recurrent):
        if init is None and recurrent:
            init = torch.zeros(4, 8, 8)
        # Without a cached state HF runs its block form from zeros, with one its recurrence.
        cache = None if init is None else _LinearCacheStub(init[None].clone())
        with torch.no_grad():
            _, s = hf(tok["h"][None], None, None, cache=cache)
        return captured.pop().view(-1, 4, 8), s[0]

    return Case("lightning", (4, 8, 8), make, prefill, decode, oracle)


CASES = [
    _conv_case(),
    _delta_case("gdn", hk=2, hv=4, per_channel=False),
    _delta_case("kda", hk=3, hv=3, per_channel=True),
    _mamba_case(),
    _lightning_case(),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1e-6)
    assert err <= tol * scale, f"max error {err:.3g} > {tol:g} * {scale:.3g}"


def _tokens(case: Case, lens: list[int], seed: int) -> list[Tokens]:
    gen = torch.Generator().manual_seed(seed)
    return [case.make(gen, n) for n in lens]


def _cat(seqs: list[Tokens], rows: list[slice] | None = None) -> tuple[Tokens, torch.Tensor]:
    """Flat batch of (parts of) sequences and its query_start_loc."""
    rows = rows or [slice(None)] * len(seqs)
    parts = [{n: t[r] for n, t in s.items()} for s, r in zip(seqs, rows)]
    lens = [len(next(iter(p.values()))) for p in parts]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}, qsl


def _pool(case: Case, size: int = 8) -> torch.Tensor:
    return torch.randn(size, *case.state_shape, generator=torch.Generator().manual_seed(9)) * 0.5


IDX = torch.tensor([5, 0, 3, 7, 2])
INIT = torch.tensor([True, False, True, False, True])
LENS = [70, 33, 1, 64, 5]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prefill_matches_oracle(case: Case):
    seqs = _tokens(case, LENS, seed=0)
    tok, qsl = _cat(seqs)
    pool = _pool(case)
    state = pool.clone()
    out = case.prefill(tok, state, qsl, IDX, INIT)
    for b, seq in enumerate(seqs):
        ref_out, ref_state = case.oracle(seq, pool[IDX[b]] if INIT[b] else None, False)
        assert_close(out[qsl[b] : qsl[b + 1]], ref_out)
        assert_close(state[IDX[b]], ref_state)
    untouched = [i for i in range(len(pool)) if i not in IDX.tolist()]
    assert torch.equal(state[untouched], pool[untouched])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chunked_equals_recurrent(case: Case):
    seqs = _tokens(case, LENS, seed=1)
    tok, qsl = _cat(seqs)
    pool = _pool(case)
    chunked = pool.clone()
    out = case.prefill(tok, chunked, qsl, IDX, INIT)
    stepped = pool.clone()
    stepped[IDX[~INIT]] = 0  # decode always reads a state: a new sequence's is zeros
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for t in range(max(LENS)):
        live = [b for b, n in enumerate(LENS) if n > t]
        step, _ = _cat([seqs[b] for b in live], [slice(t, t + 1)] * len(live))
        y = case.decode(step, stepped, IDX[live])
        for i, b in enumerate(live):
            outs[b].append(y[i : i + 1])
    assert_close(out, torch.cat([torch.cat(o) for o in outs]))
    assert_close(chunked, stepped)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_prefill_equals_one_shot(case: Case):
    lens = [70, 40, 3]
    seqs = _tokens(case, lens, seed=2)
    idx, init = torch.tensor([4, 1, 6]), torch.tensor([True, False, False])
    pool = _pool(case)
    whole = pool.clone()
    tok, qsl = _cat(seqs)
    out = case.prefill(tok, whole, qsl, idx, init)
    split = pool.clone()
    cuts = [[0, 20, 50, 70], [0, 25, 40], [0, 1, 3]]  # seq 0 in three pieces, the others two
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for p in range(3):
        live = [b for b in range(3) if p + 1 < len(cuts[b])]
        rows = [slice(cuts[b][p], cuts[b][p + 1]) for b in live]
        part, pqsl = _cat([seqs[b] for b in live], rows)
        y = case.prefill(
            part,
            split,
            pqsl,
            idx[live],
            init[live] if p == 0 else torch.ones(len(live), dtype=torch.bool),
        )
        for i, b in enumerate(live):
            outs[b].append(y[pqsl[i] : pqsl[i + 1]])
    assert_close(torch.cat([torch.cat(o) for o in outs]), out)
    assert_close(split, whole)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decode_after_prefill_matches_oracle(case: Case):
    prompt, extra = [40, 67], 3
    seqs = _tokens(case, [n + extra for n in prompt], seed=3)
    idx, init = torch.tensor([2, 6]), torch.tensor([True, False])
    pool = _pool(case)
    state = pool.clone()
    part, pqsl = _cat(seqs, [slice(0, n) for n in prompt])
    outs = [[y] for y in case.prefill(part, state, pqsl, idx, init).split(prompt)]
    for t in range(extra):
        step, _ = _cat(seqs, [slice(n + t, n + t + 1) for n in prompt])
        for b, y in enumerate(case.decode(step, state, idx).split(1)):
            outs[b].append(y)
    for b, seq in enumerate(seqs):
        ref_out, ref_state = case.oracle(seq, pool[idx[b]] if init[b] else None, True)
        assert_close(torch.cat(outs[b]), ref_out)
        assert_close(state[idx[b]], ref_state)


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "conv"], ids=lambda c: c.name)
def test_chunk_size_does_not_matter(case: Case):
    seqs = _tokens(case, [70, 9], seed=4)
    tok, qsl = _cat(seqs)
    idx, init = torch.tensor([3, 1]), torch.tensor([True, False])
    results = []
    for chunk in (16, 24, 256):
        state = _pool(case)
        results.append((case.prefill(tok, state, qsl, idx, init, chunk), state))
    for out, state in results[1:]:
        assert_close(out, results[0][0])
        assert_close(state, results[0][1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sequences_do_not_interact(case: Case):
    seqs = _tokens(case, [30, 70], seed=5)
    other = _tokens(case, [30, 70], seed=6)[1]
    idx, init = torch.tensor([6, 2]), torch.tensor([True, True])
    results = []
    for second, row in ((seqs[1], 0.5), (other, -3.0)):  # change sequence 1 and its state
        tok, qsl = _cat([seqs[0], second])
        state = _pool(case)
        state[2] = row
        out = case.prefill(tok, state, qsl, idx, init)
        results.append((out[:30], state[6]))
    assert_close(results[1][0], results[0][0], tol=1e-6)
    assert_close(results[1][1], results[0][1], tol=1e-6)


def test_lightning_decay_rates_match_transformers():
    for heads, layer, layers in [(4, 1, 4), (64, 0, 80), (64, 79, 80), (8, 0, 1)]:
        cfg = MiniMaxConfig(
            hidden_size=8 * heads,
            num_attention_heads=heads,
            head_dim=8,
            num_key_value_heads=heads,
            num_hidden_layers=max(layers, 1),
        )
        ref = MiniMaxLightningAttention(cfg, layer_idx=layer).slope_rate.flatten()
        torch.testing.assert_close(
            lightning_decay_rates(heads, layer, layers), ref, rtol=1e-6, atol=0
        )
    # MiniMax-Text-01, layer 0, head 0: 2^(-8/64) * (1 + 1e-5)
    assert lightning_decay_rates(64, 0, 80)[0].item() == pytest.approx(2**-0.125 * 1.00001)


def test_conv_prefill_shorter_than_kernel_keeps_old_inputs():
    # A one-token prefill leaves the two newest old inputs and the new token in the state.
    state = torch.arange(2 * 3, dtype=torch.float32).view(1, 2, 3).repeat(2, 1, 1)
    x = torch.tensor([[10.0, 20.0]])
    causal_conv1d_prefill(
        x,
        torch.ones(2, 4),
        None,
        state,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([True]),
    )
    assert state[1].tolist() == [[1.0, 2.0, 10.0], [4.0, 5.0, 20.0]]
    assert state[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
