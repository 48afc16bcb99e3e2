"""The kernel-variant table (``attention/kernels.py``): one pick per operation with every reason,
recorded by the plan per step kind, shown by ``inspect`` on any platform, handed to the backends
the engine builds, turned off by ``disabled_kernels``, prepared by the plan.

The variants' arithmetic is ``tests/kernels/test_kernel_variants.py``'s; this file is the choice.
"""

from __future__ import annotations

import json

import pytest

from attnserve import LLM
from attnserve.arch import load_hf_config, read_arch
from attnserve.attention import kernels
from attnserve.attention.kernels import KernelError, KernelProblem, get_variant, pick, variants_of
from attnserve.config import EngineConfig
from attnserve.engine.plan import plan_engine, prepare_kernels
from attnserve.entrypoints.cli import main
from attnserve.platforms import get_platform
from attnserve.presets import resolve_config_path

H100, A100, CPU = get_platform("cuda", (9, 0)), get_platform("cuda", (8, 0)), get_platform("cpu")


def _problem(platform="cuda", capability=(9, 0), **fields) -> KernelProblem:
    base = dict(dtype="bfloat16", cache_dtype="bfloat16", block_size=64, num_heads=128, num_kv_heads=1,
                head_size=576, head_size_v=512, kv_lora_rank=512)
    return KernelProblem(platform=platform, capability=capability, **{**base, **fields})


def test_pick_takes_the_first_that_fits_and_says_why_of_the_others():
    assert pick("mla.absorbed", _problem(), "TRITON_MLA").variant == "gluon"
    choice = pick("mla.absorbed", _problem(cache_dtype="fp8"), "TRITON_MLA")
    assert choice.variant == "triton_gather"
    passed = dict(choice.passed_over)
    assert passed["gluon"] == ("a bfloat16 latent cache only, not fp8",)
    assert passed["triton_tma"] == ("reads a cache of the model dtype only, not fp8 (model bfloat16)",)
    ampere = pick("mla.absorbed", _problem(capability=(8, 0)), "TRITON_MLA")
    assert ampere.variant == "triton_gather"
    assert dict(ampere.passed_over)["triton_tma"] == ("needs compute capability 9.0 or later, the device has 8.0",)
    # 16 heads: the Gluon kernel pads them; the TMA form was built for 64-row programs only
    assert pick("mla.absorbed", _problem(num_heads=16), "TRITON_MLA").variant == "gluon"
    assert pick("mla.absorbed", _problem(num_heads=16, block_size=16), "TRITON_MLA").variant == "triton_gather"


def test_a_backend_only_picks_among_its_own_variants():
    assert [v.name for v in variants_of("attention.decode", "TRITON_ATTN")] == ["triton"]
    assert [v.name for v in variants_of("attention.decode", "TORCH_SDPA")] == ["cpu_ext", "torch"]
    cuda = _problem(cache_dtype="bfloat16", num_heads=8, num_kv_heads=2, head_size=128, head_size_v=128)
    assert pick("attention.decode", cuda, "TORCH_SDPA").variant == "torch"  # cpu_ext runs on the CPU only


def test_nothing_fits_is_a_choice_with_every_reason():
    choice = pick("attention.prefill", _problem(), "TRITON_ATTN", disabled=("gluon", "triton"))
    assert choice.variant == "none"
    assert "turned off by disabled_kernels (gluon)" in choice.error
    assert "turned off by disabled_kernels (triton)" in choice.error
    with pytest.raises(KernelError, match="no kernel variant of attention.prefill fits TRITON_ATTN"):
        choice.get()


@pytest.mark.parametrize("entry", ["gluon", "mla.absorbed/gluon", "triton_tma", "cpu_ext", "triton_gemv"])
def test_disabled_kernels_names_variants_operations_and_technologies(entry):
    kernels.check_disabled([entry])
    assert "turned off" in " ".join(kernels.reasons(_matching(entry), _problem(), [entry]))


def _matching(entry: str):
    return next(v for v in kernels.VARIANTS if entry in (v.name, v.tech, v.key))


