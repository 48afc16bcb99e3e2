"""StreamingLLM mode (``streaming_sinks`` + ``streaming_window``) against a plain PyTorch
reference of the rule, on a generation much longer than the window.

The reference is written independently of the engine's trick: it streams tokens one at a time
through the transformers model's own modules, keeps the first N and the last W tokens' keys
*before* RoPE, and applies RoPE at their positions within the cache (Xiao et al., 2023). The
engine instead caches keys rotated at their text positions and re-rotates only sink keys.
"""

from __future__ import annotations

import pytest
import torch

from attnserve import LLM, SamplingParams
from tests.models.parity import VOCAB, build_hf_model, make_prompts

SINKS, WINDOW = 4, 12
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@torch.no_grad()
def streaming_reference(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = model.model
    cfg = model.config
    hd = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    caches = [[] for _ in m.layers]  # per layer: retained (k before RoPE, v) of each token
    tokens, generated, logprobs = list(prompt), [], []
    for step in range(len(prompt) + new_tokens - 1):
        x = m.embed_tokens(torch.tensor([[tokens[step]]]))
        for layer, cache in zip(m.layers, caches):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, 1, -1, hd).transpose(1, 2)
            k = a.k_proj(h).view(1, 1, -1, hd).transpose(1, 2)
            v = a.v_proj(h).view(1, 1, -1, hd).transpose(1, 2)
            cache.append((k, v))
            if len(cache) > SINKS + WINDOW:  # drop the oldest token after the sinks
                del cache[SINKS]
            keys = torch.cat([c[0] for c in cache], dim=2)
            vals = torch.cat([c[1] for c in cache], dim=2)
            n = keys.shape[2]
            cos, sin = m.rotary_emb(v, torch.arange(n)[None])  # positions within the cache
            _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
            qr, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
            group = qr.shape[1] // keys.shape[1]
            keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            probs = torch.softmax((qr @ keys.transpose(-1, -2)) * a.scaling, dim=-1)
            x = x + a.o_proj((probs @ vals).transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(m.norm(x))[0, -1]
        if step >= len(prompt) - 1:
            lp = torch.log_softmax(logits.float(), -1)
            nxt = int(lp.argmax())
            logprobs.append(lp)
            generated.append(nxt)
            tokens.append(nxt)
    return generated, logprobs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("streaming")
    return path, build_hf_model("llama", CONFIG, path)


@pytest.mark.parametrize("chunk", [None, 5])
def test_streaming_matches_the_reference_and_stays_bounded(model, chunk):
    path, hf = model
    prompts = make_prompts([10, 23])
    new = 60
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=512, streaming_sinks=SINKS,
              streaming_window=WINDOW, **kw)
    assert llm.llm_engine.parts.backend_names == ["TORCH_SDPA"]
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    bound = -(-SINKS // 4) + -(-(WINDOW - 1) // 4) + 1  # sink blocks + window + straddle
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.kv_manager.check_integrity()
        for rid in engine.scheduler.running:
            held = [b for b in engine.kv_manager.block_ids(rid.request_id)[0] if b]
            assert len(held) <= bound + 2, f"the cache grew to {len(held)} blocks"  # + a prefill chunk
    for rid, prompt in zip(ids, prompts):
        tokens, logprobs = streaming_reference(hf, prompt, new)
        out = finals[rid].outputs[0]
        assert out.token_ids == tokens
        for step, entry in enumerate(out.logprobs):
            for tid, lp in entry.items():
                assert abs(lp.logprob - logprobs[step][tid].item()) < 1e-4
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_streaming_is_not_plain_attention(model):
    """Past the window the streaming output must differ from full attention (the rule is real)."""
    path, _ = model
    prompt = make_prompts([40])
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    full = LLM(str(path), dtype="float32").generate({"prompt_token_ids": prompt[0]}, params)[0]
    stream = LLM(str(path), dtype="float32", streaming_sinks=SINKS, streaming_window=WINDOW).generate(
        {"prompt_token_ids": prompt[0]}, params)[0]
    last = prompt[0][-1]
    assert abs(full.prompt_logprobs[-1][last].logprob - stream.prompt_logprobs[-1][last].logprob) > 1e-3


def test_streaming_refuses_backends_and_layers_it_cannot_serve(model):
    path, _ = model
    from attnserve.attention.registry import BackendSelectionError

    with pytest.raises(BackendSelectionError, match="streaming"):
        LLM(str(path), dtype="float32", streaming_sinks=4, streaming_window=8, attention_backend="FLEX_ATTENTION")
