"""Checkpoint files: shard planning and the parallel checksummed writer.

:func:`write_files` writes every file's blocks in parallel, digesting each block
(:mod:`torchforge.checkpoint.digest`) while it is in the CPU cache, and fsyncs every file; large files go
with ``O_DIRECT`` where the filesystem allows it. :func:`crash_point` is the test-only hook that kills a
save at a named moment.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from torchforge._vmem import HUGE_PAGE
from torchforge.checkpoint import digest
from torchforge.checkpoint.digest import PAGE, BlockDigest, _digest_of_sums, _page_sums
from torchforge.formats.safetensors import as_bytes, plan, write_all

__all__ = [
    "CRASH_AT",
    "CRASH_POINTS",
    "FilePlan",
    "crash_point",
    "file_plan",
    "huge_page_buffer",
    "plan_group",
    "split_by_size",
    "write_block",
    "write_files",
    "write_run_direct",
]

CHUNK = 4 << 20  # hash-then-write run size
WRITEBACK = True  # start write-back per block (sync_file_range) instead of leaving it all to fsync
DIRECT_MIN = 16 << 20  # files at least this large are written with O_DIRECT where the filesystem allows it
DIRECT_RUN = 32 << 20  # bytes per O_DIRECT write (a multiple of SUM_PIECE that divides digest.BLOCK); large
# writes matter: fewer, larger requests in flight keep the disk busier (figures in benchmarks/RESULTS.md)
SUM_PIECE = 1 << 20  # copied and digested at a time (stays in the CPU cache in between)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
CRASH_AT = "TORCHFORGE_CRASH_AT"
CRASH_POINTS = ("tmp-created", "data-written", "manifest-written", "before-rename", "after-rename",
                "old-step-hidden")
_SYNC_FILE_RANGE_WRITE = 2


def crash_point(name: str) -> None:
    """Test-only hook: SIGKILL this process when the ``TORCHFORGE_CRASH_AT`` environment variable names
    the point of a save reached now (one of ``CRASH_POINTS``), so that a test can kill a save at a
    defined moment and check what it leaves on disk (tests/test_checkpoint_crash.py). Unset, it does
    nothing. The point's name goes to stderr first, so the test can tell where the process died.
    """
    if os.environ.get(CRASH_AT) == name:
        os.write(2, f"torchforge: {CRASH_AT}={name} reached, killing the process\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks in one go (Linux ``fallocate``: contiguous extents, no allocation work
    during write-back); where the filesystem cannot, just set the size (never glibc's zero-filling
    emulation, which would write the file twice)."""
    if _fallocate is None or _fallocate(fd, 0, 0, size) != 0:
        os.ftruncate(fd, size)


@dataclass
class FilePlan:
    """One file of a checkpoint: its name, header bytes and (file offset, tensor) parts, in order."""

    name: str
    head: bytes
    parts: list[tuple[int, torch.Tensor]]
    size: int
    views: list[tuple[int, memoryview]] = field(default_factory=list)  # filled in by bind()/stage()

    @classmethod
    def of_bytes(cls, name: str, data: bytes) -> FilePlan:
        return cls(name, data, [], len(data), [(0, memoryview(data))])

    def bind(self) -> None:
        """Write straight from the tensors' memory (contiguous CPU tensors only)."""
        self.views = [(0, memoryview(self.head))] + [(off, as_bytes(t)) for off, t in self.parts]


