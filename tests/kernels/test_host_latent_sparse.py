"""HostLatentSparseBackend (host-resident sparse-MLA latents) against the backend it wraps.

Over the random paged layouts of ``test_torch_mla_sparse.py`` (decode / prefill / mixed-chunked
batches, shuffled block tables, block 0 null, garbage in every row that is not a live key, so
a wrong row shows up), with random top-k indices (-1 slots in shuffled places, a row with none):
the wrapper, holding the latent cache as a separate "host" tensor and attending over a staging
buffer, gives the inner backend's output bit for bit, writes the same rows, leaves the indices
alone, and stages only what the step needs (K rows per decode, whole pages per prefill).
Both inner backends: TORCH_MLA_SPARSE, and TRITON_MLA_SPARSE through Triton's interpreter;
float32 and fp8 (656-byte layout at kv_lora_rank 128) caches. Then a tiny DeepSeek-V3.2
through the engine with TRITON_MLA_SPARSE, flag on and off: the same tokens and logprobs.
"""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from attnserve.attention.backends.host_latent_sparse import HostLatentSparseBackend  # noqa: E402
from attnserve.attention.backends.torch_mla_sparse import TorchMLASparseBackend  # noqa: E402
from tests.kernels.test_torch_mla_sparse import (  # noqa: E402
    BLOCK,
    CASES,
    HEADS,
    NOPE,
    ROPE,
    TOPK,
    indexer_cache,
    latent_cache,
    make_common,
    make_layer,
    random_indices,
)

BACKENDS = {"TORCH_MLA_SPARSE": TorchMLASparseBackend}
try:
    from attnserve.attention.backends.triton_mla_sparse import TritonMLASparseBackend  # noqa: E402

    BACKENDS["TRITON_MLA_SPARSE"] = TritonMLASparseBackend
except ImportError:  # triton is not installed
    pass


def staged_rows(common) -> int:
    """Rows the wrapper stages: the null page, K per decode (whole pages), prefills' pages."""
    nd = common.num_decodes
    prefill_pages = sum(-(-s // BLOCK) for s in common.seq_lens_cpu[nd:])
    return BLOCK * (1 + nd * -(-TOPK // BLOCK) + prefill_pages)


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_equals_the_inner_backend_bit_for_bit(name, case, fp8, monkeypatch):
    gen = torch.Generator().manual_seed(len(case) + 2 * fp8)
    common = make_common(*CASES[case], gen)
    rank = 128 if fp8 else 32
    device_cache = latent_cache(common, rank, torch.uint8 if fp8 else torch.float32, gen)
    host_cache = device_cache.clone()
    layer = make_layer(rank, gen)
    t = common.num_tokens
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen)
    rows = torch.randn(t, rank + ROPE, generator=gen)
    idx = random_indices(common, TOPK, gen)
    idx_before = idx.clone()
    inner = BACKENDS[name](BLOCK)
    want = inner.forward(layer, q, rows, None, {"latent": device_cache},
                         inner.build_metadata(common, 0), topk_indices=idx)  # fmt: skip
    wrapper = HostLatentSparseBackend(BACKENDS[name](BLOCK), BLOCK, torch.device("cpu"))
    gathered = []
    real_gather = wrapper._gather
    monkeypatch.setattr(wrapper, "_gather", lambda host, pages, rows: gathered.append(
        pages.numel() * BLOCK + rows.numel()) or real_gather(host, pages, rows))  # fmt: skip
    got = wrapper.forward(layer, q, rows, None, {"latent": host_cache},
                          wrapper.build_metadata(common, 0), topk_indices=idx)  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(host_cache, device_cache)  # the same rows written, byte for byte
    assert torch.equal(idx, idx_before)  # a GLM-5 shared layer reuses them after this one
    assert gathered == [staged_rows(common)]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_selection_is_the_inner_backends(name):
    """select_topk runs on the device indexer cache, as the inner backend's."""
    gen = torch.Generator().manual_seed(5)
    common = make_common(*CASES["mixed_chunked"], gen)
    cache = indexer_cache(common, False, gen)
    t = common.num_tokens
    args = (torch.randn(t, 16, 32, generator=gen), torch.randn(t, 32, generator=gen),
            torch.randn(t, 16, generator=gen))  # fmt: skip
    inner = BACKENDS[name](BLOCK)
    want = inner.select_topk(*args, {"indexer": cache.clone()}, inner.build_metadata(common, 0),
                             topk=TOPK)  # fmt: skip
    wrapper = HostLatentSparseBackend(BACKENDS[name](BLOCK), BLOCK, torch.device("cpu"))
    got = wrapper.select_topk(*args, {"indexer": cache}, wrapper.build_metadata(common, 0), topk=TOPK)
    assert torch.equal(got, want) and (got >= 0).any()


@pytest.mark.skipif("TRITON_MLA_SPARSE" not in BACKENDS, reason="triton is not installed")
def test_engine_with_triton_backend(tmp_path):
    """Chunked prefill (mixed decode + prefill steps) and decode through TRITON_MLA_SPARSE,
    latents on the host against on the device: identical tokens, prompt and sample logprobs."""
    from attnserve import LLM, SamplingParams
    from tests.models.parity import build_hf_model, make_prompts, run_engine
    from tests.models.test_parity_dsa import DSA

    build_hf_model("deepseek_v32", dict(DSA), tmp_path)
    prompts = make_prompts([5, 19, 27])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)  # fmt: skip

    def run(flag: bool):
        llm = LLM(str(tmp_path), dtype="float32", block_size=16, attention_backend="TRITON_MLA_SPARSE",
                  max_num_batched_tokens=12, kv_offload_sparse_latents=flag)  # fmt: skip
        assert isinstance(llm.llm_engine.parts.runner.backends[0], HostLatentSparseBackend) == flag
        outs = run_engine(llm, prompts, params)
        return [(o.outputs[0].token_ids,
                 [{k: v.logprob for k, v in e.items()} for e in o.prompt_logprobs[1:]],
                 [{k: v.logprob for k, v in e.items()} for e in o.outputs[0].logprobs]) for o in outs]  # fmt: skip

    assert run(True) == run(False)
