"""The default collate: builds batch tensors directly in the slab the batch travels in.

Rules, field by field (a sample may be a mapping, a tuple/list of fields, or a single field):

- mappings (at any depth) -> a dict of the collated fields, keys taken from the first sample;
- a sample that is a tuple or list -> transposed: one collated field per position;
- bools -> a ``bool`` tensor; ints -> ``int64``; floats (or ints mixed with floats) -> ``float64``;
  numpy scalars of one dtype -> a tensor of that dtype;
- tensors or arrays of equal shape and dtype -> stacked into one tensor of shape ``(B, *shape)``;
- bytes-like values (bytes, bytearray, memoryview) -> ``{"data": uint8 (B, max_len) zero-padded,
  "lengths": int64 (B,)}``;
- anything else (str, None, lists such as chat messages, ragged arrays) -> a list, one item per sample;
  lazy mappings in it (a lazy dataset's nested records) become plain dicts, memoryviews bytes.

Every tensor is allocated from the arena (the shared-memory slab in a worker, the heap in-process), so
the transport sends it by reference: the only copy is the one from the sample into the batch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["default_collate"]

_BYTES_LIKE = (bytes, bytearray, memoryview)
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def default_collate(samples: list, arena: Any) -> Any:
    """Collate ``samples`` into one batch whose tensors live in ``arena``.

    Args:
        samples: the samples of one batch, in order (at least one).
        arena: where tensors are allocated (:class:`torchforge._shm.Arena` or ``HeapArena``).

    Returns:
        The batch (see the module docstring for the rules).
    """
    first = samples[0]
    if isinstance(first, (tuple, list)) and not isinstance(first, str):
        n = len(first)
        if any(len(s) != n for s in samples):
            raise ValueError(f"samples are sequences of different lengths ({n} and others); cannot collate")
        columns = [_field([s[j] for s in samples], arena) for j in range(n)]
        return tuple(columns) if isinstance(first, tuple) else columns
    return _field(samples, arena)


def _field(vals: list, arena: Any) -> Any:
    first = vals[0]
    if isinstance(first, Mapping):
        keys = list(first.keys())
        out = {}
        for k in keys:
            try:
                column = [v[k] for v in vals]
            except (KeyError, TypeError):
                raise ValueError(f"field {k!r} of the first sample is missing from another sample") from None
            out[k] = _field(column, arena)
        return out
    types = set(map(type, vals))
    if types <= {bool}:
        return _numbers(vals, np.bool_, arena)
    if types <= {int}:
        return _numbers(vals, np.int64, arena)
    if types <= {int, float}:
        return _numbers(vals, np.float64, arena)
    if len(types) == 1:
        t = next(iter(types))
        if issubclass(t, np.generic) and t is not np.object_:
            return _numbers(vals, np.dtype(t), arena)
        if issubclass(t, (np.ndarray, torch.Tensor)):
            stacked = _stack(vals, arena)
            if stacked is not None:
                return stacked
    if all(isinstance(v, _BYTES_LIKE) for v in vals):
        return _pad_bytes(vals, arena)
    return [v if type(v) in _SCALARS else _plain(v) for v in vals]


def _plain(v: Any) -> Any:
    """Lazy mappings (at any depth in lists and dicts) as plain dicts, memoryviews as bytes: the batch is
    the same plain data with or without workers."""
    t = type(v)
    if t in _SCALARS:
        return v
    if t is list or t is tuple:
        out = [x if type(x) in _SCALARS else _plain(x) for x in v]
        return out if t is list else tuple(out)
    if isinstance(v, Mapping):
        return {k: x if type(x) in _SCALARS else _plain(x) for k, x in v.items()}
    if t is memoryview:
        return v.tobytes()
    return v


def _numbers(vals: list, dtype: Any, arena: Any) -> Any:
    dt = np.dtype(dtype)
    out = arena.alloc(len(vals) * dt.itemsize).view(dt)
    try:
        out[:] = vals
    except (OverflowError, ValueError, TypeError):
        return list(vals)  # ints beyond int64 and the like stay Python objects
    return torch.from_numpy(out)


def _stack(vals: list, arena: Any) -> torch.Tensor | None:
    first = vals[0]
    shape, dtype = tuple(first.shape), first.dtype
    if any(tuple(v.shape) != shape or v.dtype != dtype for v in vals):
        return None
    if isinstance(first, np.ndarray):
        if dtype.hasobject or dtype.fields is not None:
            return None
        out = arena.alloc(len(vals) * first.nbytes).view(dtype).reshape((len(vals),) + shape)
        np.stack(vals, out=out)
        return torch.from_numpy(out)
    nbytes = first.numel() * first.element_size()
    out = torch.from_numpy(arena.alloc(len(vals) * nbytes)).view(dtype).view((len(vals),) + shape)
    torch.stack([v.detach().cpu() for v in vals], out=out)
    return out


def _pad_bytes(vals: list, arena: Any) -> dict[str, torch.Tensor]:
    views = [memoryview(v).cast("B") if isinstance(v, memoryview) else v for v in vals]
    lengths = _numbers(list(map(len, views)), np.int64, arena)
    width = int(lengths.max()) if len(views) else 0
    data = arena.alloc(len(views) * width)
    flat = memoryview(data)  # slice assignment on a memoryview is a bare memcpy: cheaper than numpy's
    zeros = memoryview(bytes(width))
    for i, v in enumerate(views):
        start, n = i * width, len(v)
        flat[start:start + n] = v
        if n < width:
            flat[start + n:start + width] = zeros[:width - n]  # slabs are recycled: clear the padding
    del flat
    return {"data": torch.from_numpy(data.reshape(len(views), width)), "lengths": lengths}


