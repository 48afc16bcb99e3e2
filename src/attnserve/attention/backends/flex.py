"""FLEX_ATTENTION: standard attention over the paged cache through torch's FlexAttention.

The cache handling (writes, gathering whole blocks per request) is TORCH_SDPA's; the attention
itself is ``flex_attention`` with the layer's rules as mods: causal and window as a block mask,
ALiBi and soft-capping as a score mod, learned sinks folded in afterwards from the
log-sum-exp (``out * sigmoid(lse - sink)`` is the softmax with one more logit in the
denominator). Compiled on CUDA, eager on CPU. It serves as a second backend and as the peer
that the Triton kernels are measured against.
"""

from __future__ import annotations

import functools

import torch

from attnserve.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata

__all__ = ["FlexAttentionBackend"]


@functools.cache
def _flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def _attend(q, keys, vals, context: int, layer) -> torch.Tensor:
    """q [H, Q, D] at positions context..context+Q-1; keys/vals [Hkv, S, D] -> [H, Q, Dv]."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    num_q, s_len = q.shape[1], keys.shape[1]
    window = layer.window

    def mask_mod(b, h, qi, ki):
        dist = qi + context - ki
        visible = dist >= 0
        return visible & (dist < window) if window is not None else visible

    slopes, cap = layer.alibi_slopes, layer.softcap

    def score_mod(score, b, h, qi, ki):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[h] * (qi + context - ki).to(score.dtype)
        return score

    mask = create_block_mask(mask_mod, None, None, num_q, s_len, device=q.device.type)
    out, aux = _flex(q.device.type)(q[None], keys[None], vals[None], score_mod=score_mod, block_mask=mask,
                                    scale=layer.scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    out = out[0]
    if layer.sinks is not None:  # the sink logit joins the denominator only
        weight = torch.sigmoid(aux.lse[0].float() - layer.sinks.float()[:, None])  # [H, Q]
        out = (out.float() * weight[..., None]).to(out.dtype)
    return out


class FlexAttentionBackend(TorchSDPABackend):
    name = "FLEX_ATTENTION"

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchSDPAMetadata) -> torch.Tensor:
        if getattr(layer, "streaming", None) is not None:
            raise ValueError("FLEX_ATTENTION does not serve StreamingLLM layers")
        key_cache, value_cache = kv_cache
        fp8 = key_cache.dtype == torch.float8_e4m3fn
        self._write(layer, k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(q.shape[0], q.shape[1], value_cache.shape[-1], dtype=q.dtype, device=q.device)
        requests = [(i, i + 1, int(metadata.decode_query_pos[i]), int(metadata.decode_query_pos[i]) + 1,
                     metadata.decode_blocks[i]) for i in range(metadata.num_decodes)]
        requests += list(metadata.prefills)
        for start, end, context, seq_len, blocks in requests:
            keys = self._read(key_cache, blocks, layer.k_scale, fp8, q.dtype)[:seq_len].transpose(0, 1)
            vals = self._read(value_cache, blocks, layer.v_scale, fp8, q.dtype)[:seq_len].transpose(0, 1)
            out[start:end] = _attend(q[start:end].transpose(0, 1), keys, vals, context, layer).transpose(0, 1)
        return out
