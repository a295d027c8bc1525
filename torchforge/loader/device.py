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

import logging
import mmap
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["DeviceStage", "map_tensors"]

log = logging.getLogger(__name__)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a nested dict/list/tuple batch."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
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
        self._registered: list[tuple[int, mmap.mmap]] = []
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
            log.warning("cudaHostRegister of a %d-byte slab failed (%s); copies will not overlap", len(mm), err)
            return
        self._registered.append((ptr, mm))  # keeps the mapping alive until it is unregistered

    def start(self, batch: Any) -> Any:
        """Begin moving a host batch; returns a handle for :meth:`finish`."""
        if not self.cuda:
            return map_tensors(batch, lambda t: t.to(self.device)) if self.device is not None else batch
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = map_tensors(batch, lambda t: _pinned(t, self.pin).to(self.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        return (moved, event, batch)

    def finish(self, handle: Any) -> Any:
        """The device batch of a handle, ready for use on the current stream."""
        if not self.cuda:
            return handle
        moved, event, host = handle
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        map_tensors(moved, lambda t: (t.record_stream(current), t)[1])
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
            for ptr, _ in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()


def _pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    # Slab tensors are page-locked through cudaHostRegister; heap tensors (num_workers=0) are not,
    # and an asynchronous copy needs pinned memory, so those take one pinned copy first.
    if pin and not t.is_pinned():
        return t.pin_memory()
    return t
