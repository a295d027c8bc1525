"""A canonical, JSON-able digest of a sample, computed the same way by torchforge's tests (Python 3.11)
and by the MLDataForge helper (Python 3.12), so that both sides' readings can be compared as JSON.

Standard library and numpy only; torch tensors are digested through ``.numpy()``.
"""
import hashlib
from collections.abc import Mapping

import numpy as np


def _sha(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()[:32]


def canon(value):
    """Nested dicts/lists kept; bytes, arrays, tensors and numpy scalars become tagged digests."""
    if isinstance(value, Mapping):
        return {str(k): canon(value[k]) for k in sorted(value.keys())}
    if isinstance(value, (list, tuple)):
        return [canon(v) for v in value]
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        arr = value.detach().cpu().numpy()
        return {"$tensor": str(arr.dtype), "shape": list(arr.shape), "sha": _sha(np.ascontiguousarray(arr).tobytes())}
    if isinstance(value, np.ndarray):
        return {"$nd": str(value.dtype), "shape": list(value.shape),
                "sha": _sha(np.ascontiguousarray(value).tobytes())}
    if isinstance(value, np.generic):
        return {"$np": str(value.dtype), "v": repr(value.item())}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": len(bytes(value)), "sha": _sha(value)}
    if isinstance(value, float):
        return {"$float": repr(value)}
    return value
