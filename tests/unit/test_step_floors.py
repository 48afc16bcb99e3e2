"""The hybrid cases of benchmarks/gpu_mechanisms.py and their floors (benchmarks/step_floors.py),
without building a model: each case's cut config keeps the released model's layer mix, width and
experts, and plans on an H200 with the state backend named and the attention backend the CUDA
platform picks; the state bytes and FLOPs of a decode step of the Qwen3-Next cut, by hand."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_mechanisms as gm  # noqa: E402
import step_floors as sf  # noqa: E402

from attnserve.arch import LayerKind, load_hf_config, read_arch  # noqa: E402
from attnserve.config import EngineConfig  # noqa: E402
from attnserve.engine.plan import plan_engine  # noqa: E402
from attnserve.platforms import get_platform  # noqa: E402

G, K, L, M, F, A = LayerKind.GDN, LayerKind.KDA, LayerKind.LIGHTNING, LayerKind.MAMBA, LayerKind.FULL, LayerKind.MLA
# case -> (layer kinds, hidden size, (experts, top-k) or None, MoE layers, attention backend on CUDA)
EXPECTED = {
    "qwen3_next": ([G, G, G, F], 2048, (512, 10), [0, 1, 2, 3], "TRITON_ATTN"),
    "qwen35": ([G, G, G, F], 5120, None, [], "TRITON_ATTN"),
    "qwen35_moe": ([G, G, G, F], 2048, (256, 8), [0, 1, 2, 3], "TRITON_ATTN"),
    "kimi_linear": ([K, K, K, A], 2304, (256, 8), [1, 2, 3], "TRITON_MLA"),
    "jamba": ([M, M, M, M, F, M, M, M], 4096, (16, 2), [1, 3, 5, 7], "TRITON_ATTN"),
    "minimax": ([L, L, L, F], 6144, (32, 2), [0, 1, 2, 3], "TRITON_ATTN"),
}


def cut(name: str, smoke: bool = False):
    path, _ = gm.model_dir(gm.CASES[name], 16, smoke)
    try:
        return path, read_arch(load_hf_config(path))
    except Exception:
        shutil.rmtree(path, ignore_errors=True)
        raise


def test_every_hybrid_is_checked():
    assert sorted(EXPECTED) == sorted(gm.HYBRIDS)
    assert set(gm.SMOKE_HYBRIDS) <= set(gm.HYBRIDS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hybrid_cut_keeps_the_layer_mix(name):
    kinds, hidden, moe, moe_layers, attention = EXPECTED[name]
    path, arch = cut(name)
    try:
        assert [s.kind for s in arch.layers] == kinds
        assert arch.hidden_size == hidden
        assert (arch.moe and (arch.moe.num_experts, arch.moe.top_k)) == moe
        assert [s.index for s in arch.layers if s.moe] == moe_layers
        for backend in ("torch", "triton"):
            state = gm.CASES[name].backend_name(backend)
            config = EngineConfig.from_kwargs(path, load_format="dummy", dtype="bfloat16", attention_backend=state,
                                              max_model_len=4096)
            plan = plan_engine(arch, config, get_platform("cuda", (9, 0)))
            assert sorted(plan.backend_names) == sorted([attention, state])
            assert plan.state_bytes_per_sequence > 0
    finally:
        shutil.rmtree(path, ignore_errors=True)
    # the smoke cut keeps a state layer and an attention layer
    path, arch = cut(name, smoke=True)
    shutil.rmtree(path, ignore_errors=True)
    assert {s.kind.is_state for s in arch.layers} == {True, False}


def test_qwen3_next_decode_floor_by_hand():
    path, arch = cut("qwen3_next")
    try:
        config = EngineConfig.from_kwargs(path, load_format="dummy", dtype="bfloat16", max_model_len=4096)
        plan = plan_engine(arch, config, get_platform("cuda", (9, 0)))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    # as state_rows reads them from the bound slots: recurrent 32 heads x 128 x 128 float32,
    # conv (2 * 16 * 128 + 32 * 128) channels x 3 bf16, in each of the 3 GDN layers
    states = {i: {"conv": 8192 * 3 * 2, "recurrent": 32 * 128 * 128 * 4} for i in range(3)}
    rows = {3: {"kv": 2 * 2 * 256 * 2}}  # 2 KV heads of 256, K and V, bf16
    sf.check_rows(rows, plan, states)
    assert sf.decode_state_bytes(states, 8) == 2 * 8 * 3 * (2_097_152 + 49_152) == 103_022_592
    assert sf.decode_cache_bytes(arch, rows, 8, 1024, states) == 8 * 1024 * 2048 + 103_022_592
    with pytest.raises(RuntimeError, match="state slot"):  # a slot the plan does not describe
        sf.check_rows(rows, plan, {**states, 0: {"conv": 8192 * 3 * 2, "recurrent": 32 * 128 * 128 * 2}})
    gdn = arch.layers[0]
    assert sf.state_flops_per_token(gdn, decode=True) == 7 * 32 * 128 * 128 + 2 * 8192 * 4 == 3_735_552
    assert sf.state_flops_per_token(gdn, decode=False) == 32 * (6 * 128 * 128 + 4 * 64 * 256) + 65_536
    # one decode token at 1,000 keys: 3 GDN steps + the full layer's 16 heads of 256 (QK^T and PV)
    assert sf.decode_attention_flops(arch, 1000) == 3 * 3_735_552 + 2 * 16 * 512 * 1000
