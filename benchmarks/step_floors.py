"""What one step of a model must read and compute: the floors ``gpu_mechanisms.py`` measures
against. Sizes come from the built model's modules and the engine's bound cache tensors.

Decode floor, the bytes one step must read at 4.25 TB/s (the copy bandwidth measured on the
H200, ``ceilings.NOMINAL_BW``):

- weights: every parameter of the model (sizes from its modules), except the input embedding,
  of which only the b rows looked up count; the output head in full; for each MoE layer the
  routed experts (the stacked ``FusedExperts`` weights) scaled to the experts b tokens touch
  under uniform routing, E * (1 - (1 - k/E)^b) of E with top-k k, shared experts in full;
- cache, per layer, for b sequences of ``context`` tokens, with row bytes read from the engine's
  cache tensors (so fp8 rows count as stored): GQA/MoE 2 * kv_heads * head_dim * dtype bytes a
  token (a sliding window caps the tokens); MLA one latent row ((kv_lora_rank + rope) * 2 in
  bf16, 656 B in fp8) a token; DSA the indexer key of every token (128 * 2 B in bf16, 132 in
  fp8; none in a GLM-5 "shared" layer, which reuses the previous layer's top-k) plus
  min(context, index_topk) latent rows. At context <= index_topk the engine selects every key
  without scoring (``ops/indexer/logits_triton.py``), so no indexer key counts there;
- state, per state layer and sequence, read once and written once (so twice its bytes), with
  the sizes read from the engine's slot tensors (``state_rows``: the recurrent state in
  ``mamba_ssm_cache_dtype``, float32 by default; the conv state in the KV cache dtype, the
  model's under ``auto``): the recurrent state (Gated DeltaNet Hv * dk * dv, KDA H * dk * dv,
  lightning H * dk * dv, Mamba d_inner * d_state) and the conv state (channels * (K - 1): GDN
  2 * Hk * dk + Hv * dv channels, KDA three convs of H * dk, Mamba d_inner; lightning none).
  Qwen3-Next: 32 * 128 * 128 * 4 B = 2 MiB + 8,192 * 3 * 2 B = 48 KiB, x 2 a GDN layer and
  sequence. The state does not grow with the context; the hybrids' attention layers add their
  paged rows as above.

Prefill FLOPs of b prompts of C tokens: b * (C * (2 * P + A) + 2 * H), with

- P the parameters a token touches: all but the input embedding, the output head and the routed
  experts, plus top-k routed experts' share (k/E of each MoE layer's stacked experts), shared
  experts in full; H the output head, applied once per prompt (the engine computes logits for
  the sampled row only);
- A the attention FLOPs of a token, summed over layers, with m(C, cap) the mean over positions
  p = 1..C of min(p, cap) (uncapped: (C + 1) / 2, i.e. causal C/2):
  GQA 2 * heads * (head_dim_qk + head_dim_v) * m(C, window) (QK^T and PV);
  MLA as the engine prefills it, expanded: 2 * heads * (qk_nope + rope + v_head_dim) * m(C);
  DSA absorbed sparse attention 2 * heads * ((kv_lora_rank + rope) + kv_lora_rank) *
  m(C, index_topk), plus in each layer with an indexer 2 * index_n_heads * index_head_dim *
  m(C) (0 when C <= index_topk: nothing is scored then);
  state layers, as the engine's chunked forms compute them, with R the recurrent state's
  elements and c the chunk: Gated DeltaNet and KDA (c = 64) H * (6 * dk * dv + 4 * c * (dk +
  dv)) (three products against the state: k S, q S and the update; the chunk's Q K^T, K K^T
  and the products by them); lightning (c = its block_size, 256) H * (4 * dk * dv + 2 * c *
  (dk + dv)); Mamba 7 * R (the recurrence below; the engine's log-step scan does more); plus
  the short convs, 2 * channels * K.

Achieved TFLOP/s is against the measured 790 TFLOP/s bf16 matrix product (``ceilings.NOMINAL_FLOPS``).

A decode step also has a FLOP floor, its FLOPs at 790 TFLOP/s: 2 * (P + H) per token for the
weights plus the attention of each token over its keys in the form the backends decode (GQA
2 * heads * (d_qk + d_v) a key; MLA absorbed, 2 * heads * (2 * kv_lora_rank + rope) a key, so 128
heads do 278 KFLOP per 1,152-byte row: 242 FLOP/B, above the H200's 186, and dense MLA decode at
128 heads is compute-bound before it is bandwidth-bound; DSA the same over min(context, topk)
keys, plus the indexer's 2 * n_heads * head_dim per scored key; a state layer its recurrent
step, per state element: Gated DeltaNet and KDA 7 (decay, S^T k, the rank-1 update, S^T q),
lightning 5 (decay, the k v^T update, q S), Mamba 7 (exp(dt * A), the update, B * dt * x, C . h),
plus the convs' 2 * channels * K).
"""

