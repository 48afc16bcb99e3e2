"""The cases of ``gpu_mechanisms.py``: each mechanism's released config, how it is cut (at full
width on the device, to toy sizes for ``--smoke``), the grid of (context, batches) it runs, and
the temporary model directory holding its cut config.

Not here: building and timing the engines (``mechanism_timing.py``), the tables and JSON
(``mechanism_report.py``), the command line (``gpu_mechanisms.py``, whose docstring describes
the benchmark).
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from attnserve.presets import resolve_config_path

LONG_CONTEXT = 32768  # contexts above this run for the DSA and MLA cases only, at --dsa-long-batches


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
