"""Decode and prefill per attention mechanism, against the H200's bandwidth and FLOP ceilings.

Real configs cut to 4 full-width layers, dummy bf16 weights, through ``LLM(...)``:

- ``llama8b`` (GQA): Llama-3.1-8B-Instruct, TRITON_ATTN;
- ``qwen3_30b_a3b`` (MoE): Qwen3-30B-A3B, every layer MoE with all 128 experts (top-8), TRITON_ATTN;
- ``dsv3`` (MLA): DeepSeek-V3, 1 dense + 3 MoE layers of ``--experts`` routed experts (16), TRITON_MLA;
- ``dsv32`` (DSA): DeepSeek-V3.2, the same cut, TRITON_MLA_SPARSE;
- ``glm5`` (DSA): GLM-5, the same cut (its ``n_group``/``topk_group`` of 1 divide any count),
  TRITON_MLA_SPARSE.

Hybrids, cut to their layer period at full width, every routed expert kept; the state layers
run the backend ``--state-backend`` names (TRITON_<kind>, default, or TORCH_<kind>: a
state-only name applies to the layers it handles), the attention layers the platform's first
that fits (on CUDA TRITON_ATTN, TRITON_MLA for Kimi's MLA):

- ``qwen3_next`` (GDN+GQA): Qwen3-Next-80B-A3B, 3 Gated DeltaNet + 1 gated attention layer,
  every layer MoE with all 512 experts (top-10) and the shared expert (13.4 GiB of weights);
- ``qwen35`` (GDN+GQA): Qwen3.5-27B (dense), the same 3 + 1 (7.6 GiB);
- ``qwen35_moe`` (GDN+GQA): Qwen3.5-35B-A3B, the same 3 + 1, 256 experts top-8 and a shared
  expert (8.2 GiB; its config is ``RELEASED``'s, see there);
- ``kimi_linear`` (KDA+MLA): Kimi-Linear-48B-A3B, 3 KDA + 1 MLA layer, layer 0 dense, the
  others 256 experts top-8 and a shared expert (12.0 GiB);
- ``jamba`` (Mamba+GQA): AI21-Jamba-1.5-Mini, one period of 8: 7 Mamba + 1 attention layer
  (layer 4), MoE (16 experts top-2) at the odd layers (24.8 GiB);
- ``minimax`` (lightning+GQA): MiniMax-Text-01 (``RELEASED``'s config), 3 lightning + 1
  softmax layer (the released 7 : 1 would be 8 layers, 87 GiB), all 32 experts top-2 (46.7 GiB).

``--experts N`` sets the routed experts of the three DeepSeek/GLM cuts; ``n_group`` becomes the
largest divisor of N not above the config's, ``topk_group`` at least enough groups for top-k.

Grid: batch 1 / 8 / 64 x context 1K / 8K / 32K for every case; DSA and dense MLA also 64K and 128K
at the ``--dsa-long-batches`` (1, 32). One engine per (case, context): ``max_num_seqs`` the
largest batch, ``max_model_len`` context + new tokens + 16. Its largest batch of distinct random
prompts (no two share a block) runs once with ``max_tokens=1`` after a short warm-up: that is
the prefill cell, and it fills the prefix cache. Then for each batch b the first b prompts run
again (prefix hits: only the last block is recomputed; a hybrid restores its state snapshot at
that block, for which its engine keeps ``snapshot_room`` snapshots per sequence
(``num_state_snapshots``), so that the snapshots outlive the grid; ``prefix_hit_fraction`` in each decode cell says how much of the
prompts the cache served) through the engine's ``step``: once
every request has its first token and 4 more steps have run, N - 16 decode steps are timed
(synchronised at both ends), the median of ``--repeats``: decode ms per step. (Subtracting a
1-token ``generate`` from an N-token one left the prefill's variance in the result.) Before an engine is built,
the KV cache of its batches is checked against the memory left (the plan's bytes per sequence,
the weights' bytes from the model built on the meta device); after, against the blocks the
engine really has. A batch that does not fit is recorded as skipped with the reason.

The floors (the bytes a decode step must read at 4.25 TB/s, its FLOPs at 790 TFLOP/s) and the
FLOPs of a prefill come from ``benchmarks/step_floors.py``, whose docstring gives the formulas;
the table gives both decode floors and the fraction of the larger one reached.

    python benchmarks/gpu_mechanisms.py [--cases dsv32,glm5|hybrids] [--batches 1,8] [--contexts 8K,128K]
        [--dsa-long-batches 1,32] [--experts 16] [--new 64] [--kv-cache-dtype fp8] [--block-size 64]
        [--max-num-batched-tokens 16384] [--state-backend torch,triton] [--budget-s 540]
        [--docs docs/performance.md] [--smoke]
    python benchmarks/gpu_mechanisms.py --render run1.json run2.json [--docs docs/performance.md]

Prints a JSON line per cell as it completes, then a markdown table; writes
``$OUT/gpu_mechanisms.json`` (cells, options, environment) when ``OUT`` is set, after every cell
(``"partial": true`` until the run ends), so a command stopped by its time limit keeps its
cells; ``--budget-s`` starts no engine or decode cell after that many seconds; ``--docs``
rewrites the table between the ``gpu_mechanisms`` markers of that markdown file (appending the
section when they are missing). A device command is limited in time: run the grid in parts
(``--cases``, ``--contexts``) and ``--render`` their JSON files into one table (a later file's
cell replaces an earlier one's). The long DSA prefills dominate the cost: 32 prompts of 128K
are 4.2M prompt tokens, about 48 PFLOP for the DeepSeek-V3.2 cut (28 of them attention and
indexer), minutes at the rates ``gpu_mla.py`` measured. For the hybrids, the prefills of their
state layers in PyTorch (chunked delta rule, Mamba's log-step scan) set the pace: Jamba's seven
Mamba layers move about 6 GB of float32 scan tensors per 128-token chunk and layer; estimated
(not measured) 64 x 32K prompts take 30-60 s a case, Jamba's 4-5 minutes. ``--state-backend
torch,triton`` runs each hybrid with both; its cells carry ``state_backend``.

``--smoke``: the five cases at toy sizes on CPU in float32 under Triton's interpreter (one
layer for the GQA, MoE and MLA cases and DeepSeek-V3.2, whose one layer is MoE; GLM-5 one dense
and one MoE layer, the second a "shared" layer without indexer; index_topk 16 so the indexer
selects), and the hybrids of ``SMOKE_HYBRIDS`` (one per state kind: a state and an attention
layer each, TRITON_<kind> under the interpreter, the first context only; ``--cases hybrids``
all six), batch 1/2, contexts 32/64, 3 new tokens, one repeat, blocks of 8, no warm-up; then the
docs rewrite into a temporary file and the JSON read back. It exits non-zero unless every cell
ran; a device run exits non-zero when a cell failed (skipped cells are not failures).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from step_floors import (  # noqa: E402 (a sibling module: the script's directory is on sys.path)
    BANDWIDTH,
    PEAK_FLOPS,
    attention_flops_per_token,
    cache_rows,
    check_rows,
    decode_cache_bytes,
    decode_flops,
    decode_state_bytes,
    decode_weight_bytes,
    param_bytes,
    prefill_flops,
    prefill_params,
    state_rows,
)

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.arch import ModelArch, load_hf_config, read_arch  # noqa: E402
from attnserve.attention.registry import BackendSelectionError  # noqa: E402
from attnserve.config import EngineConfig  # noqa: E402
from attnserve.engine.plan import plan_engine  # noqa: E402
from attnserve.models.registry import get_model_class  # noqa: E402
from attnserve.platforms import current_platform  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402

LONG_CONTEXT = 32768  # contexts above this run for the DSA and MLA cases only, at --dsa-long-batches
GIB = 1024**3
MARK_BEGIN = "<!-- gpu_mechanisms:begin -->"
MARK_END = "<!-- gpu_mechanisms:end -->"
DOCS_TITLE = "## Per-mechanism decode and prefill (benchmarks/gpu_mechanisms.py)"
JSON_NAME = "gpu_mechanisms.json"


@dataclass(frozen=True)
class Case:
    """One mechanism: a real config, its cut, and the backend that runs it (for a hybrid, the
    backend of its state layers; its attention layers take the platform's first that fits)."""

    name: str
    config: str  # the Hugging Face name ``resolve_config_path`` finds, or a key of RELEASED
    mechanism: str
    backend: str = ""  # the attention backend; hybrids: "" (``state`` names theirs)
    overrides: dict = field(default_factory=dict)  # on the text config (``text_config`` if nested)
    cut_experts: bool = False  # ``--experts`` sets its routed experts
    long: bool = False  # also runs the long contexts (DSA, and dense MLA to compare with)
    smoke_overrides: dict = field(default_factory=dict)  # on top of SMOKE
    state: str = ""  # hybrids: the state mechanism of the backend names (TORCH_<state>, TRITON_<state>)

    def backend_name(self, state_backend: str = "triton") -> str:
        """The ``attention_backend`` the engine is given: a state-only name for a hybrid, which
        the registry applies to the layers it handles (``override_for``)."""
        return f"{state_backend.upper()}_{self.state}" if self.state else self.backend


DEEPSEEK_CUT = {"num_hidden_layers": 4, "first_k_dense_replace": 1}
FOUR_HYBRID = ["linear_attention"] * 3 + ["full_attention"]  # the 3:1 period of Qwen3-Next/3.5
TWO_HYBRID = ["linear_attention", "full_attention"]
# Kimi-Linear's layers 1-3 KDA, 4 MLA (1-based, as in its checkpoint), heads as released
KIMI_LINEAR_CUT = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 128, "num_heads": 32,
                   "short_conv_kernel_size": 4}

