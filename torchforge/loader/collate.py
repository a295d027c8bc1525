"""Collate functions: torch's default collate with its tensors built in shared memory, and the opt-in
padded collate.

:func:`default_collate` is ``torch.utils.data.default_collate``: same rules, types, dtypes, nesting and
errors (it runs torch's own ``collate`` with torch's own function table), except that inside a
torchforge worker the stacked tensors (from tensors and numpy arrays) are allocated directly in the
batch's shared-memory slab, so the batch travels to the main process without another copy. Outside a
worker it is torch's function. The loader uses it whenever ``collate_fn`` is None or torch's
``default_collate``.

:func:`empty` gives a user's own ``collate_fn`` the same: an uninitialised tensor in the batch's slab
inside a worker, an ordinary tensor elsewhere.

:func:`padded_collate` is torchforge's own collation for multimodal records, opt-in
(``collate_fn=torchforge.loader.padded_collate``). Rules, field by field (a sample may be a mapping, a
tuple/list of fields, or a single field):

- mappings (at any depth) -> a dict of the collated fields, keys taken from the first sample;
- a sample that is a tuple or list -> transposed: one collated field per position;
- bools -> a ``bool`` tensor; ints -> ``int64``; floats (or ints mixed with floats) -> ``float64``;
  numpy scalars of one dtype -> a tensor of that dtype;
- tensors or arrays of equal shape and dtype -> stacked into one tensor of shape ``(B, *shape)``;
- bytes-like values (bytes, bytearray, memoryview) -> ``{"data": uint8 (B, max_len) zero-padded,
  "lengths": int64 (B,)}``;
- anything else (str, None, lists such as chat messages, ragged arrays) -> a list, one item per sample;
  lazy mappings in it (a lazy dataset's nested records) become plain dicts, memoryviews bytes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from torchforge.formats.values import ByteView
from torchforge.loader.slabs import HeapArena

__all__ = ["default_collate", "empty", "padded_collate"]

_BYTES_LIKE = (bytes, bytearray, memoryview, ByteView)  # ByteView: MDS bytes and JINX sidecar values
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})

_arena: Any = None  # the slab arena of the task a worker is running, None elsewhere


def set_arena(arena: Any) -> None:
    """Make ``arena`` the allocator of :func:`empty` and :func:`default_collate` (the worker, per task)."""
    global _arena
    _arena = arena


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor; inside a torchforge worker it lies in the batch's shared memory, so
    a ``collate_fn`` that fills it sends it to the main process without a copy.

    >>> empty((2, 3), torch.uint8).shape
    torch.Size([2, 3])
    """
    if _arena is None:
        return torch.empty(shape, dtype=dtype)
    shape = tuple(int(d) for d in shape)
    if min(shape, default=0) < 0:
        raise RuntimeError(f"empty: negative dimension in {shape}")
    return torch.from_numpy(_arena.alloc(math.prod(shape) * dtype.itemsize)).view(dtype).view(shape)


def empty_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes as a uint8 array, where :func:`empty` puts a tensor (the batch's
    shared memory inside a torchforge worker); ``torch.from_numpy`` of it is such a tensor."""
    return np.empty(nbytes, np.uint8) if _arena is None else _arena.alloc(nbytes)


def _shm_tensor_fn(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
    elem = batch[0]
    if _arena is None or type(elem) is not torch.Tensor or elem.layout is not torch.strided \
            or elem.is_nested or elem.device.type != "cpu" \
            or any(type(t) is not torch.Tensor or t.dtype != elem.dtype or t.shape != elem.shape
                   or t.device != elem.device for t in batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's rules and errors
    out = empty((len(batch), *elem.shape), elem.dtype)
    return torch.stack(batch, 0, out=out)


_SHM_MAP = dict(default_collate_fn_map)
_SHM_MAP[torch.Tensor] = _shm_tensor_fn


def default_collate(batch: list) -> Any:
    """``torch.utils.data.default_collate``, with stacked tensors in the batch's slab inside a worker."""
    return collate(batch, collate_fn_map=_SHM_MAP)


def padded_collate(samples: list) -> Any:
    """Collate multimodal records: bytes padded into ``{"data", "lengths"}``, ragged values as lists
    (see the module docstring for the rules). Tensors are built in the batch's slab inside a worker.

    >>> b = padded_collate([{"id": 1, "img": b"ab"}, {"id": 2, "img": b"c"}])
    >>> b["id"].tolist(), b["img"]["data"].tolist(), b["img"]["lengths"].tolist()
    ([1, 2], [[97, 98], [99, 0]], [2, 1])
    """
    arena = _arena if _arena is not None else HeapArena()
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
        if issubclass(t, (np.ndarray, torch.Tensor)) and t is not ByteView:
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
    if first.device.type == "cpu":
        try:
            with torch.no_grad():  # (detaches, without a call per tensor)
                return torch.stack(vals, out=out)
        except RuntimeError:  # a tensor on another device (or another layout): one at a time
            pass
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


