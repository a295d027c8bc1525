"""torchforge: fast, trustworthy data loading and checkpoints for PyTorch.

Names are imported lazily so that ``import torchforge`` stays cheap and never imports optional
packages (MosaicML Streaming in particular).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "torchforge.checkpoint",
    "DataLoader": "torchforge.loader",
    "FeatureStore": "torchforge.features",
    "GlobalSampler": "torchforge.sampler",
    "IterableShards": "torchforge.sampler",
    "JinxDataset": "torchforge.datasets.jinx",
    "JinxWriter": "torchforge.formats.jinx",
    "MDSDataset": "torchforge.datasets.mds",
    "MDSWriter": "torchforge.formats.mds",
    "SafetensorsDataset": "torchforge.datasets.safetensors",
    "SafetensorsShardWriter": "torchforge.datasets.safetensors",
    "TorchforgeError": "torchforge.errors",
    "load_safetensors": "torchforge.formats.safetensors",
    "open_dataset": "torchforge.datasets.base",
    "register_format": "torchforge.datasets.base",
    "save_safetensors": "torchforge.formats.safetensors",
}

__all__ = [
    "Checkpointer",
    "DataLoader",
    "FeatureStore",
    "GlobalSampler",
    "IterableShards",
    "JinxDataset",
    "JinxWriter",
    "MDSDataset",
    "MDSWriter",
    "SafetensorsDataset",
    "SafetensorsShardWriter",
    "TorchforgeError",
    "load_safetensors",
    "open_dataset",
    "register_format",
    "save_safetensors",
]


_SUBMODULES = frozenset({"cache", "checkpoint", "cli", "codecs", "convert", "datasets", "errors", "features",
                         "formats", "lazy", "loader", "remote", "sampler", "sizes", "streaming"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # torchforge.streaming.patch() after a plain `import torchforge`
        return importlib.import_module(f"torchforge.{name}")
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'torchforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if "torch" in sys.modules:
    # torch is loaded already (a training script): define DataLoader now (about 40 ms). Frameworks that
    # rebuild loaders (Lightning's re-instantiation with a distributed sampler) record the constructor
    # arguments of every DataLoader subclass that exists when they start watching; a subclass first made
    # inside their watch is not recorded, and rebuilding it from torch's arguments loses ours.
    DataLoader = importlib.import_module("torchforge.loader").DataLoader
