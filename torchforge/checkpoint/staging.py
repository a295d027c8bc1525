"""Staging: copying the state into a reusable CPU buffer (the snapshot of a non-blocking save, and the
way GPU tensors reach the disk), and the copies of a restore."""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torchforge.checkpoint.writer import FilePlan
from torchforge.formats.safetensors import as_bytes

__all__ = ["Arena", "copy_tensors", "pinned_empty"]


class Arena:
    """A reusable CPU buffer (pinned when CUDA is present) that snapshots tensors in file layout."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self._layout: tuple[Any, list[torch.Tensor], list[memoryview]] | None = None  # the last stage's views

    def stage(self, files: Sequence[FilePlan], *, ordered: bool = False) -> Any:
        """Copy every part of ``files`` into the arena and point the files' views at it.

        The destination views are kept and reused while the files' layout stays the same (save after
        save of one model): making them costs about 40 us a tensor. See :func:`copy_tensors` for what
        ``ordered`` does and what is returned.
        """
        layout = tuple((f.size, len(f.head), tuple((off, t.dtype, t.shape) for off, t in f.parts)) for f in files)
        if self._layout is not None and self._layout[0] == layout and self.buf is not None:
            dsts, spans = self._layout[1], self._layout[2]
        else:
            self._layout = None
            regions, total = [], 0
            for f in files:
                regions.append(total)
                total += -(-(f.size - len(f.head)) // 64) * 64
            if self.buf is None or self.buf.numel() < total:
                self.buf = None
                self.buf = pinned_empty(total) if torch.cuda.is_available() else torch.empty(total, dtype=torch.uint8)
            dsts, spans = [], []
            for f, base in zip(files, regions):
                hl = len(f.head)
                for off, t in f.parts:
                    n = t.numel() * t.element_size()
                    if n:
                        dsts.append(self.buf[base + off - hl: base + off - hl + n].view(t.dtype).view(t.shape))
                spans.append(as_bytes(self.buf[base: base + f.size - hl]) if f.size > hl else memoryview(b""))
            self._layout = (layout, dsts, spans)
        pairs = []
        it = iter(dsts)
        for f, span in zip(files, spans):
            pairs += [(next(it), t) for _, t in f.parts if t.numel()]
            f.views = [(0, memoryview(f.head))]
            if len(span):
                f.views.append((len(f.head), span))
        return copy_tensors(pairs, ordered=ordered)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, exactly: ordinary memory registered with CUDA
    (``cudaHostRegister``). ``torch.empty(..., pin_memory=True)`` goes through the caching host
    allocator, which rounds a request up to the next power of two: a 5 GiB state would pin 8 GiB. Falls
    back to that allocator where registering fails."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    try:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
    except Exception:  # noqa: BLE001 - an old driver, a sandbox: pin through torch's allocator instead
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = buf[:nbytes]
    weakref.finalize(out, _unregister, buf.data_ptr(), buf)  # the finalizer holds buf until out dies
    return out


def _unregister(ptr: int, buf: torch.Tensor) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        torch.cuda.cudart().cudaHostUnregister(ptr)


_side_streams: dict[Any, Any] = {}


def copy_tensors(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, ordered: bool = False) -> list[Any]:
    """``dst.copy_(src)`` for every pair. CPU pairs are copied by torch, which splits each copy over its
    intra-op threads (8 MiB pieces shared by a pool of threads through numpy were no faster), and it is
    the copy ``load_file`` + ``copy_`` uses.

    Copies that involve a GPU are waited for before returning, unless ``ordered``: then they run on a
    side stream of each device (after everything already queued on its current stream), the current
    stream is made to wait for them (kernels queued after this call, an optimizer step for instance,
    run after the copies), and the host does not wait. The returned CUDA events (one per device, none
    without GPU copies) say when the destinations are complete: synchronize them before reading those.
    """
    gpu = []
    with torch.no_grad():
        for dst, src in pairs:
            if "cuda" in (dst.device.type, src.device.type):
                gpu.append((dst, src))
            else:
                dst.copy_(src)  # under no_grad: no detach needed (a DTensor's would cost a dispatch)
        return _copy_gpu(gpu, ordered) if gpu else []


def _copy_gpu(pairs: list[tuple[torch.Tensor, torch.Tensor]], ordered: bool) -> list[Any]:
    if not ordered:
        devices = set()
        for dst, src in pairs:
            dst.copy_(src.detach(), non_blocking=True)
            devices.update(t.device for t in (dst, src) if t.is_cuda)
        for device in devices:  # every device a copy ran on, not only the current one
            torch.cuda.synchronize(device)  # the sources (mmaps, live tensors) may go away once we return
        return []
    by_device: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        by_device.setdefault(src.device if src.is_cuda else dst.device, []).append((dst, src))
    events = []
    for device, group in by_device.items():
        current = torch.cuda.current_stream(device)
        side = _side_streams.get(device)
        if side is None:
            side = _side_streams[device] = torch.cuda.Stream(device)
        side.wait_stream(current)  # the snapshot sees every kernel queued before save()
        with torch.cuda.stream(side):
            for dst, src in group:
                dst.copy_(src.detach(), non_blocking=True)
                if src.is_cuda:
                    src.record_stream(side)  # its memory is not reused before the copy has run
        done = torch.cuda.Event()
        done.record(side)
        current.wait_event(done)  # later kernels on the current stream may change the sources
        events.append(done)
    return events
