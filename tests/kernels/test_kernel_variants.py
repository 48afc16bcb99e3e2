"""Every kernel variant of ``attention/kernels.py`` against the PyTorch reference, on one shared
set of batch shapes (``tests/kernels/variants``: decode, prefill, mixed, block boundaries, window,
sinks, ALiBi, soft-cap, fp8 cache, 64-token pages).

The test iterates the table, so a registered variant is under it: its operation's harness runs
it the way its launcher does (a backend built with the variant, or a layer with it forced) and
compares with the reference, on every spec the variant takes; a variant that no spec runs fails,
and so does an operation with no harness. On CPU, Triton variants run through the interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) and Gluon ones, which have no interpreter, are
compiled for sm_90 (``sm90.py``: the launcher runs on CPU tensors with every kernel recorded). On a
Hopper GPU with ``TRITON_INTERPRET=0`` every variant runs compiled and is checked numerically::

    TRITON_INTERPRET=0 python -m pytest -q tests/kernels/test_kernel_variants.py
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from attnserve import env  # noqa: E402
from attnserve.attention.kernels import OPERATIONS, VARIANTS, KernelVariant  # noqa: E402
from attnserve.attention.registry import list_backends  # noqa: E402
from tests.kernels.sm90 import compile_for_sm90  # noqa: E402
from tests.kernels.variants import BATCH_SPECS, Mode  # noqa: E402

# operation family -> its harness module under tests/kernels/variants
HARNESSES = {"attention": "attention", "mla": "mla", "indexer": "mla", "nsa": "nsa", "gdn": "state",
             "kda": "state", "mamba": "state", "lightning": "state", "dense": "dense", "moe": "dense"}


def harness(variant: KernelVariant):
    return importlib.import_module(f"tests.kernels.variants.{HARNESSES[variant.op.partition('.')[0]]}")


def mode_for(variant: KernelVariant) -> Mode:
    """Compiled on a GPU when the interpreter is off, else on CPU; Gluon off Hopper: compiled
    for sm_90 only."""
    gpu = torch.cuda.is_available() and not env.triton_interpret()
    if variant.tech == "cpu_ext":
        return Mode("numeric")
    if variant.tech == "gluon":
        hopper = gpu and torch.cuda.get_device_capability()[0] == 9
        return Mode("numeric", torch.device("cuda")) if hopper else Mode("compile")
    return Mode("numeric", torch.device("cuda")) if gpu else Mode("numeric")


def test_every_operation_has_a_harness_and_every_backend_operation_a_variant():
    assert set(HARNESSES) == {op.partition(".")[0] for op in OPERATIONS}
    for entry in list_backends():
        for kind in ("decode", "prefill"):
            for op in entry.operations_for(kind):
                assert any(entry.name in v.launched_by for v in VARIANTS if v.op == op), (entry.name, op)
    # the table's size, so that a change to it shows here: 48 variants of 20 operations
    assert (len(VARIANTS), len(OPERATIONS)) == (48, 20)


# The compile run: the launcher on CPU tensors in a fresh interpreter without TRITON_INTERPRET,
# every JIT kernel of attnserve.ops recorded (nothing runs), the variant's own launches compiled.
_COMPILE_BODY = r"""
import importlib, pkgutil
import attnserve.ops
import attnserve.ops.launch as launch_helpers
launch_helpers.require_hopper = lambda *a, **k: None  # reach the launch on CPU tensors
from attnserve.attention.kernels import get_variant
from tests.kernels.variants import BATCH_SPECS, Mode
variant = get_variant(OP, NAME)
for info in pkgutil.walk_packages(attnserve.ops.__path__, "attnserve.ops."):
    module = importlib.import_module(info.name)
    record(module, *[n for n, obj in vars(module).items()
                     if n.endswith("_kernel") and hasattr(obj, "arg_names") and obj.fn.__module__ == info.name])
harness = importlib.import_module(HARNESS)
ran = [spec.name for spec in BATCH_SPECS if not isinstance(harness.run(variant, spec, Mode("compile")), str)]
print("ran", ",".join(ran))
own = variant.launch.partition(":")[0]
calls[:] = [c for c in calls if c[0].fn.__module__ == own]
"""


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.key)
def test_variant_matches_the_reference(variant):
    why = variant.run_prepare()  # the CPU extension builds here (or says why it cannot)
    if why is not None:
        pytest.skip(f"{variant.key} cannot run here: {why}")
    mode = mode_for(variant)
    module = harness(variant)
    if mode.kind == "compile":
        body = f"OP, NAME, HARNESS = {variant.op!r}, {variant.name!r}, {module.__name__!r}\n" + _COMPILE_BODY
        infos = compile_for_sm90(body)
        assert infos, f"{variant.key}: the launcher launched none of its kernels"
        return
    ran, skipped = [], {}
    for spec in BATCH_SPECS:
        result = module.run(variant, spec, mode)
        if isinstance(result, str):
            skipped[spec.name] = result
            continue
        assert result.ok, f"{variant.key} on {spec.name}: error {result.error:.3g} > {result.tolerance:g} {result.detail}"
        ran.append(spec.name)
    assert ran, f"no batch spec runs {variant.key}: {skipped}"
