"""ModelArch: what a model's layers compute, read from a Hugging Face ``config.json``.

The types every other package reads instead of the raw config: per layer a ``LayerSpec``
(attention kind, heads, head sizes, windows, RoPE, ALiBi, sinks, MLA and indexer dims, state
dims and the state mixer's own constants, MoE), and for the model the facts its family's reader
normalised once (norm epsilon, activation, dense MLP width, tying, final logit soft-cap and
scale, the family's own options in ``arch/options.py``).

It is not a reader: ``arch/families.py`` fills these from ``config.json``, with each family's
defaults; the raw config does not travel past ``read_arch`` (only ``quantization_config``,
as written, for the checkpoint loader).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnserve.arch.options import FamilyOptions

__all__ = [
    "ArchError",
    "GDNDims",
    "IndexerDims",
    "KDADims",
    "LayerKind",
    "LightningDims",
    "LayerSpec",
    "MLADims",
    "MambaDims",
    "Mechanism",
    "MixerDims",
    "MoESpec",
    "ModelArch",
    "NSADims",
    "RopeConfig",
    "StateDims",
]


class ArchError(ValueError):
    """A config that cannot be understood: the message names the model type and the field."""


class LayerKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    SPARSE_MLA = "sparse_mla"
    GDN = "gdn"
    MAMBA = "mamba"
    LIGHTNING = "lightning"
    KDA = "kda"
    NSA = "nsa"  # native sparse attention: compressed, selected-block, sliding branches

    @property
    def is_attention(self) -> bool:
        return self in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.MLA, LayerKind.SPARSE_MLA,
                        LayerKind.NSA)

    @property
    def is_state(self) -> bool:
        return not self.is_attention

    @property
    def is_mla(self) -> bool:
        return self in (LayerKind.MLA, LayerKind.SPARSE_MLA)


class Mechanism(str, Enum):
    MHA = "MHA"
    MQA = "MQA"
    GQA = "GQA"
    MLA = "MLA"
    SPARSE_MLA = "SPARSE_MLA"
    NSA = "NSA"
    HYBRID = "HYBRID"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of one layer. ``rotary_dim`` dims are rotated, the rest pass through."""

    rotary_dim: int
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | dynamic | yarn | llama3 | longrope
    interleaved: bool = False  # GPT-J adjacent pairs (True) or NeoX half-split (False)
    factor: float = 1.0
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn / longrope
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ArchError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")


@dataclass(frozen=True, slots=True)
class MLADims:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False  # biases on q_a/kv_a (or q), and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class IndexerDims:
    """The DSA lightning indexer of one sparse-MLA layer."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleaved: bool  # False: NeoX half-split (DeepSeek-V3.2); True: GLM-5
    has_cache: bool = True  # False for GLM-5 "shared" layers that reuse the previous top-k


@dataclass(frozen=True, slots=True)
class NSADims:
    """Native sparse attention of one layer (FLA's ``NativeSparseAttention``).

    ``block_size`` tokens make one compression block (mean-pooled K/V) and one selection block;
    each token keeps ``num_selected`` blocks per KV head, among them the first, the previous and
    its own; ``window`` is the sliding branch (None: no such branch).
    """

    block_size: int
    block_counts: int  # as configured
    window: int | None

    @property
    def num_selected(self) -> int:
        """Blocks each query attends over: FLA's kernels round ``block_counts`` up to a power of
        two (``triton.next_power_of_2``) and fill every slot."""
        return 1 << max(self.block_counts - 1, 0).bit_length()


@dataclass(frozen=True, slots=True)
class StateDims:
    """Per-sequence state of a state layer, in elements (dtypes come from the cache config)."""

    conv: tuple[tuple[int, ...], ...] = ()
    recurrent: tuple[tuple[int, ...], ...] = ()

    @property
    def conv_numel(self) -> int:
        return sum(math.prod(s) for s in self.conv)

    @property
    def recurrent_numel(self) -> int:
        return sum(math.prod(s) for s in self.recurrent)


@dataclass(frozen=True, slots=True)
class GDNDims:
    """Gated DeltaNet's own constants (value heads and head sizes are the ``LayerSpec``'s).

    Whole-model values: tensor parallelism splits the built layer (``runner/parallel.py``)."""

    num_k_heads: int
    conv_kernel: int
    norm_eps: float  # the gated output norm


@dataclass(frozen=True, slots=True)
class MambaDims:
    """A Mamba-1 mixer's constants beyond its state shapes (inner width, state size, kernel)."""

    dt_rank: int
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    norm_eps: float  # Jamba's dt/B/C RMSNorms


@dataclass(frozen=True, slots=True)
class LightningDims:
    """Lightning attention's block size: tokens per block of the prefill's block algorithm."""

    block_size: int


@dataclass(frozen=True, slots=True)
class KDADims:
    """Kimi delta attention's constants beyond its state shapes."""

    norm_eps: float  # the gated output norm


