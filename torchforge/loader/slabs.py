"""Shared-memory slabs: the memory batches travel in from workers to the main process.

A slab is one anonymous memory file (``memfd_create``; a ``/dev/shm`` file where that is missing). The
main process creates and owns every slab; a worker opens one by path (``/proc/<main pid>/fd/<fd>``),
bump-allocates a batch into it, grows the file if the batch needs more room, and reports how many bytes
it used. The main process then maps the same pages and hands out tensors that point into them: no copy.

Release: :meth:`SlabPool.lease` returns a fresh numpy base array over the used bytes. Every tensor or
array of the decoded batch is a view of that base, and a ``weakref.finalize`` on the base puts the slab
back on the free list when the last view is garbage collected. A slab is only given to a worker while
it is free, so a batch the user still holds is never overwritten.

Held batches: the pool keeps at most ``keep`` slabs (free, in flight, or leased). A slab leased beyond
that is *detached*: its file is cut to the page-rounded bytes the batch uses and its descriptor closed,
so a batch the user holds costs memory in proportion to its size and no descriptor, however many
batches are held (``list(loader)``). The batch's mapping keeps the pages until the batch dies. Workers
are told the ids of detached slabs (:meth:`SlabPool.take_detached`) and drop their own maps of them.

Leaks: a memfd has no name, so nothing is left in ``/dev/shm`` even if the main process is killed; its
pages are freed when the last descriptor and mapping go away. The ``/dev/shm`` fallback unlinks its files
in :meth:`SlabPool.close` (and at interpreter exit through a finalizer).
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable

import numpy as np

from torchforge._vmem import map_at, round_up, unmap_with

__all__ = ["ALIGN", "Arena", "HeapArena", "SlabPool", "SlabWriter"]

log = logging.getLogger(__name__)
ALIGN = 64
_GROW_STEP = 1 << 20  # slab files grow in whole MiB
_PAGE = mmap.PAGESIZE
_ids = itertools.count()


def _memfd_ok() -> bool:
    if not hasattr(os, "memfd_create"):
        return False
    try:
        fd = os.memfd_create("torchforge-probe", os.MFD_CLOEXEC)
    except OSError:
        return False
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class _Slab:
    __slots__ = ("fd", "id", "mapped", "mm", "path", "unlink")

    def __init__(self, fd: int, path: str, unlink: bool):
        self.id = next(_ids)
        self.fd, self.path, self.unlink = fd, path, unlink
        self.mm: mmap.mmap | None = None
        self.mapped = 0

    def map(self, nbytes: int) -> mmap.mmap:
        """The main-process mapping, remapped larger when a worker grew the file."""
        if self.mm is None or self.mapped < nbytes:
            size = os.fstat(self.fd).st_size
            if size < nbytes:
                raise OSError(f"slab {self.path} holds {size} bytes, a worker reported {nbytes}")
            # An older, smaller mapping may still be exported by a batch the user holds: it stays valid
            # (same pages) and is unmapped by refcounting when that batch dies.
            self.mm = _map_shared(self.fd, size)
            self.mapped = size
        return self.mm


class SlabPool:
    """The main process's slabs: free list, leases and release on garbage collection.

    Args:
        on_map: called as ``on_map(mm)`` after each new mapping (used to page-lock it for CUDA).
        use_memfd: force the memfd (True) or ``/dev/shm`` file (False) backing; None picks memfd if usable.
        keep: slabs the pool keeps open at most; a slab leased beyond that is detached (see the module
            docstring).
    """

    def __init__(self, *, on_map: Callable[[mmap.mmap], None] | None = None, use_memfd: bool | None = None,
                 keep: int = 64):
        self._memfd = _memfd_ok() if use_memfd is None else use_memfd
        self._slabs: dict[int, _Slab] = {}
        self._free: collections.deque[int] = collections.deque()
        self._free_ids: set[int] = set()
        self._on_map = on_map
        self._keep = max(int(keep), 1)
        self._detached: list[int] = []
        self._hint = 0  # the size new slabs start at: the largest batch leased so far, in whole MiB
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._slabs)

    def __len__(self) -> int:
        return len(self._slabs)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every slab mapped in this process: a batch's tensors lie inside them."""
        return [(ctypes.addressof(s.mm), s.mapped) for s in self._slabs.values() if s.mm is not None]

    def acquire(self) -> tuple[int, str]:
        """A free slab (a new one if none is free): its id and the path a worker opens it by."""
        while self._free:
            sid = self._free.popleft()
            self._free_ids.discard(sid)
            slab = self._slabs.get(sid)
            if slab is not None:
                return sid, slab.path
        if self._memfd:
            fd = os.memfd_create(f"torchforge-slab-{len(self._slabs)}", os.MFD_CLOEXEC)
            slab = _Slab(fd, f"/proc/{os.getpid()}/fd/{fd}", unlink=False)
        else:
            fd, path = tempfile.mkstemp(prefix="torchforge-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            slab = _Slab(fd, path, unlink=True)
        if self._hint:  # as large as the batches so far needed: a worker maps it once, never grows it
            os.ftruncate(fd, self._hint)
        self._slabs[slab.id] = slab
        return slab.id, slab.path

    def path(self, sid: int) -> str:
        return self._slabs[sid].path

    def release(self, sid: int) -> None:
        """Return a slab whose contents nobody references (a task that produced no batch)."""
        if not self._closed and sid in self._slabs and sid not in self._free_ids:
            self._free.append(sid)
            self._free_ids.add(sid)  # a slab on the free list twice would go to two writers at once

    def lease(self, sid: int, used: int) -> np.ndarray:
        """A fresh uint8 base array over the first ``used`` bytes; the slab is freed when it dies."""
        slab = self._slabs[sid]
        old = slab.mm
        mm = slab.map(used)
        if mm is not old and self._on_map is not None:
            self._on_map(mm)
        base = np.frombuffer(mm, dtype=np.uint8, count=used)
        if used > self._hint:
            self._hint = round_up(used, _GROW_STEP)
        if len(self._slabs) > self._keep and self._detach(slab, used):
            return base
        weakref.finalize(base, self.release, sid)
        return base

    def _detach(self, slab: _Slab, used: int) -> bool:
        """Give a leased slab's pages to its batch alone: cut the file to what the batch uses, close
        the descriptor, forget the slab (its mapping lives as long as the batch)."""
        try:
            os.ftruncate(slab.fd, max(round_up(used, _PAGE), _PAGE))
        except OSError:
            return False
        os.close(slab.fd)
        if slab.unlink:
            try:
                os.unlink(slab.path)
            except OSError:
                pass
        del self._slabs[slab.id]
        self._detached.append(slab.id)
        return True

    def take_detached(self) -> list[int]:
        """Ids of the slabs detached since the last call (workers drop their maps of them)."""
        out, self._detached = self._detached, []
        return out

    def close(self) -> None:
        """Close every descriptor (and unlink fallback files); mappings users still hold stay valid."""
        self._closed = True
        self._free.clear()
        self._free_ids.clear()
        self._finalizer()


def _close_all(slabs: dict[int, _Slab]) -> None:
    for slab in slabs.values():
        try:
            os.close(slab.fd)
        except OSError:
            pass
        if slab.unlink:
            try:
                os.unlink(slab.path)
            except OSError:
                pass
        slab.mm = None
    slabs.clear()


class Arena:
    """Bump allocator over one slab for one task, on the worker side. Grows the slab file as needed."""

    def __init__(self, fd: int, mm: mmap.mmap, maps: list[tuple[int, int, mmap.mmap]]):
        self._fd = fd
        self._mm = mm
        self._maps = maps  # (address, size, mmap) of every mapping handed out in this task
        self.used = 0

    @property
    def size(self) -> int:
        return len(self._mm)

    def put(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Room for ``nbytes``: its 64-byte-aligned slab offset and a writable uint8 array over it."""
        off = round_up(self.used, ALIGN)
        end = off + nbytes
        if end > len(self._mm):
            self._grow(end)
        self.used = end
        return off, np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=off)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` in the slab (64-byte aligned)."""
        return self.put(nbytes)[1]

    def _grow(self, need: int) -> None:
        size = round_up(max(need, 2 * len(self._mm)), _GROW_STEP)
        os.ftruncate(self._fd, size)
        self._mm = _map_rw(self._fd, size)
        self._maps.append((_address(self._mm), size, self._mm))

    def offset_of(self, ptr: int, nbytes: int) -> int | None:
        """The slab offset of ``[ptr, ptr + nbytes)`` if that memory lies in this arena's slab."""
        for addr, size, _ in self._maps:
            if addr <= ptr and ptr + nbytes <= addr + size:
                return ptr - addr
        return None


class HeapArena:
    """The arena of the in-process path (``num_workers=0``): plain heap memory, nothing shared."""

    used = 0

    def put(self, nbytes: int) -> tuple[int, np.ndarray]:
        return 0, np.empty(nbytes, dtype=np.uint8)

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def offset_of(self, ptr: int, nbytes: int) -> int | None:
        return None


def _address(mm: mmap.mmap) -> int:
    if len(mm) == 0:
        return 0
    probe = np.frombuffer(mm, dtype=np.uint8, count=1)
    addr = probe.ctypes.data
    del probe
    return addr


class SlabWriter:
    """The worker's side: opens slabs once (by id; the path only the first time), keeps them mapped,
    starts one arena per task, and drops the slabs the main process detached."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[int, mmap.mmap]] = {}

    def begin(self, sid: int, path: str) -> Arena:
        """An arena over slab ``sid``. Raises OSError when the slab cannot be opened or mapped."""
        entry = self._open.get(sid)
        if entry is None:
            fd = os.open(path, os.O_RDWR)
            try:
                entry = (fd, _map_whole(fd))
            except BaseException:
                os.close(fd)
                raise
        fd, mm = entry
        size = os.fstat(fd).st_size
        if size != len(mm) and size > 0:  # grown by another worker since we mapped it
            mm = _map_whole(fd)
        self._open[sid] = (fd, mm)
        return Arena(fd, mm, [(_address(mm), len(mm), mm)])

    def end(self, sid: int, arena: Arena) -> None:
        """Keep the arena's newest mapping for the next task on this slab."""
        fd, _ = self._open[sid]
        self._open[sid] = (fd, arena._mm)

    def forget(self, sids: list[int]) -> None:
        """Close the descriptors and maps of slabs the main process detached."""
        for sid in sids:
            entry = self._open.pop(sid, None)
            if entry is not None:
                os.close(entry[0])

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


def _map_shared(fd: int, size: int) -> ctypes.Array:
    """The main process's mapping of a slab, as a ctypes byte array unmapped when its last view dies.

    Not ``mmap.mmap``: CPython's mmap keeps a duplicate of the descriptor for as long as the map
    lives, so every batch a user holds would hold a descriptor too.
    """
    addr = map_at(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, "a slab")
    arr = (ctypes.c_uint8 * size).from_address(addr)
    unmap_with(arr, addr, size)
    return arr


def _map_whole(fd: int) -> mmap.mmap:
    size = os.fstat(fd).st_size
    if size == 0:
        os.ftruncate(fd, _GROW_STEP)
        size = _GROW_STEP
    return _map_rw(fd, size)


def _map_rw(fd: int, size: int) -> mmap.mmap:
    """A worker's mapping, its pages faulted in by one system call (MAP_POPULATE where available)
    instead of one fault per 4 KiB page as the collate writes."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
