"""What a model computes, read once from its ``config.json``: the bottom of the package.

``read_arch(load_hf_config(path))`` gives a frozen ``ModelArch`` with one ``LayerSpec`` per
layer; every other package reads these types and never the raw config. Inside: the types
(``model_arch.py``), typed field access and shared layer builders (``reader.py``), the family
readers (``families.py``), the entry point (``load.py``) and the tensor-parallel split
(``sharding.py``). Imports nothing of attnserve outside this package.
"""

from attnserve.arch.load import load_hf_config, read_arch
from attnserve.arch.model_arch import (
    ArchError,
    IndexerDims,
    LayerKind,
    LayerSpec,
    Mechanism,
    MLADims,
    ModelArch,
    MoESpec,
    NSADims,
    RopeConfig,
    StateDims,
)
from attnserve.arch.sharding import kv_head_share, shard_arch

__all__ = [
    "ArchError",
    "IndexerDims",
    "LayerKind",
    "LayerSpec",
    "MLADims",
    "Mechanism",
    "MoESpec",
    "ModelArch",
    "NSADims",
    "RopeConfig",
    "StateDims",
    "kv_head_share",
    "load_hf_config",
    "read_arch",
    "shard_arch",
]