def test_an_unknown_disabled_kernel_is_an_error_naming_the_known_ones():
    with pytest.raises(KernelError, match="names no kernel variant: glon .*known names: .*gluon"):
        kernels.check_disabled(["glon"])
    path = resolve_config_path("meta-llama/Llama-3.1-8B-Instruct")
    config = EngineConfig.from_kwargs(str(path.parent), disabled_kernels="gluon, glon")
    assert config.cache.disabled_kernels == ("gluon", "glon")
    with pytest.raises(KernelError, match="glon"):
        plan_engine(read_arch(load_hf_config(path)), config, H100)


def _plan(model: str, platform, **kwargs):
    path = resolve_config_path(model)
    return plan_engine(read_arch(load_hf_config(path)), EngineConfig.from_kwargs(str(path.parent), **kwargs), platform)


def _kernels(plan) -> dict[str, dict[str, str]]:
    """step kind -> operation -> variant, over every group (each group's ops are distinct here)."""
    out: dict[str, dict[str, str]] = {}
    for g in plan.groups:
        for kind, choices in g.kernels:
            out.setdefault(kind, {}).update({c.op: c.variant for c in choices})
    return out


def test_the_plan_records_each_operation_per_step_kind():
    plan = _plan("deepseek-ai/DeepSeek-V3.2", H100, kv_cache_dtype="fp8")
    got = _kernels(plan)
    assert got["decode"] == {"indexer.decode": "gluon", "indexer.topk_decode": "triton_radix",
                             "mla.sparse": "gluon_fp8"}
    assert got["prefill"] == {"indexer.prefill": "triton", "indexer.topk_prefill": "torch", "mla.sparse": "gluon_fp8"}
    assert got["mixed"] == {**got["decode"], **got["prefill"]}
    model = {kind: {c.op: c.variant for c in cs} for kind, cs in plan.model_kernels}
    assert model == {"decode": {"dense.small_m": "triton_gemv", "moe.experts": "triton"},
                     "prefill": {"moe.experts": "triton"}, "mixed": {"moe.experts": "triton"}}
    # on an A100 nothing is Gluon, and each choice says why
    a100 = _kernels(_plan("deepseek-ai/DeepSeek-V3.2", A100, kv_cache_dtype="fp8"))
    assert a100["decode"] == {"indexer.decode": "triton", "indexer.topk_decode": "triton_radix", "mla.sparse": "triton"}
    # dense MLA: 128 heads in 64-token pages on the H100 take the Gluon kernel; turned off, TMA
    dense = _plan("deepseek-ai/DeepSeek-V3", H100)
    assert _kernels(dense)["decode"] == {"mla.absorbed": "gluon"}
    assert _kernels(dense)["prefill"] == {"mla.absorbed": "gluon", "mla.expanded": "torch"}
    assert _kernels(_plan("deepseek-ai/DeepSeek-V3", H100, disabled_kernels=("gluon",)))["decode"] == {
        "mla.absorbed": "triton_tma"}


def test_the_plan_passes_a_variant_whose_preparation_fails_over(monkeypatch):
    """The CPU extension's build is the cpu_ext variant's prepare hook: the plan calls it, and a
    failure moves the choice to the next variant with the failure as its reason."""
    from attnserve.ops.cpu import paged_decode

    monkeypatch.setattr(paged_decode, "prepare", lambda: "no compiler (test)")
    path = resolve_config_path("attnserve-demo-gqa")
    config = EngineConfig.from_kwargs(str(path.parent))
    plan = plan_engine(read_arch(load_hf_config(path)), config, CPU)
    assert _kernels(plan)["decode"]["attention.decode"] == "cpu_ext"  # the machine allows it
    prepared = prepare_kernels(plan, config)
    choice = prepared.groups[0].kernel_choices["attention.decode"]
    assert choice.variant == "torch"
    assert dict(choice.passed_over)["cpu_ext"] == ("not ready: no compiler (test)",)


def test_the_engine_builds_its_backends_and_model_with_the_plans_choices():
    llm = LLM("attnserve-demo-gqa", kv_cache_memory=0.02, max_model_len=256, disabled_kernels=("cpu_ext",))
    parts = llm.llm_engine.parts
    (backend,) = parts.runner.backends
    assert backend.name == "TORCH_SDPA" and backend.kernels == {"attention.decode": "torch", "attention.prefill": "torch"}
    assert parts.plan.groups[0].kernel_names() == backend.kernels
    assert dict(parts.plan.groups[0].kernel_choices["attention.decode"].passed_over) == {
        "cpu_ext": ("turned off by disabled_kernels (cpu_ext)",)}
    out = llm.generate(["def f(x):"], use_tqdm=False)[0].outputs[0]
    assert out.token_ids and backend.kernels["attention.decode"] == "torch"