# Released models without a config file in the repository, by the name a Case gives:
# - Qwen3.5-35B-A3B (qwen3_5_moe): transformers' ``Qwen3_5MoeTextConfig`` defaults, which its
#   docstring calls the Qwen3.5-35B-A3B configuration and which agree with that release's
#   config.json as published inventories of it list them (hidden 2048, 40 layers, 3 GDN : 1
#   full attention, GDN 16 key / 32 value heads of 128, attention 16 / 2 heads of 256, 256
#   routed experts (top-8) and a shared expert, each of intermediate size 512, vocabulary
#   248,320, rope_theta 1e7 on a quarter of the head); max_position_embeddings is the
#   release's 262,144 (the class default is 32,768).
# - MiniMax-Text-01 (minimax): /work/shared/specs/algorithms.md section 4.3 (transformers'
#   ``MiniMaxConfig`` defaults are Mixtral's sizes, not this model's): hidden 6144, 80 layers,
#   7 lightning : 1 softmax, 64 heads of 128 (8 KV heads in the softmax layers, RoPE on 64
#   dims, theta 1e7), 32 experts top-2 of 9216, vocabulary 200,064, DeepNorm alpha
#   (2 * 80)^(1/4), beta 1.
RELEASED = {
    "Qwen/Qwen3.5-35B-A3B": {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attn_output_gate": True,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
        "num_experts": 256, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
    "MiniMaxAI/MiniMax-Text-01": {
        "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax", "torch_dtype": "bfloat16",
        "vocab_size": 200064, "hidden_size": 6144, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "rope_theta": 10000000,
        "intermediate_size": 9216, "num_local_experts": 32, "num_experts_per_tok": 2, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "block_size": 256, "max_position_embeddings": 10240000,
        "tie_word_embeddings": False, "layer_types": (["linear_attention"] * 7 + ["full_attention"]) * 10,
        **{f"{w}_alpha_factor": (2 * 80) ** 0.25 for w in ("linear_attn", "full_attn", "mlp")},
        **{f"{w}_beta_factor": 1.0 for w in ("linear_attn", "full_attn", "mlp")}},
}
# the interpreter's time grows with the layers (the sparse kernels run a program per prompt
# token): the smoke run keeps one layer where one shows the mechanism
ONE_LAYER = {"num_hidden_layers": 1}
ONE_MOE_LAYER = {"num_hidden_layers": 1, "first_k_dense_replace": 0}
CASES = {c.name: c for c in (
    Case("llama8b", "meta-llama/Llama-3.1-8B-Instruct", "GQA", "TRITON_ATTN", {"num_hidden_layers": 4},
         smoke_overrides=ONE_LAYER),
    Case("qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B", "MoE", "TRITON_ATTN", {"num_hidden_layers": 4},
         smoke_overrides=ONE_LAYER),
    Case("dsv3", "deepseek-ai/DeepSeek-V3", "MLA", "TRITON_MLA", DEEPSEEK_CUT, cut_experts=True, long=True,
         smoke_overrides=ONE_MOE_LAYER),
    Case("dsv32", "deepseek-ai/DeepSeek-V3.2", "DSA", "TRITON_MLA_SPARSE", DEEPSEEK_CUT, cut_experts=True,
         long=True, smoke_overrides=ONE_MOE_LAYER),
    # the stored GLM-5 config names no indexer types: every layer runs its own indexer; the smoke
    # run (1 dense + 1 MoE layer) gives its second layer none, so the "shared" path runs too
    Case("glm5", "zai-org/GLM-5", "DSA", "TRITON_MLA_SPARSE", DEEPSEEK_CUT, cut_experts=True, long=True,
         smoke_overrides={"indexer_types": ["full", "shared"]}),
    # hybrids: 3 state layers + 1 attention layer (Jamba: its period of 8, 7 + 1), every routed
    # expert kept; the smoke run keeps one state and one attention layer
    Case("qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", "GDN+GQA", overrides={"num_hidden_layers": 4},
         state="GDN", smoke_overrides={"layer_types": TWO_HYBRID}),
    Case("qwen35", "Qwen/Qwen3.5-27B", "GDN+GQA", overrides={"num_hidden_layers": 4, "layer_types": FOUR_HYBRID},
         state="GDN", smoke_overrides={"layer_types": TWO_HYBRID}),
    Case("qwen35_moe", "Qwen/Qwen3.5-35B-A3B", "GDN+GQA",
         overrides={"num_hidden_layers": 4, "layer_types": FOUR_HYBRID}, state="GDN",
         smoke_overrides={"layer_types": TWO_HYBRID}),
    Case("kimi_linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct", "KDA+MLA",
         overrides={"num_hidden_layers": 4, "linear_attn_config": KIMI_LINEAR_CUT}, state="KDA",
         smoke_overrides={"linear_attn_config": {**KIMI_LINEAR_CUT, "full_attn_layers": [2], "kda_layers": [1],
                                                 "num_heads": 4, "head_dim": 16},
                          "num_experts_per_token": 2, "first_k_dense_replace": 0}),
    # attention at layer 4 of 8, MoE at the odd layers (attn_layer_period/offset, expert_layer_*)
    Case("jamba", "ai21labs/AI21-Jamba-1.5-Mini", "Mamba+GQA", overrides={"num_hidden_layers": 8}, state="MAMBA",
         smoke_overrides={"attn_layer_period": 2, "attn_layer_offset": 1}),
    Case("minimax", "MiniMaxAI/MiniMax-Text-01", "lightning+GQA",
         overrides={"num_hidden_layers": 4, "layer_types": FOUR_HYBRID}, state="LIGHTNING",
         smoke_overrides={"layer_types": TWO_HYBRID, "rotary_dim": 8, "block_size": 16}),
)}
HYBRIDS = [name for name, c in CASES.items() if c.state]
# the hybrids the smoke run (and CI) builds, one per state mechanism (Qwen3.5's two have
# Qwen3-Next's layers; tests/unit/test_step_floors.py reads their cut configs); each adds about
# 4 s at one context; ``--smoke --cases hybrids`` builds all six
SMOKE_HYBRIDS = ["qwen3_next", "kimi_linear", "jamba", "minimax"]
# toy sizes: each key replaces the config's where the config has it (num_hidden_layers always)
SMOKE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
         "num_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 128, "q_lora_rank": 64,
         "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "qk_head_dim": 32, "v_head_dim": 16,
         "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
         # the hybrids' state layers and experts
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16, "shared_expert_intermediate_size": 32, "num_local_experts": 8,
         "mamba_dt_rank": 8, "mamba_d_state": 8}
