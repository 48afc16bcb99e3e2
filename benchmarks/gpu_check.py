"""The CUDA path against transformers on the GPU: every implemented family, float32 and bf16.

For each family: a tiny random model (the CPU parity configs), transformers' eager forward and
greedy generation on the GPU as the reference, and attnserve on the GPU (TRITON_ATTN with CUDA
graphs; MLA families on their own backend). float32 must agree within 1e-4 in prompt logprobs
with identical greedy tokens; bf16 is reported (max logprob deviation, greedy agreement), since
bf16 rounding moves logits by about 1e-2, next to transformers' own bf16 run against its float32
one (families with discrete choices, MoE routing or DSA's top-k, flip some of them under bf16).
Also checks that CUDA-graph decode equals eager decode.

    python benchmarks/gpu_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.models.parity import VOCAB, make_prompts  # noqa: E402
from tests.models.test_parity_alibi import FAMILIES as ALIBI_FAMILIES  # noqa: E402
from tests.models.test_parity_classic import FAMILIES as CLASSIC_FAMILIES  # noqa: E402
from tests.models.test_parity_dsa import FAMILIES as DSA_FAMILIES  # noqa: E402
from tests.models.test_parity_gemma import FAMILIES as GEMMA_FAMILIES  # noqa: E402
from tests.models.test_parity_hybrid import HYBRID as HYBRID_FAMILIES  # noqa: E402
from tests.models.test_standard_parity import FAMILIES as STANDARD_FAMILIES  # noqa: E402

DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama3_gqa": ("llama", dict(DENSE, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 32})),
    "qwen3": ("qwen3", dict(DENSE, head_dim=32)),
    "mistral_window": ("mistral", dict(DENSE, sliding_window=8)),
    "phi3": ("phi3", dict(DENSE, num_key_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "starcoder2": ("starcoder2", dict(DENSE, sliding_window=8, bos_token_id=1, eos_token_id=2,
                                      residual_dropout=0.0, embedding_dropout=0.0)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
                          eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)),
    "falcon_gqa": ("falcon", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, alibi=False,
                                  bias=False, bos_token_id=1, eos_token_id=2)),
    "bloom_alibi": ("bloom", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1,
                                  eos_token_id=2, tie_word_embeddings=False)),
    "gemma2": ("gemma2", dict(DENSE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0)),
    "mixtral": ("mixtral", dict(DENSE, num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64})),
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
                                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                        first_k_dense_replace=1, q_lora_rank=32, n_group=2, topk_group=1)),
}
# 128 heads, kv_lora_rank 64, rope 16: the TMA decode kernel's shape class (64 heads a program,
# two 32-column value halves, whole 64-row pages) at a tiny width
FAMILIES["deepseek_v3_h128"] = ("deepseek_v3", dict(FAMILIES["deepseek_v3"][1], num_attention_heads=128,
                                                    num_key_value_heads=128, kv_lora_rank=64,
                                                    qk_rope_head_dim=16))
# the shapes the Gluon kernels take on Hopper (bf16 only; float32 runs the Triton ones): head 128
# at 4 query heads per KV head (causal prefill, ops/attention/prefill_gluon.py) and DeepSeek's real latent
# width, rank 512 + rope 64 at 128 heads (MLA decode, ops/mla/decode_gluon.py)
FAMILIES["llama_h128"] = ("llama", dict(DENSE, num_attention_heads=8, num_key_value_heads=2, head_dim=128))
FAMILIES["deepseek_v3_r512"] = ("deepseek_v3", dict(FAMILIES["deepseek_v3"][1], num_attention_heads=128,
                                                    num_key_value_heads=128, kv_lora_rank=512,
                                                    qk_rope_head_dim=64))
# the sparse-MLA (DSA) and hybrid families of their CPU parity tests
FAMILIES.update({f"dsa_{k}": v for k, v in DSA_FAMILIES.items()})
# DeepSeek-V3.2 at the real latent width and 128 heads: the sparse Gluon kernel's class (the
# indexer head must hold the 64 rope dimensions)
FAMILIES["dsa_v32_r512"] = ("deepseek_v32", dict(DSA_FAMILIES["v32"][1], num_attention_heads=128,
                                                 num_key_value_heads=128, kv_lora_rank=512,
                                                 qk_rope_head_dim=64, index_head_dim=128))
FAMILIES["qwen3_next"] = HYBRID_FAMILIES["qwen3_next"]
FAMILIES["qwen3_5"] = HYBRID_FAMILIES["qwen3_5"]
FAMILIES["qwen3_5_moe"] = HYBRID_FAMILIES["qwen3_5_moe"]
FAMILIES["kimi_linear"] = HYBRID_FAMILIES["kimi_linear"]
FAMILIES["jamba"] = HYBRID_FAMILIES["jamba"]
FAMILIES["minimax"] = HYBRID_FAMILIES["minimax"]
# the rest of the standard families, with their CPU parity configs (falcon's ALiBi variant is
# left out: transformers' eager path is not its reference, see test_parity_alibi.py)
FAMILIES["qwen2"] = STANDARD_FAMILIES["qwen2"]
FAMILIES["gemma"] = GEMMA_FAMILIES["gemma"]
FAMILIES["gemma3_text"] = GEMMA_FAMILIES["gemma3_text"]
FAMILIES["bigcode_mqa"] = CLASSIC_FAMILIES["bigcode_mqa"]
FAMILIES["mpt_clip_qkv"] = ALIBI_FAMILIES["mpt_6h"]
LENGTHS = [5, 12, 19, 27, 40, 64]
MODES = (("graphs", {}), ("eager", {"enforce_eager": True}),
         ("chunked", {"max_num_batched_tokens": 16, "enforce_eager": True}))
NEW = 16
# the state mechanism of each hybrid family: ``--state-backend torch|triton`` runs its state
# layers on TORCH_<kind> or TRITON_<kind> (its attention layers on the platform's first)
STATE_KINDS = {"qwen3_next": "GDN", "qwen3_5": "GDN", "qwen3_5_moe": "GDN", "kimi_linear": "KDA", "jamba": "MAMBA",
               "minimax": "LIGHTNING"}


@torch.no_grad()
def reference(model, prompts):
    dev = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    plp, greedy = [], []
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        plp.append(torch.log_softmax(model(ids).logits[0].float()[:-1], -1).cpu())
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)
        greedy.append(gen[0, len(p):].tolist())
    return plp, greedy


def compare(outs, prompts, plp, greedy):
    worst, agree = 0.0, 0
    for i, o in enumerate(outs):
        agree += o.outputs[0].token_ids == greedy[i]
        for pos in range(1, len(prompts[i])):
            tok = prompts[i][pos]
            worst = max(worst, abs(o.prompt_logprobs[pos][tok].logprob - plp[i][pos - 1, tok].item()))
    return worst, agree / len(outs)


def check_family(name: str, dtype: str, device: str = "cuda", backend: str | None = None,
                 state_backend: str | None = None, block_size: int | None = 16,
                 kv_cache_dtype: str = "auto") -> dict:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from attnserve import LLM, SamplingParams

    model_type, kwargs = FAMILIES[name]
    tdtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        cfg = CONFIG_MAPPING[model_type](**{"initializer_range": 0.1, **kwargs})
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        hf.save_pretrained(d)
        prompts = make_prompts(LENGTHS)
        baseline = None
        if tdtype != torch.float32:  # how far transformers' own low-precision run is from float32
            plp32, greedy32 = reference(hf.to(device), prompts)
        hf = hf.to(device, tdtype)
        plp, greedy = reference(hf, prompts)
        if tdtype != torch.float32:
            baseline = {"max_dlogprob": max((a - b).abs().max().item() for a, b in zip(plp, plp32)),
                        "greedy_agree": sum(g == h for g, h in zip(greedy, greedy32)) / len(greedy)}
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=1)
        row = {"family": name, "dtype": dtype, "hf_vs_fp32": baseline, "kv_cache_dtype": kv_cache_dtype}
        if state_backend and name in STATE_KINDS:
            backend = f"{state_backend.upper()}_{STATE_KINDS[name]}"
        for mode, extra in MODES:
            if backend:
                extra = dict(extra, attention_backend=backend)
            llm = LLM(d, dtype=dtype, device=device, block_size=block_size, max_model_len=256, max_num_seqs=8,
                      kv_cache_dtype=kv_cache_dtype, **extra)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            worst, agree = compare(outs, prompts, plp, greedy)
            row[mode] = {"max_dlogprob": worst, "greedy_agree": agree, "backends": llm.llm_engine.parts.backend_names,
                         "block_size": llm.llm_engine.config.cache.block_size,
                         "graphs": llm.llm_engine.runner.graphs is not None}
            row.setdefault("tokens", {})[mode] = [o.outputs[0].token_ids for o in outs]
            del llm
            if device == "cuda":
                torch.cuda.empty_cache()
        row["graphs_equal_eager"] = row["tokens"]["graphs"] == row["tokens"]["eager"]
        del row["tokens"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--attention-backend", default=None,
                    help="force a backend (on CPU: TRITON_ATTN runs under TRITON_INTERPRET=1)")
    ap.add_argument("--state-backend", choices=("torch", "triton"), default=None,
                    help="the hybrid families' state layers on TORCH_<kind> or TRITON_<kind> (replaces "
                         "--attention-backend for them; default: the platform's first)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the engine's KV cache dtype (fp8: the 656-byte MLA rows and fp8 indexer keys)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV block; 0: the engine's default (64 for MLA models on CUDA)")
    args = ap.parse_args()
    rows = []
    start = time.time()
    for name in args.only or FAMILIES:
        for dtype in args.dtypes:
            if time.time() - start > args.budget_s:
                print(f"budget spent: {name} {dtype} not run", flush=True)
                continue
            try:
                rows.append(check_family(name, dtype, args.device, args.attention_backend, args.state_backend,
                                         args.block_size or None, args.kv_cache_dtype))
                print(json.dumps(rows[-1]), flush=True)
            except Exception as e:  # one family failing must not hide the others
                rows.append({"family": name, "dtype": dtype, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-2000:]})
                print(rows[-1]["trace"], file=sys.stderr)
    out = os.environ.get("OUT")
    path = args.json or (os.path.join(out, "gpu_check.json") if out else None)
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"\nCUDA parity against transformers ({time.time() - start:.0f} s); dlogprob = max |prompt logprob "
          f"difference|, agree = share of prompts whose {NEW} greedy tokens are identical")
    print(f"{'family':<18}{'dtype':<10}{'backend':<28}{'graphs dlp/agree':>20}{'eager dlp/agree':>20}"
          f"{'chunked dlp/agree':>20}  graphs==eager  [transformers itself vs fp32]")
    for r in rows:
        if "error" in r:
            print(f"{r['family']:<18}{r['dtype']:<10}ERROR {r['error'][:90]}")
            continue
        cells = [f"{r[m]['max_dlogprob']:.1e}/{r[m]['greedy_agree']:.2f}" for m in ("graphs", "eager", "chunked")]
        backend = ",".join(sorted(set(r["graphs"]["backends"])))
        if r.get("kv_cache_dtype", "auto") != "auto":
            backend += f" kv {r['kv_cache_dtype']}"
        print(f"{r['family']:<18}{r['dtype']:<10}{backend:<28}{cells[0]:>20}{cells[1]:>20}{cells[2]:>20}  "
              f"{r['graphs_equal_eager']} (graphs {'on' if r['graphs']['graphs'] else 'off'})"
              + (f"  [{r['hf_vs_fp32']['max_dlogprob']:.1e}/{r['hf_vs_fp32']['greedy_agree']:.2f}]"
                 if r.get("hf_vs_fp32") else ""))


if __name__ == "__main__":
    main()
