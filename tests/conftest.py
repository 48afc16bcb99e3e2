"""Test-session setup shared by every test directory.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and any test may import it first
(transformers does), so on a machine without a GPU the interpreter is switched on here,
before any test module loads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
