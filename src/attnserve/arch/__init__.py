"""What a model computes, read once from its ``config.json``: the bottom of the package.

``read_arch(load_hf_config(path))`` gives a frozen ``ModelArch`` with one ``LayerSpec`` per
layer and the facts its family's reader normalised (norm epsilon, activation, MLP width, tying,
the family's options); every other package reads these types and never the raw config. Inside:
the types (``model_arch.py``, ``options.py``), typed field access and shared layer builders
(``reader.py``), the family readers (``readers_standard.py``, ``readers_mla_state.py``), the one
table of families (``families.py``), the entry point (``load.py``) and the tensor-parallel split
(``sharding.py``). Imports nothing of attnserve outside this package.
"""

from attnserve.arch.families import FAMILIES, Family
from attnserve.arch.load import load_hf_config, read_arch
from attnserve.arch.model_arch import (
    ArchError,
    GDNDims,
    IndexerDims,
    KDADims,
    LayerKind,
    LayerSpec,
    LightningDims,
    MambaDims,
    Mechanism,
    MixerDims,
    MLADims,
    ModelArch,
    MoESpec,
    NSADims,
    RopeConfig,
    StateDims,
)
from attnserve.arch.options import (
    BloomOptions,
    DeepNorm,
    DeepseekOptions,
    FalconOptions,
    FamilyOptions,
    GemmaOptions,
    GPT2Options,
    GptOssOptions,
    LlamaOptions,
    MiniMaxOptions,
    MPTOptions,
    NSAOptions,
    Qwen3NextOptions,
)
from attnserve.arch.sharding import ShardPlan, kv_head_share, shard_arch

__all__ = [
    "FAMILIES",
    "ArchError",
    "BloomOptions",
    "DeepNorm",
    "DeepseekOptions",
    "FalconOptions",
    "Family",
    "FamilyOptions",
    "GDNDims",
    "GPT2Options",
    "GemmaOptions",
    "GptOssOptions",
    "IndexerDims",
    "KDADims",
    "LayerKind",
    "LayerSpec",
    "LightningDims",
    "LlamaOptions",
    "MLADims",
    "MPTOptions",
    "MambaDims",
    "Mechanism",
    "MiniMaxOptions",
    "MixerDims",
    "MoESpec",
    "ModelArch",
    "NSADims",
    "NSAOptions",
    "Qwen3NextOptions",
    "RopeConfig",
    "ShardPlan",
    "StateDims",
    "kv_head_share",
    "load_hf_config",
    "read_arch",
    "shard_arch",
]
