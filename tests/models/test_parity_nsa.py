"""NSA (fla-org's ``NSAForCausalLM``, model_type ``nsa``) against fla's own code, on CPU.

The oracle (``fla_nsa_oracle.py``) runs flash-linear-attention 0.6.0 in a worker process: it
builds tiny random models with fla's ``NSAConfig``/``NSAForCausalLM`` and ``save_pretrained``,
which attnserve then loads, and computes fla's float32 forward over whole sequences. The
engine's generated tokens are checked by teacher forcing: fla's forward over prompt +
generated tokens must put its argmax on every generated token (so the greedy sequences are
equal) and give the same log-probabilities. Tolerance ``TOL`` (1e-5) on every log-probability
attnserve reports (the prompt token and the top 2 at every prompt position, the top 2 at every
generated one).

Two models. ``MAIN`` (2 layers, 32 query heads over 2 KV heads, so selection is per KV head;
QKV bias; NSA blocks of 8, 4 selected blocks, a 16-token window; prompts up to 70 tokens, so
selection drops blocks and the window is shorter than the prompt) is checked against fla's
pure-PyTorch ``naive_nsa`` on four engine paths: one batch of four prompt lengths (one shorter
than a block, whose first block completes during decode), chunked prefill, prefix-cache hits and
preemption, with cache pages of 4 or 16 tokens, both unlike the NSA block. ``KERNEL`` (1 layer,
``block_counts`` 3, tied embeddings, an explicit MLP width) is checked against fla's real
``parallel_nsa`` Triton kernels through Triton's interpreter (slow, so one prompt): the kernels
round ``block_counts`` up to 4, and attnserve with 3 would not match. Also: selection and the
window are active in these tests, bad configs fail with errors that name the problem, and
``inspect`` reports NSA's KV bytes.
"""

from __future__ import annotations

import json

import pytest

from attnserve import LLM, SamplingParams
from attnserve.arch import ArchError, read_arch
from attnserve.entrypoints.inspect import build_report
from attnserve.platforms import get_platform
from tests.models.fla_nsa_oracle import FlaOracle
from tests.models.parity import make_prompts, run_engine

TOL = 1e-5
VOCAB = 256
_FLA_FLAGS = dict(fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False)  # same math, no Triton
MAIN = dict(hidden_size=64, num_hidden_layers=2, num_heads=32, num_kv_heads=2, head_dim=16, qkv_bias=True,
            block_size=8, block_counts=4, window_size=16, hidden_ratio=2, max_position_embeddings=256,
            vocab_size=VOCAB, **_FLA_FLAGS)
KERNEL = dict(hidden_size=64, num_hidden_layers=1, num_heads=16, num_kv_heads=1, head_dim=16, block_size=8,
              block_counts=3, window_size=12, intermediate_size=96, tie_word_embeddings=True,
              max_position_embeddings=256, vocab_size=VOCAB, **_FLA_FLAGS)
PROMPTS = make_prompts([70, 5, 43, 17], vocab=VOCAB, seed=1)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    fla = FlaOracle(tmp_path_factory.mktemp("nsa"))
    yield fla
    fla.close()


@pytest.fixture(scope="module")
def main_model(oracle):
    return oracle.build("main", MAIN, seed=0, std=0.15)


def params(max_tokens: int = 8, prompt_logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                          prompt_logprobs=prompt_logprobs)


def deviation(oracle, name: str, prompts, outs, *, kernels: bool = False) -> float:
    """Largest log-probability gap to fla; asserts fla's argmax is every generated token."""
    seqs = [p + list(o.outputs[0].token_ids)[:-1] for p, o in zip(prompts, outs)]
    worst = 0.0
    for i, (p, o, ref) in enumerate(zip(prompts, outs, oracle.logprobs(name, seqs, kernels=kernels))):
        gen = list(o.outputs[0].token_ids)
        fla_greedy = ref[len(p) - 1:].argmax(-1).tolist()
        assert gen == fla_greedy, f"prompt {i}: greedy tokens differ\n attnserve {gen}\n fla       {fla_greedy}"
        rows = [(len(p) - 1 + step, entry) for step, entry in enumerate(o.outputs[0].logprobs)]
        if o.prompt_logprobs is not None:
            assert all(p[pos] in o.prompt_logprobs[pos] for pos in range(1, len(p)))
            rows += [(pos - 1, o.prompt_logprobs[pos]) for pos in range(1, len(p))]
        for row, entry in rows:
            for tid, lp in entry.items():
                worst = max(worst, abs(lp.logprob - ref[row, tid].item()))
    return worst


def _llm(path, **engine) -> LLM:
    return LLM(str(path), dtype="float32", **{"block_size": 4, **engine})


def test_batch_of_mixed_lengths_matches_fla(oracle, main_model):
    outs = run_engine(_llm(main_model), PROMPTS, params())
    assert deviation(oracle, "main", PROMPTS, outs) < TOL


def test_chunked_prefill_matches_fla(oracle, main_model):
    """13-token chunks (cache pages of 16): chunks end inside NSA blocks, and the short
    prompts decode in the same steps as the long one's chunks."""
    llm = _llm(main_model, block_size=16, max_num_batched_tokens=13)
    outs = run_engine(llm, PROMPTS, params())
    assert deviation(oracle, "main", PROMPTS, outs) < TOL


