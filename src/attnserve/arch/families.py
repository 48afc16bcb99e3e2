"""Every model family in one table, ``FAMILIES``: how its config is read and what runs it.

A ``Family`` names, for one ``model_type``, its reader (the layer layout, the MoE shape and the
facts its model needs, each with that family's default: ``readers_standard.py``,
``readers_mla_state.py``), the class that runs it (a "module:Class" string, imported only when a
model is built: ``models/registry.py``), whether its config class ties the embeddings by
default, and its tensor-parallel plan (``runner/parallel.py``; None refuses tensor
parallelism). ``arch.load.read_arch`` dispatches here. The quirks the readers handle are listed
in DESIGN.md (ModelArch); each has a test in ``tests/unit/test_arch.py``.

Not here: typed field access and the layer builders the readers share (``reader.py``), the
family options' types (``options.py``), model code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnserve.arch import readers_mla_state as mla_state
from attnserve.arch import readers_standard as std
from attnserve.arch.reader import Built, Reader, expand_mla
from attnserve.arch.readers_mla_state import deepnorm_factors
from attnserve.arch.sharding import ShardPlan

__all__ = ["FAMILIES", "Built", "Family", "Reader", "deepnorm_factors", "expand_mla"]


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: how its config is read, and what runs it."""

    read: Callable[[Reader], Built]
    model: str | None  # "module:Class", imported when built; None: `inspect` reads it, nothing runs it
    tied_by_default: bool = False  # its HF config class ties input and output embeddings
    shard_plan: ShardPlan | None = None  # None: tensor_parallel_size > 1 is refused


# --- the table ----------------------------------------------------------------------------

_M = "attnserve.models."
_LLAMA = _M + "llama:LlamaForCausalLM"
_GEMMA = _M + "gemma:GemmaForCausalLM"
_GPT2 = _M + "gpt2:GPT2LMHeadModel"
_MOE = _M + "moe_families:MoEForCausalLM"
_DEEPSEEK = _M + "deepseek:DeepseekForCausalLM"
_QWEN3_NEXT = _M + "qwen3_next:Qwen3NextForCausalLM"
# MLPs by attribute name: SwiGLU's gate_up_proj/down_proj, starcoder2's plain up_proj/down_proj
_LLAMA_PLAN = ShardPlan(column=("gate_up_proj", "up_proj"), row=("down_proj",))

FAMILIES: dict[str, Family] = {
    "llama": Family(std.llama, _LLAMA, shard_plan=_LLAMA_PLAN),
    "mistral": Family(std.mistral, _LLAMA, shard_plan=_LLAMA_PLAN),
    "qwen2": Family(std.qwen, _LLAMA, shard_plan=_LLAMA_PLAN),
    "qwen3": Family(std.qwen, _LLAMA, shard_plan=_LLAMA_PLAN),
    "phi3": Family(std.mistral, _LLAMA, shard_plan=_LLAMA_PLAN),
    "starcoder2": Family(std.mistral, _LLAMA, shard_plan=_LLAMA_PLAN),
    "gemma": Family(std.gemma, _GEMMA, tied_by_default=True),
    "gemma2": Family(std.gemma2, _GEMMA, tied_by_default=True),
    "gemma3_text": Family(std.gemma3, _GEMMA, tied_by_default=True),
    "gpt2": Family(std.gpt2, _GPT2, tied_by_default=True),
    "gpt_bigcode": Family(std.gpt2, _GPT2, tied_by_default=True),
    "falcon": Family(std.falcon, _M + "falcon:FalconForCausalLM", tied_by_default=True),
    "bloom": Family(std.bloom, _M + "bloom:BloomForCausalLM", tied_by_default=True),
    "mpt": Family(std.mpt, _M + "mpt:MPTForCausalLM", tied_by_default=True),
    "mixtral": Family(std.mixtral, _MOE),
    "qwen2_moe": Family(std.qwen_moe, None),
    "qwen3_moe": Family(std.qwen_moe, _MOE),
    "glm4_moe": Family(std.glm4_moe, _MOE),
    "gpt_oss": Family(std.gpt_oss, _M + "gpt_oss:GptOssForCausalLM"),
    "deepseek_v2": Family(mla_state.deepseek, _DEEPSEEK, shard_plan=ShardPlan()),
    "deepseek_v3": Family(mla_state.deepseek, _DEEPSEEK, shard_plan=ShardPlan()),
    "kimi_k2": Family(mla_state.deepseek, _DEEPSEEK, shard_plan=ShardPlan()),
    "deepseek_v32": Family(mla_state.dsa, _DEEPSEEK, shard_plan=ShardPlan()),
    "glm_moe_dsa": Family(mla_state.dsa, _DEEPSEEK, shard_plan=ShardPlan()),
    "qwen3_next": Family(mla_state.qwen3_next, _QWEN3_NEXT, shard_plan=ShardPlan()),
    "qwen3_5": Family(mla_state.qwen3_next, _QWEN3_NEXT, shard_plan=ShardPlan()),
    "qwen3_5_moe": Family(mla_state.qwen3_next, _QWEN3_NEXT, shard_plan=ShardPlan()),
    "jamba": Family(mla_state.jamba, _M + "jamba:JambaForCausalLM"),
    "minimax": Family(mla_state.minimax, _M + "minimax:MiniMaxForCausalLM"),
    "kimi_linear": Family(mla_state.kimi_linear, _M + "kimi_linear:KimiLinearForCausalLM"),
    "nsa": Family(mla_state.nsa, _M + "nsa:NSAForCausalLM"),
}
