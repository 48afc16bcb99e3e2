"""What ``inspect`` promises is what the engine allocates; checkpoints load from single files
and sharded indexes, and bad ones fail naming the file."""

from __future__ import annotations

import json

import pytest

from attnserve import LLM, SamplingParams
from attnserve.entrypoints.cli import main
from tests.models.parity import VOCAB, build_hf_model

DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CASES = {
    "llama": ("llama", DENSE),
    "gemma2_windows": ("gemma2", dict(DENSE, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "deepseek_v3_mla": ("deepseek_v3", dict(DENSE, moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32,
                                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                            first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inspect_and_allocation_agree(name, tmp_path, capsys):
    model_type, kwargs = CASES[name]
    build_hf_model(model_type, kwargs, tmp_path)
    assert main(["inspect", str(tmp_path), "--json", "--platform", "cpu", "--block-size", "16",
                 "--max-model-len", "256", "--memory", "0.01"]) == 0
    report = json.loads(capsys.readouterr().out)
    llm = LLM(str(tmp_path), block_size=16, max_model_len=256, kv_cache_memory=0.01)
    parts = llm.llm_engine.parts
    seen, allocated = set(), 0
    for module in parts.runner.model.modules():
        cache = getattr(module, "kv_cache", None)
        if cache is None:
            continue
        tensors = cache if isinstance(cache, tuple) else tuple(cache.values()) if isinstance(cache, dict) else (cache,)
        for t in tensors:
            if t.data_ptr() not in seen:  # slots shared between groups are counted once
                seen.add(t.data_ptr())
                allocated += t.numel() * t.element_size()
    per_block = allocated // parts.num_blocks
    # inspect's bytes per sequence of 256 tokens, in blocks, is what the allocator charges for it
    blocks_per_sequence = llm.llm_engine.kv_manager.num_blocks_for_tokens(256)
    assert report["bytes_per_sequence"] == blocks_per_sequence * per_block
    assert allocated == parts.num_blocks * per_block
    full_rate = report["kv_bytes_per_token"] * 16  # every layer, one block of 16 tokens
    assert per_block <= full_rate
    if name == "gemma2_windows":  # sliding and full layers share slots: a block id costs half
        assert per_block == full_rate // 2
    else:
        assert per_block == full_rate


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    model = build_hf_model("llama", DENSE, tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    outs = []
    for d in ("single", "sharded"):
        llm = LLM(str(tmp_path / d), dtype="float32")
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs.append(llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_bad_checkpoints_name_the_file(tmp_path):
    build_hf_model("llama", DENSE, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(tmp_path), dtype="float32")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        LLM(str(tmp_path), dtype="float32")
    # no weights on disk: load_format="dummy" builds the model with random weights and serves it
    dummy = LLM(str(tmp_path), dtype="float32", load_format="dummy")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = dummy.generate({"prompt_token_ids": [5, 6, 7]}, greedy)
    assert out.prompt_token_ids == [5, 6, 7] and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 8 and all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
    matrices = [p for p in dummy.llm_engine.parts.runner.model.parameters() if p.dim() >= 2]
    # every matrix drawn from N(0, 0.02), none left at its constructor's init or read from a file
    assert matrices and all(p.detach().std().item() == pytest.approx(0.02, rel=0.1) for p in matrices)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        LLM(str(tmp_path), dtype="float32")
