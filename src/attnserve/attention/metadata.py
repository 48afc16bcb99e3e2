"""Per-step attention metadata, built once by the model runner and shared by every backend.

Requests are ordered with decodes (one new token) first, then prefills, as vLLM orders them,
so a backend can split the batch at ``num_decodes``. Each KV cache group has its own block
table and slot mapping (groups follow different policies, e.g. a sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CommonAttentionMetadata"]


@dataclass(slots=True)
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: start of each request's new tokens
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens in the cache after this step
    positions: torch.Tensor  # [num_tokens] int64: absolute position of each new token
    block_tables: list[torch.Tensor]  # per group: [num_reqs, max_blocks] int32
    slot_mappings: list[torch.Tensor]  # per group: [num_tokens] int64, -1 where nothing is written
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int  # the first num_decodes requests have exactly one new token
    max_query_len: int
    max_seq_len: int
    # hybrid models: each request's state slot, whether that slot holds its state already
    # (False on a request's first chunk), and how many leading requests are one-token steps
    # with a state (they may take the recurrent decode form)
    state_slots: torch.Tensor | None = None  # [num_reqs] int64
    has_initial_state: torch.Tensor | None = None  # [num_reqs] bool
    num_state_decodes: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def query_lens_cpu(self) -> list[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    @property
    def context_lens_cpu(self) -> list[int]:
        """Tokens already in the cache before this step, per request."""
        return [s - n for s, n in zip(self.seq_lens_cpu, self.query_lens_cpu)]