SMOKE_EXPERTS = 4


# --- the models ---------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """``"1K,8K,100"`` -> [1024, 8192, 100] (K: x1024)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        out.append(int(item[:-1]) * 1024 if item[-1] in "kK" else int(item))
    return out


def size_label(n: int) -> str:
    """1024 -> "1K", 100 -> "100"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def routed_cut(cfg: dict, experts: int) -> dict:
    """Config overrides for ``experts`` routed experts that keep top-k routing valid: ``n_group``
    the largest divisor of ``experts`` not above the config's, ``topk_group`` the config's (at most
    ``n_group``) or more, so that the kept groups hold at least top-k experts."""
    k = cfg["num_experts_per_tok"]
    if experts < k:
        raise SystemExit(f"--experts {experts} is below the top-k of {k}")
    groups = max(g for g in range(1, cfg.get("n_group", 1) + 1) if experts % g == 0)
    needed = math.ceil(k * groups / experts)  # groups of experts/groups experts that hold k
    topk_group = max(min(cfg.get("topk_group", 1), groups), needed)
    return {"n_routed_experts": experts, "n_group": groups, "topk_group": topk_group}


def load_config(case: Case) -> dict:
    """The case's released config: a file ``resolve_config_path`` finds, or RELEASED's copy."""
    if case.config in RELEASED:
        return copy.deepcopy(RELEASED[case.config])
    return json.loads(Path(resolve_config_path(case.config)).read_text())


def model_dir(case: Case, experts: int, smoke: bool) -> tuple[str, dict]:
    """A temporary directory holding the case's cut config, and the fields that were changed
    (in the text config of a multimodal wrapper such as Qwen3.5's)."""
    d = tempfile.mkdtemp(prefix="attnserve_mech_")
    cfg = load_config(case)
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    changed = dict(case.overrides)
    if smoke:  # toy sizes for the fields the config sets (a null, e.g. Kimi's q_lora_rank, stays)
        changed.update({k: v for k, v in SMOKE.items() if text.get(k) is not None or k == "num_hidden_layers"})
        changed.update(case.smoke_overrides)
        cfg.pop("quantization_config", None)
        text.pop("quantization_config", None)
    text.update(changed)
    if case.cut_experts:
        changed.update(routed_cut(text, experts))
        text.update(changed)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d, changed


def grid(case: Case, batches: list[int], contexts: list[int], long_batches: list[int]) -> list[tuple[int, list[int]]]:
    """(context, batch sizes) to run: contexts above LONG_CONTEXT only for DSA and dense MLA (the
    DSA goals compare the two there), at ``long_batches``."""
    out = []
    for c in contexts:
        if c <= LONG_CONTEXT:
            out.append((c, sorted(set(batches))))
        elif case.long and long_batches:
            out.append((c, sorted(set(long_batches))))
    return out


# --- memory checks ------------------------------------------------------------------------


def meta_weight_bytes(arch: ModelArch, dtype: str) -> int:
    """The model's parameter bytes, built on the meta device (nothing allocated)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            model = get_model_class(arch)(arch)
    finally:
        torch.set_default_dtype(previous)
    return param_bytes(model.parameters())


def kv_precheck(path: str, kwargs: dict, batches: list[int], room: int = 1) -> tuple[list[int], dict[int, str]]:
    """Before building: the batches whose KV cache fits in the memory left (device: its
    utilisation share less what is in use less the weights; CPU: ``kv_cache_memory``), and a
    reason for each that does not. A hybrid's state slots count too: for batch b the engine
    keeps ``room * b`` snapshots, so 1 + b + room * b slots (running and snapshots). The
    profiling pass's activations are not known yet: the engine's real block count is checked
    after building."""
    config = EngineConfig.from_kwargs(path, **kwargs)
    arch = read_arch(load_hf_config(path))
    plan = plan_engine(arch, config, current_platform())
    state = plan.state_bytes_per_sequence
    per_seq = plan.sequence_bytes(plan.max_model_len) + room * state
    if config.cache.kv_cache_memory is not None:
        budget, what = config.cache.kv_cache_memory * GIB, "kv_cache_memory"
    elif torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        try:
            weights = meta_weight_bytes(arch, plan.dtype)
        except Exception:  # a model that cannot be built on the meta device: the post-check decides
            weights = 0
        budget = total * config.cache.gpu_memory_utilization - (total - free) - weights
        what = (f"{config.cache.gpu_memory_utilization} of {total / GIB:.0f} GiB, less {(total - free) / GIB:.1f} "
                f"in use and {weights / GIB:.1f} of weights")
    else:
        return list(batches), {}
    fit = [b for b in batches if b * per_seq + state <= budget]
    reasons = {b: f"KV cache of {b} x {plan.max_model_len} tokens needs {(b * per_seq + state) / GIB:.2f} GiB; "
                  f"{max(budget, 0) / GIB:.2f} GiB left ({what})" for b in batches if b not in fit}
    return fit, reasons


def kv_postcheck(llm: LLM, batches: list[int]) -> tuple[list[int], dict[int, str]]:
    """After building: the batches whose sequences all fit in the engine's block pool at once."""
    engine = llm.llm_engine
    per_seq = engine.kv_manager.num_blocks_for_tokens(engine.max_model_len)
    capacity = engine.parts.num_blocks - 1  # block 0 is the null block
    fit = [b for b in batches if b * per_seq <= capacity]
    reasons = {b: f"{b} sequences need {b * per_seq} blocks of {engine.config.cache.block_size} tokens; the "
                  f"engine has {capacity}" for b in batches if b not in fit}
    return fit, reasons


# --- running ------------------------------------------------------------------------------


def snapshot_room(case: Case, context: int, args) -> int:
    """State snapshots the engine keeps per sequence of a batch (``num_state_snapshots``), enough
    that a hybrid's snapshots outlive the grid (least recently used are evicted). It takes one wherever a step leaves a request on a block
    boundary: at each prefill chunk's end (about ceil(context / max_num_batched_tokens) + 2 a
    prompt, the last boundary and the end included) and every block_size decoded tokens (a
    decode cell's run decodes N - 4). Sized as the batch, the snapshots of the prefill cell
    were evicted before the decode cells came back to them, which then prefilled their prompts
    again (64 x 32K tokens at batch 64, in every repeat). Each costs state memory only
    (Qwen3-Next's cut: 6 MiB a slot)."""
    if not case.state:
        return 1
    block = args.block_size or 16
    return math.ceil(context / args.max_num_batched_tokens) + 3 + math.ceil(args.new / block)


def engine_kwargs(args, case: Case, context: int, max_batch: int, state_backend: str = "triton") -> dict:
    """``LLM(...)`` keywords of one (case, context) engine."""
    kwargs = dict(load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                  attention_backend=case.backend_name(state_backend), max_model_len=context + args.new + 16,
                  max_num_seqs=max_batch,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    if args.smoke:
        kwargs["kv_cache_memory"] = 0.05
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kwargs


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    """``count`` prompts of ``length`` random token ids (distinct: no two share a block)."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(count, length))
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def timed(llm: LLM, prompts: list, tokens: int) -> float:
    """Seconds for ``llm.generate`` of ``tokens`` greedy tokens each (EOS ignored, no detokenising)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


class Recorder:
    """Collects cells and prints each as a JSON line when it completes; rewrites ``json_path``
    (when given) after every cell, so a command stopped by its time limit leaves what it
    measured. ``budget_s``: cells not started by then are recorded as skipped."""

    def __init__(self, json_path: Path | None = None, header: dict | None = None, budget_s: float | None = None):
        self.cells: list[dict] = []
        self.json_path, self.header, self.budget_s = json_path, header or {}, budget_s
        self.started = time.perf_counter()

    def emit(self, cell: dict) -> None:
        self.cells.append(cell)
        print(json.dumps(cell), flush=True)
        if self.json_path is not None:
            self.json_path.write_text(json.dumps({**self.header, "partial": True, "cells": self.cells}, indent=2))

    def out_of_time(self) -> bool:
        return self.budget_s is not None and time.perf_counter() - self.started > self.budget_s

    def budget_reason(self) -> str:
        return f"not started: the run's time budget (--budget-s {self.budget_s:g}) was spent"

    def not_run(self, base: dict, batches: list[int], status: str, reasons: dict[int, str] | str,
                prefill: bool = False) -> None:
        """Skipped or failed decode cells (and the prefill cell when ``prefill``)."""
        why = (lambda b: reasons) if isinstance(reasons, str) else reasons.get
        key = "reason" if status == "skipped" else "error"
        if prefill and batches:
            self.emit({**base, "cell": "prefill", "batch": max(batches), "status": status, key: why(max(batches))})
        for b in batches:
            self.emit({**base, "cell": "decode", "batch": b, "status": status, key: why(b)})


def measure_prefill(llm: LLM, prompts: list, context: int, warm_up: bool, base: dict) -> dict:
    """Warm up on an unrelated prompt (``warm_up``), then prefill ``prompts`` once
    (max_tokens=1), which also fills the prefix cache; the prefill cell."""
    engine = llm.llm_engine
    if warm_up:  # Triton compiles outside the timed prefill (two prompts: a batch of one is a variant of its own)
        timed(llm, random_prompts(engine.arch.vocab_size, 2, min(context, 1024), seed=1), 2)
    seconds = timed(llm, prompts, 1)
    batch = len(prompts)
    flops = prefill_flops(engine.runner.model, engine.arch, batch, context)
    per_token, head = prefill_params(engine.runner.model, engine.arch)
    return {**base, "cell": "prefill", "batch": batch, "status": "ok", "seconds": seconds,
            "tok_s": batch * context / seconds, "flops": flops, "tflops": flops / seconds / 1e12,
            "fraction_of_peak": flops / seconds / PEAK_FLOPS, "params_per_token": per_token, "head_params": head,
            "attention_flops_per_token": attention_flops_per_token(engine.arch, context)}


def decode_steps_ms(llm: LLM, prompts: list, steps: int, warm: int = 4) -> tuple[float, float]:
    """Mean ms of ``steps`` decode-only engine steps of ``prompts``, timed once every request
    has its first token (so no prefill, not even the recomputed last block of a prefix hit,
    falls in the timed span), after ``warm`` more steps; the requests are then aborted. Also
    the share of the prompts' tokens the prefix cache served.

    (Timing ``generate`` with N tokens and with 1 and subtracting leaves the prefill's
    variance in the difference: 64 prefix hits of 8K-32K tokens vary by 0.1-0.3 s, which is
    1.5-5 ms a step over 63 steps, as much as the step itself.)"""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + warm + 8, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(None, p, params) for p in prompts]
    requests = [engine.scheduler.requests[i] for i in ids]
    for _ in range(100_000):  # bounded: a stuck prefill fails the cell instead of hanging
        if all(r.num_output_tokens > 0 for r in requests):
            break
        engine.step()
    else:
        raise RuntimeError("the prompts never finished their prefill")
    cached = sum(max(r.num_cached_tokens, 0) for r in requests) / sum(r.num_prompt_tokens for r in requests)
    for _ in range(warm):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if any(r.num_output_tokens < steps + warm for r in requests):
        raise RuntimeError("a request did not decode in every timed step (preempted or finished)")
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * seconds / steps, cached


def measure_decode(llm: LLM, prompts: list, batch: int, context: int, args, rows: dict, base: dict,
                   states: dict | None = None) -> dict:
    """Decode ms per step of the first ``batch`` prompts (prefix hits) and its HBM floor."""
    engine = llm.llm_engine
    steps = max(1, args.new - 16)
    runs = [decode_steps_ms(llm, prompts[:batch], steps) for _ in range(args.repeats)]
    ms = statistics.median(r[0] for r in runs)
    weights = decode_weight_bytes(engine.runner.model, engine.arch, batch)
    cache = decode_cache_bytes(engine.arch, rows, batch, context, states)
    floor_ms = 1e3 * (weights + cache) / BANDWIDTH
    flops = decode_flops(engine.runner.model, engine.arch, batch, context)
    flop_ms = 1e3 * flops / PEAK_FLOPS
    bound = max(floor_ms, flop_ms)
    return {**base, "cell": "decode", "batch": batch, "status": "ok", "decode_ms": ms, "floor_ms": floor_ms,
            "floor_fraction": floor_ms / ms if ms > 0 else None, "flop_floor_ms": flop_ms, "decode_flops": flops,
            "bound_fraction": bound / ms if ms > 0 else None, "weight_bytes": weights, "cache_bytes": cache,
            "state_bytes": decode_state_bytes(states or {}, batch), "prefix_hit_fraction": min(r[1] for r in runs),
            "timed_steps": steps, "graphs": engine.runner.graphs is not None,
            "async_scheduling": engine.async_scheduling}


def measure_engine(llm: LLM, context: int, batches: list[int], args, rec: Recorder, base: dict) -> None:
    """The prefill cell and a decode cell per batch of one engine (the batches whose sequences
    fit its block pool; the others are recorded as skipped)."""
    engine = llm.llm_engine
    base.update(mechanism_arch=engine.arch.mechanism.value, kv_cache_dtype=engine.parts.plan.kv_cache_dtype,
                block_size=engine.config.cache.block_size)
    if base.get("state_backend"):  # what every layer group ran: the state backend first
        base["backend"] = " + ".join(dict.fromkeys([base["backend"], *engine.parts.backend_names]))
    todo, reasons = kv_postcheck(llm, batches)
    rec.not_run(base, [b for b in batches if b not in todo], "skipped", reasons)
    if not todo:
        return
    rows, states = cache_rows(engine.runner.model), state_rows(engine.runner.model)
    check_rows(rows, engine.parts.plan, states)
    base["cache_row_bytes"] = rows[min(rows)]
    if states:
        base["state_slot_bytes"] = states[min(states)]
    prompts = random_prompts(engine.arch.vocab_size, max(todo), context, seed=context)
    rec.emit(measure_prefill(llm, prompts, context, not args.smoke, base))  # nothing compiles in smoke
    for b in todo:
        if rec.out_of_time():
            rec.not_run(base, [b], "skipped", rec.budget_reason())
            continue
        rec.emit(measure_decode(llm, prompts, b, context, args, rows, base, states))


def not_fitting(error: Exception) -> bool:
    """Whether building an engine failed because the configuration does not fit this device
    (out of memory, the engine's KV cache checks, no backend for it) rather than by a bug."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, BackendSelectionError)):
        return True
    return isinstance(error, ValueError) and "KV cache" in str(error)


def run_context(case: Case, path: str, context: int, batches: list[int], args, rec: Recorder,
                state_backend: str = "triton") -> None:
    """One engine for ``case`` at ``context``: the prefill cell and a decode cell per batch."""
    base = {"case": case.name, "mechanism": case.mechanism, "backend": case.backend_name(state_backend),
            "context": context}
    if case.state:
        base["state_backend"] = case.backend_name(state_backend)
    if rec.out_of_time():
        rec.not_run(base, batches, "skipped", rec.budget_reason(), prefill=True)
        return
    kwargs = engine_kwargs(args, case, context, max(batches), state_backend)
    room = snapshot_room(case, context, args)
    try:
        fit, reasons = kv_precheck(path, kwargs, batches, room)
    except ValueError as e:  # a plan the engine would refuse (e.g. fp8 rows this rank cannot tile)
        rec.not_run(base, batches, "skipped", f"{type(e).__name__}: {e}", prefill=True)
        return
    rec.not_run(base, [b for b in batches if b not in fit], "skipped", reasons)
    if not fit:
        return
    kwargs["max_num_seqs"] = max(fit)
    if case.state:
        kwargs["num_state_snapshots"] = max(fit) * room
    started = time.perf_counter()
    try:
        llm = LLM(path, **kwargs)
    except Exception as e:
        unfit = not_fitting(e)
        if not unfit:
            traceback.print_exc()
        rec.not_run(base, fit, "skipped" if unfit else "failed", f"{type(e).__name__}: {e}", prefill=True)
        return
    base["build_s"] = round(time.perf_counter() - started, 1)
    try:
        measure_engine(llm, context, fit, args, rec, base)
    except Exception as e:  # the engine may be left mid-request: the rest of this context is not run
        traceback.print_exc()
        done = {(c["cell"], c["batch"]) for c in rec.cells
                if (c["case"], c["context"], c.get("state_backend")) == (case.name, context, base.get("state_backend"))}
        rec.not_run(base, [b for b in fit if ("decode", b) not in done], "failed", f"{type(e).__name__}: {e}",
                    prefill=not any(kind == "prefill" for kind, _ in done))
    finally:  # nothing else holds the engine: its memory goes back before the next one is sized
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- output -------------------------------------------------------------------------------


def environment() -> dict:
    """Versions, device and commit of this run."""
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "commit": commit,
            "date": datetime.date.today().isoformat(), "command": command_line()}


def command_line() -> str:
    return " ".join(["python", "benchmarks/gpu_mechanisms.py", *sys.argv[1:]])


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown_table(cells: list[dict]) -> str:
    """One row per decode cell, the prefill figures on the row of the batch that was prefilled;
    then the reasons of the cells that did not run."""
    prefill = {cell_key(c)[1:]: c for c in cells if c["cell"] == "prefill"}
    lines = ["| case | mechanism | backend | batch | context | decode ms | HBM floor ms | % of HBM floor "
             "| FLOP floor ms | % of max floor | graphs | prefill tok/s | prefill % of 790 TF |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    notes: list[str] = []
    for c in (c for c in in_grid_order(cells) if c["cell"] == "decode"):
        p = prefill.get(cell_key(c)[1:], {})
        if c["status"] == "ok":
            frac = c["floor_fraction"]
            bound = c.get("bound_fraction")
            decode = [f"{c['decode_ms']:.2f}", f"{c['floor_ms']:.2f}", _fmt(frac and 100 * frac, ".0f"),
                      _fmt(c.get("flop_floor_ms"), ".2f"), _fmt(bound and 100 * bound, ".0f"),
                      "yes" if c["graphs"] else "no"]
        else:
            note = c.get("reason") or c.get("error")
            if note not in notes:
                notes.append(note)
            decode = [f"{c['status']} ({notes.index(note) + 1})", "", "", "", "", ""]
        pre = [f"{p['tok_s']:,.0f}", f"{100 * p['fraction_of_peak']:.1f}"] if p.get("status") == "ok" else ["", ""]
        lines.append("| " + " | ".join([c["case"], c["mechanism"], backend_label(c), str(c["batch"]),
                                         size_label(c["context"]), *decode, *pre]) + " |")
    if notes:
        lines += [""] + [f"({i}) {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(lines)


def docs_block(table: str, env: dict, cells: list[dict]) -> str:
    """The text between the markers: a one-line header, then the table."""
    asyncs = sorted({c["async_scheduling"] for c in cells if c.get("async_scheduling") is not None})
    mode = {(True,): "on", (False,): "off"}.get(tuple(asyncs), "mixed")
    header = (f"{env['device']}, {env['date']}, `{env['command']}` ({env.get('weights', 'dummy')} weights, "
              f"async scheduling {mode}; decode ms per step on prefix hits, floor = bytes read at 4.25 TB/s):")
    return f"{header}\n\n{table}"


def rewrite_docs(path: str | Path, block: str) -> None:
    """Put ``block`` between the markers of the markdown file at ``path``, or append a new section
    with the markers when they are missing."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    start, end = text.find(MARK_BEGIN), text.find(MARK_END)
    body = f"{MARK_BEGIN}\n{block}\n{MARK_END}"
    if start >= 0 and end > start:
        text = text[:start] + body + text[end + len(MARK_END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + f"{DOCS_TITLE}\n\n{body}\n"
    path.write_text(text)


def smoke_checks(cells: list[dict], block: str, out: str | None) -> None:
    """The docs rewrite on a temporary file (appended once, then replaced in place), the JSON
    output read back through ``--render``'s loader, and a floor and a FLOP count in every cell."""
    for c in cells:
        if c["status"] == "ok" and not (c.get("floor_ms", 0) > 0 or c.get("flops", 0) > 0):
            raise SystemExit(f"no floor or FLOP count in {cell_key(c)}")
    if out:
        again, _ = load_results([str(Path(out, JSON_NAME))])
        if sorted(map(cell_key, again)) != sorted(map(cell_key, cells)):
            raise SystemExit("the JSON output does not read back to the same cells")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "performance.md")
        path.write_text("# Performance notes\n\nSome text.\n")
        rewrite_docs(path, "placeholder")
        rewrite_docs(path, block)
        text = path.read_text()
        if text.count(MARK_BEGIN) != 1 or text.count(DOCS_TITLE) != 1 or block not in text or "placeholder" in text:
            raise SystemExit("the docs rewrite did not replace the section between the markers")
        if not text.startswith("# Performance notes\n\nSome text.\n"):
            raise SystemExit("the docs rewrite changed the text before the section")


# --- main ---------------------------------------------------------------------------------


# option defaults on the device and in the smoke run (an option given on the command line wins)
DEFAULTS = {"cases": ",".join(CASES), "batches": "1,8,64", "contexts": "1K,8K,32K,64K,128K",
            "dsa_long_batches": "1,32", "experts": 16, "new": 64, "repeats": 3, "block_size": None}
SMOKE_DEFAULTS = {"cases": ",".join([*(n for n in CASES if n not in HYBRIDS), *SMOKE_HYBRIDS]), "batches": "1,2",
                  "contexts": "32,64", "dsa_long_batches": "1", "experts": SMOKE_EXPERTS,
                  "new": 3, "repeats": 1, "block_size": 8}  # blocks of 8: a prefix hit recomputes less


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help=f"comma list of {', '.join(CASES)} (default all; --smoke: the attention "
                                    f"cases and {', '.join(SMOKE_HYBRIDS)}); 'hybrids' names {', '.join(HYBRIDS)}")
    ap.add_argument("--state-backend", default="triton",
                    help="the hybrids' state backends, TORCH_<kind> or TRITON_<kind>: torch, triton, or "
                         "torch,triton for both in one run (their attention layers take the platform's first)")
    ap.add_argument("--budget-s", type=float,
                    help="seconds after which no new engine or decode cell starts (recorded as skipped)")
    ap.add_argument("--batches", help=f"comma list (default {DEFAULTS['batches']})")
    ap.add_argument("--contexts", help=f"comma list, K = 1024 (default {DEFAULTS['contexts']}; above "
                                       f"{LONG_CONTEXT // 1024}K: DSA cases only)")
    ap.add_argument("--dsa-long-batches", help=f"batches of the DSA contexts above {LONG_CONTEXT // 1024}K "
                                               f"(default {DEFAULTS['dsa_long_batches']})")
    ap.add_argument("--experts", type=int, help="routed experts of the DeepSeek/GLM cuts (default 16)")
    ap.add_argument("--new", type=int, help="new tokens of the timed decode (default 64)")
    ap.add_argument("--repeats", type=int, help="timings per measurement, their median (default 3)")
    ap.add_argument("--block-size", type=int, help="the engine's block_size (default: its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--docs", help="markdown file whose gpu_mechanisms section to rewrite")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU under Triton's interpreter")
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="run nothing: merge these outputs of earlier runs (later ones win) into the table")
    args = ap.parse_args()
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n for item in args.cases.split(",") for n in (HYBRIDS if item == "hybrids" else [item]) if n]
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    args.cases = ",".join(dict.fromkeys(names))
    args.state_backends = list(dict.fromkeys(b.strip().lower() for b in args.state_backend.split(",") if b.strip()))
    if not args.state_backends or set(args.state_backends) - {"torch", "triton"}:
        ap.error(f"--state-backend takes torch, triton or torch,triton, got {args.state_backend!r}")
    if args.new < 1:
        ap.error("--new must be at least 1 (N - 16 decode steps are timed, at least one)")
    return args


