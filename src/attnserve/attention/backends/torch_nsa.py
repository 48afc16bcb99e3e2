"""TORCH_NSA: native sparse attention (NSA, arXiv 2502.11089) in PyTorch over the paged K/V.

What is computed is fla-org's form (``fla.ops.nsa.parallel.parallel_nsa``, the code the public
NSA models are trained with). The three branches share q, k and v (k after RoPE). For a query
token at absolute position p, KV head g with its G query heads, ``l = block_size`` and
``scale = D^-0.5``:

- compression: block c is the mean of k (and of v) over positions [c*l, (c+1)*l); the query
  sees the ``(p + 1) // l`` complete blocks; ``o_cmp = softmax(scale q.K~) V~``, and 0 before
  the first block is complete;
- selection: block c < p // l scores its compression probability summed over the G query heads
  of g (selection is per KV head); the first block, the previous one and the current one
  (p // l, partial) are forced in with score G (every head at probability 1). The top
  ``num_selected`` blocks are kept (``block_counts`` rounded up to a power of two, as FLA's
  kernels do; every block while there are fewer), and ``o_slc`` is attention over their tokens
  with the causal mask. Exact ties are broken by ``torch.topk`` where FLA's bitonic sort has its
  own order; with ``block_counts >= 3`` the forced blocks never compete, so only blocks of
  exactly equal importance could differ (probabilities that underflow to 0, say);
- sliding window (``window`` set): attention over positions [p - w + 1, p];
- ``o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa`` with the layer's sigmoid gates.

All three branches read the layer's one paged K/V cache (a ``FullAttentionSpec``), and
everything is a function of absolute positions over the keys in the cache, so chunked prefill,
prefix-cache hits, preemption and decode need nothing more.

Cost, and what this backend is not: the compressed K/V are not cached. Each step mean-pools the
complete blocks of every request's gathered K/V again (one more pass over keys the step reads
anyway), and the selected and window branches are dense attention over the whole sequence under
masks: the cost of full attention, not NSA's sparse reads. A fast path would keep the pooled
K/V per page (``2 * Hkv * D / l`` values per token, 1/l of the raw K/V) and read only the
selected blocks and the window. Decodes run as one batch, prefills one request at a time, in
query chunks that bound the [H, Q, S] scores. Not here: projections, RoPE and gates
(``layers/nsa.py``), Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.backend import AttentionBackend
from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["TorchNSABackend", "TorchNSAMetadata", "nsa_attention"]

# Elements of one chunk's score tensor [B, H, Q, S]: 2^24 float32 values = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(slots=True)
class TorchNSAMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 where nothing is written
    positions: torch.Tensor  # [T] int64 absolute position of each new token
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [B_dec, max_blocks] block ids of each decode (0 = pad)
    prefills: list[tuple[int, int, torch.Tensor]]  # (q_start, q_end, block ids) per prefill


def _attend(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax over the keys ``mask`` keeps (never none here: a query always sees itself)."""
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def nsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                  gates: torch.Tensor, *, scale: float, block_size: int, num_selected: int,
                  window: int | None) -> torch.Tensor:
    """NSA of a batch of queries over the keys of their sequences (the module docstring's math).

    Args:
        q: [B, Q, H, D] queries after RoPE.
        k, v: [B, S, Hkv, D] the sequence's keys (after RoPE) and values, key i at position i;
            keys past a query's own position may be anything (they are masked).
        qpos: [B, Q] absolute position of each query (< S).
        gates: [B, Q, H, 3] sigmoid gates (compression, selection, window).
        scale, block_size, num_selected, window: the layer's NSA parameters.
    Returns:
        [B, Q, H, D] in q's dtype.
    """
    b, nq, heads, dim = q.shape
    s_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dev = q.device
    qf = q.float().view(b, nq, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [B, Hkv, S, D]
    qp = qpos.long()[:, None, None, :, None]  # [B, 1, 1, Q, 1]

    # compression: complete blocks, mean-pooled in float32 and kept in the input dtype (as FLA)
    n_cmp = s_len // block_size
    pooled = [x[:, : n_cmp * block_size].float().view(b, n_cmp, block_size, kv_heads, dim).mean(2)
              .to(x.dtype).float().transpose(1, 2) for x in (k, v)]  # [B, Hkv, NC, D]
    cmp_scores = (qf @ pooled[0][:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, Q, NC]
    visible = torch.arange(n_cmp, device=dev) < (qp + 1) // block_size  # [B, 1, 1, Q, NC]
    p_cmp = torch.softmax(cmp_scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    o_cmp = p_cmp @ pooled[1][:, :, None]  # [B, Hkv, G, Q, D]; 0 while no block is complete

    # selection: per KV head, importance summed over its query heads; 3 forced blocks
    n_sel = -(-s_len // block_size)
    importance = F.pad(p_cmp.sum(2), (0, n_sel - n_cmp))  # [B, Hkv, Q, n_sel]
    blk = torch.arange(n_sel, device=dev)
    cur = qp[:, :, 0] // block_size  # [B, 1, Q, 1] the query's own block
    scores = torch.where(blk < cur, importance, float("-inf"))
    forced = (blk == 0) | (blk == cur - 1) | (blk == cur)
    scores = torch.where(forced, float(group), scores)
    top_val, top_idx = scores.topk(min(num_selected, n_sel), dim=-1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top_idx, top_val > float("-inf"))

    key_pos = torch.arange(s_len, device=dev)
    causal = key_pos <= qp[:, :, 0]  # [B, 1, Q, S]
    full_scores = (qf @ kf[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, Q, S]
    slc_mask = chosen.index_select(-1, key_pos // block_size) & causal  # [B, Hkv, Q, S]
    g = gates.view(b, nq, kv_heads, group, 3).permute(0, 2, 3, 1, 4).float()  # [B, Hkv, G, Q, 3]
    out = _attend(full_scores, slc_mask[:, :, None], vf[:, :, None]) * g[..., 1:2]
    out = out + o_cmp * g[..., 0:1]
    if window:
        win_mask = causal & (key_pos > qp[:, :, 0] - window)  # [B, 1, Q, S]
        out = out + _attend(full_scores, win_mask[:, :, None], vf[:, :, None]) * g[..., 2:3]
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq, heads, dim).to(q.dtype)


def _chunks(total: int, per_item: int):
    """(start, end) ranges over ``total`` items so a chunk holds about ``_CHUNK_ELEMENTS``."""
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, n] block ids -> [B, n * block_size, Hkv, D] (whole blocks: row copies)."""
    x = cache.index_select(0, blocks.reshape(-1))
    return x.view(blocks.shape[0], -1, *cache.shape[2:])


class TorchNSABackend(AttentionBackend):
    name = "TORCH_NSA"

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TorchNSAMetadata:
        bt = common.block_tables[group_id]
        bs, nd = self.block_size, common.num_decodes
        decode_blocks = None
        if nd:
            decode_blocks = bt[:nd, : -(-max(common.seq_lens_cpu[:nd]) // bs)].long()
        q = common.query_start_loc_cpu
        prefills = [(q[i], q[i + 1], bt[i, : -(-common.seq_lens_cpu[i] // bs)].long())
                    for i in range(nd, common.num_reqs)]
        return TorchNSAMetadata(common.slot_mappings[group_id], common.positions.long(), nd,
                                decode_blocks, prefills)

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchNSAMetadata, *,
                gates: torch.Tensor | None = None) -> torch.Tensor:
        """Write the new K/V, then NSA (``nsa_attention``) for every new token.

        ``gates`` [T, H, 3] are the layer's sigmoid gates (compression, selection, window);
        ``layer`` gives ``scale``, ``nsa_block_size``, ``num_selected`` and ``window``.
        """
        if gates is None:
            raise ValueError("TORCH_NSA needs the layer's gates [T, H, 3]")
        key_cache, value_cache = kv_cache
        keep = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[keep]
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, k[keep].to(key_cache.dtype))
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, v[keep].to(value_cache.dtype))

        def attend(qs, keys, vals, qpos, gs):
            return nsa_attention(qs, keys, vals, qpos, gs, scale=layer.scale, block_size=layer.nsa_block_size,
                                 num_selected=layer.num_selected, window=layer.window)

        out = torch.empty_like(q)
        pos, heads, nd = metadata.positions, q.shape[1], metadata.num_decodes
        if nd:
            blocks = metadata.decode_blocks
            for a, b in _chunks(nd, heads * blocks.shape[1] * key_cache.shape[1]):
                keys, vals = _gather(key_cache, blocks[a:b]), _gather(value_cache, blocks[a:b])
                out[a:b] = attend(q[a:b, None], keys, vals, pos[a:b, None], gates[a:b, None])[:, 0]
        for start, end, blocks in metadata.prefills:
            keys, vals = _gather(key_cache, blocks[None]), _gather(value_cache, blocks[None])
            for a, b in _chunks(end - start, heads * keys.shape[1]):
                a, b = start + a, start + b
                out[a:b] = attend(q[None, a:b], keys, vals, pos[None, a:b], gates[None, a:b])[0]
        return out
