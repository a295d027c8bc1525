"""Batches from a worker to the main process through a shared-memory slab: pickle protocol 5 with
out-of-band buffers.

:func:`encode` pickles any picklable batch (namedtuples, Mapping subclasses, dataclasses, custom batch
objects, nested tensors all keep their types). Every buffer pickle can take out of band -- the data of
CPU tensors and of numpy arrays -- lands in the worker's :class:`~torchforge.loader.slabs.Arena`
instead of the pickle stream; data the collate already built in the slab is referenced where it is, not
copied. The pickle stream itself is written into the slab too, so only a few integers cross the pipe.
:func:`decode` unpickles in the main process with the slab's views as the buffers: tensors and arrays
are views of the slab (no copy), and they keep it leased while they live. Tensors of one batch that
share a storage arrive sharing one, with their strides, as from torch's workers (a view that touches
few of the bytes between its first and last element is sent compactly instead).

Tensors that pickle in band (their own ``__reduce_ex__``): tensors that require grad, sparse, nested
and quantized tensors, tensor subclasses, and tensors on other devices (copied to the CPU by torch).

Only the main process unpickles, and only what its own workers wrote.
"""
from __future__ import annotations

import contextlib
import gc
import io
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from torchforge.loader.slabs import Arena, HeapArena

__all__ = ["decode", "encode"]

_IN_BAND = 64  # buffers smaller than this go into the stream: a view costs more than the copy


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arena: Arena | HeapArena):
        super().__init__(file, protocol=5, buffer_callback=self._place)
        self.arena = arena
        self.buffers: list[int] = []  # offset, length, offset, length, ...
        # storage address -> (first byte, end byte, dtype, tensor) of each tensor placed whole from it
        self.spans: dict[int, list[tuple[int, int, torch.dtype, torch.Tensor]]] = {}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout is torch.strided and obj.device.type == "cpu" \
                and not obj.requires_grad and not obj.is_nested and not obj.is_quantized:
            if obj.is_conj() or obj.is_neg():  # its stored bytes are not its values: a resolved copy
                return self._tensor(obj.resolve_conj().resolve_neg(), False)
            return self._tensor(obj, True)
        return NotImplemented

    def _tensor(self, t: torch.Tensor, shareable: bool) -> Any:
        """Tensors that share a storage arrive sharing one, strides kept (as torch's workers send them): a
        tensor's bytes from its first to its last element are placed once, and a later tensor of the batch
        that lies inside them (inputs and targets sliced from one token tensor) is rebuilt as a view of the
        first one's storage (the pickle memo hands the decoder that same tensor). A view whose elements
        are spread thin over its range is copied compactly instead."""
        dtype, shape, size = t.dtype, tuple(t.shape), t.element_size()
        nbytes = t.numel() * size
        if nbytes == 0:
            return _rebuild_tensor, (pickle.PickleBuffer(bytearray()), str(dtype)[6:], shape)
        stride = t.stride()
        lo = t.storage_offset() * size
        contiguous = t.is_contiguous() and t.numel() > 1  # (one element may have any stride: no flat view)
        hi = lo + (nbytes if contiguous else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * size)
        key = t.data_ptr() - lo  # the storage's address
        placed = self.spans.get(key)
        for a, b, dt, first in placed or ():
            if a <= lo and hi <= b and dt == dtype and (lo - a) % size == 0:
                return _view_of, (first, shape, stride, (lo - a) // size)
        if hi - lo > 2 * nbytes:  # a thin view of a larger storage: its elements only
            flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            return _rebuild_tensor, (pickle.PickleBuffer(flat), str(dtype)[6:], shape)
        if contiguous:
            data = t.reshape(-1).view(torch.uint8).numpy()
        else:
            data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), lo, (hi - lo,)).numpy()
        if shareable:  # (the object pickle memoizes: a later view refers to it)
            if placed is None:
                self.spans[key] = [(lo, hi, dtype, t)]
            else:
                placed.append((lo, hi, dtype, t))
        return _rebuild_view, (pickle.PickleBuffer(data), str(dtype)[6:], shape, stride)

    def _place(self, buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        n = raw.nbytes
        if n < _IN_BAND:
            return True
        src = np.frombuffer(raw, dtype=np.uint8)
        off = self.arena.offset_of(src.ctypes.data, n)
        if off is None:
            off, dst = self.arena.put(n)
            np.copyto(dst, src)
        self.buffers += (off, n)
        return False


def encode(obj: Any, arena: Arena | HeapArena) -> tuple[int, int, list[int]]:
    """Write ``obj`` into ``arena``.

    Returns:
        ``(stream_offset, stream_length, buffers)``: where the pickle stream lies in the slab, and the
        flat ``[offset, length, ...]`` list of its out-of-band buffers, in order.

    Raises:
        Whatever pickling ``obj`` raises (an object that cannot be pickled).
    """
    out = io.BytesIO()
    p = _Pickler(out, arena)
    with _no_gc():
        p.dump(obj)
    stream = out.getbuffer()
    off, dst = arena.put(len(stream))
    dst[:] = np.frombuffer(stream, dtype=np.uint8)
    return off, len(stream), p.buffers


def decode(base: np.ndarray, stream_offset: int, stream_length: int, buffers: list[int]) -> Any:
    """Rebuild an object from its slab: tensor and array data are views of ``base`` (no copy)."""
    views = [base[buffers[i]:buffers[i] + buffers[i + 1]] for i in range(0, len(buffers), 2)]
    with _no_gc():
        return pickle.loads(base[stream_offset:stream_offset + stream_length], buffers=views)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC: building many small acyclic objects would trigger needless full passes over
    a large heap."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"unknown tensor dtype {name!r} in a batch from a worker")
    return dt


def _slab_bytes(buf: Any) -> np.ndarray:
    """A buffer pickle handed back (a slab view, or the stream's in-band bytes) as a writable uint8 array."""
    if isinstance(buf, np.ndarray):
        return buf
    return np.frombuffer(buf if isinstance(buf, bytearray) else bytearray(buf), dtype=np.uint8)


def _rebuild_view(buf: Any, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """A tensor with its strides over its bytes (from its first to its last element) in the slab."""
    return torch.from_numpy(_slab_bytes(buf)).view(_dtype(dtype)).as_strided(shape, stride, 0)


def _view_of(first: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
    """A tensor that lay inside an earlier one's bytes: a view of that tensor's storage."""
    return first.as_strided(shape, stride, first.storage_offset() + offset)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = _dtype(dtype)
    buf = _slab_bytes(buf)
    if buf.size == 0:
        return torch.empty(shape, dtype=dt)
    return torch.from_numpy(buf).view(dt).view(shape)
