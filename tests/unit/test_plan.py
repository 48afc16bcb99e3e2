"""The engine and ``attnserve inspect`` share one plan (``engine/plan.py``) and cannot drift.

For the shipped demo models an engine is built on CPU, and what it runs (each layer's backend,
the bytes of the cache tensors it allocated, the blocks a sequence takes) is compared with what
inspect reports for the same options. Released configs are too big to build: there the plan the
builder would take is compared, group by group, with inspect's report. A named backend that
does not fit, and a platform where nothing fits, give the same error from both. Last, each side
is shown to take what it shows or allocates from the plan, not from a selection of its own.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from attnserve import LLM, env
from attnserve.arch import LayerKind, load_hf_config, read_arch
from attnserve.attention.registry import BackendSelectionError
from attnserve.config import EngineConfig
from attnserve.engine import builder
from attnserve.engine.plan import BackendChoice, EnginePlan, default_block_size, plan_engine
from attnserve.entrypoints import inspect as inspect_cmd
from attnserve.entrypoints.cli import main
from attnserve.platforms import get_platform
from attnserve.presets import resolve_config_path
from attnserve.runner.host_latents import plan_host_latents

DEMOS = ["attnserve-demo-gqa", "attnserve-demo-mla", "attnserve-demo-dsa"]
MAX_LEN = 256
CPU = get_platform("cpu")
_LIBRARIES = {LayerKind.FULL: ("FLASH_ATTN", "FLASHINFER"), LayerKind.SLIDING: ("FLASH_ATTN", "FLASHINFER"),
              LayerKind.MLA: ("FLASHMLA",), LayerKind.SPARSE_MLA: ("FLASHMLA_SPARSE",)}
# a CPU whose lists put the library backends (CUDA only, not installed) first: every choice
# then passes some over, each with its reasons
CPU_LIBRARIES_FIRST = replace(CPU, priorities=tuple((k, _LIBRARIES.get(k, ()) + names)
                                                    for k, names in CPU.priorities))
# a CPU where no backend runs full-attention layers
CPU_NOTHING_FITS = replace(CPU, priorities=((LayerKind.FULL, ("FLASH_ATTN", "TORCH_MLA")),))


def _engine(monkeypatch, name: str, platform, **kwargs) -> LLM:
    monkeypatch.setattr(builder, "current_platform", lambda: platform)
    return LLM(name, load_format="dummy", kv_cache_memory=0.02, max_model_len=MAX_LEN, max_num_seqs=4, **kwargs)


def _cache_layers(llm: LLM) -> list[torch.nn.Module]:
    model = llm.llm_engine.runner.model
    return [m for m in model.modules() if getattr(m, "layer_id", None) is not None and hasattr(m, "kv_cache")]


def _tensors(cache) -> list[torch.Tensor]:
    if isinstance(cache, torch.Tensor):
        return [cache]
    values = cache.values() if isinstance(cache, dict) else cache
    return [t for v in values for t in _tensors(v)]


def _allocated_bytes_per_block(llm: LLM) -> int:
    """What the engine's cache tensors hold per block id, each tensor counted once."""
    tensors = {t.data_ptr(): t for m in _cache_layers(llm) for t in _tensors(m.kv_cache)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total % llm.llm_engine.parts.num_blocks == 0
    return total // llm.llm_engine.parts.num_blocks


def _rows_by_layer(report: dict) -> dict[int, dict]:
    rows = {layer: row for row in report["layer_groups"] for layer in row["layers"]}
    assert len(rows) == sum(len(r["layers"]) for r in report["layer_groups"]), "a layer in two rows"
    return rows


def _passed_over(choice: BackendChoice) -> dict[str, list[str]]:
    return {name: list(reasons) for name, reasons in choice.passed_over}


@pytest.mark.parametrize("platform", [CPU, CPU_LIBRARIES_FIRST], ids=["cpu", "cpu-libraries-first"])
@pytest.mark.parametrize("name", DEMOS)
def test_demo_engine_runs_and_allocates_what_inspect_shows(monkeypatch, name, platform):
    llm = _engine(monkeypatch, name, platform)
    parts = llm.llm_engine.parts
    report = inspect_cmd.build_report(name, platform, max_model_len=MAX_LEN).to_json()
    rows = _rows_by_layer(report)
    # every cache-owning layer runs the backend inspect names, in the group the plan put it in
    layers = _cache_layers(llm)
    assert sorted(m.layer_id for m in layers) == sorted(rows) == list(range(report["num_layers"]))
    for m in layers:
        assert m.backend.name == rows[m.layer_id]["backend"] == parts.backend_names[m.group_id]
        assert _passed_over(parts.plan.groups[m.group_id].backend) == rows[m.layer_id]["passed_over"]
    if platform is CPU_LIBRARIES_FIRST:
        assert all(row["passed_over"] for row in report["layer_groups"])
    # the bytes inspect promises are those of the tensors the engine allocated
    per_block = _allocated_bytes_per_block(llm)
    assert per_block == parts.plan.bytes_per_block
    assert report["kv_bytes_per_token"] * report["block_size"] == per_block  # one group, no window
    assert report["bytes_per_sequence"] == llm.llm_engine.kv_manager.num_blocks_for_tokens(MAX_LEN) * per_block
    assert (report["dtype"], report["max_model_len"], report["block_size"]) == (
        parts.dtype, parts.max_model_len, parts.groups[0].block_size)


RELEASED = [
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", {}),  # hybrid: full attention + Gated DeltaNet state
    ("openai/gpt-oss-20b", {}),  # sliding windows and sinks
    ("google/gemma-2-9b", {"max_model_len": 8192}),  # sliding windows and soft-capping
    ("deepseek-ai/DeepSeek-V3.2", {"kv_cache_dtype": "fp8"}),  # sparse MLA with its indexer cache
    ("deepseek-ai/DeepSeek-V3.2", {"tensor_parallel_size": 8}),
]
PLATFORMS = [CPU, CPU_LIBRARIES_FIRST, get_platform("cuda", (9, 0))]


def _builder_plan(name: str, platform, **kwargs) -> EnginePlan:
    """The plan ``builder`` takes for ``name`` (its arch read the way the builder reads it)."""
    path = resolve_config_path(name)
    arch = read_arch(load_hf_config(path), use_mla=not env.mla_disabled())
    return plan_engine(arch, EngineConfig.from_kwargs(str(path), **kwargs), platform)


def _inspect_json(capsys, name: str, platform, **kwargs) -> dict:
    report = inspect_cmd.build_report(name, platform, **kwargs)
    if platform.name == "cpu" and platform.priorities == CPU.priorities:  # the command line too
        args = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
        assert main(["inspect", name, "--platform", "cpu", "--json", *args]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(inspect_cmd.dumps(report))
    return report.to_json()


@pytest.mark.parametrize("platform", PLATFORMS, ids=["cpu", "cpu-libraries-first", "cuda-9.0"])
@pytest.mark.parametrize(("name", "kwargs"), RELEASED, ids=[f"{n}-{'-'.join(k) or 'default'}" for n, k in RELEASED])
def test_released_config_plan_equals_the_report(capsys, name, kwargs, platform):
    plan = _builder_plan(name, platform, **kwargs)
    report = _inspect_json(capsys, name, platform, **kwargs)
    rows = _rows_by_layer(report)
    assert sorted(rows) == list(range(report["num_layers"]))
    # group by group, as the engine loads backends: every layer's row shows the group's choice
    assert [g.group.group_id for g in plan.groups] == list(range(len(plan.groups)))
    for g in plan.groups:
        for e in g.group.entries:
            assert rows[e.layer]["backend"] == g.backend.name
            assert rows[e.layer]["passed_over"] == _passed_over(g.backend)
    for layer, row in rows.items():
        own = [e for e in plan.entries if e.layer == layer]
        assert row["bytes_per_token_per_layer"] == sum(e.spec.bytes_per_token for e in own)
        assert row["state_bytes_per_sequence_per_layer"] == sum(e.spec.bytes_per_sequence for e in own)
    # the bytes the builder sizes the pool and the state slots with
    state = sum(g.bytes_per_sequence_state for g in plan.state_groups)
    assert report["state_bytes_per_sequence"] == state
    assert report["kv_bytes_per_token"] == sum(g.group.bytes_per_token for g in plan.groups)
    blocks = plan.layout.blocks_for(plan.max_model_len)
    assert report["bytes_per_sequence"] == blocks * plan.bytes_per_block + state
    assert report["tensor_parallel_size"] == kwargs.get("tensor_parallel_size", 1)
    assert (report["dtype"], report["kv_cache_dtype"], report["max_model_len"]) == (
        plan.dtype, plan.kv_cache_dtype, plan.max_model_len)


def test_host_resident_latents_split_is_the_builders(capsys):
    """DeepSeek-V3.2 in fp8: inspect's device/host split per token is what the builder's
    host-latent plan costs per block on each side."""
    name, block = "deepseek-ai/DeepSeek-V3.2", 64
    plan = _builder_plan(name, CPU, kv_cache_dtype="fp8", block_size=block)
    report = _inspect_json(capsys, name, CPU, kv_cache_dtype="fp8", block_size=block)
    config = EngineConfig.from_kwargs(name, kv_cache_dtype="fp8", block_size=block, kv_offload_sparse_latents=True)
    host = plan_host_latents(config, plan.arch, plan.layout, plan.max_model_len, max_num_seqs=128)
    split = report["sparse_latent_offload"]
    assert split["device_bytes_per_token"] * block == host.device_bytes_per_block
    assert split["host_bytes_per_token"] * block == host.host_bytes_per_block
    assert (split["device_bytes_per_token"], split["host_bytes_per_token"]) == (132 * 61, 656 * 61)


@pytest.mark.parametrize(("name", "backend"), [
    ("attnserve-demo-gqa", "TORCH_MLA"), ("attnserve-demo-mla", "TORCH_SDPA"),
    ("attnserve-demo-dsa", "TORCH_MLA"), ("attnserve-demo-gqa", "NOPE"),
])
def test_a_named_backend_that_does_not_fit_fails_alike(monkeypatch, capsys, name, backend):
    with pytest.raises(BackendSelectionError) as engine_error:
        _engine(monkeypatch, name, CPU, attention_backend=backend)
    assert main(["inspect", name, "--platform", "cpu", "--attention-backend", backend]) == 2
    assert capsys.readouterr().err == f"error: {engine_error.value}\n"
    assert backend in str(engine_error.value)


@pytest.mark.parametrize(("name", "backend", "kind"), [
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", "FLASH_ATTN", "full"),
    ("deepseek-ai/DeepSeek-V3.2", "TORCH_SDPA", "sparse_mla"),
])
def test_released_config_named_backend_fails_alike(name, backend, kind):
    plan = _builder_plan(name, CPU, attention_backend=backend)
    with pytest.raises(BackendSelectionError) as engine_error:
        plan.backend_names  # noqa: B018 - what the builder reads, and raises on
    with pytest.raises(BackendSelectionError) as inspect_error:
        inspect_cmd.build_report(name, CPU, attention_backend=backend)
    assert str(inspect_error.value) == str(engine_error.value)
    assert f"{backend} cannot run {kind} layers" in str(engine_error.value)


def test_nothing_fits_is_the_engines_error_and_inspects_none(monkeypatch):
    name = "attnserve-demo-gqa"
    with pytest.raises(BackendSelectionError) as engine_error:
        _engine(monkeypatch, name, CPU_NOTHING_FITS)
    (row,) = inspect_cmd.build_report(name, CPU_NOTHING_FITS).to_json()["layer_groups"]
    assert row["backend"] == "none" and list(row["passed_over"]) == ["FLASH_ATTN", "TORCH_MLA"]
    assert "no attention backend can run full layers on cpu" in str(engine_error.value)
    assert engine_error.value.reasons == tuple(f"{n}: {'; '.join(r)}" for n, r in row["passed_over"].items())


def test_inspect_renders_the_plan_it_is_given(monkeypatch):
    """inspect computes nothing of its own: a changed plan changes the report."""
    def altered(arch, config, platform):
        plan = plan_engine(arch, config, platform)
        layers = tuple(replace(lp, backend=BackendChoice("SENTINEL", (("X", ("a reason",)),))) for lp in plan.layers)
        return replace(plan, layers=layers, kv_bytes_per_token=12345, bytes_per_sequence=678)

    monkeypatch.setattr(inspect_cmd, "plan_engine", altered)
    report = inspect_cmd.build_report("attnserve-demo-gqa", CPU)
    text = report.render()
    assert "SENTINEL  (passed over X: a reason)" in text and "12,345 B" in text
    assert report.to_json()["bytes_per_sequence"] == 678


def test_engine_allocates_from_the_plan_it_is_given(monkeypatch):
    """The builder selects nothing of its own: a plan naming another backend is what runs."""
    def altered(arch, config, platform):
        plan = plan_engine(arch, config, platform)
        assert plan.backend_names == ["TORCH_SDPA"]
        return replace(plan, groups=tuple(replace(g, choices=(BackendChoice("FLEX_ATTENTION"),))
                                          for g in plan.groups))

    monkeypatch.setattr(builder, "plan_engine", altered)
    llm = _engine(monkeypatch, "attnserve-demo-gqa", CPU)
    assert llm.llm_engine.parts.backend_names == ["FLEX_ATTENTION"]
    assert {m.backend.name for m in _cache_layers(llm)} == {"FLEX_ATTENTION"}


@pytest.mark.parametrize("name,platform,want", [
    ("deepseek-ai/DeepSeek-V3", "cuda", 64), ("deepseek-ai/DeepSeek-V3.2", "cuda", 64),
    ("deepseek-ai/DeepSeek-V3", "cpu", 16), ("meta-llama/Llama-3.1-8B-Instruct", "cuda", 16),
])
def test_default_block_size_by_model_and_platform(name, platform, want):
    """No block size given: 64 for MLA caches on CUDA (a TMA page), else 16; inspect shows the
    same size the engine would take, and a size given is kept."""
    arch = read_arch(load_hf_config(resolve_config_path(name)))
    plat = get_platform(platform)
    assert default_block_size(arch, plat) == want
    config = EngineConfig.from_kwargs("m", load_format="dummy")
    assert config.cache.block_size is None
    assert plan_engine(arch, config, plat).block_size == want
    assert plan_engine(arch, EngineConfig.from_kwargs("m", block_size=32), plat).block_size == 32
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig.from_kwargs("m", block_size=48)