def split_by_size(tensors: Mapping[str, torch.Tensor], max_shard: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, in groups closed when the next tensor would pass ``max_shard`` bytes (a larger
    tensor gets a group of its own), as ``transformers`` shards."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    cur = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and cur + n > max_shard:
            shards.append({})
            cur = 0
        shards[-1][name] = t
        cur += n
    return [s for s in shards if s] or [{}]


def file_plan(fname: str, tensors: Mapping[str, torch.Tensor]) -> tuple[FilePlan, list[tuple[str, torch.Tensor, int]]]:
    """One safetensors file's plan, and its layout: (name, tensor, file offset of its data)."""
    head, layout = plan(tensors, align=True)
    size = len(head) + sum(t.numel() * t.element_size() for t in tensors.values())
    return FilePlan(fname, head, [(off, t) for _, t, off in layout], size), layout


def plan_group(prefix: str, tensors: Mapping[str, torch.Tensor], max_shard: int
               ) -> tuple[list[FilePlan], bytes]:
    """Split tensors into ``prefix-0000k-of-0000n.safetensors`` shards (:func:`split_by_size`) and build
    the HF index JSON."""
    shards = split_by_size(tensors, max_shard)
    files, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"{prefix}-{k:05d}-of-{len(shards):05d}.safetensors"
        files.append(file_plan(fname, shard)[0])
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return files, json.dumps(index, indent=2).encode() + b"\n"


def _blocks(views: Sequence[tuple[int, memoryview]], size: int) -> list[list[memoryview]]:
    out: list[list[memoryview]] = [[] for _ in range(max(1, -(-size // digest.BLOCK)))]
    for off, v in views:
        pos = 0
        while pos < len(v):
            b = (off + pos) // digest.BLOCK
            take = min(len(v) - pos, (b + 1) * digest.BLOCK - (off + pos))
            out[b].append(v[pos: pos + take])
            pos += take
    return out


def write_files(folder: str, files: Sequence[FilePlan], pool: ThreadPoolExecutor,
                flusher: ThreadPoolExecutor | None = None,
                then: Callable[[dict[str, dict[str, Any]]], FilePlan] | None = None, *, direct: bool = True,
                spares: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Write files into ``folder`` with parallel block writes, digest each block, fsync each file.

    With ``direct`` (Linux), files of at least ``DIRECT_MIN`` bytes are written with ``O_DIRECT``: each
    thread gathers ``DIRECT_RUN`` bytes of the file into a page-aligned buffer of its own, digests them
    there while they are in the CPU cache and hands them to the disk without the page cache; several
    writes in flight keep the disk's queue full, and the buffers' huge pages let each request reach the
    device's size limit (see :func:`huge_page_buffer`). Its speed does not depend on the state of the
    page cache, where buffered writes plus fsync can swing several-fold: writing into the page cache is
    slow whenever the kernel must first find fresh memory (on a VM, memory its host has not backed yet).
    It also leaves the page cache to the training job. The files are then not in the page cache.
    Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems) the buffered path runs.

    ``spares``: files of a pruned step (paths; the list is consumed) that O_DIRECT files are written over
    instead of new ones: each is renamed into ``folder`` under the new name, overwritten and cut to its
    new size. Writing over allocated blocks skips the filesystem's block allocation (on ext4 1 GiB in
    8 x 32 MiB O_DIRECT writes took 0.36 s over an existing file against 0.45 s into a new one), and the
    pruned step costs no deletion.

    The buffered path: ``pool`` hashes and writes blocks; ``flusher`` (one thread) starts each written
    block's write-back to disk (Linux ``sync_file_range``) so that the disk works while the CPUs still
    hash and copy, and the final fsync has little left to do. ``then(entries)``, if given, makes one more
    (small) file from the entries - the manifest - which is written before the fsyncs, so that all files
    share them.

    Returns:
        The manifest entries of ``files``: name -> ``{"size": bytes, "digests": [hex per 64 MiB block]}``.
    """
    fds: dict[str, int] = {}
    queued: list[Future] = []  # every write, run and fsync handed to the pool
    padded: list[tuple[int, int]] = []  # (fd, size) of files whose last O_DIRECT write went past the end

    def create(name: str, size: int, want_direct: bool = False) -> tuple[int, bool]:
        path, flags = os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd, is_direct = -1, False
        if want_direct and _O_DIRECT and size >= DIRECT_MIN:
            if spares:
                fd = _recycled(spares.pop(), path)
                if fd >= 0:
                    fds[name] = fd
                    padded.append((fd, size))  # cut to its new size once written
                    return fd, True
            try:
                fd, is_direct = os.open(path, flags | _O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = os.open(path, flags, 0o644)
        fds[name] = fd
        if size and not is_direct:  # (fallocate's unwritten extents slow O_DIRECT writes down)
            try:
                _preallocate(fd, size)
            except OSError as e:  # (ftruncate's error names no file: EFBIG, ENOSPC)
                raise OSError(e.errno, e.strerror, path) from None
        return fd, is_direct

    try:
        jobs, flushes = [], []
        for f in files:
            fd, is_direct = create(f.name, f.size, direct)
            if is_direct and f.size % PAGE and (fd, f.size) not in padded:
                padded.append((fd, f.size))
            for b, views in enumerate(_blocks(f.views, f.size)):
                if is_direct:  # runs of a block are written in parallel; the digest is made in order
                    size = min(digest.BLOCK, f.size - b * digest.BLOCK)
                    runs = [pool.submit(write_run_direct, fd, b * digest.BLOCK + k * DIRECT_RUN, run)
                            for k, run in enumerate(_pieces(views, DIRECT_RUN))]
                    queued += runs
                    jobs.append((f.name, lambda runs=runs, size=size: _digest_of_sums(
                        [r.result() for r in runs], size)))
                else:
                    fut = pool.submit(write_block, fd, b * digest.BLOCK, views, flusher, flushes)
                    queued.append(fut)
                    jobs.append((f.name, fut.result))
        sums: dict[str, list[str]] = {f.name: [] for f in files}
        for name, result in jobs:
            with _naming(folder, name):
                sums[name].append(result())
        for fd, size in padded:
            os.ftruncate(fd, size)
        entries = {f.name: {"size": f.size, "digests": sums[f.name]} for f in files}
        crash_point("data-written")
        if then is not None:
            last = then(entries)
            write_all(create(last.name, last.size)[0], [v for _, v in last.views], 0)
            crash_point("manifest-written")
        for fut in flushes:
            fut.result()
        syncs = {name: pool.submit(os.fsync, fd) for name, fd in fds.items()}
        queued += syncs.values()
        for name, fut in syncs.items():
            with _naming(folder, name):
                fut.result()
    finally:
        # A descriptor is closed only once nothing queued can still use it: after a failure (ENOSPC in one
        # block) the other blocks' writes are still running, and a closed number may be reused at once by
        # another open file, which they would then write into.
        concurrent.futures.wait(queued)
        concurrent.futures.wait(list(flushes))
        for fd in fds.values():
            os.close(fd)
    return entries


@contextlib.contextmanager
def _naming(folder: str, name: str) -> Iterator[None]:
    """Give an OSError raised inside (a failed write or fsync: no file name of its own) the file's path."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, os.path.join(folder, name)) from e
        raise


def _unused(path: str) -> bool:
    """Whether no open file refers to ``path`` (a descriptor or a map, in any process): Linux grants a write
    lease (``F_SETLEASE``) only then. A pruned step's file that a reader still has open or mapped (an
    evaluation job restoring it) keeps its bytes: it is deleted, which leaves them to the reader, never
    written over. False where leases are not available (then nothing is written over)."""
    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return True
    except OSError:  # EAGAIN: open elsewhere; EINVAL: no leases on this filesystem
        return False
    finally:
        os.close(fd)


def _recycled(spare: str, path: str) -> int:
    """``spare`` moved to ``path`` and opened for O_DIRECT writes over its blocks; -1 (and nothing at
    ``path``) where it cannot be: gone, linked from elsewhere (another name would see the new bytes), open
    or mapped by any process (:func:`_unused`), not a regular file, or refused by the filesystem. Nobody
    opens it anew meanwhile: it lies in a hidden folder under a name no reader looks for."""
    try:
        st = os.lstat(spare)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or not _unused(spare):
            return -1
        os.rename(spare, path)
    except OSError:
        return -1
    try:
        return os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return -1


_free_buffers: list[memoryview] = []  # page-aligned DIRECT_RUN-byte buffers not in use (kept for the next save)
_buffers_lock = threading.Lock()


def _take_buffer() -> memoryview:
    """A page-aligned ``DIRECT_RUN``-byte buffer. Buffers are shared by every writer thread and returned
    after each run, so a process holds as many as writes were ever in flight at once, not one per
    thread that ever wrote (which grew save after save as the pool's threads took turns)."""
    with _buffers_lock:
        while _free_buffers:
            buf = _free_buffers.pop()
            if len(buf) >= DIRECT_RUN:
                return buf
    return huge_page_buffer(DIRECT_RUN)


def _give_buffer(buf: memoryview) -> None:
    with _buffers_lock:
        _free_buffers.append(buf)



def huge_page_buffer(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory, aligned to 2 MiB and advised for transparent huge pages.

    An O_DIRECT write hands the disk the buffer's physical pages: 4 KiB pages scattered in memory cap a
    request at the device's segment count (``/sys/block/*/queue/max_segments``; 254 x 4 KiB, about 1 MiB,
    on a typical virtio disk) where 2 MiB pages let a request reach its size limit
    (``max_sectors_kb``). It must be a private map: a shared anonymous map (``mmap.mmap(-1, n)``'s
    default) is shmem, which gets transparent huge pages only where
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows. Where the kernel gives none, this is
    plain page-aligned memory.
    """
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, size + HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP switched off: the map works, with 4 KiB pages
            pass
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = -addr % HUGE_PAGE
    return memoryview(m)[start: start + size]  # the view keeps the map alive


def write_run_direct(fd: int, offset: int, views: list[memoryview]) -> np.ndarray:
    """Write one run of a file with O_DIRECT: gather it into an aligned buffer (:func:`_take_buffer`) 1 MiB at a
    time, summing each piece's pages while it is in the CPU cache, and write it (the file's last run is
    zero-padded to a whole page; the caller truncates the file). Returns the run's page sums."""
    buf = _take_buffer()
    try:
        return _write_run_into(buf, fd, offset, views)
    finally:
        _give_buffer(buf)


def _write_run_into(buf: memoryview, fd: int, offset: int, views: list[memoryview]) -> np.ndarray:
    dst = np.frombuffer(buf, dtype=np.uint8)
    n, done, sums = 0, 0, []  # bytes copied, bytes summed, page sums
    for v in views:
        src = np.frombuffer(v, dtype=np.uint8)
        for i in range(0, len(src), SUM_PIECE):
            k = min(SUM_PIECE, len(src) - i)
            np.copyto(dst[n: n + k], src[i: i + k])
            n += k
            if n - done >= SUM_PIECE:
                cut = n // PAGE * PAGE
                sums.append(_page_sums(dst[done: cut]))
                done = cut
    end = -(-n // PAGE) * PAGE
    dst[n:end] = 0
    if end > done:
        sums.append(_page_sums(dst[done: end]))
    pos = 0
    while pos < end:  # a short O_DIRECT write ends on a block boundary: resume there
        pos += os.pwrite(fd, buf[pos:end], offset + pos)
    return np.concatenate(sums) if sums else np.zeros(0, np.uint64)


def _pieces(views: Sequence[memoryview], size: int) -> list[list[memoryview]]:
    """Cut views into runs of at most ``size`` bytes (small views share a run)."""
    runs: list[list[memoryview]] = [[]]
    room = size
    for v in views:
        pos = 0
        while pos < len(v):
            if room == 0:
                runs.append([])
                room = size
            take = min(room, len(v) - pos)
            runs[-1].append(v[pos: pos + take])
            pos += take
            room -= take
    return runs


def write_block(fd: int, offset: int, views: list[memoryview], flusher: ThreadPoolExecutor | None,
                 flushes: list) -> str:
    """Digest and write one block in cache-sized runs (each run is summed, then written while it is still
    in the CPU cache); then hand the block's write-back to the flusher."""
    digest, start = BlockDigest(), offset
    for run in _pieces(views, CHUNK):
        for v in run:
            digest.update(v)
        write_all(fd, run, offset)
        offset += sum(len(v) for v in run)
    if _sync_file_range is not None and flusher is not None and WRITEBACK:
        flushes.append(flusher.submit(_sync_file_range, fd, start, offset - start, _SYNC_FILE_RANGE_WRITE))
    return digest.hexdigest()


