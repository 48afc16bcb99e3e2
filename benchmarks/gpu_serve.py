"""Serving against offline on one GPU: ``attnserve serve`` driven by ``attnserve bench serve``
with the nano-vllm request mix, then ``LLM.generate`` on the same requests in the same run.

The mix is benchmarks/gpu_engine.py's: Qwen3-0.6B shape with dummy bf16 weights, 256 requests of
random token ids, input and output lengths uniform in 100..1024, EOS ignored. The server runs at
each request rate (``inf``: all at once, the saturating one) and the client reports output
tokens/s, TTFT and inter-token latency; then the server stops and the offline engine, with the
same engine options (``ENGINE``) and the same detokenisation (text, as the server streams it),
runs the same requests. The table's last column is server over offline throughput.

The server runs once per ``--frontend``: ``process`` (the default of ``attnserve serve``: the
engine in its own process) and ``inprocess`` (``--disable-frontend-multiprocessing``: the engine
on a thread of the server). Server CPU per output token counts every process of the server:
for ``process`` the frontend's and the engine process's, shown apart too.

    python benchmarks/gpu_serve.py [--rates inf,32,16,8] [--num-clients 4] [--frontend process,inprocess] [--json out.json]
    python benchmarks/gpu_serve.py --smoke     # CPU, a tiny model, a few requests

Writes gpu_serve.json under $OUT when set. Not here: the engine-only figures (gpu_engine.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from attnserve import LLM, SamplingParams  # noqa: E402
from attnserve.presets import resolve_config_path  # noqa: E402

# the offline run's options (gpu_engine.py throughput_attnserve), passed to both: explicit batch
# limits until the platform-picked defaults land
ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 16384, "max_model_len": 4096,
          "gpu_memory_utilization": 0.85, "dtype": "bfloat16", "load_format": "dummy"}
SMOKE_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "max_model_len": 512,
                "dtype": "float32", "load_format": "dummy", "device": "cpu"}
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "bos_token_id": 4000,
        "eos_token_id": 4001}


def model_dir(smoke: bool) -> str:
    d = tempfile.mkdtemp(prefix="attnserve_serve_")
    cfg = json.loads(resolve_config_path("Qwen/Qwen3-0.6B").read_text())
    if smoke:
        cfg.update(TINY)
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """gpu_engine.py's ``workload``: (prompt ids, output length) pairs."""
    rng = random.Random(seed)
    margin = min(1000, vocab // 8)
    return [([rng.randrange(margin, vocab - margin) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def _flags(engine: dict) -> list[str]:
    return [a for k, v in engine.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Server:
    """``attnserve serve`` as a subprocess, its log in ``log_path``."""

    def __init__(self, model: str, engine: dict, log_path: Path, frontend: str = "process", timeout: float = 900.0):
        import httpx

        self.port = _free_port()
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "attnserve", "serve", model, "--port", str(self.port),
               "--served-model-name", "bench", "--uvicorn-log-level", "warning", *_flags(engine)]
        if frontend == "inprocess":
            cmd.append("--disable-frontend-multiprocessing")
        print("server:", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = Path(log_path).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the server exited ({self.proc.returncode}); {log_path} ends:\n{tail}")
            try:
                status = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                return
            if status == 503:  # the app is up (it starts after the engine) and says the engine died
                self.stop()
                tail = Path(log_path).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the server is up but its engine is not: {log_path} ends:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not come up in {timeout:.0f} s: see {log_path}")
            time.sleep(1.0)

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time so far (user + system, every thread; Linux) of the server's process and of its
        descendants (the engine process; none with ``inprocess``)."""
        stats = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            stats[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        children = {pid: ppid for pid, (ppid, _) in stats.items()}
        own, descendants, frontier = stats.get(self.proc.pid, (0, 0.0))[1], 0.0, {self.proc.pid}
        while frontier:
            frontier = {pid for pid, ppid in children.items() if ppid in frontier}
            descendants += sum(stats[pid][1] for pid in frontier)
        return own, descendants

    def bench(self, requests_file: Path, rate: float, clients: int, out: Path) -> dict:
        cpu = self.cpu_seconds()
        cmd = [sys.executable, "-m", "attnserve", "bench", "serve", "--port", str(self.port),
               "--requests-file", str(requests_file), "--request-rate", str(rate),
               "--num-clients", str(clients), "--output-json", str(out)]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT)
        r = json.loads(out.read_text())
        (front, engine), tokens = (b - a for a, b in zip(cpu, self.cpu_seconds())), max(r["total_output_tokens"], 1)
        r["server_cpu_s"], r["frontend_cpu_s"], r["engine_process_cpu_s"] = front + engine, front, engine
        r["server_cpu_us_per_token"] = r["server_cpu_s"] / tokens * 1e6
        r["frontend_cpu_us_per_token"], r["engine_process_cpu_us_per_token"] = front / tokens * 1e6, engine / tokens * 1e6
        return r

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def offline(model: str, engine: dict, reqs: list[tuple[list[int], int]], detokenize: bool) -> dict:
    import torch

    llm = LLM(model, **engine)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=detokenize)
              for _, o in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    eng = llm.llm_engine
    before = (eng.scheduler.stats.steps, eng.step_seconds, eng.runner.device_wait_seconds)
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps, step_s, wait_s = (b - a for a, b in zip(before, (eng.scheduler.stats.steps, eng.step_seconds,
                                                             eng.runner.device_wait_seconds)))
    print(f"offline (detokenize {detokenize}): {steps} steps of {step_s / max(steps, 1) * 1e3:.2f} ms, "
          f"{wait_s / max(step_s, 1e-9):.0%} of it waiting on the device", flush=True)
    del llm, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_throughput": tokens / elapsed,
            "detokenize": detokenize, "server_cpu_us_per_token": cpu / tokens * 1e6}  # this process's


def _row(name: str, r: dict, bases: list[float | None]) -> str:
    ratio = " / ".join(f"{r['output_throughput'] / b:.2f}" if b else "-" for b in bases)
    cells = [name, f"{r['output_throughput']:.0f}"]
    for m in ("ttft", "tpot", "itl"):
        cells.append(" / ".join(f"{r[f'{s}_{m}_ms']:.1f}" for s in ("mean", "median", "p99")) if f"mean_{m}_ms" in r
                     else "-")
    cpu = f"{r['server_cpu_us_per_token']:.0f}" if "server_cpu_us_per_token" in r else "-"
    if r.get("engine_process_cpu_s"):
        cpu += f" ({r['frontend_cpu_us_per_token']:.0f} + {r['engine_process_cpu_us_per_token']:.0f})"
    cells.append(cpu)
    return "| " + " | ".join([*cells, ratio]) + " |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="inf,32,16,8", help="request rates, comma-separated (inf: all at once)")
    ap.add_argument("--num-clients", type=int, default=4, help="bench client processes")
    ap.add_argument("--num-requests", type=int, default=None, help="default 256 (smoke: 24)")
    ap.add_argument("--lengths", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="input and output lengths uniform in [LO, HI] (default 100 1024; smoke: 8 48)")
    ap.add_argument("--frontend", default="process,inprocess",
                    help="the server's engine, comma-separated: process (its own process, serve's default), "
                         "inprocess (a thread of the server, --disable-frontend-multiprocessing)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few short requests")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = SMOKE_ENGINE if args.smoke else ENGINE
    n = args.num_requests or (24 if args.smoke else 256)
    lo, hi = args.lengths or ((8, 48) if args.smoke else (100, 1024))
    model = model_dir(args.smoke)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    reqs = workload(n, lo, hi, vocab)
    # the servers' logs are copied under $OUT when set (the rest stays here: few files come back)
    work = Path(tempfile.mkdtemp(prefix="attnserve_serve_run_"))
    requests_file = work / "requests.json"
    requests_file.write_text(json.dumps(reqs))
    rates = [float(r) for r in args.rates.split(",")]
    result: dict = {"engine": engine, "num_requests": n, "lengths": [lo, hi],
                    "output_tokens": sum(o for _, o in reqs), "server": {}}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a label only
        result["device"] = "unknown"
    frontends = args.frontend.split(",")
    if not frontends or set(frontends) - {"process", "inprocess"}:
        raise SystemExit(f"--frontend takes process and/or inprocess, got {args.frontend!r}")
    for frontend in frontends:
        server = Server(model, engine, work / f"server_{frontend}.log", frontend)
        try:
            warm = work / "warm.json"
            warm.write_text(json.dumps(reqs[:8]))
            server.bench(warm, math.inf, 1, work / "warm_out.json")  # compiles, graphs: not timed
            for rate in rates:
                r = server.bench(requests_file, rate, args.num_clients, work / f"{frontend}_rate_{rate}.json")
                if r["failed"]:
                    raise RuntimeError(f"{r['failed']} requests failed at rate {rate}: {r['errors']}")
                r["frontend"] = frontend
                result["server"][f"{frontend}/{rate}"] = r
                print(f"{frontend}, rate {rate}: {r['output_throughput']:.0f} tok/s, server CPU {r['server_cpu_s']:.1f} s "
                      f"({r['server_cpu_us_per_token']:.0f} us per token: frontend {r['frontend_cpu_us_per_token']:.0f}, "
                      f"engine process {r['engine_process_cpu_us_per_token']:.0f})", flush=True)
        finally:
            server.stop()
            log = (work / f"server_{frontend}.log").read_text()
            if os.environ.get("OUT"):
                shutil.copy(work / f"server_{frontend}.log", os.environ["OUT"])
            print(f"server ({frontend}) log tail:\n" + "".join(log.splitlines(True)[-15:]))
            print("".join(line for line in log.splitlines(True)[:-15] if " steps of " in line))
    if not args.skip_offline:
        result["offline"] = offline(model, engine, reqs, detokenize=True)  # as the server: text
        result["offline_token_ids"] = offline(model, engine, reqs, detokenize=False)  # gpu_engine.py's
    shutil.rmtree(model, ignore_errors=True)
    bases = [result.get(k, {}).get("output_throughput") for k in ("offline", "offline_token_ids")]
    out = os.environ.get("OUT")
    path = args.json or (os.path.join(out, "gpu_serve.json") if out else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n{result['device']}, {n} requests, lengths uniform in {lo}..{hi}, {result['output_tokens']} output "
          f"tokens; engine {engine}\n")
    print("| run | output tok/s | TTFT ms mean / p50 / p99 | TPOT ms mean / p50 / p99 | ITL ms mean / p50 / p99 "
          "| CPU us/token (server: all (frontend + engine process); or offline process) | server / offline (text / ids) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for key, r in result["server"].items():
        frontend, rate = key.split("/")
        print(_row(f"server ({frontend}), rate {rate}", r, bases))
    for key, label in (("offline", "offline (text)"), ("offline_token_ids", "offline (token ids only)")):
        if key in result:
            print(_row(label, result[key], [None]))
    for key, r in result["server"].items():
        if r["total_output_tokens"] != result["output_tokens"]:
            print(f"warning: {key} returned {r['total_output_tokens']} tokens, expected {result['output_tokens']}")


if __name__ == "__main__":
    main()