from __future__ import annotations

from torch import nn

from attnserve.arch import LayerKind, LayerSpec, ModelArch
from attnserve.kvcache.spec import CachePolicy
from attnserve.layers.moe import FusedExperts

__all__ = [
    "attention_flops_per_token",
    "cache_rows",
    "check_rows",
    "decode_cache_bytes",
    "decode_flops",
    "decode_state_bytes",
    "decode_weight_bytes",
    "expected_experts",
    "mean_keys",
    "param_bytes",
    "prefill_flops",
    "prefill_params",
    "state_flops_per_token",
    "state_rows",
]

# chunk of the chunked delta-rule prefill forms (``attention/state/steps.py``: GDN and KDA)
DELTA_CHUNK = 64
# FLOPs per recurrent-state element of one decode token (the module docstring)
STATE_DECODE_FLOPS = {LayerKind.GDN: 7, LayerKind.KDA: 7, LayerKind.LIGHTNING: 5, LayerKind.MAMBA: 7}


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _embedding_and_head(model: nn.Module) -> tuple[nn.Embedding | None, nn.Linear | None]:
    """The input embedding and the output head (``CausalLM``'s names; else the first embedding)."""
    emb = getattr(model, "embed_tokens", None)
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    head = getattr(model, "lm_head", None)
    return emb, head if isinstance(head, nn.Linear) else None


