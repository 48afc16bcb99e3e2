"""Rotary position embeddings (RoPE) with every scaling type a ``RopeConfig`` can name.

What this file is: the layer that rotates the first ``rotary_dim`` dims of each q/k head by
``position * inv_freq``, in the NeoX half-split layout or the GPT-J interleaved layout, with the
scalings default, linear, llama3, yarn (static: one cos/sin table indexed by position, grown on
demand) and dynamic NTK, longrope (length-dependent: the frequencies depend on the length of the
token's sequence). Frequencies and cos/sin are computed in float32, in the same arithmetic as
transformers' ``modeling_rope_utils``; the rotation runs in the input dtype.

What it is not: it does not read HF configs (``arch/families.py`` builds the ``RopeConfig``), it
holds no kernel (the static types rotate through ``layers/fused.py``: a fused Triton kernel on
CUDA, the same PyTorch arithmetic elsewhere; the length-dependent types always in PyTorch), it
does not fold YaRN's mscale into the softmax scale (that is the attention layer's
``LayerSpec.scale``) and it has no multimodal (M-RoPE) sections.

Length-dependent types, per token. transformers computes one length for the whole batch,
``L = max(position_ids) + 1``, and its dynamic-NTK module keeps the grown frequencies until L
falls below the original maximum. attnserve instead takes ``seq_lens[t]``: for every token, its
own request's highest position in this step + 1. For one request at a time the two agree (a
request's L only grows from step to step, and HF regrows to exactly that L), and keys already in
the cache keep the rotation they were written with in both. Per-token lengths keep requests
batched together independent of each other: a long request never changes the rotation of a
short one next to it, which HF's batch-wide L would. As in HF, dynamic-NTK results still depend
on how a long prompt is split into prefill chunks, since each chunk sees its own L.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnserve.arch import RopeConfig
from attnserve.attention.backend import RopeTable
from attnserve.layers.fused import rotary, rotate_ref

__all__ = ["RotaryEmbedding", "get_rope"]

_STATIC_TYPES = ("default", "linear", "llama3", "yarn")
_LENGTH_TYPES = ("dynamic", "longrope")
_MIN_CACHE = 256  # smallest cos/sin table; tables grow to the next power of two


class RotaryEmbedding(nn.Module):
    """RoPE for one ``RopeConfig``; stateless apart from its cos/sin tables.

    One instance may be shared by every layer with the same config. The tables are plain
    tensors, not buffers, so ``model.to(dtype)`` never lowers their float32 precision; they
    follow the device of ``positions``.
    """

    def __init__(self, cfg: RopeConfig, head_size: int) -> None:
        super().__init__()
        if cfg.rope_type not in _STATIC_TYPES + _LENGTH_TYPES:
            raise ValueError(f"unsupported rope_type '{cfg.rope_type}'")
        if cfg.rotary_dim > head_size:
            raise ValueError(f"rotary_dim {cfg.rotary_dim} exceeds head_size {head_size}")
        self.cfg = cfg
        self.head_size = head_size
        self.rotary_dim = cfg.rotary_dim
        self.attention_factor = _attention_factor(cfg)
        self.original_max_len = _original_max_len(cfg)
        # "short" is the only table of the static types; dynamic uses it while L <= original
        # max; longrope switches to "long" beyond it.
        self._inv_freq: dict[str, torch.Tensor] = {"short": _static_inv_freq(cfg)}
        if cfg.rope_type == "longrope":
            self._inv_freq["long"] = _scaled_base_inv_freq(cfg, cfg.long_factor)
        self._tables: dict[str, torch.Tensor] = {}
        self._reserved = 0  # positions the caller promised never to exceed (0: check each call)

    def extra_repr(self) -> str:
        c = self.cfg
        layout = "interleaved" if c.interleaved else "neox"
        return (
            f"rope_type={c.rope_type}, rotary_dim={c.rotary_dim}, head_size={self.head_size}, "
            f"theta={c.theta}, {layout}"
        )

    # --- cos/sin --------------------------------------------------------------------------
    def reserve(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """Grow the cos/sin tables to cover positions ``[0, num_positions)``.

        The model runner should call this once with the maximum model length: afterwards
        forward trusts that positions stay below it and skips the per-call ``positions.max()``
        check, a host sync on GPU (also needed for CUDA graph capture).
        """
        for name in self._inv_freq:
            self._table(name, num_positions, device)
        self._reserved = max(self._reserved, num_positions)

    def cos_sin(
        self,
        positions: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin, each [T, rotary_dim // 2], attention factor included.

        Args:
            positions: [T] integer positions.
            seq_lens: [T] length of each token's sequence (for dynamic and longrope); None
                means ``positions.max() + 1`` for every token.
        Returns:
            (cos, sin), one angle per rotated pair.
        """
        positions = positions.long()
        if self.cfg.rope_type in _STATIC_TYPES:
            return self._lookup("short", positions)
        lens = _lengths(positions, seq_lens)
        beyond = (lens > self.original_max_len)[:, None]  # [T, 1]
        cos, sin = self._lookup("short", positions)
        if self.cfg.rope_type == "longrope":
            cos_l, sin_l = self._lookup("long", positions)
        else:
            cos_l, sin_l = self._dynamic_cos_sin(positions, lens)
        return torch.where(beyond, cos_l, cos), torch.where(beyond, sin_l, sin)

    def _table(self, name: str, need: int, device: torch.device | str | None) -> torch.Tensor:
        """The [N, rotary_dim] table (cos | sin) for ``name``, on ``device``, with N >= need."""
        table = self._tables.get(name)
        device = (
            torch.device(device)
            if device is not None
            else (table.device if table is not None else torch.device("cpu"))
        )
        if table is not None and table.shape[0] >= need:
            if table.device != device:
                table = self._tables[name] = table.to(device)
            return table
        n = max(_MIN_CACHE, 1 << max(need - 1, 0).bit_length())
        inv_freq = self._inv_freq[name].to(device)
        pos = torch.arange(n, device=device, dtype=torch.int64).float()
        angles = pos[:, None] * inv_freq[None, :]  # [N, rotary_dim // 2]
        table = torch.cat(
            [angles.cos() * self.attention_factor, angles.sin() * self.attention_factor], dim=-1
        )  # [N, rotary_dim]
        self._tables[name] = table
        return table

    def _need(self, positions: torch.Tensor) -> int:
        if self._reserved:
            return self._reserved  # no host sync
        return int(positions.max()) + 1 if positions.numel() else 0

    def _lookup(self, name: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._table(name, self._need(positions), positions.device)
        rows = table.index_select(0, positions)  # [T, rotary_dim]
        return rows.chunk(2, dim=-1)

    def _dynamic_cos_sin(
        self,
        positions: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK cos/sin with the base rescaled for each token's own length."""
        c, dim = self.cfg, self.rotary_dim
        orig = self.original_max_len
        # transformers' arithmetic (float32, length clamped to >= orig), except that the power is
        # taken in float64 and rounded once: HF computes it on a scalar, which is correctly
        # rounded, while a vectorised float32 pow may be 1 ulp off (visible at large positions).
        length = torch.clamp(lens, min=orig).float()  # [T]
        ratio = (c.factor * length / orig) - (c.factor - 1)
        base = c.theta * (ratio.double() ** (dim / (dim - 2))).float()
        exponents = (
            torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        )
        inv_freq = 1.0 / (base[:, None] ** exponents[None, :])  # [T, rotary_dim // 2]
        angles = positions.float()[:, None] * inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def position_table(self, positions: torch.Tensor) -> RopeTable | None:
        """The rotation as one table row per position, for a backend that fuses RoPE into its
        cache write; None for the length-dependent types (their cos/sin depend on more than the
        position: ``forward`` rotates those)."""
        if self.cfg.rope_type not in _STATIC_TYPES:
            return None
        table = self._table("short", self._need(positions), positions.device)
        return RopeTable(table, positions, self.rotary_dim, self.cfg.interleaved)

    # --- rotation -------------------------------------------------------------------------
    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k.

        Args:
            positions: [T] int64 absolute positions.
            q: [T, Hq, head_size].
            k: [T, Hk, head_size].
            seq_lens: [T] per-token sequence length for dynamic/longrope (see the module
                docstring); None means ``positions.max() + 1`` for every token.
        Returns:
            (q, k) rotated, same shapes and dtypes; dims past ``rotary_dim`` pass through.
        """
        rd, interleaved = self.rotary_dim, self.cfg.interleaved
        if self.cfg.rope_type in _STATIC_TYPES:  # one table row per position: fused on CUDA
            table = self._table("short", self._need(positions), positions.device)
            return rotary(q, k, table, positions, rd, interleaved)
        cos, sin = self.cos_sin(positions, seq_lens)
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rotary_dim // 2]
        q_out = rotate_ref(q, cos.to(q.dtype), sin.to(q.dtype), rd, interleaved)
        return q_out, rotate_ref(k, cos.to(k.dtype), sin.to(k.dtype), rd, interleaved)


def get_rope(cfg: RopeConfig | None, head_size: int) -> RotaryEmbedding | None:
    """The rotary embedding of a layer, or None for a layer without RoPE (ALiBi, NoPE).

    Args:
        cfg: the layer's ``LayerSpec.rope``.
        head_size: q/k head size; the first ``cfg.rotary_dim`` dims rotate.
    Returns:
        A new ``RotaryEmbedding``, or None when ``cfg`` is None.
    """
    return None if cfg is None else RotaryEmbedding(cfg, head_size)


# --- helpers ------------------------------------------------------------------------------


def _lengths(positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
    if seq_lens is None:
        top = positions.max() + 1 if positions.numel() else positions.new_zeros(())
        return top.expand(positions.shape[0])
    if seq_lens.shape != positions.shape:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must match positions {tuple(positions.shape)}"
        )
    return seq_lens.to(device=positions.device, dtype=torch.int64)


def _original_max_len(cfg: RopeConfig) -> int | None:
    """The length beyond which length-dependent types change their frequencies.

    Dynamic NTK, as in transformers, measures against ``max_position_embeddings``; longrope
    against ``original_max_position_embeddings``.
    """
    if cfg.rope_type == "dynamic":
        orig = cfg.max_position_embeddings or cfg.original_max_position_embeddings
    elif cfg.rope_type in ("longrope", "yarn", "llama3"):
        orig = cfg.original_max_position_embeddings
    else:
        return None
    if orig is None:
        raise ValueError(f"rope_type '{cfg.rope_type}' needs original_max_position_embeddings")
    return orig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """[dim // 2] float32: ``theta ** (-2i / dim)``."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _scaled_base_inv_freq(cfg: RopeConfig, factors: tuple[float, ...] | None) -> torch.Tensor:
    """longrope: the base frequencies divided by one factor per pair."""
    dim = cfg.rotary_dim
    if factors is None or len(factors) != dim // 2:
        got = None if factors is None else len(factors)
        raise ValueError(
            f"longrope needs short_factor and long_factor of length {dim // 2}, got {got}"
        )
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _static_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """The inverse frequencies used at every position (dynamic: while L <= original max)."""
    if cfg.rope_type == "linear":
        return _base_inv_freq(cfg.theta, cfg.rotary_dim) / cfg.factor
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    if cfg.rope_type == "longrope":
        return _scaled_base_inv_freq(cfg, cfg.short_factor)
    return _base_inv_freq(cfg.theta, cfg.rotary_dim)  # default, dynamic


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    if cfg.low_freq_factor is None or cfg.high_freq_factor is None:
        raise ValueError("llama3 rope needs low_freq_factor and high_freq_factor")
    inv_freq = _base_inv_freq(cfg.theta, cfg.rotary_dim)
    orig, low, high = _original_max_len(cfg), cfg.low_freq_factor, cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / cfg.factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) low frequencies, keep high ones, ramp between."""
    dim, base = cfg.rotary_dim, cfg.theta
    orig = _original_max_len(cfg)
    beta_fast, beta_slow = cfg.beta_fast or 32, cfg.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:  # the pair index that turns that often
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_factor(cfg: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (yarn and longrope; 1.0 otherwise)."""
    if cfg.rope_type not in ("yarn", "longrope"):
        return 1.0
    if cfg.attention_factor is not None:
        return float(cfg.attention_factor)
    if cfg.rope_type == "yarn":
        if cfg.mscale and cfg.mscale_all_dim:  # DeepSeek: the rest goes into the softmax scale
            return _yarn_mscale(cfg.factor, cfg.mscale) / _yarn_mscale(
                cfg.factor, cfg.mscale_all_dim
            )
        return _yarn_mscale(cfg.factor)
    orig = _original_max_len(cfg)
    factor = cfg.factor
    if factor == 1.0 and cfg.max_position_embeddings is not None:
        # RopeConfig stores a missing factor as 1.0; HF then uses max / original (Phi-3)
        factor = cfg.max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
