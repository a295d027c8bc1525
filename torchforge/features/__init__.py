"""Feature stores: per-sample columns keyed by int64 id, written by every rank, read by batch of ids.

See :mod:`torchforge.features.store` (the API), ``layout`` (files and the lock-free commit),
``writer``, ``index``, ``reader``, ``join`` and ``inspect`` (``torchforge inspect|verify``).
"""
from __future__ import annotations

from torchforge.features.join import JoinedDataset
from torchforge.features.reader import MissingIdsError
from torchforge.features.store import FeatureStore
from torchforge.features.writer import FeatureWriter

__all__ = ["FeatureStore", "FeatureWriter", "JoinedDataset", "MissingIdsError"]