@pytest.mark.parametrize("block_size,want", [(64, "triton_tma"), (16, "triton_gather")])
def test_a_backend_built_without_choices_picks_what_the_plan_would(block_size, want):
    """A backend a test builds by hand picks on its first call from the call's tensors
    (``latent_problem`` in TRITON_MLA): the same variant, passed over for the same reasons, as the
    plan picks from the layer's spec (DeepSeek-V3, 128 heads, on the interpreter's CPU)."""
    import torch

    from attnserve.attention.backends.triton_mla import latent_problem

    plan = _plan("deepseek-ai/DeepSeek-V3", CPU, attention_backend="TRITON_MLA", dtype="float32",
                 block_size=block_size)
    planned = plan.groups[0].kernel_choices["mla.absorbed"]
    q = torch.zeros(3, 128, 576)  # absorbed rows [N, H, L + R]
    cache = torch.zeros(4, block_size, 576)
    lazy = pick("mla.absorbed", latent_problem(q, cache, 512), "TRITON_MLA")
    assert planned.variant == lazy.variant == want
    assert planned.passed_over == lazy.passed_over


@pytest.mark.parametrize("platform_args,want", [
    (["--platform", "cuda", "--compute-capability", "9.0"], {"attention.decode": "triton", "attention.prefill": "gluon"}),
    (["--platform", "cuda", "--compute-capability", "8.0"], {"attention.decode": "triton", "attention.prefill": "triton"}),
    (["--platform", "cpu"], {"attention.decode": "cpu_ext", "attention.prefill": "torch"}),
])
def test_inspect_json_names_every_operations_kernel_with_its_reasons(capsys, platform_args, want):
    assert main(["inspect", "meta-llama/Llama-3.1-8B-Instruct", "--json", *platform_args]) == 0
    report = json.loads(capsys.readouterr().out)
    (group, model) = report["kernels"]
    assert group["backend"] in ("TRITON_ATTN", "TORCH_SDPA") and group["layers"] == list(range(32))
    assert {o["op"]: o["variant"] for o in group["operations"]} == want
    steps = {o["op"]: o["steps"] for o in group["operations"]}
    assert steps == {"attention.decode": ["decode", "mixed"], "attention.prefill": ["prefill", "mixed"]}
    if platform_args[-1] == "8.0":
        prefill = next(o for o in group["operations"] if o["op"] == "attention.prefill")
        assert prefill["passed_over"] == {"gluon": ["needs compute capability 9.0 to 9.9, the device has 8.0"]}
    assert model["backend"] == "model" and [o["op"] for o in model["operations"]] == ["dense.small_m"]


def test_inspect_text_shows_the_kernels_and_disabled_ones(capsys):
    assert main(["inspect", "deepseek-ai/DeepSeek-V3", "--platform", "cuda", "--compute-capability", "9.0",
                 "--disabled-kernels", "gluon"]) == 0
    out = capsys.readouterr().out
    assert "mla.absorbed -> triton_tma [decode, prefill, mixed]  (passed over gluon: turned off by " \
           "disabled_kernels (gluon))" in out
    assert "mla.expanded -> torch [prefill, mixed]" in out


def test_every_variant_names_a_real_launch_and_prepare_hook():
    for v in kernels.VARIANTS:
        if v.launch is not None and "triton" not in v.requires:  # Triton modules import Triton
            assert callable(v.load()), v.key
        if v.prepare is not None:
            module, _, fn = v.prepare.partition(":")
            assert callable(getattr(__import__(module, fromlist=[fn]), fn)), v.key
    pytest.importorskip("triton")
    for v in kernels.VARIANTS:
        if v.launch is not None:
            assert callable(v.load()), v.key
    assert get_variant("attention.prefill", "gluon").load().__name__ == "launch_prefill_attention"
