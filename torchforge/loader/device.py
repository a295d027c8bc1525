"""Host-to-device stage: page-locked slabs and copies on a side stream, one batch ahead.

With a CUDA ``device`` (or ``pin_memory=True`` on a machine with CUDA), every slab mapping is page-locked once with ``cudaHostRegister`` (no staging
copy: the batch's own shared memory becomes pinned memory), and each batch is copied with
``non_blocking=True`` on a side stream while the training step still works on the previous batch. The
consumer's stream waits on the copy's event, and every device tensor is marked with
``record_stream`` so the caching allocator does not reuse it early. The host batch (and so its slab) is
kept alive until its copy event has completed, so a slab is never recycled while a copy reads it.

Without CUDA the same stage runs with plain ``.to(device)`` (or nothing when ``device`` is None).

The side stream is created with the first batch, never before: the worker processes have started by
then, so creating it cannot change how they start.
"""
from __future__ import annotations

import copy
import logging
import mmap
import os
import weakref
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["DeviceStage", "map_tensors"]

log = logging.getLogger(__name__)


_LEAVES = frozenset({str, bytes, int, float, bool, type(None)})


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a nested batch, keeping container types as torch's ``pin_memory``
    does: a namedtuple, a Mapping or Sequence subclass comes back as its own type (a copy updated in
    place when mutable), falling back to a dict or list when the type cannot be rebuilt.

    Plain dicts, lists and tuples holding no tensor come back as themselves, not copied: a batch's
    text (lists of chat turns, say) costs one type check per value, once per batch on the main thread.
    """
    t = type(obj)
    if t in _LEAVES:
        return obj
    if t is torch.Tensor or isinstance(obj, torch.Tensor):
        return fn(obj)
    if t is dict:
        out = None
        for k, v in obj.items():
            if type(v) in _LEAVES:
                continue
            new = map_tensors(v, fn)
            if new is not v:
                if out is None:
                    out = dict(obj)
                out[k] = new
        return obj if out is None else out
    if t is list or t is tuple:
        changed = None
        for i, v in enumerate(obj):
            tv = type(v)
            if tv in _LEAVES:
                continue
            if tv is dict:  # a record of plain values (a chat turn): checked here, without a call
                for x in v.values():
                    if type(x) not in _LEAVES:
                        break
                else:
                    continue
            new = map_tensors(v, fn)
            if new is not v:
                if changed is None:
                    changed = list(obj)
                changed[i] = new
        if changed is None:
            return obj
        return changed if t is list else tuple(changed)
    return _map_other(obj, fn)


def _map_other(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Containers other than plain dict, list and tuple, rebuilt as torch's ``pin_memory`` rebuilds them."""
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            if isinstance(obj, MutableMapping):
                clone = copy.copy(obj)
                clone.update(items)
                return clone
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*(map_tensors(v, fn) for v in obj))
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, Sequence):
        values = [map_tensors(v, fn) for v in obj]
        try:
            if isinstance(obj, MutableSequence):
                clone = copy.copy(obj)
                for i, v in enumerate(values):
                    clone[i] = v
                return clone
            return type(obj)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    return obj


class DeviceStage:
    """Moves host batches to ``device``.

    Args:
        device: target device, or None to leave batches on the host.
        pin_memory: page-lock slabs; None means "yes when ``device`` is a CUDA device".
    """

    def __init__(self, device: Any, pin_memory: bool | None):
        self.device = None if device is None else torch.device(device)
        self.cuda = self.device is not None and self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} requested but CUDA is not available")
        if pin_memory is None:
            pin_memory = self.cuda
        if pin_memory and not torch.cuda.is_available():
            pin_memory = False  # torch's own iterator has warned already
        self.pin = bool(pin_memory)
        self.stream: Any = None
        # (address, mapping) of every page-locked slab mapping; the list keeps each mapping alive until
        # it is unregistered, by close() or, for a stage nobody closed, by this finalizer: a mapping
        # unmapped while still registered would make the next mapping at that address unregistrable
        self._registered: list[tuple[int, Any]] = []
        self._unregister = weakref.finalize(self, _unregister_all, self._registered, os.getpid())
        self._unregister.atexit = False  # at exit the process's registrations go with it
        self._pending: deque[tuple[Any, Any]] = deque()

    @property
    def active(self) -> bool:
        return self.device is not None

    def register(self, mm: mmap.mmap) -> None:
        """Page-lock one slab mapping (called once per mapping by the slab pool)."""
        if not self.pin or len(mm) == 0:
            return
        probe = np.frombuffer(mm, dtype=np.uint8, count=1)
        ptr = probe.ctypes.data
        del probe
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(mm), 0)
        if int(err) != 0:
            _clear_cuda_error()  # or the next CUDA call in this thread reports this one's error
            log.warning("cudaHostRegister of a %d-byte slab failed (CUDA error %d); its batches take a pinned "
                        "copy", len(mm), int(err))
            return
        self._registered.append((ptr, mm))  # keeps the mapping alive until it is unregistered

    def start(self, batch: Any) -> Any:
        """Begin moving a host batch; returns a handle for :meth:`finish`."""
        if not self.cuda:
            return map_tensors(batch, lambda t: t.to(self.device)) if self.device is not None else batch
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        tensors: list[torch.Tensor] = []  # the device tensors, for record_stream in finish()

        def move(t: torch.Tensor) -> torch.Tensor:
            out = _pinned(t, self.pin).to(self.device, non_blocking=True)
            tensors.append(out)
            return out

        with torch.cuda.stream(self.stream):
            moved = map_tensors(batch, move)
            event = torch.cuda.Event()
            event.record(self.stream)
        return (moved, tensors, event, batch)

    def finish(self, handle: Any) -> Any:
        """The device batch of a handle, ready for use on the current stream."""
        if not self.cuda:
            return handle
        moved, tensors, event, host = handle
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)
        self._pending.append((event, host))  # the host slab must outlive the copy
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()
        return moved

    def close(self) -> None:
        """Wait for outstanding copies and unregister every page-locked mapping."""
        if self.cuda:
            for event, _ in self._pending:
                event.synchronize()
            self._pending.clear()
        self._unregister()


def _unregister_all(registered: list[tuple[int, Any]], pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the list, not the registrations
        for ptr, _ in registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``), which torch's cudart
    module does not expose: through the libcudart this process has loaded."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    # Slab tensors are page-locked through cudaHostRegister; heap tensors (num_workers=0) are not,
    # and an asynchronous copy needs pinned memory, so those take one pinned copy first.
    if pin and not t.is_pinned():
        return t.pin_memory()
    return t
