"""The CUDA-graph runner through the backend contract, on CPU.

``runner/cuda_graph.py`` knows backends only by ``Backend.cuda_graph_safe``,
``build_graph_metadata`` and ``refresh_graph_metadata``. Here its ``_capture_graph`` is replaced by
an eager stand-in whose "replay" runs the captured forward again over the persistent buffers,
with the metadata and host bounds fixed at capture, as a graph would: decode steps of a real
engine (TRITON_ATTN; TRITON_MLA and DSA's TRITON_MLA_SPARSE, DeepSeek-V3.2 and GLM-5, with a
float32 or an fp8 latent cache; the hybrid families qwen3_next, kimi_linear, jamba and minimax with
TRITON_GDN, TRITON_KDA, TRITON_MAMBA and TORCH_LIGHTNING on their state layers; under Triton's
interpreter) replayed that way equal the eager engine, padded buckets included (a hybrid's
padded row advances the null state slot, and every real slot stays exact); a hybrid's state
layer dispatches the same aten ops every replay, none of which reads device data on the host
(``.item()``, ``nonzero``, boolean indexing: what a CUDA graph cannot hold; a ``tolist`` does
not pass the dispatcher and goes unseen), and a backend that
owns a persistent buffer is refreshed before each replay (without the refresh the outputs differ,
so the check can fail). On the H200, ``benchmarks/gpu_check.py`` compares real graphs with eager
runs.
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from attnserve.attention.metadata import CommonAttentionMetadata  # noqa: E402
from attnserve.attention.state.base import StateBackend  # noqa: E402
from attnserve.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from tests.models.parity import build_hf_model, make_prompts, run_engine  # noqa: E402

MAX_SEQS = 4  # buckets 1, 2, 4: three requests replay the bucket of 4 with a padded row


class EagerReplay(CudaGraphRunner):
    """A graph runner whose "graphs" run the captured forward again (CPU has no CUDA graphs).

    A capture keeps the forward over the bucket's metadata, built at capture; each replay runs
    it into the bucket's output tensor. Nothing runs before a bucket's first replay (no warm-up:
    there is nothing to compile), so buckets no step uses cost nothing."""

    replays = 0
    replaying = False
    warmups = 0

    def _capture_graph(self, forward):
        output = torch.empty(0)  # [bucket, D] float32 once replayed (the models here are float32)

        def replay() -> None:
            EagerReplay.replays += 1
            EagerReplay.replaying = True
            try:
                out = forward()
            finally:
                EagerReplay.replaying = False
            output.resize_(out.shape).copy_(out)

        return replay, output


class DispatchedOps(TorchDispatchMode):
    """The aten ops run inside it, each with its tensor arguments' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        self.ops.append((str(func), tuple((tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor))))
        return func(*args, **(kwargs or {}))


# ops a CUDA graph cannot hold: they read device data on the host, or their output's shape does
# (``tolist`` reads without the dispatcher: not seen here)
_HOST_READS = ("aten._local_scalar_dense", "aten.nonzero.", "aten.masked_select", "aten.masked_scatter",
               "aten.repeat_interleave.Tensor", "aten.unique", "aten._unique")


def reads_on_host(op: str, args: tuple) -> bool:
    boolean_index = op.startswith(("aten.index.", "aten.index_put")) and any(d is torch.bool for _, d in args)
    return op.startswith(_HOST_READS) or boolean_index


def _trace_replays(backend: StateBackend, traces: list) -> None:
    """Record the ops of ``backend``'s forward whenever it runs inside a replay."""
    forward = backend.forward

    def traced(*args, **kwargs):
        if not EagerReplay.replaying:
            return forward(*args, **kwargs)
        with DispatchedOps() as ops:
            out = forward(*args, **kwargs)
        traces.append(ops.ops)
        return out

    backend.forward = traced


class OwnSeqLens(TritonAttentionBackend):
    """TRITON_ATTN whose captured decode metadata reads a sequence-length buffer of its own,
    refreshed before every replay (the contract's persistent-buffer hook)."""

    refreshes = 0

    def build_graph_metadata(self, common, group_id):
        meta = self.build_metadata(common, group_id)
        (part,) = meta.parts
        part.seq_lens = torch.ones_like(common.seq_lens)  # owned, not a view of the runner's
        return meta

    def refresh_graph_metadata(self, metadata, common):
        OwnSeqLens.refreshes += 1
        own = metadata.parts[0].seq_lens
        own[: common.num_reqs].copy_(common.seq_lens)
        own[common.num_reqs:].fill_(1)


LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CASES = {  # name -> (model type, config, backend, engine options)
    "gqa": ("llama", LLAMA, "TRITON_ATTN", {}),
    "mla": ("deepseek_v3", {}, "TRITON_MLA", {}),
    "mla_fp8": ("deepseek_v3", {"kv_lora_rank": 128}, "TRITON_MLA", {"kv_cache_dtype": "fp8"}),
    # DSA: the indexer scores every key (top-k 6, below the longer sequences) in both runs
    # (two layers each, a dense and a MoE one; GLM-5's second reuses the first's top-k)
    "dsa": ("deepseek_v32", {"num_hidden_layers": 2}, "TRITON_MLA_SPARSE", {}),
    "glm5_fp8": ("glm_moe_dsa", {"kv_lora_rank": 128, "num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
                 "TRITON_MLA_SPARSE", {"kv_cache_dtype": "fp8"}),
}
# hybrid families: test_parity_hybrid's tiny models cut to a state layer and an attention layer
# (MoE), with fewer heads; name -> (attention layers' backend, state layers' backend, config)
_TWO_LAYERS = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                   num_attention_heads=2, num_key_value_heads=1)
HYBRID_CASES = {
    "qwen3_next": ("TRITON_ATTN", "TRITON_GDN", dict(_TWO_LAYERS, linear_num_key_heads=1,
                                                     linear_num_value_heads=2)),  # Hk 1 < Hv 2
    "kimi_linear": ("TRITON_MLA", "TRITON_KDA", dict(_TWO_LAYERS, linear_num_heads=2)),  # 3 convs, per-channel decay
    "jamba": ("TRITON_ATTN", "TRITON_MAMBA", dict(num_hidden_layers=2, num_attention_heads=2,
                                                 num_key_value_heads=1)),  # mamba, then attention; conv bias
    "minimax": ("TRITON_ATTN", "TORCH_LIGHTNING", _TWO_LAYERS),  # a PyTorch decode form, no conv
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine their
    synchronisation costs a third of this module's time; restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    _build("gqa", path)
    return path


def _build(case: str, path) -> None:
    if case in HYBRID_CASES:
        from tests.models.test_parity_hybrid import HYBRID

        model_type, config = HYBRID[case]
        build_hf_model(model_type, {**config, **HYBRID_CASES[case][2], "vocab_size": 256}, path)
        return
    model_type, config, _, _ = CASES[case]
    if model_type == "deepseek_v3":  # the parity test's tiny DeepSeek-V3 (MoE, q LoRA, MLA)
        from tests.models.test_parity_deepseek import FAMILIES

        config = {**FAMILIES["v3"][1], **config, "vocab_size": 256}
    elif model_type in ("deepseek_v32", "glm_moe_dsa"):  # the DSA parity test's tiny models
        from tests.models.test_parity_dsa import FAMILIES

        name = "v32" if model_type == "deepseek_v32" else "glm5"
        config = {**FAMILIES[name][1], **config, "vocab_size": 256}
    build_hf_model(model_type, config, path)


def _rebind(runner, group: int, backend: type) -> None:
    """Run group ``group`` on ``backend`` (built like the old one), rebound to every layer."""
    old = runner.backends[group]
    runner.backends[group] = backend(old.block_size)
    for m in runner.model.modules():
        if getattr(m, "backend", None) is old:
            m.backend = runner.backends[group]


def _generate(model_dir, graphs: type[CudaGraphRunner] | None, backend: type | None = None,
              case: str = "gqa", traces: list | None = None):
    if case in HYBRID_CASES:  # the graphs read max_model_len keys: 32 covers these runs
        (attention, state, _), options, max_len = HYBRID_CASES[case], {}, 32
    else:
        (_, _, attention, options), state, max_len = CASES[case], None, 64
    llm = LLM(str(model_dir), dtype="float32", attention_backend=attention, max_num_seqs=MAX_SEQS,
              max_model_len=max_len, max_num_batched_tokens=64, **options)
    runner = llm.llm_engine.runner
    if case in HYBRID_CASES:  # the state layers' backend (CPU picks TORCH_*), in both runs
        from attnserve.attention.registry import load_backend

        (group,) = [g for g, b in enumerate(runner.backends) if isinstance(b, StateBackend)]
        _rebind(runner, group, load_backend(state))
        assert sorted(b.name for b in runner.backends) == sorted([attention, state])
        if traces is not None:
            _trace_replays(runner.backends[group], traces)
    if graphs is not None:
        if backend is not None:  # the same backend with other graph hooks
            _rebind(runner, 0, backend)
        assert CudaGraphRunner.supported(runner.backends)
        runner.graphs = graphs(runner.model, runner.backends, runner.block_size, MAX_SEQS, max_len, runner.device,
                               has_state=bool(runner.state_caches), num_paged_groups=len(runner.groups))
        runner.graphs.capture()
    # 3 requests: the bucket of 4 with a padded row; hybrids decode fewer tokens (each forward
    # of theirs runs two or three Triton kernels under the interpreter)
    params = SamplingParams(temperature=0.0, max_tokens=4 if case in HYBRID_CASES else 6, ignore_eos=True,
                            logprobs=3)
    return run_engine(llm, make_prompts([5, 9, 3], vocab=256), params)


def _assert_same(a_outs, b_outs, tol=1e-5):
    for a, b in zip(a_outs, b_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert set(ea) == set(eb)
            for tid in ea:
                assert abs(ea[tid].logprob - eb[tid].logprob) < tol


@pytest.mark.parametrize("case", sorted(CASES) + sorted(HYBRID_CASES))
def test_replayed_decode_steps_equal_eager(case, tmp_path):
    _build(case, tmp_path)
    eager = _generate(tmp_path, None, case=case)
    EagerReplay.replays = 0
    traces = []
    replayed = _generate(tmp_path, EagerReplay, case=case, traces=traces)
    assert EagerReplay.replays >= (3 if case in HYBRID_CASES else 5)  # every decode step of the three requests
    if case in HYBRID_CASES:  # the state layer's captured decode: the same ops every replay, none reads on the host
        assert len(traces) == EagerReplay.replays and all(t == traces[0] for t in traces)
        assert not [op for op, args in traces[0] if reads_on_host(op, args)]
    # fp8 DSA (GLM-5): the indexer query is rounded to e4m3 after a batched Hadamard matmul, whose last
    # bit follows the batch's row count (3 eager, 4 in the padded bucket), so a score near a
    # rounding edge moves a little; with 4 requests (no padding) the runs are bitwise equal
    _assert_same(eager, replayed, tol=2e-3 if case == "glm5_fp8" else 1e-5)


def test_backend_buffers_are_refreshed_before_each_replay(model_dir, monkeypatch):
    eager = _generate(model_dir, None)
    OwnSeqLens.refreshes = 0
    EagerReplay.replays = 0
    _assert_same(eager, _generate(model_dir, EagerReplay, OwnSeqLens))
    assert OwnSeqLens.refreshes == EagerReplay.replays >= 5
    # the same run without the refresh reads stale sequence lengths: other logprobs
    monkeypatch.setattr(OwnSeqLens, "refresh_graph_metadata", lambda self, metadata, common: None)
    with pytest.raises(AssertionError):
        _assert_same(eager, _generate(model_dir, EagerReplay, OwnSeqLens))


def _common(num_tokens: list[int], state_decodes: int | None = None) -> CommonAttentionMetadata:
    qsl = [0]
    for n in num_tokens:
        qsl.append(qsl[-1] + n)
    lens = [8] * len(num_tokens)
    state = state_decodes is not None
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.zeros(qsl[-1], dtype=torch.int64), block_tables=[torch.zeros(len(lens), 1, dtype=torch.int32)],
        slot_mappings=[torch.zeros(qsl[-1], dtype=torch.int64)], query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        num_decodes=sum(1 for n in num_tokens if n == 1), max_query_len=max(num_tokens), max_seq_len=8,
        state_slots=torch.ones(len(lens), dtype=torch.int64) if state else None,
        has_initial_state=torch.ones(len(lens), dtype=torch.bool) if state else None,
        num_state_decodes=state_decodes or 0)


def test_which_steps_replay():
    backends = [TritonAttentionBackend(16)]
    plain = CudaGraphRunner(torch.nn.Identity(), backends, 16, MAX_SEQS, 64, torch.device("cpu"))
    assert plain.can_run(_common([1, 1, 1]))
    assert not plain.can_run(_common([1, 1, 3]))  # a prefill in the step
    assert not plain.can_run(_common([1] * (MAX_SEQS + 1)))  # no bucket that large
    hybrid = CudaGraphRunner(torch.nn.Identity(), backends, 16, MAX_SEQS, 64, torch.device("cpu"), has_state=True)
    assert hybrid.can_run(_common([1, 1], state_decodes=2))
    assert not hybrid.can_run(_common([1, 1], state_decodes=1))  # a one-token prompt: no state yet


def test_only_graph_safe_backends_are_captured():
    from attnserve.attention.backends.torch_sdpa import TorchSDPABackend
    from attnserve.attention.state.torch_backends import TorchGDNBackend

    assert CudaGraphRunner.supported([TritonAttentionBackend(16)])
    assert CudaGraphRunner.supported([TritonAttentionBackend(16), TorchGDNBackend(16)])  # state layers too
    assert not CudaGraphRunner.supported([TorchSDPABackend(16), TorchGDNBackend(16)])
    assert not CudaGraphRunner.supported([TorchSDPABackend(16)])
