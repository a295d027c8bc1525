"""Whole objects downloaded in parts, inside the fetcher: concurrent range GETs into the object's cache
file, with the parts a reader is waiting for fetched first.

A shard that a first batch needs two samples of should not keep that batch waiting for all of its 64 MiB.
So a download is tracked in blocks of :data:`BLOCK` bytes and fetched by the fetcher's pool of threads,
which serves every download of the node. The blocks readers wait for (:meth:`PartScheduler.read`) come
first, each run of them one range GET; otherwise a thread takes the next :data:`PART` bytes (one GET) of
the oldest download, so shards still complete in the order they were first needed. Blocks readers wait
for never queue behind parts in order (:data:`URGENT_THREADS` threads take only them), but parts in order
go on while they are in flight: in an exactly shuffled cold epoch some reader waits for some block nearly
all the time, and holding every part in order back meanwhile left the downloads to those blocks alone
(``benchmarks/remote.py``, cold epoch, alternating runs: 2,850-3,130 samples/s holding back, 2,990-3,490
not; a cap of 4 parts in order, or holding back for the first 32 blocks, fell in between). The price is
the first batch's: its blocks share the link with up to :data:`THREADS` parts in order (0.82-1.33 s to the
first batch there, against 0.66-0.87 s holding back and MosaicML Streaming's 1.49-1.76 s). Each GET's
length is checked and its bytes written in place into the temporary file the cache reserved; the object
is renamed into the cache only once every block is there (and its hash, when the index records one,
checks out), exactly as a one-stream download was. Readers of an object whose index records a hash wait
for the whole object: no byte is served before it is verified.

An object read in no particular order takes ``size / PART`` GETs plus one per run of blocks readers asked
for first; its bytes are fetched once whatever the order.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BLOCK", "PART", "THREADS", "URGENT_THREADS", "Download", "PartScheduler"]

BLOCK = int(os.environ.get("TORCHFORGE_FETCH_BLOCK") or 2 << 20)  # what a download tracks, and a reader waits for
PART = int(os.environ.get("TORCHFORGE_FETCH_PART") or 8 * BLOCK)  # the most bytes of one GET in order
THREADS = int(os.environ.get("TORCHFORGE_FETCH_THREADS") or 8)  # range GETs in order in flight per fetcher
URGENT_THREADS = 8  # more threads that fetch only blocks readers wait for (they never queue behind the rest)

_TODO, _TAKEN, _DONE = 0, 1, 2


class Download:
    """One object being downloaded into its cache file. Fields are guarded by the scheduler's lock."""

    def __init__(self, key: Any, url: str, size: int, context: Any, *, verified_only: bool) -> None:
        self.key = key  # (URL, version): one download per object version in a fetcher
        self.url = url
        self.size = size
        self.context = context  # what the part fetcher needs (store, key, pinned ETag): the fetcher's
        self.verified_only = verified_only  # readers wait for the whole object (it has a hash to check)
        self.blocks = -(-size // BLOCK)
        self.state = bytearray(self.blocks)
        self.left = self.blocks  # blocks not yet written
        self.urgent: deque[int] = deque()  # blocks readers wait for
        self.cursor = 0  # no block below this is still to do
        self.fd = -1  # the temporary file, while parts are written into it
        self.inflight = 0  # parts being fetched or written now
        self.readers = 0  # readers reading the temporary file now
        self.ended = False  # the download is over (complete or failed); fd closes once nobody uses it
        self.ran = False  # the object was downloaded (not found in the cache)
        self.claimed = False  # a fetch request has reported the download as its own
        self.path: str | None = None  # the object's cache file, once complete
        self.error: BaseException | None = None
        self.changed: threading.Condition | None = None  # its readers and downloader wait here (set by the scheduler)

    def span(self, first: int, count: int) -> tuple[int, int]:
        """The bytes of blocks ``first`` to ``first + count - 1``."""
        return first * BLOCK, min(self.size, (first + count) * BLOCK)

    def run_from(self, b: int, most: int) -> int:
        """How many blocks from ``b`` on (at most ``most``) are still to do."""
        n = 0
        while n < most and b + n < self.blocks and self.state[b + n] == _TODO:
            n += 1
        return n


class PartScheduler:
    """The fetcher's pool of part-fetching threads and its downloads in progress.

    Args:
        fetch_part: ``fetch_part(download, start, end)`` returns the object's bytes ``[start, end)`` (exactly
            that many, retried and typed by the caller) or raises.
    """

    def __init__(self, fetch_part: Callable[[Download, int, int], Any]) -> None:
        self.fetch_part = fetch_part
        # one lock, three kinds of waiters, each woken only by what concerns it: the pool's threads (work
        # to take), and per download its readers and its downloader (its parts written, its end). With one
        # condition for all, every part written woke every waiting reader of every download and every idle
        # thread (a few dozen in an exactly shuffled cold epoch), each to take the GIL and sleep again: the
        # cold epoch of benchmarks/remote.py made ~2,650 samples/s with that, ~2,930 without
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)  # (callers hold it as the scheduler's lock)
        self._pool = threading.Condition(self._lock)
        self.active: dict[Any, Download] = {}  # oldest first
        self._threads = 0

    # -- the downloader's side (the thread that owns the cache file) ----------------------------------
    def run(self, d: Download, fd: int) -> None:
        """Download every part of ``d`` into the file ``fd`` (its temporary cache file); returns once all
        are written, raises the first part's error. Called again after a failed verification, it fetches
        every part again."""
        with self.cond:
            if d.ran:  # again, after a failed verification: every block is fetched again
                d.state[:] = bytes(d.blocks)
                d.left, d.cursor = d.blocks, 0
            d.ran = True
            if d.fd < 0:
                d.fd = os.dup(fd)
            self._more_threads()
            self._pool.notify_all()
            changed = self._changed(d)
            changed.notify_all()  # readers waiting for the file to exist
            while d.left and d.error is None:
                changed.wait()
            if d.error is not None:
                raise d.error.with_traceback(None)  # (one error object, raised by many threads)

    def end(self, d: Download, *, path: str | None = None, error: BaseException | None = None) -> None:
        """``d`` is over: complete in the cache at ``path``, or failed with ``error``."""
        with self.cond:
            d.path, d.ended = path, True
            if error is not None and d.error is None:
                d.error = error
            if self.active.get(d.key) is d:
                del self.active[d.key]
            self._release(d)
            self._changed(d).notify_all()
            self._pool.notify_all()  # (its parts left to take are dropped)

    # -- readers ---------------------------------------------------------------------------------------
    def wait(self, d: Download) -> str:
        """The cache file of ``d`` once complete; raises its error once it is over (its partial file gone)."""
        with self.cond:
            changed = self._changed(d)
            while not d.ended:
                changed.wait()
            if d.error is not None:
                raise d.error.with_traceback(None)  # (one error object, raised by many threads)
            return d.path

    def want(self, d: Download, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Queue the blocks holding ``ranges`` before every other part of ``d`` (none if ``d`` is
        ``verified_only``: its readers wait for the whole object anyway); returns the blocks. Call with
        the lock held."""
        blocks = sorted({b for s, e in ranges if e > s for b in range(s // BLOCK, (e - 1) // BLOCK + 1)})
        if not d.verified_only:
            todo = [b for b in blocks if d.state[b] == _TODO]
            if todo:
                d.urgent.extend(todo)
                self._pool.notify(len(todo))
        return blocks

    def read(self, d: Download, ranges: Sequence[tuple[int, int]]) -> tuple[list[bytes], str | None]:
        """The bytes of each ``[start, end)`` of ``d``, as soon as the parts holding them are written (their
        fetch comes before any other part's), or once the object is complete if it is ``verified_only``;
        and the object's cache file if it was complete by then (else None)."""
        with self.cond:
            want = self.want(d, ranges)
            changed = self._changed(d)

            def ready() -> bool:  # a failed download is reported once over (its partial file removed)
                if d.ended:
                    return True
                return (d.error is None and not d.verified_only and d.fd >= 0
                        and all(d.state[b] == _DONE for b in want))

            while not ready():
                changed.wait()
            if d.error is not None:
                raise d.error.with_traceback(None)  # (one error object, raised by many threads)
            if d.path is not None:
                path, fd = d.path, -1
            else:
                path, fd = None, d.fd
                d.readers += 1
        try:
            if path is not None:
                with open(path, "rb") as f:
                    return [os.pread(f.fileno(), e - s, s) for s, e in ranges], path
            return [os.pread(fd, e - s, s) for s, e in ranges], None
        finally:
            if path is None:
                with self.cond:
                    d.readers -= 1
                    self._release(d)

    # -- the pool ----------------------------------------------------------------------------------------
    def _more_threads(self) -> None:
        while self._threads < THREADS + URGENT_THREADS:
            urgent_only = self._threads >= THREADS
            self._threads += 1
            threading.Thread(target=self._work, args=(urgent_only,), daemon=True, name="torchforge-parts").start()

    def _take(self, urgent_only: bool) -> tuple[Download, int, int] | None:
        """The next GET: ``(download, first block, blocks)``. Blocks a reader waits for come first
        (oldest download first; a run of them is one GET); else, unless ``urgent_only``, the next
        :data:`PART` of the oldest download."""
        live = [d for d in self.active.values() if d.fd >= 0 and d.left and d.error is None and not d.ended]
        for d in live:
            while d.urgent:
                b = d.urgent.popleft()
                if d.state[b] == _TODO:
                    n = 1
                    while d.urgent and d.urgent[0] == b + n and d.state[b + n] == _TODO:
                        d.urgent.popleft()
                        n += 1
                    return d, b, n
        if urgent_only:
            return None
        for d in live:
            while d.cursor < d.blocks and d.state[d.cursor] != _TODO:
                d.cursor += 1
            if d.cursor < d.blocks:
                return d, d.cursor, d.run_from(d.cursor, max(1, PART // BLOCK))
        return None

    def _work(self, urgent_only: bool) -> None:
        while True:
            with self.cond:
                task = self._take(urgent_only)
                while task is None:
                    self._pool.wait()
                    task = self._take(urgent_only)
                d, first, count = task
                d.state[first:first + count] = bytes([_TAKEN]) * count
                d.inflight += 1
                fd = d.fd
            s, e = d.span(first, count)
            err: BaseException | None = None
            try:
                data = self.fetch_part(d, s, e)
                if len(data) != e - s:
                    raise AssertionError(f"bytes [{s}, {e}) of {d.url} came back as {len(data)} bytes")
                view, at = memoryview(data), s
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            except BaseException as exc:  # noqa: BLE001 - handed to every reader and the downloader
                err = exc
            with self.cond:
                d.inflight -= 1
                if err is not None:
                    d.state[first:first + count] = bytes(count)
                    if d.error is None:
                        d.error = err
                elif d.state[first] == _TAKEN:  # (not reset by a new run meanwhile)
                    d.state[first:first + count] = bytes([_DONE]) * count
                    d.left -= count
                self._release(d)
                self._changed(d).notify_all()

    def _changed(self, d: Download) -> threading.Condition:
        """The condition ``d``'s readers and downloader wait on (made on first use). Call with the lock held."""
        if d.changed is None:
            d.changed = threading.Condition(self._lock)
        return d.changed

    def _release(self, d: Download) -> None:
        """Close the temporary file's descriptor once the download is over and nobody writes or reads it
        (a descriptor closed while another thread uses it could be reused for another file)."""
        if d.ended and d.fd >= 0 and not d.inflight and not d.readers:
            os.close(d.fd)
            d.fd = -1
