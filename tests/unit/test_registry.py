"""Backend validation and selection on each platform, and their errors."""

from __future__ import annotations

import importlib.util

import pytest

from attnserve.arch import LayerKind
from attnserve.attention.backend import BackendRequest
from attnserve.attention.registry import (
    BackendSelectionError,
    get_entry,
    is_implemented,
    list_backends,
    rank_backends,
    select_backend,
    validate,
)
from attnserve.platforms import get_platform

CPU = get_platform("cpu")
H100 = get_platform("cuda", (9, 0))
T4 = get_platform("cuda", (7, 5))
MI300 = get_platform("rocm", (9, 4))


def req(kind=LayerKind.FULL, head=128, dtype="bfloat16", kv="bfloat16", block=16, features=()):
    return BackendRequest(kind=kind, head_size=head, dtype=dtype, kv_cache_dtype=kv, block_size=block,
                          features=frozenset(features))


def test_names_are_upper_case_and_unique():
    names = [e.name for e in list_backends()]
    assert len(names) == len(set(names))
    assert all(n == n.upper() for n in names)
    for required in ("TORCH_SDPA", "TRITON_ATTN", "FLEX_ATTENTION", "TORCH_MLA", "TRITON_MLA",
                     "TORCH_MLA_SPARSE", "TRITON_MLA_SPARSE"):
        assert required in names


def test_every_priority_name_is_registered():
    for platform in (CPU, H100, MI300):
        for kind in LayerKind:
            names = platform.backend_priority(kind)
            assert names, f"{platform.name} lists no backend for {kind.value}"
            for n in names:
                get_entry(n)


@pytest.mark.parametrize("kind", [LayerKind.GDN, LayerKind.KDA, LayerKind.MAMBA, LayerKind.LIGHTNING])
def test_state_layers_take_triton_on_cuda_and_fall_back_below_sm80(kind):
    # the Triton state backends lead on CUDA since their H200 run (issue #20); a T4 (sm_75) is
    # below their floor and gets the PyTorch form, with the reason kept
    state = req(kind=kind, head=128)
    assert select_backend(state, H100).name == f"TRITON_{kind.name}"
    chosen = select_backend(state, T4)
    assert chosen.name == f"TORCH_{kind.name}"
    assert any(name == f"TRITON_{kind.name}" and "compute capability" in " ".join(r) for name, r in chosen.passed_over)
    assert select_backend(state, CPU).name == f"TORCH_{kind.name}"


def test_validation_returns_every_reason():
    reasons = validate(get_entry("FLASH_ATTN"), req(dtype="float32", kv="fp8", head=100, block=8,
                                                    features=("sinks",)), CPU)
    text = "\n".join(reasons)
    assert "runs on cuda, not on cpu" in text
    assert "does not support dtype float32" in text
    assert "does not support kv_cache_dtype fp8" in text
    assert "does not support head size 100" in text
    assert "multiple of 16, got 8" in text
    assert "does not support sinks" in text
    assert "library 'flash_attn' is not installed" in text


def test_compute_capability_and_layer_kind():
    reasons = validate(get_entry("TRITON_ATTN"), req(), T4)
    assert any("needs compute capability >= 8.0, the device has 7.5" in r for r in reasons)
    reasons = validate(get_entry("TORCH_MLA"), req(kind=LayerKind.FULL), CPU)
    assert any("does not handle full layers (handles mla)" in r for r in reasons)


def test_unimplemented_backend_is_not_selectable_and_says_so():
    entry = get_entry("FLASHMLA")
    assert not is_implemented(entry)
    assert "not implemented yet in this version of attnserve" in validate(entry, req(kind=LayerKind.MLA), H100)


def test_cpu_auto_selection_picks_torch_sdpa():
    sel = select_backend(req(dtype="float32", kv="float32"), CPU)
    assert sel.name == "TORCH_SDPA" and sel.passed_over == () and not sel.forced


def test_cuda_selection_explains_what_it_passed_over():
    ranked = rank_backends(req(), H100)
    assert [n for n, _ in ranked][:2] == ["FLASH_ATTN", "TRITON_ATTN"]
    sel = select_backend(req(), H100)
    passed = dict(sel.passed_over)
    assert "FLASH_ATTN" in passed and any("flash_attn" in r for r in passed["FLASH_ATTN"])
    # bf16, head 128, block 16 on sm_90: FLASH_ATTN has no implementation, TRITON_ATTN fits once
    # triton is installed (a test extra); without it FLASHINFER (no implementation) is passed over
    # too and FLEX_ATTENTION, which needs no library, is next on the list
    if importlib.util.find_spec("triton") is not None:
        assert sel.name == "TRITON_ATTN" and list(passed) == ["FLASH_ATTN"]
    else:
        assert sel.name == "FLEX_ATTENTION" and list(passed) == ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"]
        assert passed["TRITON_ATTN"] == ("library 'triton' is not installed",)
    for name, reasons in sel.passed_over:
        assert reasons, f"{name} was passed over without a reason"


def test_rocm_never_lists_cuda_only_libraries():
    names = MI300.backend_priority(LayerKind.FULL)
    assert "FLASH_ATTN" not in names and "FLASHINFER" not in names


def test_explicit_backend_that_does_not_fit_fails_with_all_reasons():
    with pytest.raises(BackendSelectionError) as e:
        select_backend(req(dtype="float32", kv="float32"), CPU, override="flash_attn")
    assert len(e.value.reasons) >= 3
    assert "FLASH_ATTN cannot run full layers" in str(e.value)
    with pytest.raises(BackendSelectionError, match="unknown attention backend 'NOPE'"):
        select_backend(req(), CPU, override="NOPE")


def test_explicit_backend_that_fits_is_taken():
    sel = select_backend(req(dtype="float32", kv="float32"), CPU, override="torch_sdpa")
    assert sel.name == "TORCH_SDPA" and sel.forced