def _tied(emb: nn.Embedding | None, head: nn.Linear | None) -> bool:
    return emb is not None and head is not None and head.weight is emb.weight


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens touch when each picks ``top_k`` of ``num_experts``
    uniformly: E * (1 - (1 - k/E)^b)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_weight_bytes(model: nn.Module, arch: ModelArch, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` tokens reads (see the module docstring)."""
    total = param_bytes(model.parameters())  # a tied weight once
    emb, head = _embedding_and_head(model)
    if emb is not None and not _tied(emb, head):  # only the looked-up rows are read
        w = emb.weight
        total += min(batch, w.shape[0]) * w[0].numel() * w.element_size() - param_bytes([w])
    for m in model.modules():
        if isinstance(m, FusedExperts):
            share = expected_experts(m.num_experts, arch.moe.top_k, batch) / m.num_experts
            total -= (1.0 - share) * param_bytes(m.parameters())
    return int(total)


def prefill_params(model: nn.Module, arch: ModelArch) -> tuple[float, int]:
    """(parameters a prompt token multiplies by, parameters of the head applied once a prompt)."""
    per_token = float(_numel(model.parameters()))
    emb, head = _embedding_and_head(model)
    head_params = head.weight.numel() if head is not None else 0
    per_token -= head_params
    if emb is not None and not _tied(emb, head):
        per_token -= emb.weight.numel()
    for m in model.modules():
        if isinstance(m, FusedExperts):
            per_token -= (1.0 - arch.moe.top_k / m.num_experts) * _numel(m.parameters())
    return per_token, head_params


def mean_keys(context: int, cap: int | None = None) -> float:
    """Mean over positions p = 1..context of min(p, cap): the keys a causal query sees."""
    if cap is None or cap >= context:
        return (context + 1) / 2
    return (cap * (cap + 1) / 2 + (context - cap) * cap) / context


def attention_flops_per_token(arch: ModelArch, context: int) -> float:
    """Attention (and state-mixer) FLOPs of one prompt token of a ``context``-token prompt, over
    every layer."""
    total = 0.0
    for s in arch.layers:
        if s.kind in (LayerKind.FULL, LayerKind.SLIDING):
            total += 2 * s.num_heads * (s.head_size + s.head_size_v) * mean_keys(context, s.window)
        elif s.kind is LayerKind.MLA:
            total += 2 * s.num_heads * (s.mla.qk_head_dim + s.mla.v_head_dim) * mean_keys(context)
        elif s.kind is LayerKind.SPARSE_MLA:
            idx = s.indexer
            total += 2 * s.num_heads * (s.mla.latent_dim + s.mla.kv_lora_rank) * mean_keys(context, idx.topk)
            if idx.has_cache and context > idx.topk:  # at most topk keys visible: nothing is scored
                total += 2 * idx.n_heads * idx.head_dim * mean_keys(context)
        elif s.kind.is_state:
            total += state_flops_per_token(s, decode=False)
        else:
            raise ValueError(f"layer {s.index}: no FLOP count for {s.kind.value} layers")
    return total


def _conv_flops(spec: LayerSpec) -> float:
    """2 * channels * K per token over the layer's short convs (state shapes [channels, K - 1])."""
    return sum(2 * c * (k1 + 1) for c, k1 in spec.state.conv)


def state_flops_per_token(spec: LayerSpec, decode: bool) -> float:
    """FLOPs of one token through a state layer's mixer (convs and recurrence, not its
    projections, which the parameter count has): the recurrent step for a decode token, the
    engine's chunked form for a prompt token (the module docstring)."""
    if spec.state is None or not spec.state.recurrent:
        raise ValueError(f"layer {spec.index}: a {spec.kind.value} layer without a recurrent state shape")
    rec = spec.state.recurrent[0]
    elements = spec.state.recurrent_numel
    conv = _conv_flops(spec)
    if spec.kind not in STATE_DECODE_FLOPS:
        raise ValueError(f"layer {spec.index}: no FLOP count for {spec.kind.value} layers")
    if decode or spec.kind is LayerKind.MAMBA:
        return STATE_DECODE_FLOPS[spec.kind] * elements + conv
    heads, dk, dv = rec
    if spec.kind is LayerKind.LIGHTNING:
        block = spec.mixer.block_size
        return heads * (4 * dk * dv + 2 * block * (dk + dv)) + conv
    return heads * (6 * dk * dv + 4 * DELTA_CHUNK * (dk + dv)) + conv  # GDN, KDA


def decode_attention_flops(arch: ModelArch, context: int) -> float:
    """Attention FLOPs of one decode token over ``context`` keys, summed over layers, in the form
    the backends decode: GQA 2 * heads * (d_qk + d_v) per key; MLA absorbed (one latent KV head,
    ``kv_lora_rank + rope`` wide keys, ``kv_lora_rank`` wide values) 2 * heads * (L + R + L) per
    key; DSA the same over min(context, topk) keys plus the indexer's 2 * n_heads * head_dim per
    context key where it scores; a state layer its recurrent step (``state_flops_per_token``)."""
    total = 0.0
    for s in arch.layers:
        if s.kind in (LayerKind.FULL, LayerKind.SLIDING):
            total += 2 * s.num_heads * (s.head_size + s.head_size_v) * min(context, s.window or context)
        elif s.kind is LayerKind.MLA:
            total += 2 * s.num_heads * (s.mla.latent_dim + s.mla.kv_lora_rank) * context
        elif s.kind is LayerKind.SPARSE_MLA:
            idx = s.indexer
            total += 2 * s.num_heads * (s.mla.latent_dim + s.mla.kv_lora_rank) * min(context, idx.topk)
            if idx.has_cache and context > idx.topk:
                total += 2 * idx.n_heads * idx.head_dim * context
        elif s.kind.is_state:
            total += state_flops_per_token(s, decode=True)
        else:
            raise ValueError(f"layer {s.index}: no FLOP count for {s.kind.value} layers")
    return total


def decode_flops(model: nn.Module, arch: ModelArch, batch: int, context: int) -> float:
    """FLOPs of one decode step of ``batch`` tokens: 2 * (P + H) + attention, per token."""
    per_token, head = prefill_params(model, arch)
    return batch * (2 * (per_token + head) + decode_attention_flops(arch, context))


def prefill_flops(model: nn.Module, arch: ModelArch, batch: int, context: int) -> float:
    """FLOPs of prefilling ``batch`` prompts of ``context`` tokens: b * (C * (2P + A) + 2H)."""
    per_token, head = prefill_params(model, arch)
    return batch * (context * (2 * per_token + attention_flops_per_token(arch, context)) + 2 * head)


def _row_bytes(cache) -> int:
    """Bytes of one token's row in a paged cache tensor [blocks, block_size, ...] (or a tuple)."""
    if isinstance(cache, (tuple, list)):
        return sum(_row_bytes(t) for t in cache)
    return cache[0, 0].numel() * cache.element_size()


def cache_rows(model: nn.Module) -> dict[int, dict[str, int]]:
    """Per cache-owning layer, the bytes of one token's row in each of its cache entries, read
    from the tensors the engine bound (``kv`` for K and V together, ``latent``, ``indexer``)."""
    rows: dict[int, dict[str, int]] = {}
    for m in model.modules():
        layer, cache = getattr(m, "layer_id", None), getattr(m, "kv_cache", None)
        if layer is None or cache is None:
            continue
        entries = cache if isinstance(cache, dict) else {"kv": cache}
        rows[layer] = {name: _row_bytes(t) for name, t in entries.items()}
    return rows


def state_rows(model: nn.Module) -> dict[int, dict[str, int]]:
    """Per state layer, the bytes of one sequence's slot in its ``conv`` and ``recurrent`` state
    tensors ([slots, ...] each), read from the ``StateCache`` the engine bound (``state_cache``)."""
    rows: dict[int, dict[str, int]] = {}
    for m in model.modules():
        layer, cache = getattr(m, "layer_id", None), getattr(m, "state_cache", None)
        if layer is None or cache is None:
            continue
        rows[layer] = {"conv": sum(t[0].numel() * t.element_size() for t in cache.conv),
                       "recurrent": sum(t[0].numel() * t.element_size() for t in cache.recurrent)}
    return rows


def check_rows(rows: dict[int, dict[str, int]], plan, states: dict[int, dict[str, int]] | None = None) -> None:
    """The rows read from the tensors must be the plan's bytes per token, and a state layer's
    slot its bytes per sequence (a changed layout would make the floor count something else)."""
    states = states or {}
    for e in plan.entries:
        if e.spec.policy is CachePolicy.STATE:
            got = sum(states.get(e.layer, {}).values()) if e.layer in states else None
            if got != e.spec.bytes_per_sequence:
                raise RuntimeError(f"layer {e.layer}: state slot of {got} bytes, the plan says "
                                   f"{e.spec.bytes_per_sequence}")
            continue
        got = rows.get(e.layer, {}).get(e.name)
        if got != e.spec.bytes_per_token:
            raise RuntimeError(f"layer {e.layer} {e.name}: cache row of {got} bytes, the plan says "
                               f"{e.spec.bytes_per_token}")


def decode_state_bytes(states: dict[int, dict[str, int]], batch: int) -> int:
    """State bytes one decode step of ``batch`` sequences moves: every state layer's conv and
    recurrent slot read once and written once."""
    return 2 * batch * sum(sum(r.values()) for r in states.values())


def decode_cache_bytes(arch: ModelArch, rows: dict[int, dict[str, int]], batch: int, context: int,
                       states: dict[int, dict[str, int]] | None = None) -> int:
    """Cache bytes one decode step of ``batch`` sequences of ``context`` tokens reads (paged rows),
    plus what it reads and writes of the state layers' slots (``states``, from ``state_rows``)."""
    total = 0
    for layer, r in rows.items():
        s = arch.layers[layer]
        if s.kind in (LayerKind.FULL, LayerKind.SLIDING):
            total += r["kv"] * min(context, s.window or context)
        elif s.kind is LayerKind.MLA:
            total += r["latent"] * context
        elif s.kind is LayerKind.SPARSE_MLA:
            total += r["latent"] * min(context, s.indexer.topk)
            if context > s.indexer.topk:  # else every key is selected unscored
                total += r.get("indexer", 0) * context
        else:
            raise ValueError(f"layer {layer}: no cache count for {s.kind.value} layers")
    return total * batch + decode_state_bytes(states or {}, batch)
