"""Model families: HF ``model_type`` -> the attnserve implementation, imported when used."""

from __future__ import annotations

import importlib

from torch import nn

from attnserve.arch import ModelArch

__all__ = ["MODEL_REGISTRY", "get_model_class", "supported_model_types"]

MODEL_REGISTRY: dict[str, str] = {
    "llama": "attnserve.models.llama:LlamaForCausalLM",
    "mistral": "attnserve.models.llama:LlamaForCausalLM",
    "qwen2": "attnserve.models.llama:LlamaForCausalLM",
    "qwen3": "attnserve.models.llama:LlamaForCausalLM",
    "phi3": "attnserve.models.llama:LlamaForCausalLM",
    "starcoder2": "attnserve.models.llama:LlamaForCausalLM",
    "gemma": "attnserve.models.gemma:GemmaForCausalLM",
    "gemma2": "attnserve.models.gemma:GemmaForCausalLM",
    "gemma3_text": "attnserve.models.gemma:GemmaForCausalLM",
    "gpt2": "attnserve.models.gpt2:GPT2LMHeadModel",
    "gpt_bigcode": "attnserve.models.gpt2:GPT2LMHeadModel",
    "falcon": "attnserve.models.falcon:FalconForCausalLM",
    "bloom": "attnserve.models.bloom:BloomForCausalLM",
    "mpt": "attnserve.models.mpt:MPTForCausalLM",
    "mixtral": "attnserve.models.moe_families:MoEForCausalLM",
    "qwen3_moe": "attnserve.models.moe_families:MoEForCausalLM",
    "glm4_moe": "attnserve.models.moe_families:MoEForCausalLM",
    "gpt_oss": "attnserve.models.gpt_oss:GptOssForCausalLM",
    "deepseek_v2": "attnserve.models.deepseek:DeepseekForCausalLM",
    "deepseek_v3": "attnserve.models.deepseek:DeepseekForCausalLM",
    "kimi_k2": "attnserve.models.deepseek:DeepseekForCausalLM",
    "deepseek_v32": "attnserve.models.deepseek:DeepseekForCausalLM",
    "glm_moe_dsa": "attnserve.models.deepseek:DeepseekForCausalLM",
    "qwen3_next": "attnserve.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5": "attnserve.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_moe": "attnserve.models.qwen3_next:Qwen3NextForCausalLM",
    "jamba": "attnserve.models.jamba:JambaForCausalLM",
    "minimax": "attnserve.models.minimax:MiniMaxForCausalLM",
    "kimi_linear": "attnserve.models.kimi_linear:KimiLinearForCausalLM",
    "nsa": "attnserve.models.nsa:NSAForCausalLM",
}


def supported_model_types() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(arch: ModelArch) -> type[nn.Module]:
    target = MODEL_REGISTRY.get(arch.model_type)
    if target is None:
        raise ValueError(f"model_type '{arch.model_type}' has no attnserve implementation yet "
                         f"(implemented: {', '.join(supported_model_types())}); "
                         f"`attnserve inspect` still reads its config")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
