"""GPU benchmark of KV cache offloading to the host tier: the copy path, and time to first token
of a returning long prompt.

1. Checks first. The tier's copy path (``runner/offload_io.py`` into a pinned ``HostTier``) moves
   random bf16 blocks out and back into other block ids bit for bit, in several chunks; and an
   engine whose returning prompt comes back from the host tier gives exactly the first token and
   top-5 logprobs of the same engine serving that prefix from the device cache.
2. Copy throughput, Llama-3.1-8B cache shape (32 layers, 8 KV heads, head 128, block 16, bf16:
   2 MiB a block over all layers), batches of 1, 16 and 256 blocks: device->host (store: gather
   on the side stream, one copy per run of tier slots, tier bookkeeping) and host->device (load),
   each in GB/s and as a share of the ceiling, one ``copy_`` of a contiguous pinned buffer of the
   same size.
3. Time to first token of a returning prompt of 8K and 32K tokens (Llama-3.1-8B shape, dummy
   weights, eager): served from the device prefix cache; after other prompts flushed the device
   cache, loaded back from the host tier; and, without a tier, recomputed.

    python benchmarks/gpu_offload.py [--budget-s 200] [--smoke]

``--smoke`` runs everything on CPU at toy sizes (the script's own test). Prints a short table
last; writes ``$OUT/gpu_offload.json`` when ``OUT`` is set. Correctness of offloading itself is
``tests/unit/test_offload.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.kvcache.groups import CacheEntry, KVCacheGroup  # noqa: E402
from attnserve.kvcache.offload import HostTier, OffloadManager  # noqa: E402
from attnserve.kvcache.spec import FullAttentionSpec  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402
from attnserve.runner.offload_io import OffloadIO  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    device: str
    layers: int
    kv_heads: int
    head: int
    block: int
    batches: tuple[int, ...]
    model: str  # preset whose config.json the TTFT engine uses, with dummy weights
    dtype: str
    prompts: tuple[int, ...]  # returning prompt lengths
    chunk: int  # max_num_batched_tokens


FULL = Sizes("cuda", 32, 8, 128, 16, (1, 16, 256), "meta-llama/Llama-3.1-8B-Instruct", "bfloat16",
             (8192, 32768), 8192)
SMOKE = Sizes("cpu", 2, 2, 16, 4, (1, 4, 16), "attnserve-tiny-llama", "float32", (64, 256), 64)
SUFFIX = 16  # new tokens after the returning prefix


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the copy path


class CopyRig:
    """One full-attention group of ``layers`` layers over a random cache, a host tier, a manager."""

    def __init__(self, z: Sizes, num_blocks: int, tier_blocks: int):
        self.z, self.device = z, torch.device(z.device)
        spec = FullAttentionSpec(block_size=z.block, dtype="bfloat16", num_kv_heads=z.kv_heads, head_size=z.head,
                                 head_size_v=z.head)
        group = KVCacheGroup(0, "full", None, tuple(CacheEntry(i, "kv", spec) for i in range(z.layers)))
        shape = (num_blocks, z.block, z.kv_heads, z.head)
        self.caches = {(i, "kv"): (torch.randn(shape, dtype=torch.bfloat16, device=self.device),
                                   torch.randn(shape, dtype=torch.bfloat16, device=self.device))
                       for i in range(z.layers)}
        self.io = OffloadIO([group], self.caches, [], self.device)
        self.blob = self.io.block_bytes(0)
        self.tier = HostTier(tier_blocks, self.blob, pin_memory=z.device == "cuda")
        self.manager = OffloadManager(self.tier, 1, z.block, has_state=False)
        self._n = 0

    def store(self, block_ids: list[int]) -> tuple[list[tuple], float]:
        """Store the blocks under fresh hashes; returns (hashes, seconds to complete)."""
        self._n += 1
        hashes = [("bench", self._n, j) for j in range(len(block_ids))]
        self.manager.prepare_store(f"s{self._n}", hashes, [block_ids], len(block_ids) * self.z.block)
        self.manager.forget(f"s{self._n}")
        return hashes, self._run()

    def load(self, hashes: list[tuple], block_ids: list[int]) -> float:
        hit = self.manager.lookup(hashes, 0, len(hashes))
        assert hit.num_blocks == len(hashes), "the tier lost blocks"
        self.manager.prepare_load("load", hit, [block_ids], 0, 0)
        return self._run()

    def _run(self) -> float:
        stores, loads = self.manager.take_jobs()
        sync(self.z.device)
        start = time.perf_counter()
        self.io.run(self.manager, stores, loads)
        self.io.poll(self.manager, wait=True)
        sync(self.z.device)
        return time.perf_counter() - start


def check_copy_path(z: Sizes) -> dict:
    """Blocks out to the tier and back into other ids (shuffled, several chunks): bit-exact."""
    n = 40
    rig = CopyRig(z, 2 * n + 1, n)
    rig.io.chunk_bytes = 16 * rig.blob  # three chunks each way
    ids = list(range(1, n + 1))
    random.Random(0).shuffle(ids)
    hashes, _ = rig.store(ids)
    rig.load(hashes, [b + n for b in ids])
    bad = sum(not torch.equal(t[b], t[b + n]) for k, v in rig.caches.values() for t in (k, v) for b in ids)
    return {"case": "copy_path_round_trip", "blocks": n, "ok": bad == 0, "mismatched_pages": bad}


def ceiling(nbytes: int, device: str, to_host: bool, reps: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_copies(z: Sizes) -> list[dict]:
    top = max(z.batches)
    rig = CopyRig(z, 2 * top + 1, 2 * top)  # the tier evicts older rounds as it goes
    rows = []
    for n in z.batches:
        reps = max(3, min(50, 1024 // n))
        src = list(range(1, n + 1))
        dst = list(range(top + 1, top + n + 1))
        store_s, load_s = [], []
        for rep in range(reps + 1):  # the first round is a warm-up
            hashes, secs = rig.store(src)
            store_s += [secs] if rep else []
            load_s += [rig.load(hashes, dst)] if rep else []
        store_s, load_s = statistics.median(store_s), statistics.median(load_s)
        nbytes = n * rig.blob
        for direction, secs in (("store d2h", store_s), ("load h2d", load_s)):
            ceil_s = ceiling(nbytes, z.device, direction.startswith("store"), reps)
            rows.append({"direction": direction, "blocks": n, "bytes": nbytes, "seconds": secs,
                         "gbps": nbytes / secs / 1e9, "ceiling_gbps": nbytes / ceil_s / 1e9,
                         "of_ceiling": ceil_s / secs})
            print(json.dumps(rows[-1]), flush=True)
    del rig
    gc.collect()
    if z.device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- time to first token


def model_dir(name: str) -> str:
    d = tempfile.mkdtemp(prefix="attnserve_offload_")
    shutil.copy(resolve_config_path(name), Path(d) / "config.json")
    return d


def tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 2000), k=n)


def first_token(llm: LLM, prompt: list[int], device: str) -> tuple[float, object]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    sync(device)
    start = time.perf_counter()
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, out


def answer(out) -> tuple:
    lp = out.outputs[0].logprobs[0]
    return tuple(out.outputs[0].token_ids), tuple(sorted((t, v.logprob) for t, v in lp.items()))


def bench_ttft(z: Sizes, tier: bool, deadline: float) -> tuple[list[dict], list[dict]]:
    """Per prompt length: cold, device hit, then (after a flush) tier hit or recompute."""
    top = max(z.prompts)
    blocks = (top + top // 4) // z.block  # the device cache holds 1.25 of the longest prompt
    flush = [tokens(top // 2, 1000 + i) for i in range(3)]  # 1.5 of it: every earlier block goes
    path = model_dir(z.model)
    cfg = json.loads((Path(path) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * (2 if z.dtype == "bfloat16" else 4)
    # the tier outlasts a flush: the returning prompt, the flush, and a tenth to spare
    tier_gib = 1.1 * (top + SUFFIX + top // 2 * len(flush)) * token_bytes / 1024**3
    kw = dict(load_format="dummy", dtype=z.dtype, max_model_len=top + 2 * SUFFIX, enforce_eager=True,
              max_num_seqs=4, max_num_batched_tokens=z.chunk, num_gpu_blocks_override=blocks + 1,
              device=z.device, block_size=z.block)
    if tier:
        kw.update(kv_offloading_size=tier_gib, kv_offloading_backend="host")
    llm = LLM(path, **kw)
    first_token(llm, tokens(z.chunk // 2, 7), z.device)  # warm-up: kernels compiled
    stats = llm.llm_engine.scheduler.stats
    rows, checks = [], []
    for length in z.prompts:
        if time.perf_counter() > deadline:
            rows.append({"tier": tier, "prompt": length, "skipped": "time budget"})
            continue
        prompt = tokens(length, length)
        returning = prompt + tokens(SUFFIX, length + 1)
        hit = (length + SUFFIX - 1) // z.block * z.block  # the last token is always computed
        cold_s, _ = first_token(llm, prompt, z.device)
        first_token(llm, returning, z.device)  # its suffix blocks are cached too now
        hit_s, device_hit = first_token(llm, returning, z.device)
        assert device_hit.num_cached_tokens == hit, "the prefix did not stay on the device"
        for f in flush:
            first_token(llm, f, z.device)
        before = stats.offload_hit_tokens
        back_s, back = first_token(llm, returning, z.device)
        from_tier = stats.offload_hit_tokens - before
        # num_cached_tokens counts device and tier hits alike (as vLLM's)
        assert back.num_cached_tokens == from_tier, "the flush left prefix blocks on the device"
        rows.append({"tier": tier, "prompt": length, "cold_s": cold_s, "device_hit_s": hit_s,
                     ("tier_hit_s" if tier else "recompute_s"): back_s, "tier_hit_tokens": from_tier})
        if tier:  # the same blocks, the same suffix forward: bit for bit the device hit's answer
            checks.append({"case": f"tier_hit_{length}", "ok": from_tier == hit and answer(back) == answer(device_hit),
                           "tier_hit_tokens": from_tier, "expected": hit})
        print(json.dumps(rows[-1]), flush=True)
    if tier:
        s = llm.llm_engine.runner.offload.stats
        rows.append({"tier": True, "offload_stats": {"bytes_stored": s.bytes_stored, "bytes_loaded": s.bytes_loaded,
                                                     "store_s": s.store_seconds, "load_s": s.load_seconds}})
    del llm
    gc.collect()
    if z.device == "cuda":
        torch.cuda.empty_cache()
    return rows, checks


# ----------------------------------------------------------------------------- report


def print_tables(checks: list[dict], copies: list[dict], ttft: list[dict]) -> None:
    print("\nchecks: " + "  ".join(f"{c['case']}={'ok' if c['ok'] else 'FAIL'}" for c in checks))
    print("\ncopy path (bf16 blocks over all layers); ceiling = one copy_ of a contiguous pinned buffer")
    print(f"{'direction':>10} {'blocks':>6} {'MiB':>8} {'ms':>8} {'GB/s':>7} {'ceil GB/s':>9} {'of ceil':>7}")
    for r in copies:
        print(f"{r['direction']:>10} {r['blocks']:>6} {r['bytes'] / 2**20:>8.1f} {r['seconds'] * 1e3:>8.2f} "
              f"{r['gbps']:>7.1f} {r['ceiling_gbps']:>9.1f} {r['of_ceiling']:>7.0%}")
    print("\ntime to first token of a returning prompt (ms)")
    print(f"{'prompt':>7} {'cold':>9} {'device hit':>10} {'host tier':>10} {'recompute':>10} {'speed-up':>8}")
    by_len: dict[int, dict] = {}
    for r in ttft:
        if "prompt" in r and "skipped" not in r:
            by_len.setdefault(r["prompt"], {}).update(r)
    for length, r in sorted(by_len.items()):
        tier, rec = r.get("tier_hit_s"), r.get("recompute_s")
        ms = lambda v: f"{v * 1e3:.1f}" if v else "-"  # noqa: E731
        speed = f"{rec / tier:.1f}x" if tier and rec else "-"
        print(f"{length:>7} {ms(r.get('cold_s')):>9} {ms(r.get('device_hit_s')):>10} {ms(tier):>10} "
              f"{ms(rec):>10} {speed:>8}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="start no new measurement after this (the one running finishes: ~4 min in all)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU: tests the script")
    args = ap.parse_args()
    z = SMOKE if args.smoke else FULL
    if z.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    start = time.perf_counter()
    deadline = start + args.budget_s
    torch.manual_seed(0)
    checks = [check_copy_path(z)]
    print(json.dumps(checks[0]), flush=True)
    copies = bench_copies(z)
    ttft: list[dict] = []
    for tier in (True, False):
        if time.perf_counter() > deadline:
            ttft.append({"tier": tier, "skipped": "time budget"})
            continue
        rows, more = bench_ttft(z, tier, deadline)
        ttft += rows
        checks += more
    result = {"device": torch.cuda.get_device_name() if z.device == "cuda" else "cpu", "torch": torch.__version__,
              "sizes": z.__dict__, "checks": checks, "copies": copies, "ttft": ttft,
              "wall_s": time.perf_counter() - start}
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_offload.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    print_tables(checks, copies, ttft)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
