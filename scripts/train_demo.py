"""Train the demo models that ship with attnserve: one small causal LM in three attention variants.

The corpus is the Python standard library's own source (every Python installation ships it,
under the PSF license), split by file into train and held-out sets. A byte-level BPE tokenizer
is trained on the train split; then the same architecture is trained three times, differing
only in attention: GQA (``llama``), MLA (``deepseek_v3``, dense MLP) and DSA (``deepseek_v32``:
MLA with a lightning indexer whose small top-k keeps sparsity active at the demo's lengths).
Everything is seeded. The output directories are Hugging Face format (``config.json``,
``model.safetensors``, ``tokenizer.json``) that transformers loads too.

    python scripts/train_demo.py --out src/attnserve/presets/models [--minutes 10] [--device cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

VOCAB = 4096
SEQ = 256
SPECIALS = ["<|endoftext|>"]


def corpus(stdlib: str | None = None, held_out_share: float = 0.05, val_share: float = 0.03
           ) -> tuple[list[str], list[str], list[str]]:
    """The stdlib's .py files, split by a hash of their path (stable across machines) into train,
    validation (early stopping) and held-out (the reported perplexity) files."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    train, val, held = [], [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "test" in rel.split("/")[0] or "site-packages" in rel or "/tests/" in rel or "idlelib" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 1000
        if bucket < held_out_share * 1000:
            held.append(text)
        elif bucket < (held_out_share + val_share) * 1000:
            val.append(text)
        else:
            train.append(text)
    return train, val, held


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0], "pad_token": SPECIALS[0],
        "bos_token": None, "model_max_length": 2048,
        "added_tokens_decoder": {str(tok.token_to_id(SPECIALS[0])): {
            "content": SPECIALS[0], "special": True, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False}},
    }, indent=2) + "\n")
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(SPECIALS[0])
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
              num_attention_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, rope_theta=10000.0)
MLA = dict(num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
           first_k_dense_replace=6, n_group=1, topk_group=1)
VARIANTS = {
    "attnserve-demo-gqa": ("llama", dict(COMMON, num_key_value_heads=2)),
    "attnserve-demo-mla": ("deepseek_v3", dict(COMMON, **MLA)),
    "attnserve-demo-dsa": ("deepseek_v32", dict(COMMON, **MLA, index_n_heads=16, index_head_dim=32, index_topk=64)),
    # Not shipped: trained by benchmarks/gpu_hybrid_drift.py to show what bf16 greedy agreement means on a
    # hybrid model that has learnt something. Qwen3-Next's layer (Gated DeltaNet, 3 of every 4 layers; gated
    # full attention) with a dense MLP on every layer.
    "attnserve-demo-gdn": ("qwen3_next", dict(COMMON, num_hidden_layers=8, num_key_value_heads=2, head_dim=32,
                                              linear_num_key_heads=4, linear_num_value_heads=8,
                                              linear_key_head_dim=32, linear_value_head_dim=32,
                                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                                              mlp_only_layers=list(range(8)))),
}


class IndexerDistillation:
    """Trains the DSA lightning indexer the way DeepSeek-V3.2 does (section 2.1 of its report).

    transformers computes the indexer under ``no_grad`` (it serves checkpoints, it does not train
    them), so a model trained through it keeps a random indexer and its top-k picks noise. Here
    the indexer's scores are recomputed with gradients from detached inputs, and a KL loss pulls
    their softmax towards the main attention's dense distribution (summed over heads, then
    renormalised); the target is detached, so the indexer learns only from this loss and the
    language-model loss never flows into it. During ``dense_until`` the main attention ignores
    the top-k mask (DeepSeek's dense warm-up); after it, the model trains under sparsity.
    """

    def __init__(self):
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

        self.m, self.dense = m, True
        self.scores: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        outer = self

        def indexer_forward(ix, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs):
            b, s, _ = hidden_states.shape
            q = ix.wq_b(q_resid.detach()).view(b, s, ix.n_heads, ix.head_dim)
            k = ix.k_norm(ix.wk(hidden_states.detach())).unsqueeze(2)
            r = ix.qk_rope_head_dim
            q_rot, k_rot = m.apply_rotary_pos_emb(q[..., :r], k[..., :r], *position_embeddings, unsqueeze_dim=2)
            q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
            scores = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * ix.softmax_scale)
            weights = ix.weights_proj(hidden_states.detach()).float() * ix.n_heads ** -0.5
            index = _masked(torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2), attention_mask)
            ix._demo_causal = attention_mask
            if torch.is_grad_enabled():
                outer.scores.append(index)
            return index.detach().topk(min(ix.index_topk, s), dim=-1).indices.to(torch.int32)

        def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            raw = torch.matmul(query, key.transpose(2, 3)).float() * scaling
            dense = torch.softmax(_masked(raw, module.indexer._demo_causal.unsqueeze(1)), dim=-1)
            if torch.is_grad_enabled():
                outer.targets.append(dense.detach().sum(1) / dense.shape[1])
            probs = dense if outer.dense else torch.softmax(_masked(raw, attention_mask), dim=-1)
            out = torch.matmul(probs.to(value.dtype), value).transpose(1, 2).contiguous()
            return out, None

        m.DeepseekV32Indexer.forward = indexer_forward
        m.eager_attention_forward = attention

    def loss(self) -> torch.Tensor:
        """Mean over layers and positions of KL(attention || softmax(indexer scores))."""
        total = 0.0
        for index, target in zip(self.scores, self.targets, strict=True):
            logp = torch.log_softmax(index, dim=-1)
            ce = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logp), 0.0)
            total = total + ce.sum(-1).mean()
        n = len(self.scores)
        self.scores, self.targets = [], []
        return total / max(n, 1)