def test_prefix_cache_hits_match_fla(oracle, main_model):
    base = make_prompts([40], vocab=VOCAB, seed=7)[0]
    later = [base[:32] + make_prompts([9], vocab=VOCAB, seed=8)[0],
             base[:24] + make_prompts([13], vocab=VOCAB, seed=9)[0], base + [7, 8, 9]]
    llm = _llm(main_model)
    run_engine(llm, [base], params(prompt_logprobs=None))
    outs = run_engine(llm, later, params(prompt_logprobs=None))  # prompt logprobs would skip the cache
    assert [o.num_cached_tokens for o in outs] == [32, 24, 40]
    assert deviation(oracle, "main", later, outs) < TOL


def test_preemption_matches_fla(oracle, main_model):
    llm = _llm(main_model, max_model_len=96, num_gpu_blocks_override=34)
    outs = run_engine(llm, PROMPTS, params())
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0, "the budget did not force a preemption"
    assert deviation(oracle, "main", PROMPTS, outs) < TOL


def _with_layers(llm: LLM, **attrs) -> LLM:
    for m in llm.llm_engine.runner.model.modules():
        if hasattr(m, "num_selected"):
            for key, value in attrs.items():
                setattr(m, key, value)
    return llm


def test_selection_and_window_are_active(oracle, main_model):
    """Keeping every block, or dropping the window, moves the log-probabilities far from fla's:
    the parity tests above really check the selection and the window."""
    prompt = PROMPTS[:1]
    for change in ({"num_selected": 64}, {"window": None}):
        outs = run_engine(_with_layers(_llm(main_model), **change), prompt, params(max_tokens=1))
        with pytest.raises(AssertionError):
            assert deviation(oracle, "main", prompt, outs) < 100 * TOL, change


def test_fla_triton_kernels(oracle):
    """fla's real ``parallel_nsa`` (interpreted): block_counts 3 selects 4 blocks per token."""
    path = oracle.build("kernel", KERNEL, seed=1, std=0.15)
    prompt = make_prompts([45], vocab=VOCAB, seed=3)
    llm = _llm(path, max_num_batched_tokens=11)
    outs = run_engine(llm, prompt, params(max_tokens=3))
    assert deviation(oracle, "kernel", prompt, outs, kernels=True) < TOL
    outs = run_engine(_with_layers(_llm(path), num_selected=3), prompt, params(max_tokens=1))
    with pytest.raises(AssertionError):
        assert deviation(oracle, "kernel", prompt, outs, kernels=True) < 100 * TOL


def _config(**changes) -> dict:
    return {"model_type": "nsa", **MAIN, **changes}


@pytest.mark.parametrize("changes, message", [
    ({"num_kv_heads": 3}, "num_heads=32 is not divisible by num_kv_heads=3"),
    ({"block_size": 0}, "field 'block_size' must be an integer >= 1, got 0"),
    ({"block_size": None}, "field 'block_size' must be an integer >= 1, got None"),
    ({"block_counts": 2}, "block_counts=2 is below 3"),
    ({"block_counts": None}, "field 'block_counts' must be an integer >= 1, got None"),
    ({"window_size": -4}, "field 'window_size' must be a non-negative integer or null"),
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"hidden_act": "powlu"}, "hidden_act 'powlu' is not supported"),
    ({"attnres_block_size": 2}, "attention residuals (attnres_block_size) are not supported"),
    ({"rope_theta": None}, "field 'rope_theta' must be a positive finite number, got None"),
])
def test_bad_configs_name_the_problem(changes, message):
    with pytest.raises(ArchError) as e:
        read_arch(_config(**changes))
    assert message in str(e.value)


def test_config_reading_follows_fla_defaults():
    arch = read_arch({k: v for k, v in _config().items() if k not in ("num_kv_heads", "window_size")})
    spec = arch.layers[0]
    assert (spec.kind.value, spec.num_kv_heads, spec.nsa.window) == ("nsa", 4, 512)  # NSAConfig defaults
    spec = read_arch(_config(num_kv_heads=None, window_size=None)).layers[0]
    assert (spec.num_kv_heads, spec.nsa.window) == (32, None)  # null: one KV head per head, no window
    assert read_arch(_config(window_size=0)).layers[0].nsa.window is None
    assert [read_arch(_config(block_counts=n)).layers[0].nsa.num_selected for n in (3, 4, 5, 16)] == \
        [4, 4, 8, 16]
    assert read_arch(_config()).mechanism.value == "NSA"


def test_inspect_reports_nsa_kv_bytes(tmp_path):
    """FLA's 340M example shape in bf16: K and V of 2 KV heads of 64 per token and layer."""
    cfg = {"model_type": "nsa", "hidden_size": 1024, "num_hidden_layers": 24, "num_heads": 32, "num_kv_heads": 2,
           "head_dim": 64, "block_size": 64, "block_counts": 16, "window_size": 512, "vocab_size": 32000,
           "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    report = build_report(str(path), get_platform("cpu"), max_model_len=4096)
    assert report.kv_bytes_per_token == 24 * 2 * 2 * 64 * 2
    (row,) = report.rows
    assert (row.kind, row.num_layers, row.bytes_per_token_per_layer, row.backend) == ("nsa", 24, 512, "TORCH_NSA")
    assert report.bytes_per_sequence == 4096 * 24 * 512
    assert any("NSA" in n for n in report.notes)
    assert report.to_json()["mechanism"] == "NSA"
