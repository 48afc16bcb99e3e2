"""The shared pieces of the kernel-variant parity test (``tests/kernels/test_kernel_variants.py``).

Every variant of ``attention/kernels.py`` runs here on one shared set of batch shapes
(``BATCH_SPECS``: decode, prefill, mixed, block boundaries, window, sinks, ALiBi, soft-cap, fp8
cache, 64-token pages) against the PyTorch reference. A *harness* per operation family (the part of
the operation's name before the dot: ``attention``, ``mla``, ``indexer``, ``nsa``, the state
mechanisms, ``dense``, ``moe``) knows how to build that family's inputs for a spec, run the
variant the way its launcher runs it (a backend built with ``{op: name}``, or a model layer with
the variant forced) and compute the reference. A harness module exposes::

    def run(variant: KernelVariant, spec: BatchSpec, mode: Mode) -> Result | str

returning the error against the reference, or a string saying why the spec does not apply (a
feature the operation does not have, a problem the variant's ``takes`` refuses). The test fails
for a variant that no spec ran, and for an operation family with no harness: registering a
variant puts it under the test.

Modes: ``numeric`` runs on ``mode.device`` (CPU: Triton through its interpreter, which wants
fp32 or fp16 inputs; CUDA with ``TRITON_INTERPRET=0``: the compiled kernels); ``compile`` (Gluon
variants off Hopper: Gluon has no interpreter) runs the launcher on CPU tensors inside
``tests/kernels/sm90.py``'s recorder, so the launches are compiled for sm_90 instead of run.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field

import torch

from attnserve.attention.kernels import KernelVariant, variants_of
from attnserve.attention.metadata import CommonAttentionMetadata
from attnserve.attention.registry import get_entry

__all__ = ["BATCH_SPECS", "BatchSpec", "Mode", "Result", "backend_kernels", "make_common", "paged_layout",
           "relative_error"]


@dataclass(frozen=True)
class BatchSpec:
    """One step's batch: each request's new tokens over its cached ones, and the layer's features."""

    name: str
    query_lens: tuple[int, ...]  # new tokens a request (decodes first, as the runner orders them)
    context_lens: tuple[int, ...]  # tokens each request has cached before this step
    block_size: int = 16
    window: int | None = None
    alibi: bool = False
    sinks: bool = False
    softcap: float | None = None
    fp8: bool = False  # an fp8 KV cache (standard K/V, MLA latent rows, indexer keys)

    def generator(self) -> torch.Generator:
        """A generator seeded by the spec's name (the same inputs in every process)."""
        return torch.Generator().manual_seed(zlib.crc32(self.name.encode()))

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(q + c for q, c in zip(self.query_lens, self.context_lens))

    @property
    def num_decodes(self) -> int:
        return sum(1 for _ in itertools.takewhile(lambda q: q == 1, self.query_lens))

    @property
    def kind(self) -> str:
        """decode, prefill or mixed: the step kind the plan names the batch by."""
        nd = self.num_decodes
        return "decode" if nd == len(self.query_lens) else "prefill" if nd == 0 else "mixed"

    @property
    def features(self) -> frozenset[str]:
        out = {"sliding_window"} if self.window else set()
        out |= {f for f, on in (("alibi", self.alibi), ("sinks", self.sinks), ("softcap", self.softcap)) if on}
        return frozenset(out)


BATCH_SPECS: tuple[BatchSpec, ...] = (
    BatchSpec("decode", (1, 1, 1, 1), (0, 15, 16, 40)),
    BatchSpec("prefill", (7, 16, 23), (0, 0, 9)),
    BatchSpec("mixed", (1, 1, 12, 5), (30, 3, 0, 20)),
    BatchSpec("boundaries", (1, 1, 16, 17), (15, 31, 16, 0)),  # lengths on and around page edges
    BatchSpec("window", (1, 1, 9), (20, 4, 12), window=8),
    BatchSpec("sinks", (1, 6), (17, 5), sinks=True),
    BatchSpec("alibi", (1, 6), (17, 5), alibi=True),
    BatchSpec("softcap", (1, 6), (17, 5), softcap=5.0),
    BatchSpec("fp8", (1, 1, 7), (33, 0, 20), fp8=True),
    BatchSpec("page64", (1, 1, 20, 9), (70, 127, 0, 60), block_size=64),
)


@dataclass(frozen=True)
class Mode:
    """How a variant runs: ``numeric`` on ``device`` against the reference, or ``compile``
    (launches recorded and compiled for sm_90, nothing compared)."""

    kind: str  # numeric | compile
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def numeric(self) -> bool:
        return self.kind == "numeric"


@dataclass(frozen=True)
class Result:
    """The variant's largest error against the reference (relative to the reference's largest
    value) and the tolerance of its dtype."""

    error: float
    tolerance: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def paged_layout(spec: BatchSpec, gen: torch.Generator, spare_blocks: int = 2):
    """Random, non-contiguous block tables for ``spec`` (block 0, the null block, in no table).

    Returns:
        (num_blocks, block_table [B, W] int32, slot_mapping [T] int64 of the new tokens).
    """
    bs = spec.block_size
    need = [-(-s // bs) for s in spec.seq_lens]
    num_blocks = sum(need) + 1 + spare_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(need), max(max(need), 1) + 1, dtype=torch.int32)  # a spare column
    slots = []
    for i, (n, q, s) in enumerate(zip(need, spec.query_lens, spec.seq_lens)):
        row, perm = perm[:n], perm[n:]
        table[i, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // bs] * bs + p % bs for p in range(s - q, s)]
    return num_blocks, table, torch.tensor(slots, dtype=torch.int64)


def make_common(spec: BatchSpec, table: torch.Tensor, slots: torch.Tensor,
                device: torch.device) -> CommonAttentionMetadata:
    """The step's ``CommonAttentionMetadata`` (one KV cache group), as the runner builds it."""
    qsl = [0]
    for q in spec.query_lens:
        qsl.append(qsl[-1] + q)
    seq = list(spec.seq_lens)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(spec.query_lens, seq)])
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        positions=positions.to(device), block_tables=[table.to(device)], slot_mappings=[slots.to(device)],
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, num_decodes=spec.num_decodes,
        max_query_len=max(spec.query_lens), max_seq_len=max(seq))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float32 (inf when ``out`` holds NaN)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    if out.isnan().any():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def backend_kernels(variant: KernelVariant, mode: Mode, backend: str | None = None) -> dict[str, str]:
    """The kernels to build ``backend`` (default: the variant's one launcher) with: the variant
    for its operation; in a compile run (no interpreter, so nothing may be picked for the CPU)
    every other operation of the backend by its first variant that is not Gluon, whose launches
    are recorded too."""
    if backend is None:
        if len(variant.launched_by) != 1:
            raise ValueError(f"{variant.key} has several launchers ({sorted(variant.launched_by)}): name one")
        (backend,) = variant.launched_by
    out = {variant.op: variant.name}
    if not mode.numeric:
        for op in get_entry(backend).operations_for("mixed"):
            if op != variant.op:
                out[op] = next(v.name for v in variants_of(op, backend) if v.tech != "gluon")
    return out