def _masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def build(model_type: str, kwargs: dict, seed: int):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = CONFIG_MAPPING[model_type](**kwargs)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)


@torch.no_grad()
def perplexity(model, data: torch.Tensor, device, batches: int = 16, batch: int = 8) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=g)
        x = torch.stack([data[s: s + SEQ] for s in starts]).to(device)
        losses.append(model(x, labels=x).loss.item())
    model.train()
    return math.exp(sum(losses) / len(losses))


def train_one(name: str, data: dict[str, torch.Tensor], out: Path, args) -> dict:
    model_type, kwargs = VARIANTS[name]
    device = torch.device(args.device)
    distill = IndexerDistillation() if model_type == "deepseek_v32" else None
    model = build(model_type, kwargs, args.seed).to(device)
    params = sum(p.numel() for p in model.parameters())
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    main_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed)
    start, step, tokens = time.time(), 0, 0
    budget = args.minutes * 60
    best, best_state, next_eval, history = float("inf"), None, budget / args.evals, []
    train = data["train"]
    model.train()
    while time.time() - start < budget and step < args.max_steps:
        frac = (time.time() - start) / budget
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * max(0.0, 1 - frac))
        for group in opt.param_groups:
            group["lr"] = lr
        if distill is not None:
            distill.dense = frac < args.dense_warmup
        starts = torch.randint(0, len(train) - SEQ - 1, (args.batch,), generator=g)
        x = torch.stack([train[s: s + SEQ] for s in starts]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x, labels=x).loss
            kl = distill.loss() if distill is not None else torch.zeros((), device=device)
        opt.zero_grad(set_to_none=True)
        (loss + kl).backward()
        torch.nn.utils.clip_grad_norm_(main_params, 1.0)
        if indexer:
            torch.nn.utils.clip_grad_norm_(indexer, 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 100 == 0:
            print(f"{name} step {step} loss {loss.item():.3f} indexer-kl {kl.item():.3f} "
                  f"({tokens / (time.time() - start):.0f} tok/s)", flush=True)
        if time.time() - start >= next_eval or time.time() - start >= budget:
            next_eval += budget / args.evals
            if distill is not None and distill.dense:
                continue  # select only among checkpoints trained under sparsity
            val = perplexity(model, data["val"], device)
            history.append((step, round(val, 2)))
            print(f"{name} step {step} validation perplexity {val:.2f}", flush=True)
            if val < best:
                best, best_state = val, {k: v.detach().clone() for k, v in model.state_dict().items()}
    elapsed = time.time() - start
    if best_state is not None:
        model.load_state_dict(best_state)
    ppl = perplexity(model, data["held"], device)
    target = out / name
    model = model.to("cpu", torch.float32)
    model.save_pretrained(target)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (target / f).write_bytes((out / "_tokenizer" / f).read_bytes())
    info = {"variant": name, "model_type": model_type, "parameters": params, "steps": step, "tokens": tokens,
            "train_seconds": round(elapsed, 1), "device": str(device), "held_out_perplexity": round(ppl, 2),
            "validation_history": history, "seed": args.seed, "seq_len": SEQ, "batch": args.batch,
            "python_stdlib": data["stdlib"]}
    if distill is not None:
        info["indexer_training"] = f"KL distillation, dense warm-up {args.dense_warmup:.0%} of the time"
    (target / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(info, flush=True)
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "src/attnserve/presets/models"))
    ap.add_argument("--minutes", type=float, default=10.0, help="training time per variant")
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=None, help="default 64 on CUDA, 16 on CPU")
    ap.add_argument("--evals", type=int, default=10, help="validation checks per variant (best one kept)")
    ap.add_argument("--dense-warmup", type=float, default=0.1, help="DSA: share of the time without top-k")
    ap.add_argument("--stdlib", default=None, help="the standard library to read (default: this Python's)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", nargs="*", default=[v for v in VARIANTS if v != "attnserve-demo-gdn"])
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    if args.batch is None:
        args.batch = 64 if args.device.startswith("cuda") else 16
    train_texts, val_texts, held_texts = corpus(args.stdlib)
    tok = train_tokenizer(train_texts, out / "_tokenizer")
    data = {"train": encode(tok, train_texts), "val": encode(tok, val_texts), "held": encode(tok, held_texts),
            "stdlib": Path(args.stdlib or sysconfig.get_paths()["stdlib"]).name}
    (out / "_tokenizer" / "held_out.txt").write_text("\n\n".join(held_texts)[:200_000])
    print(f"corpus: {len(data['train']):,} train, {len(data['val']):,} validation, "
          f"{len(data['held']):,} held-out tokens", flush=True)
    for name in args.variants:
        train_one(name, data, out, args)


if __name__ == "__main__":
    main()
