"""``dtype="auto"`` on CPU chooses from the CPU's instruction set (``platforms/cpu_info.py``):
bfloat16 with native bf16 dot products (AVX512_BF16, AMX-BF16), float32 elsewhere; an explicit
dtype is kept; the plan, ``inspect`` and one start-up log line say which and why. The flags come
from ``/proc/cpuinfo`` (or torch's probes), ``ATTNSERVE_CPU_ISA`` caps them, and the C++ decode
kernel's path follows them."""

from __future__ import annotations

import logging

import pytest

from attnserve.arch import load_hf_config, read_arch
from attnserve.config import EngineConfig
from attnserve.engine.plan import plan_engine, resolve_dtype
from attnserve.entrypoints import inspect as inspect_cmd
from attnserve.platforms import cpu, get_platform
from attnserve.platforms.cpu_info import CpuInfo, detect
from attnserve.presets import resolve_config_path

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
CPUS = {  # name -> (flags, auto dtype, decode kernel path)
    "avx2": (AVX2, "float32", "avx2"),
    "avx512": (AVX512, "float32", "avx512"),
    "avx512_bf16": (AVX512 | {"avx512_bf16"}, "bfloat16", "avx512_bf16"),
    "amx": (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "bfloat16", "avx512_bf16"),
    "sse": (frozenset({"fma"}), "float32", None),
}


def cpu_with(flags, machine: str = "x86_64") -> CpuInfo:
    return CpuInfo(model="Test CPU", machine=machine, flags=frozenset(flags), source="test")


@pytest.mark.parametrize("name", sorted(CPUS))
@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16", "float16"])
def test_auto_follows_the_cpu_and_an_explicit_dtype_is_kept(name, checkpoint):
    flags, want, path = CPUS[name]
    info = cpu_with(flags)
    platform = cpu.describe(cpu=info)
    dtype, why = resolve_dtype("auto", checkpoint, platform)
    assert dtype == want and info.decode_isa == path
    assert ("has native bf16 dot products" in why) == (want == "bfloat16")
    assert f"the checkpoint's dtype is {checkpoint}" in why
    if name == "amx":
        assert "(AMX-BF16)" in why
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, checkpoint, platform) == (explicit, f'dtype="{explicit}" as given')
    # on a GPU "auto" is the checkpoint's dtype, whatever the host CPU
    assert resolve_dtype("auto", checkpoint, get_platform("cuda", (9, 0)))[0] == checkpoint


def test_not_x86_runs_float32_and_no_decode_kernel():
    info = cpu_with({"fp", "asimd", "bf16"}, machine="aarch64")
    assert info.decode_isa is None and info.bf16_dot is None
    assert info.auto_dtype("bfloat16")[0] == "float32"


PROC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_detect_reads_proc_cpuinfo_and_the_cap_drops_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(PROC)
    info = detect(proc_cpuinfo=str(path))
    assert (info.model, info.source) == ("AMD EPYC 9R14 96-Core Processor", "/proc/cpuinfo")
    assert info.flags == AVX512 | {"avx512_bf16"}  # of the first CPU, the ones attnserve reads
    assert info.auto_dtype("float32")[0] == "bfloat16" and info.decode_isa == "avx512_bf16"
    assert "AMD EPYC 9R14" in info.describe() and "avx512_bf16" in info.describe()
    capped = detect("avx512", proc_cpuinfo=str(path))
    assert capped.flags == AVX512 and capped.decode_isa == "avx512" and capped.cap == "avx512"
    assert capped.auto_dtype("bfloat16") == ("float32", capped.auto_dtype("bfloat16")[1])
    assert "ATTNSERVE_CPU_ISA=avx512" in capped.auto_dtype("bfloat16")[1]
    assert detect("avx2", proc_cpuinfo=str(path)).flags == AVX2
    with pytest.raises(ValueError, match="must be one of avx2, avx512, avx512_bf16"):
        detect("avx3", proc_cpuinfo=str(path))


def test_without_proc_cpuinfo_torch_probes_answer(tmp_path):
    """Not Linux (or no access): torch's own probes, which agree with /proc/cpuinfo here."""
    info = detect(proc_cpuinfo=str(tmp_path / "missing"))
    assert info.source == "torch.cpu"
    here = detect()
    if here.source == "/proc/cpuinfo" and here.x86_64:
        assert info.decode_isa == here.decode_isa and info.bf16_dot == here.bf16_dot
    assert detect(proc_cpuinfo=None).source == "torch.cpu"


def test_the_env_cap_reaches_the_platform(monkeypatch):
    monkeypatch.setenv("ATTNSERVE_CPU_ISA", "avx2")
    platform = get_platform("cpu")
    assert platform.cpu.cap == "avx2" and platform.cpu.decode_isa in ("avx2", None)
    assert resolve_dtype("auto", "bfloat16", platform)[0] == "float32"
    monkeypatch.setenv("ATTNSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="ATTNSERVE_CPU_ISA must be"):
        get_platform("cpu")


@pytest.mark.parametrize("name", ["avx2", "avx512_bf16"])
def test_plan_and_inspect_say_which_and_why(name, capsys):
    """Llama-3.1-8B (a bfloat16 checkpoint) on two CPUs: the plan's dtype sizes the KV cache,
    and inspect's text and JSON give the dtype and its reason."""
    flags, want, _ = CPUS[name]
    platform = cpu.describe(cpu=cpu_with(flags))
    path = resolve_config_path("meta-llama/Llama-3.1-8B-Instruct")
    plan = plan_engine(read_arch(load_hf_config(path)), EngineConfig.from_kwargs(str(path.parent)), platform)
    assert plan.dtype == plan.kv_cache_dtype == want
    assert plan.kv_bytes_per_token == 32 * 2 * 8 * 128 * (2 if want == "bfloat16" else 4)
    report = inspect_cmd.build_report("meta-llama/Llama-3.1-8B-Instruct", platform)
    assert report.to_json()["dtype"] == want and report.to_json()["dtype_reason"] == plan.dtype_reason
    assert f"dtype {want}: {plan.dtype_reason}" in report.render().splitlines()
    explicit = inspect_cmd.build_report("meta-llama/Llama-3.1-8B-Instruct", platform, dtype="float16")
    assert explicit.dtype == "float16" and explicit.dtype_reason == 'dtype="float16" as given'


def test_the_engine_logs_its_dtype_once(caplog):
    from attnserve import LLM

    with caplog.at_level(logging.INFO, logger="attnserve"):
        llm = LLM("attnserve-demo-gqa", load_format="dummy", kv_cache_memory=0.01, max_model_len=128)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    dtype, why = resolve_dtype("auto", "bfloat16", get_platform("cpu"))
    assert lines == [f"dtype {dtype}: {why}"] and llm.llm_engine.parts.dtype == dtype
