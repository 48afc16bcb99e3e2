"""State layers (GDN, Mamba, lightning, KDA) with their backends, against the transformers mixers.

Each layer of a tiny model (``tests/models/test_parity_hybrid.py``'s configs, weights loaded
from the saved checkpoint) runs a varlen schedule through its backend: first chunks, a
one-token prompt, later chunks, state decodes mixed with prefills. Its outputs must equal the
transformers mixer's over each whole sequence (no cache) within atol 1e-5 + rtol 1e-4 (float32);
the pool rows of other slots must stay as they were. Also: the decode/prefill split of
``StateMetadata``, Qwen3-Next's grouped projections, loading a multimodal Qwen3.5 checkpoint,
MiniMax's DeepNorm factors under both spellings.
"""

from __future__ import annotations

import pytest
import torch

from attnserve.arch.families import deepnorm_factors
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.state.base import build_state_metadata
from attnserve.core.forward_context import ForwardContext, forward_context
from attnserve.layers.gdn import ungroup_rows
from attnserve.models.registry import get_model_class
from attnserve.models.weights import iter_safetensors
from tests.models.test_parity_hybrid import HYBRID, SteppedModel, build_hybrid

# name -> (layer index, attribute of the mixer in both models)
LAYERS = {
    "qwen3_next": (1, "linear_attn"),
    "qwen3_5": (2, "linear_attn"),
    "jamba": (2, "mamba"),
    "minimax": (1, "self_attn"),  # a lightning layer other than 0: its decay depends on the index
    "kimi_linear": (1, "self_attn"),
}
# (request, tokens) per step; decodes (one token after a history) first, as the runner orders them
SCHEDULE = [
    [("a", 9), ("b", 3), ("c", 1)],
    [("a", 1), ("c", 1), ("b", 4)],
    [("b", 1), ("a", 1), ("c", 1), ("d", 1)],
    [("d", 1), ("c", 70), ("a", 2)],  # c crosses a 64-token chunk of the WY form
]
SLOTS = {"a": 3, "b": 1, "c": 5, "d": 6}
POOL = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine their
    synchronisation made this module several times slower; restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = build_hybrid(name, out), SteppedModel(out, num_slots=POOL)
        return cache[name]

    return get


def state_common(chunks: list[tuple[str, int]], started: set[str]) -> CommonAttentionMetadata:
    """A step's metadata as far as state backends read it (attention fields left trivial)."""
    qsl = [0]
    for _, n in chunks:
        qsl.append(qsl[-1] + n)
    init = [rid in started for rid, _ in chunks]
    nsd = next((i for i, (rid, n) in enumerate(chunks) if n != 1 or not init[i]), len(chunks))
    t = qsl[-1]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([n for _, n in chunks]),
        positions=torch.zeros(t, dtype=torch.long),
        block_tables=[],
        slot_mappings=[],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[n for _, n in chunks],
        num_decodes=nsd,
        max_query_len=max(n for _, n in chunks),
        max_seq_len=max(n for _, n in chunks),
        state_slots=torch.tensor([SLOTS[r] for r, _ in chunks]),
        has_initial_state=torch.tensor(init),
        num_state_decodes=nsd,
    )


def _hf_mixer_out(mixer, x: torch.Tensor) -> torch.Tensor:
    out = (
        mixer(hidden_states=x[None], position_embeddings=None, attention_mask=None)
        if type(mixer).__name__ == "MiniMaxLightningAttention"
        else mixer(x[None])
    )
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_transformers_on_a_varlen_schedule(name, models):
    hf, stepped = models(name)
    index, attr = LAYERS[name]
    ours = getattr(stepped.model.layers[index], attr)
    hf_mixer = getattr(hf.model.layers[index], attr)
    totals: dict[str, int] = {}
    for step in SCHEDULE:
        for rid, n in step:
            totals[rid] = totals.get(rid, 0) + n
    gen = torch.Generator().manual_seed(3)
    inputs = {
        rid: torch.randn(n, hf.config.hidden_size, generator=gen) for rid, n in totals.items()
    }
    with torch.no_grad():
        want = {rid: _hf_mixer_out(hf_mixer, x) for rid, x in inputs.items()}
    pool = ours.state_cache.conv + ours.state_cache.recurrent
    pool_before = [t.clone() for t in pool]
    done, started = dict.fromkeys(totals, 0), set()
    backend = ours.backend
    for step in SCHEDULE:
        common = state_common(step, started)
        x = torch.cat([inputs[rid][done[rid] : done[rid] + n] for rid, n in step])
        ctx = ForwardContext(common, [None, backend.build_metadata(common, 1)], None)
        with torch.no_grad(), forward_context(ctx):
            got = ours(x).split([n for _, n in step])
        for (rid, n), out in zip(step, got):
            torch.testing.assert_close(
                out,
                want[rid][done[rid] : done[rid] + n],
                atol=1e-5,
                rtol=1e-4,
                msg=lambda m, rid=rid: f"{name} request {rid}: {m}",
            )
            done[rid] += n
            started.add(rid)
    untouched = [s for s in range(POOL) if s not in SLOTS.values()]
    for before, after in zip(pool_before, pool):
        assert torch.equal(before[untouched], after[untouched]), (
            "a slot no request owns was written"
        )