# the state mixer's constants, by LayerKind: GDN, MAMBA, LIGHTNING, KDA
MixerDims = GDNDims | MambaDims | LightningDims | KDADims


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    scoring: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True, slots=True)
class LayerSpec:
    index: int
    kind: LayerKind
    num_heads: int = 0
    num_kv_heads: int = 0
    head_size: int = 0  # q/k head size (MLA: qk_nope + qk_rope)
    head_size_v: int = 0
    scale: float = 0.0  # softmax scale
    window: int | None = None  # keys visible to a query, itself included (HF semantics)
    rope: RopeConfig | None = None
    alibi: bool = False
    sinks: bool = False  # learned per-head sink logits (GPT-OSS)
    softcap: float | None = None
    mla: MLADims | None = None
    indexer: IndexerDims | None = None
    state: StateDims | None = None
    moe: bool = False  # this layer's MLP is a mixture of experts
    nsa: NSADims | None = None  # LayerKind.NSA: blocks, selection count, window
    mixer: MixerDims | None = None  # state layers: the mixer's own constants (see MixerDims)

    @property
    def features(self) -> frozenset[str]:
        """Attention features a backend must support for this layer."""
        out = set()
        if self.window is not None:
            out.add("sliding_window")
        if self.alibi:
            out.add("alibi")
        if self.sinks:
            out.add("sinks")
        if self.softcap is not None:
            out.add("softcap")
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class ModelArch:
    """A model as its family's reader normalised it; models and layers read nothing else.

    ``norm_eps``, ``hidden_act`` and ``intermediate_size`` carry each family's own default
    (transformers' config class for that family) when the config leaves them out.
    """

    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int | None
    dtype: str
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool = False
    moe: MoESpec | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    intermediate_size: int | None = None  # the dense MLP width (None: none given or no dense MLP)
    final_softcap: float | None = None  # cap * tanh(logits / cap) (Gemma 2/3)
    logit_scale: float | None = None  # logits multiplied by it (MPT)
    options: FamilyOptions | None = None  # the family's own facts (arch/options.py)
    unsupported: str | None = None  # why attnserve cannot build this model (inspect still reads it)
    # the checkpoint's quantization_config as written (models/quantized.py reads it)
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False, hash=False,
                                                           repr=False)

    # --- derived views -------------------------------------------------------------------
    @property
    def attention_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(s for s in self.layers if s.kind.is_attention)

    @property
    def state_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(s for s in self.layers if s.kind.is_state)

    @property
    def mechanism(self) -> Mechanism:
        kinds = {s.kind for s in self.layers}
        if any(k.is_state for k in kinds):
            return Mechanism.HYBRID
        if LayerKind.NSA in kinds:
            return Mechanism.NSA
        if LayerKind.SPARSE_MLA in kinds:
            return Mechanism.SPARSE_MLA
        if LayerKind.MLA in kinds:
            return Mechanism.MLA
        first = self.attention_layers[0]
        if first.num_kv_heads == first.num_heads:
            return Mechanism.MHA
        if first.num_kv_heads == 1:
            return Mechanism.MQA
        return Mechanism.GQA

    @property
    def attention_mechanism(self) -> Mechanism:
        """The mechanism of the attention layers alone (for hybrid models)."""
        attn = self.attention_layers
        if any(s.kind is LayerKind.NSA for s in attn):
            return Mechanism.NSA
        if any(s.kind is LayerKind.SPARSE_MLA for s in attn):
            return Mechanism.SPARSE_MLA
        if any(s.kind is LayerKind.MLA for s in attn):
            return Mechanism.MLA
        if not attn:
            return Mechanism.HYBRID
        first = attn[0]
        if first.num_kv_heads == first.num_heads:
            return Mechanism.MHA
        return Mechanism.MQA if first.num_kv_heads == 1 else Mechanism.GQA

    @property
    def num_heads(self) -> int:
        attn = self.attention_layers
        return attn[0].num_heads if attn else 0

    @property
    def num_kv_heads(self) -> int:
        attn = self.attention_layers
        return attn[0].num_kv_heads if attn else 0

    @property
    def head_size(self) -> int:
        attn = self.attention_layers
        return attn[0].head_size if attn else 0

    @property
    def is_mla(self) -> bool:
        return any(s.kind.is_mla for s in self.layers)

    @property
    def derived_max_model_len(self) -> int:
        """The default ``max_model_len``, vLLM's rule: ``max_position_embeddings`` (2048 when the
        config gives none) times the RoPE scaling factor, for every scaling but llama3 and
        longrope (their ``max_position_embeddings`` already is the extended length); YaRN
        multiplies ``original_max_position_embeddings``. Gemma 3 states the scaled length."""
        base = self.max_position_embeddings or 2048
        rope = next((s.rope for s in self.layers if s.rope is not None), None)
        if rope is None or rope.rope_type in ("llama3", "longrope") or self.model_type.startswith("gemma3"):
            return base
        if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
            base = rope.original_max_position_embeddings
        return int(base * rope.factor)
