"""Host-side launch helpers the kernels of several operations share: the device's SM count and
capability, power-of-two tile sizes, and the dtype ``tl.dot`` takes.

What it is not: kernel code (``tiles.py`` holds the Triton JIT helpers kernels share,
``hopper.py`` the Gluon ones), or the choice of which kernel runs (``attention/kernels.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnserve import env

__all__ = ["compute_dtype", "has_tma", "is_hopper", "num_sms", "pow2", "require_hopper"]


def pow2(n: int, floor: int = 1) -> int:
    """The next power of two at or above ``n``, at least ``floor``."""
    return max(floor, triton.next_power_of_2(n))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(_index(device))


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def is_hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (H100, H200)."""
    return device.type == "cuda" and _capability(_index(device))[0] == 9


def require_hopper(device: torch.device, kernel: str) -> None:
    """ValueError unless ``device`` is a Hopper GPU: the entry check of the Gluon kernels, which
    compile for sm_90 only (the compile tests replace it to reach the launch on CPU tensors)."""
    if not is_hopper(device):
        raise ValueError(f"{kernel} runs on Hopper (sm_90) GPUs, not {device}")


def has_tma(device: torch.device) -> bool:
    """Tensor-descriptor loads: Hopper and later, or Triton's interpreter (which emulates them)."""
    if env.triton_interpret():
        return True
    return device.type == "cuda" and _capability(_index(device))[0] >= 9


def compute_dtype(dtype: torch.dtype, interpret: bool):
    """Dtype of tl.dot inputs: q's dtype, or fp32 where the interpreter cannot do bf16."""
    if dtype == torch.float32 or (interpret and dtype == torch.bfloat16):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16
