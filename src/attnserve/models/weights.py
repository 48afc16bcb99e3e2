"""Reading checkpoints and filling parameters: safetensors (single file or sharded), dummy init.

A model maps each checkpoint name to one of its parameters (and a shard of it, for fused
projections); each parameter's ``weight_loader`` puts the tensor in place. Missing or
unexpected tensors and unreadable files are errors that name the tensor or the file, and so are
NaN or Inf in the loaded weights (``check_finite_weights``, one pass on the device they landed on).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from attnserve.layers.linear import Target, default_weight_loader

__all__ = ["check_finite_weights", "dummy_init", "iter_safetensors", "load_named_weights"]

_CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: malformed safetensors index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights in {model_dir} (model.safetensors or its index); "
                                f"use load_format='dummy' for random weights")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for path in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: cannot read safetensors file ({e})") from e


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       rename: Callable[[str], Target], *, optional: Iterable[str] = ()) -> None:
    """Load every checkpoint tensor through ``rename`` (None skips it) and check none is missing.

    Raises:
        ValueError: a tensor maps to no parameter, has the wrong shape, or a parameter got nothing.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        target = rename(hf_name)
        if target is None:
            continue
        name, shard = (target, None) if isinstance(target, str) else target
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor '{hf_name}' maps to '{name}', which the model does not have")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor.to(param.dtype))
            else:
                loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor '{hf_name}': {e}") from e
        loaded.add(name)
    missing = sorted(set(params) - loaded - set(optional))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"the checkpoint has no weights for: {shown}")


def dummy_init(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights of the right shapes: matrices ~ N(0, std); vectors keep their init
    (norm weights 1 or 0, biases 0)."""
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            if p.dim() >= 2:  # drawn where the parameter lives: an 8B model on a GPU takes seconds
                gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
                p.normal_(0.0, std, generator=gen)


def check_finite_weights(model: nn.Module, model_dir: str | Path | None = None, shown: int = 4) -> None:
    """Raises ValueError when a parameter holds NaN or Inf, naming the first ``shown`` of them
    with their counts and, read again from ``model_dir`` (only then), the checkpoint tensors
    that hold them; checkpoint tensors all finite mean the values overflowed the model's dtype.

    Cheap: one ``isfinite().all()`` per parameter where it lives and one host sync per device;
    parameters of other dtypes (quantised integers, fp8) are not checked."""
    params = [(name, p) for name, p in model.named_parameters() if p.dtype in _CHECKED_DTYPES]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, p in params:
            by_device.setdefault(p.device, []).append((name, torch.isfinite(p).all()))
        bad = [name for flags in by_device.values()
               for (name, _), ok in zip(flags, torch.stack([f for _, f in flags]).tolist()) if not ok]
        if not bad:
            return
        named = dict(params)
        counts = [f"'{n}' ({int(named[n].isnan().sum())} NaN, {int(named[n].isinf().sum())} Inf)"
                  for n in bad[:shown]]
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    message = f"the model's weights hold NaN or Inf: parameter {', '.join(counts)}{more}"
    if model_dir is not None:
        found = []
        for name, tensor in iter_safetensors(model_dir):
            if tensor.dtype in _CHECKED_DTYPES and not bool(torch.isfinite(tensor).all()):
                found.append(f"'{name}'")
                if len(found) == shown:
                    break
        dtype = named[bad[0]].dtype
        message += (f"; in the checkpoint: {', '.join(found)}" if found else
                    f"; every checkpoint tensor is finite, so values overflow {dtype} (try another dtype)")
    raise ValueError(message + " (check_weights_finite=False / --skip-weight-check loads them anyway)")
