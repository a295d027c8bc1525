"""libc's ``mmap`` for the maps CPython's ``mmap`` module cannot make: a map that keeps no duplicate
descriptor (the loader's slabs, see :mod:`torchforge.loader.slabs`) and a map placed at a chosen address
inside a reserved range (the feature store's shards side by side, see :mod:`torchforge.features.reader`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import weakref

__all__ = ["HUGE_PAGE", "map_at", "reserve", "round_up", "unmap_with"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64): a page-cache folio this large is mapped by one TLB entry


def round_up(n: int, step: int) -> int:
    """The least multiple of ``step`` that is ``>= n``."""
    return -(-n // step) * step


def map_at(addr: int | None, size: int, prot: int, flags: int, fd: int, what: str) -> int:
    """``mmap(addr, size, prot, flags, fd, 0)``; ``addr`` (not None) is taken as fixed. Returns the
    address. Raises OSError naming ``what``."""
    if addr is not None:
        flags |= _MAP_FIXED
    got = _libc.mmap(addr, size, prot, flags, fd, 0)
    if got is None or got == _FAILED or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {what} ({size} bytes) failed: {os.strerror(err)}{_map_limit(err)}")
    return got


def _map_limit(err: int) -> str:
    """For ENOMEM: how many maps this process has against ``vm.max_map_count`` (the usual cause when
    memory is not short: every mapped file is at least one map)."""
    if err != errno.ENOMEM:
        return ""
    try:
        with open("/proc/self/maps", "rb") as f:
            have = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return ""
    return f" (this process has {have} maps; vm.max_map_count is {limit}: raise it with sysctl, or open fewer files)"


def reserve(size: int, align: int) -> tuple[int, int, int]:
    """``size`` bytes of address space starting on a multiple of ``align``, no memory behind them
    (PROT_NONE: reads fault) until :func:`map_at` places a map there. Returns ``(start, raw, raw_size)``: pass
    ``raw, raw_size`` to :func:`unmap_with`."""
    raw_size = size + align
    raw = map_at(None, raw_size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1,
                 "an address range")
    return round_up(raw, align), raw, raw_size


def unmap_with(owner: object, addr: int, size: int) -> None:
    """Unmap ``[addr, addr + size)`` (every map in it) when ``owner`` is garbage collected; never at
    interpreter exit, when something may still read it (the process's end unmaps it)."""
    weakref.finalize(owner, _libc.munmap, addr, size).atexit = False
