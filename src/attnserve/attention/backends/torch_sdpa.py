"""TORCH_SDPA: standard attention over the paged cache with PyTorch on any device.

Decodes are batched: their K/V rows are gathered from the pages into one padded batch and
attended by one ``scaled_dot_product_attention`` call with a padding/window mask. Prefills
(including chunks over a cached prefix) run one request at a time. GQA/MQA use SDPA's
``enable_gqa`` so K/V are never repeated per query head. Fast enough on CPU; the GPU has
Triton kernels. Not here: ALiBi, sinks, soft-capping and fp8 caches (see the registry entry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["TorchSDPABackend", "TorchSDPAMetadata"]


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
            s_max = max(lens)
            pos = torch.arange(s_max, device=device)
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
        keep = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[keep]
        kc.index_copy_(0, slots, k[keep].to(kc.dtype))
        vc.index_copy_(0, slots, v[keep].to(vc.dtype))
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype, device=q.device)
        window = layer.window
        nd = metadata.num_decodes
        if nd:
            keys = kc[metadata.decode_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
            vals = vc[metadata.decode_slots].transpose(1, 2).to(q.dtype)
            dist = metadata.decode_query_pos[:, None] - metadata.decode_key_pos  # [B, S]
            mask = (metadata.decode_key_pos >= 0) & (dist >= 0)
            if window is not None:
                mask &= dist < window
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :],
                                               scale=layer.scale, enable_gqa=True)  # [B, H, 1, Dv]
            out[:nd] = o.squeeze(2)
        for start, end, context, slots in metadata.prefills:
            keys = kc[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, S, D]
            vals = vc[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if context == 0 and window is None:
                o = F.scaled_dot_product_attention(qi, keys, vals, is_causal=True, scale=layer.scale,
                                                   enable_gqa=True)
            else:
                qpos = torch.arange(context, context + end - start, device=q.device)
                dist = qpos[:, None] - torch.arange(slots.shape[0], device=q.device)[None, :]
                mask = dist >= 0
                if window is not None:
                    mask &= dist < window
                o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, scale=layer.scale,
                                                   enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
