"""TORCH_SDPA: standard attention over the paged cache with PyTorch on any device.

Decodes run one of two kernel variants of ``attention.decode`` (``attention/kernels.py``): on an
x86-64 CPU with AVX2, decodes of plain causal layers (no window, ALiBi, sinks or soft-capping; a
float cache) go to the ``cpu_ext`` C++ kernel that reads the cache blocks in place
(``ops/cpu/paged_decode.py``; ``disabled_kernels=("cpu_ext",)`` turns it off); the ``torch`` path
below is its twin and serves every other case. Decodes are batched: sorted by context length and split into a few buckets (``split_decodes``:
fewer padded keys against one more call per layer), each bucket's K/V blocks gathered from the
pages (whole blocks, contiguous copies) into one padded batch and attended in one call with a
padding/window mask. The buckets, their block ids, key positions and masks are built once per
step and shared by every layer. Prefills (including chunks over a cached prefix) run one
request at a time: a plain causal prefill from position 0 in one causal SDPA call (torch's CPU
flash attention: no [query x key] scores held), every other (a cached context, a window,
ALiBi, sinks, soft-capping) through ``attend_prefill``, in query chunks that hold at most
``PREFILL_SCORES_BUDGET`` [head x query x key] elements each, over only the keys the chunk's
queries see. GQA/MQA never repeat K/V per query head: a KV head's query heads are folded into
the query length (masked calls, the float32 path) or SDPA's ``enable_gqa`` (causal prefills).
ALiBi becomes an additive float mask; learned sinks and soft-capping, which SDPA cannot
express, take an explicit float32 path. An fp8 cache stores ``x / scale`` in e4m3 and is
dequantised as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.backend import AttentionBackend, layer_features, tensor_problem
from attnserve.attention.backends.streaming import attend_streaming
from attnserve.attention.metadata import CommonAttentionMetadata

__all__ = ["PREFILL_SCORES_BUDGET", "TorchSDPABackend", "TorchSDPAMetadata", "attend", "attend_prefill"]


# a bucket's fixed cost per layer (a gather pair and an SDPA call), in padded key slots: the
# split into buckets minimises padded keys + this per bucket (measured on CPU, bf16, 8/4 heads
# of 64: about 0.1 us a key slot, 60-80 us a bucket)
BUCKET_COST_KEYS = 512
# the most [head x query x key] elements one masked prefill call holds (64 MiB as float32 scores;
# its masks and distances are smaller): a longer prompt over a cached context runs in query chunks
PREFILL_SCORES_BUDGET = 1 << 24


@dataclass(slots=True)
class DecodeBucket:
    """Decodes ``start:end`` of the length-sorted order, attended in one padded call."""

    start: int
    end: int
    blocks: torch.Tensor  # [b, num_blocks] block ids (0 = pad)
    dist: torch.Tensor  # [b, 1, S] query position minus key position
    valid: torch.Tensor  # [b, 1, S] keys that exist
    masks: dict  # (window, dtype) -> additive SDPA mask [b, 1, 1, S] in the query dtype, built by the first layer


@dataclass(slots=True)
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [B_dec, max_blocks] block ids of each decode (0 = pad)
    decode_query_pos: torch.Tensor | None  # [B_dec]
    prefills: list[tuple[int, int, int, int, torch.Tensor]]  # (q_start, q_end, context, seq_len, blocks)
    all_slots_valid: bool = False  # no -1 in slot_mapping: the cache write needs no mask
    decode_table: torch.Tensor | None = None  # [B_dec, W] int32 block table rows of the decodes
    decode_seq_lens: torch.Tensor | None = None  # [B_dec] int32
    decode_lens: list[int] | None = None  # the same on the host
    # the bucketed path's split, built by the first layer that takes it (shared by the rest)
    decode_order: torch.Tensor | None = None  # [B_dec] decode rows sorted by length; None: as they are
    decode_buckets: list[DecodeBucket] | None = None


def split_decodes(num_blocks: list[int], cost: int, max_groups: int = 64) -> list[tuple[int, int, int]]:
    """The buckets of decodes sorted by block count, longest first: ``(start, end, blocks)``
    runs that minimise the padded block slots plus ``cost`` (in blocks) per run.

    ``num_blocks`` must be sorted in descending order. Exact dynamic programming over the runs
    of equal counts (at most ``max_groups`` of them; more are merged evenly first, so a step
    costs O(max_groups^2) at most).
    """
    n = len(num_blocks)
    if any(a < b for a, b in zip(num_blocks, num_blocks[1:])):
        raise ValueError("split_decodes: num_blocks must be sorted in descending order")
    starts = [i for i in range(n) if i == 0 or num_blocks[i] != num_blocks[i - 1]]
    if len(starts) > max_groups:
        step = len(starts) / max_groups
        starts = sorted({starts[int(j * step)] for j in range(max_groups)})
    m = len(starts)
    starts.append(n)
    best = [0.0] * (m + 1)  # best[k]: cost of rows starts[k]: as runs
    cut = [m] * (m + 1)
    for k in range(m - 1, -1, -1):
        width = num_blocks[starts[k]]
        best[k], cut[k] = min(((starts[j] - starts[k]) * width + cost + best[j], j) for j in range(k + 1, m + 1))
    runs, k = [], 0
    while k < m:
        runs.append((starts[k], starts[cut[k]], num_blocks[starts[k]]))
        k = cut[k]
    return runs


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
            return _sdpa_shared_mask(q, k, v, mask, layer.scale)
        bias = -slopes.view(1, -1, 1, 1) * dist[:, None].to(slopes.dtype)  # [B, H, Q, S]
        bias = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=layer.scale, enable_gqa=True)
    b, h, nq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    # a KV head's query heads folded into the query length: [B, Hkv, G * Q, D] (no K/V copies)
    scores = torch.matmul(q.float().reshape(b, hkv, -1, d), k.float().transpose(-1, -2))
    scores = scores.view(b, h, nq, s) * layer.scale  # [B, H, Q, S]
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
    out = torch.matmul(probs.reshape(b, hkv, -1, s), v.float())  # [B, Hkv, G * Q, Dv]
    return out.view(b, h, nq, -1).to(q.dtype)


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, layer,
                   budget: int | None = None) -> torch.Tensor:
    """One request's prefill through ``attend``, in query chunks of bounded size.

    Args:
        q: [1, H, Q, D], query i at position ``context + i``; k, v: [1, Hkv, S, D(v)] in q's
            dtype, the whole sequence (S = context + Q).
        layer: as ``attend``'s.
        budget: the most [head x query x key] elements a chunk's call holds (None:
            ``PREFILL_SCORES_BUDGET``): ``budget // (H * S)`` queries (at least one) a chunk.
    Returns:
        [1, H, Q, Dv]; a single chunk is exactly ``attend`` over the whole sequence.
    """
    h, nq, s = q.shape[1], q.shape[2], k.shape[2]
    rows = max(1, (PREFILL_SCORES_BUDGET if budget is None else budget) // (h * s))
    if rows >= nq:
        qpos = torch.arange(context, context + nq, device=q.device)
        dist = (qpos[:, None] - torch.arange(s, device=q.device)[None, :])[None]  # [1, Q, S]
        return attend(q, k, v, dist, torch.ones_like(dist, dtype=torch.bool), layer)
    out = q.new_empty(1, h, nq, v.shape[-1])
    for a in range(0, nq, rows):
        end = min(nq, a + rows)
        # the keys these queries see: none after the last of them, none before the window's start
        hi = context + end
        lo = 0 if layer.window is None else max(0, context + a - layer.window + 1)
        qpos = torch.arange(context + a, hi, device=q.device)
        dist = (qpos[:, None] - torch.arange(lo, hi, device=q.device)[None, :])[None]  # [1, rows, hi - lo]
        out[:, :, a:end] = attend(q[:, :, a:end], k[:, :, lo:hi], v[:, :, lo:hi], dist,
                                  torch.ones_like(dist, dtype=torch.bool), layer)
    return out


def _sdpa_shared_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """SDPA with a mask every head shares ([B, 1, Q, S]). Under GQA the query heads of one KV
    head are folded into the query length ([B, Hkv, G * Q, D]: the same keys, values and mask
    rows, so the result is the same): CPU SDPA with ``enable_gqa`` takes a slower path (bf16
    decode at batch 64: 10.5 against 3.1 ms)."""
    b, h, nq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if h == hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    g = h // hkv
    qf = q.reshape(b, hkv, g * nq, d)  # query head kvh * g + i reads KV head kvh
    mf = mask.unsqueeze(2).expand(b, 1, g, nq, s).reshape(b, 1, g * nq, s)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf, scale=scale)  # [B, Hkv, G * Q, Dv]
    return out.reshape(b, h, nq, out.shape[-1])


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One query per row: q [B, H, 1, D], k, v [B, Hkv, S, D], an additive mask [B, 1, 1, S] ->
    [B, H, 1, Dv]. As ``_sdpa_shared_mask`` (the query heads of a KV head folded into the query
    length), the mask broadcast over them instead of copied."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, 1, out.shape[-1])


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    def build_metadata(self, common: CommonAttentionMetadata, group_id: int) -> TorchSDPAMetadata:
        bt = common.block_tables[group_id]
        bs = self.block_size
        nd = common.num_decodes
        dec_blocks = dec_qpos = None
        if nd:
            lens = common.seq_lens_cpu[:nd]
            dec_blocks = bt[:nd, : -(-max(lens) // bs)].long()
            dec_qpos = common.seq_lens[:nd].long() - 1
        prefills = []
        q = common.query_start_loc_cpu
        for i in range(nd, common.num_reqs):
            seq_len = common.seq_lens_cpu[i]
            context = seq_len - (q[i + 1] - q[i])
            prefills.append((q[i], q[i + 1], context, seq_len, bt[i, : -(-seq_len // bs)].long()))
        slots = common.slot_mappings[group_id]
        # checked on the host only: on a GPU the check would wait for the stream every step, so
        # there the write keeps its mask
        all_valid = slots.device.type == "cpu" and bool((slots >= 0).all())
        return TorchSDPAMetadata(slots, nd, dec_blocks, dec_qpos, prefills, all_valid, bt[:nd],
                                 common.seq_lens[:nd].to(torch.int32).contiguous(), common.seq_lens_cpu[:nd])

    def _decode_buckets(self, metadata: TorchSDPAMetadata) -> list[DecodeBucket]:
        """The step's decode buckets, built by the first layer that asks: decodes sorted by
        length (``decode_order``, None where they already are) and split into buckets, each
        with its block ids, key distances and validity (shared by every layer)."""
        if metadata.decode_buckets is not None:
            return metadata.decode_buckets
        bs, bt, seq, lens = self.block_size, metadata.decode_table, metadata.decode_seq_lens, metadata.decode_lens
        nblk = [-(-n // bs) for n in lens]
        rows = sorted(range(len(lens)), key=nblk.__getitem__, reverse=True)
        runs = split_decodes([nblk[i] for i in rows], -(-BUCKET_COST_KEYS // bs))
        if len(runs) == 1:
            rows = list(range(len(lens)))  # one bucket: no reordering
        order = None if rows == sorted(rows) else torch.tensor(rows, device=bt.device)
        bt_sorted = bt if order is None else bt.index_select(0, order)
        seq_sorted = (seq if order is None else seq.index_select(0, order)).long()
        buckets = []
        for start, end, width in runs:
            pos = torch.arange(width * bs, device=bt.device)
            qpos = seq_sorted[start:end, None] - 1
            buckets.append(DecodeBucket(start, end, bt_sorted[start:end, :width].long(), (qpos - pos)[:, None],
                                        (pos < qpos + 1)[:, None], {}))
        metadata.decode_order, metadata.decode_buckets = order, buckets
        return buckets

    @staticmethod
    def _write(layer, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slot_mapping: torch.Tensor, all_valid: bool = False) -> None:
        """New K/V [T, Hkv, D] into their slots (-1: skipped; ``all_valid``: none is -1, so no
        mask); fp8 stores ``x / scale``."""
        kc = key_cache.view(-1, *key_cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        vc = value_cache.view(-1, *value_cache.shape[2:])
        if all_valid:
            keep, slots = slice(None), slot_mapping
        else:
            keep = slot_mapping >= 0
            slots = slot_mapping[keep]
        if kc.dtype == torch.float8_e4m3fn:  # copied as raw bytes: not every device indexes float8
            kc.view(torch.uint8).index_copy_(0, slots, (k[keep].float() / layer.k_scale).to(kc.dtype).view(torch.uint8))
            vc.view(torch.uint8).index_copy_(0, slots, (v[keep].float() / layer.v_scale).to(vc.dtype).view(torch.uint8))
        else:
            kc.index_copy_(0, slots, k[keep].to(kc.dtype))
            vc.index_copy_(0, slots, v[keep].to(vc.dtype))

    @staticmethod
    def _read(cache: torch.Tensor, blocks: torch.Tensor, scale: float, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
        """[..., n_blocks] block ids -> [..., n_blocks * block_size, Hkv, D] in ``dtype``."""
        src = cache if not fp8 else cache.view(torch.uint8)
        x = src.index_select(0, blocks.reshape(-1))  # whole blocks: row copies, 4x faster than x[idx]
        x = x.view(*blocks.shape[:-1], -1, *cache.shape[2:])
        return x.to(dtype) if not fp8 else (x.view(cache.dtype).float() * scale).to(dtype)

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchSDPAMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        fp8 = key_cache.dtype == torch.float8_e4m3fn
        self._write(layer, k, v, key_cache, value_cache, metadata.slot_mapping, metadata.all_slots_valid)

        def read(cache: torch.Tensor, blocks: torch.Tensor, scale: float) -> torch.Tensor:
            return self._read(cache, blocks, scale, fp8, q.dtype)

        out = torch.empty(q.shape[0], q.shape[1], value_cache.shape[-1], dtype=q.dtype, device=q.device)
        nd = metadata.num_decodes
        if getattr(layer, "streaming", None) is not None:
            return self._forward_streaming(layer, q, key_cache, value_cache, read, metadata, out)
        plain = layer.alibi_slopes is None and layer.sinks is None and layer.softcap is None
        if nd and self.kernel("attention.decode", lambda: self._problem(layer, q, key_cache, value_cache)).name \
                == "cpu_ext":
            self.launch("attention.decode", None)(q[:nd], key_cache, value_cache, metadata.decode_table,
                                                  metadata.decode_seq_lens, layer.scale, out[:nd])
        elif nd:
            self._decode(layer, q[:nd], out[:nd], key_cache, value_cache, read, metadata, plain)
        for start, end, context, seq_len, blocks in metadata.prefills:
            keys = read(key_cache, blocks, layer.k_scale)[:seq_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            vals = read(value_cache, blocks, layer.v_scale)[:seq_len].transpose(0, 1).unsqueeze(0)
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            if plain and context == 0 and layer.window is None:  # flash attention: no scores held
                o = F.scaled_dot_product_attention(qi, keys, vals, is_causal=True, scale=layer.scale,
                                                   enable_gqa=True)
            else:
                o = attend_prefill(qi, keys, vals, context, layer)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _problem(layer, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
        """The kernel problem of this layer's calls (what the plan builds from its spec)."""
        return tensor_problem(q, key_cache, num_heads=q.shape[1], num_kv_heads=key_cache.shape[2],
                              head_size=key_cache.shape[3], head_size_v=value_cache.shape[3],
                              features=layer_features(layer))

    def _decode(self, layer, q: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                read, metadata: TorchSDPAMetadata, plain: bool) -> None:
        """The decodes' attention, bucket by bucket: q [B_dec, H, D] -> out [B_dec, H, Dv]."""
        buckets = self._decode_buckets(metadata)
        order = metadata.decode_order
        qs = q if order is None else q.index_select(0, order)
        outs = out if order is None else torch.empty_like(out)
        for bk in buckets:
            keys = read(key_cache, bk.blocks, layer.k_scale).transpose(1, 2)  # [b, Hkv, S, D]
            vals = read(value_cache, bk.blocks, layer.v_scale).transpose(1, 2)
            qb = qs[bk.start:bk.end].unsqueeze(2)  # [b, H, 1, D]
            if plain:  # the padding/window mask, additive, once per step and window
                mask = bk.masks.get((layer.window, q.dtype))
                if mask is None:
                    keep = bk.valid if layer.window is None else bk.valid & (bk.dist < layer.window)
                    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
                    mask = bk.masks[(layer.window, q.dtype)] = mask[:, None]  # [b, 1, 1, S]
                ob = _sdpa_decode(qb, keys, vals, mask, layer.scale)
            else:
                ob = attend(qb, keys, vals, bk.dist, bk.valid, layer)
            outs[bk.start:bk.end] = ob.squeeze(2)
        if order is not None:
            out.index_copy_(0, order, outs)

    @staticmethod
    def _forward_streaming(layer, q, key_cache, value_cache, read, metadata, out) -> torch.Tensor:
        """StreamingLLM layers: one request at a time (see ``streaming.py``)."""
        requests = [(i, i + 1, int(metadata.decode_query_pos[i]) + 1, metadata.decode_blocks[i])
                    for i in range(metadata.num_decodes)]
        requests += [(start, end, seq_len, blocks) for start, end, _, seq_len, blocks in metadata.prefills]
        for start, end, seq_len, blocks in requests:
            keys = read(key_cache, blocks, layer.k_scale)[:seq_len]
            vals = read(value_cache, blocks, layer.v_scale)[:seq_len]
            qpos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            out[start:end] = attend_streaming(q[start:end], keys, vals, qpos, layer)
        return out
