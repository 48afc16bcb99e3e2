"""TORCH_SDPA: standard attention over the paged cache with PyTorch on any device.

Decodes are batched: their K/V rows are gathered from the pages into one padded batch and
attended in one call with a padding/window mask. Prefills (including chunks over a cached
prefix) run one request at a time. GQA/MQA use SDPA's ``enable_gqa`` so K/V are never repeated
per query head. ALiBi becomes an additive float mask; learned sinks and soft-capping, which
SDPA cannot express, take an explicit float32 path. An fp8 cache stores ``x / scale`` in e4m3
and is dequantised as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["TorchSDPABackend", "TorchSDPAMetadata", "attend"]


@dataclass(slots=True)
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B_dec, S_max] cache rows of each decode's keys (0 = pad)
    decode_key_pos: torch.Tensor | None  # [B_dec, S_max] key positions, -1 for padding
    decode_query_pos: torch.Tensor | None  # [B_dec]
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_end, context_len, slots [S])


def _slots(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table_row.device)
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dist: torch.Tensor, valid: torch.Tensor,
           layer) -> torch.Tensor:
    """Masked attention of one batch.

    Args:
        q: [B, H, Q, D]; k, v: [B, Hkv, S, D(v)] in q's dtype.
        dist: [B, Q, S] query position minus key position; valid: [B, Q, S] keys that exist.
        layer: scale, window, alibi_slopes [H] or None, sinks [H] or None, softcap or None.
    Returns:
        [B, H, Q, Dv].
    """
    mask = valid & (dist >= 0)
    if layer.window is not None:
        mask &= dist < layer.window
    mask = mask[:, None]  # [B, 1, Q, S]
    slopes = layer.alibi_slopes
    if layer.sinks is None and layer.softcap is None:
        if slopes is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True)
        bias = -slopes.view(1, -1, 1, 1) * dist[:, None].to(slopes.dtype)  # [B, H, Q, S]
        bias = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=layer.scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * layer.scale  # [B, H, Q, S]
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    if slopes is not None:
        scores = scores - slopes.view(1, -1, 1, 1) * dist[:, None].float()
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).to(q.dtype)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TorchSDPAMetadata:
        bt = common.block_tables[group_id]
        device = bt.device
        nd = common.num_decodes
        dec_slots = dec_kpos = dec_qpos = None
        if nd:
            lens = common.seq_lens_cpu[:nd]
            pos = torch.arange(max(lens), device=device)
            seq = torch.tensor(lens, device=device)
            blocks = bt[:nd].long().gather(1, (pos // self.block_size).clamp(max=bt.shape[1] - 1)
                                           .expand(nd, -1))  # [B_dec, S_max]
            valid = pos[None, :] < seq[:, None]
            dec_slots = torch.where(valid, blocks * self.block_size + pos % self.block_size, 0)
            dec_kpos = torch.where(valid, pos.expand(nd, -1), -1)
            dec_qpos = seq - 1
        prefills = []
        q = common.query_start_loc_cpu
        for i in range(nd, common.num_reqs):
            seq_len = common.seq_lens_cpu[i]
            context = seq_len - (q[i + 1] - q[i])
            prefills.append((q[i], q[i + 1], context, _slots(bt[i], seq_len, self.block_size)))
        return TorchSDPAMetadata(common.slot_mappings[group_id], nd, dec_slots, dec_kpos, dec_qpos, prefills)

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchSDPAMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        kc = key_cache.view(-1, *key_cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        vc = value_cache.view(-1, *value_cache.shape[2:])
        fp8 = kc.dtype == torch.float8_e4m3fn
        keep = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[keep]
        if fp8:  # fp8 is copied as raw bytes: not every device indexes float8 tensors
            kc.view(torch.uint8).index_copy_(0, slots, (k[keep].float() / layer.k_scale).to(kc.dtype).view(torch.uint8))
            vc.view(torch.uint8).index_copy_(0, slots, (v[keep].float() / layer.v_scale).to(vc.dtype).view(torch.uint8))
        else:
            kc.index_copy_(0, slots, k[keep].to(kc.dtype))
            vc.index_copy_(0, slots, v[keep].to(vc.dtype))

        def read(cache: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
            if not fp8:
                return cache[rows].to(q.dtype)
            x = cache.view(torch.uint8)[rows].view(cache.dtype)
            return (x.float() * scale).to(q.dtype)

        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype, device=q.device)
        nd = metadata.num_decodes
        if nd:
            keys = read(kc, metadata.decode_slots, layer.k_scale).transpose(1, 2)  # [B, Hkv, S, D]
            vals = read(vc, metadata.decode_slots, layer.v_scale).transpose(1, 2)
            dist = (metadata.decode_query_pos[:, None] - metadata.decode_key_pos)[:, None, :]  # [B, 1, S]
            valid = (metadata.decode_key_pos >= 0)[:, None, :]
            out[:nd] = attend(q[:nd].unsqueeze(2), keys, vals, dist, valid, layer).squeeze(2)
        plain = layer.alibi_slopes is None and layer.sinks is None and layer.softcap is None
        for start, end, context, slots in metadata.prefills:
            keys = read(kc, slots, layer.k_scale).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            vals = read(vc, slots, layer.v_scale).transpose(0, 1).unsqueeze(0)
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if plain and context == 0 and layer.window is None:
                o = F.scaled_dot_product_attention(qi, keys, vals, is_causal=True, scale=layer.scale,
                                                   enable_gqa=True)
            else:
                qpos = torch.arange(context, context + end - start, device=q.device)
                dist = (qpos[:, None] - torch.arange(slots.shape[0], device=q.device)[None, :])[None]
                o = attend(qi, keys, vals, dist, torch.ones_like(dist, dtype=torch.bool), layer)
            out[start:end] = o[0].transpose(0, 1)
        return out