def test_state_metadata_splits_decodes_from_prefills():
    common = state_common([("a", 1), ("c", 1), ("b", 4), ("d", 1)], started={"a", "c", "b"})
    meta = build_state_metadata(common)
    assert meta.num_decodes == 2 and meta.num_prefills == 2
    assert meta.decode_slots.tolist() == [3, 5]
    assert meta.prefill_slots.tolist() == [1, 6]
    assert meta.prefill_query_start_loc.tolist() == [0, 4, 5]
    assert meta.prefill_has_initial_state.tolist() == [True, False]
    assert meta.max_prefill_len == 4 and meta.chunk_size(64) == 4 and meta.chunk_size(2) == 2
    common.num_state_decodes = 3  # b has 4 tokens: it cannot take the one-token form
    with pytest.raises(ValueError, match="one token each"):
        build_state_metadata(common)


def test_qwen3_next_grouped_projections_match_transformers(models):
    hf, stepped = models("qwen3_next")
    hf_gdn, ours = hf.model.layers[0].linear_attn, stepped.model.layers[0].linear_attn
    x = torch.randn(1, 5, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = hf_gdn.fix_query_key_value_ordering(
            hf_gdn.in_proj_qkvz(x), hf_gdn.in_proj_ba(x)
        )
        qkvz, ba = ours.in_proj_qkvz(x[0]), ours.in_proj_ba(x[0])
    want = torch.cat([t[0].reshape(5, -1) for t in (q, k, v, z)], dim=-1)
    torch.testing.assert_close(qkvz, want, atol=0, rtol=0)
    torch.testing.assert_close(ba, torch.cat([b[0], a[0]], dim=-1), atol=0, rtol=0)
    w = torch.arange(12.0).view(6, 2)  # 2 groups of [p0 (2 rows) | p1 (1 row)]
    assert ungroup_rows(w, 2, [2, 1])[:, 0].tolist() == [0, 2, 6, 8, 4, 10]


def test_multimodal_qwen3_5_checkpoint_names(models, tmp_path):
    """Qwen3.5 releases are multimodal: the text model sits under ``model.language_model.``,
    beside a vision tower and MTP layers, which are skipped."""
    _, stepped = models("qwen3_5")
    renamed = [
        (n.replace("model.", "model.language_model.", 1), t)
        for n, t in iter_safetensors(stepped.path)
    ]
    renamed += [
        ("model.visual.blocks.0.attn.qkv.weight", torch.zeros(3)),
        ("mtp.fc.weight", torch.zeros(2)),
    ]
    fresh = get_model_class(stepped.arch)(stepped.arch)
    fresh.load_weights(renamed)
    for (n, p), (_, q) in zip(fresh.named_parameters(), stepped.model.named_parameters()):
        assert torch.equal(p, q), n


def test_minimax_deepnorm_factors_read_both_spellings():
    hf_names = {
        "linear_attn_alpha_factor": 2.0,
        "full_attn_beta_factor": 0.5,
        "mlp_alpha_factor": 3.0,
    }
    assert deepnorm_factors(hf_names, lightning=True) == (2.0, 1.0, 3.0, 1.0)
    assert deepnorm_factors(hf_names, lightning=False) == (1.0, 0.5, 3.0, 1.0)
    original = {
        "layernorm_full_attention_alpha": 3.5565588,
        "layernorm_linear_attention_beta": 1.0,
        "layernorm_mlp_beta": 0.25,
    }
    assert deepnorm_factors(original, lightning=False) == (3.5565588, 1.0, 1.0, 0.25)
    assert deepnorm_factors(original, lightning=True) == (1.0, 1.0, 1.0, 0.25)


def test_every_family_is_covered():
    assert set(LAYERS) <= set(HYBRID)
