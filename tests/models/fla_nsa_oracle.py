"""The NSA oracle: fla-org's own ``NSAForCausalLM`` (flash-linear-attention 0.6.0) on CPU, in a
worker process.

``FlaOracle`` starts this file as a subprocess and sends it one JSON request per line, so
that fla (which registers its own ``mamba``/``mamba2``/``bitnet`` configs with transformers
when imported) and the Triton interpreter shims below never touch the pytest process.
Requests:

- ``build``: an ``NSAConfig`` from the given keys, seeded random weights (matrices ~ N(0, std),
  norm weights 1 + N(0, 0.1), biases N(0, 0.1)), saved with ``save_pretrained`` (config.json +
  model.safetensors) where attnserve will load it;
- ``logprobs``: fla's forward over whole sequences (batch 1, no cache), ``log_softmax`` of the
  logits at every position, saved with ``torch.save`` to the given file.

How fla's attention runs (``kernels``):
- true: fla's real path, ``parallel_nsa`` (its Triton kernels), through Triton's interpreter,
  with two shims that leave the arithmetic alone: the autotuner runs the first config instead of
  timing them (the interpreter has no benchmarker), and a 1-element block converts to an index
  (numpy 2 refuses ``int()`` of a 1-d array, which the interpreter relies on). About 0.1 s per
  token, layer and KV head.
- false: fla's pure-PyTorch reference ``fla.ops.nsa.naive.naive_nsa`` (its compression, top-k
  and selection functions) in place of ``parallel_nsa``. The two agree when ``block_counts`` is
  a power of two (``parallel_nsa`` rounds it up, ``naive_nsa`` does not).
Both call ``flash_attn_func`` for the sliding window; flash-attn has no CPU build, so a dense
masked attention with flash-attn's ``causal=True, window_size=(w - 1, 0)`` meaning (bottom-right
aligned) stands in for it. The worker runs torch on one thread: its ops are small, and threads
would only contend with the test process (10x slower on two busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from importlib import metadata
from pathlib import Path

import torch


def _interpreter_shims() -> None:
    import triton.runtime.interpreter as interpreter
    from triton.runtime.autotuner import Autotuner

    Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


def window_attention(q, k, v, causal=True, window_size=(-1, 0)):
    """flash_attn_func(q, k, v, causal=True, window_size=(left, 0)) for [B, T, H, D] inputs (the
    call fla 0.6.0 makes: no other argument, so the scale is flash-attn's default D^-0.5)."""
    assert causal and window_size[1] == 0
    tq, tk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2).float() for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * q.shape[-1] ** -0.5
    qpos = torch.arange(tq)[:, None] + tk - tq
    kpos = torch.arange(tk)[None, :]
    mask = (kpos <= qpos) & (kpos >= qpos - window_size[0])
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).to(q.dtype)


def _build(req: dict):
    from fla.models import NSAConfig, NSAForCausalLM

    torch.manual_seed(req["seed"])
    model = NSAForCausalLM(NSAConfig(**req["config"])).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, req["std"])
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(req["dir"])
    return model


@torch.no_grad()
def _logprobs(model, kernels: bool, sequences: list[list[int]]) -> list[torch.Tensor]:
    import fla.layers.nsa as fla_layer
    from fla.ops.nsa.naive import naive_nsa
    from fla.ops.nsa.parallel import parallel_nsa

    fla_layer.parallel_nsa = parallel_nsa if kernels else naive_nsa
    return [torch.log_softmax(model(torch.tensor([s]), use_cache=False).logits[0].float(), dim=-1) for s in sequences]


def serve() -> None:
    _interpreter_shims()  # FlaOracle sets TRITON_INTERPRET=1: fla's Triton kernels run on CPU
    torch.set_num_threads(1)
    import fla.ops.nsa.naive as fla_naive
    import fla.ops.nsa.parallel as fla_parallel

    fla_naive.flash_attn_func = fla_parallel.flash_attn_func = window_attention
    models = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "build":
                models[req["name"]] = _build(req)
            else:
                torch.save(_logprobs(models[req["name"]], req["kernels"], req["sequences"]), req["out"])
            reply = {"ok": True}
        except Exception:  # reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


class FlaOracle:
    """The pytest side: one worker process for the test module."""

    def __init__(self, workdir: Path):
        try:  # the test process hides fla (tests/conftest.py): ask for the distribution
            metadata.version("flash-linear-attention")
        except metadata.PackageNotFoundError:
            raise RuntimeError("the NSA oracle needs flash-linear-attention and fla-core: "
                               "pip install -e '.[test]'") from None
        self.workdir = workdir
        self._memo: dict[tuple, torch.Tensor] = {}
        self.log = open(workdir / "fla_oracle.log", "w")  # closed in close()
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)

    def _call(self, req: dict) -> None:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fla oracle exited; its log:\n{(self.workdir / 'fla_oracle.log').read_text()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the fla oracle failed:\n{reply['error']}")

    def build(self, name: str, config: dict, *, seed: int, std: float) -> Path:
        path = self.workdir / name
        self._call({"op": "build", "name": name, "dir": str(path), "config": config, "seed": seed, "std": std})
        return path

    def logprobs(self, name: str, sequences: list[list[int]], *, kernels: bool = False) -> list[torch.Tensor]:
        """Per sequence [L, V]: row i is the log-distribution of the token after position i
        (remembered: engine paths that agree ask for the same sequences)."""
        keys = [(name, kernels, tuple(s)) for s in sequences]
        todo = list(dict.fromkeys(k for k in keys if k not in self._memo))
        if todo:
            with tempfile.NamedTemporaryFile(dir=self.workdir, suffix=".pt", delete=False) as f:
                out = f.name
            self._call({"op": "logprobs", "name": name, "kernels": kernels,
                        "sequences": [list(k[2]) for k in todo], "out": out})
            self._memo.update(zip(todo, torch.load(out)))
        return [self._memo[k] for k in keys]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


if __name__ == "__main__":
    serve()