def run_grid(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every (case, context) engine of the grid; (cells, environment)."""
    batches, contexts = parse_sizes(args.batches), parse_sizes(args.contexts)
    long_batches = parse_sizes(args.dsa_long_batches)
    out = os.environ.get("OUT")
    json_path = None
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        json_path = Path(out, JSON_NAME)
    env = environment()  # a partial file reads back through --render as a whole one does
    env["weights"] = "dummy float32" if args.smoke else "dummy bf16"
    rec = Recorder(json_path, {"environment": env, "options": {k: v for k, v in vars(args).items() if k != "docs"}},
                   args.budget_s)
    started = time.perf_counter()
    env["cases"] = cases = {}
    for name in args.cases.split(","):
        case = CASES[name]
        path, changed = model_dir(case, args.experts, args.smoke)
        cases[name] = {"config": case.config, "backend": case.backend or [case.backend_name(b)
                                                                         for b in args.state_backends],
                       "mechanism": case.mechanism, "overrides": changed}
        try:
            # the smoke run's hybrids take its first context only (the test's time)
            case_contexts = contexts[:1] if args.smoke and case.state else contexts
            for state_backend in args.state_backends if case.state else ["triton"]:
                for context, bs in grid(case, batches, case_contexts, long_batches):
                    run_context(case, path, context, bs, args, rec, state_backend)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    env["seconds"] = time.perf_counter() - started
    return rec.cells, env


def cell_key(cell: dict) -> tuple:
    """Cells of other block sizes, cache dtypes or state backends are other measurements, not
    replacements."""
    return (cell["cell"], cell["case"], cell["context"], cell["batch"], cell.get("block_size"),
            cell.get("kv_cache_dtype"), cell.get("state_backend"))


def backend_label(cell: dict) -> str:
    """The backend, with the block size and cache dtype when they are not the defaults."""
    extra = [f"block {cell['block_size']}"] if cell.get("block_size") not in (None, 16) else []
    if cell.get("kv_cache_dtype") == "fp8":
        extra.append("fp8 cache")
    return cell["backend"] + (f" ({', '.join(extra)})" if extra else "")


def in_grid_order(cells) -> list[dict]:
    """Cells by case (in CASES order), state backend, context, prefill first, batch."""
    order = list(CASES)
    return sorted(cells, key=lambda c: (order.index(c["case"]) if c["case"] in order else len(order),
                                        c.get("state_backend") or "", c["context"], c["cell"] != "prefill",
                                        c["batch"]))


def load_results(paths: list[str]) -> tuple[list[dict], dict]:
    """The cells of earlier JSON outputs, a later file's cell replacing an earlier one's at the
    same (cell, case, context, batch), in grid order; and an environment naming every command
    (the device and versions of the last file)."""
    merged: dict[tuple, dict] = {}
    envs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        envs.append(data["environment"])
        for cell in data["cells"]:
            merged[cell_key(cell)] = cell
    cells = in_grid_order(merged.values())
    env = dict(envs[-1])
    env["date"] = max(e["date"] for e in envs)
    env["command"] = "; ".join(dict.fromkeys(e["command"] for e in envs))
    env["cases"] = {k: v for e in envs for k, v in e.get("cases", {}).items()}
    env["merged_from"] = list(paths)
    return cells, env


def main() -> None:
    args = parse_args()
    if args.render:
        cells, env = load_results(args.render)
    elif not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    else:
        cells, env = run_grid(args)
    out = os.environ.get("OUT")
    if out:
        options = {k: v for k, v in vars(args).items() if k != "docs"}
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, JSON_NAME).write_text(json.dumps({"environment": env, "options": options, "cells": cells},
                                                   indent=2))
    block = docs_block(markdown_table(cells), env, cells)
    print(f"\n{block}")
    if args.docs:
        rewrite_docs(args.docs, block)
    if args.smoke:
        smoke_checks(cells, block, out)
    if args.render:
        return
    bad = [c for c in cells if c["status"] == "failed" or (args.smoke and c["status"] != "ok")]
    if bad or not cells:  # a smoke run must run every cell
        sys.exit(f"{len(bad)} cells did not run: " + "; ".join(sorted({c.get("error") or c.get("reason")
                                                                        for c in bad})) if bad else "no cell ran")


if __name__ == "__main__":
    main()
