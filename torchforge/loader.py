"""torchforge.DataLoader: a worker pool that hands batches over in shared memory, in sampler order.

Example:
    >>> from torchforge import DataLoader
    >>> loader = DataLoader(list(range(10)), batch_size=4, num_workers=0)
    >>> [b.tolist() for b in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

How a batch travels: the main process cuts the sampler's index stream into batches and sends each
index list to the least busy worker together with a free shared-memory slab; the worker fetches the
samples, collates them straight into the slab and sends back a few bytes saying where the batch is. The
main process maps the slab and yields tensors that point into it (see :mod:`torchforge._shm` for the
release rule: a slab is reused only after every tensor of its batch has been garbage collected).

Guarantees: batches come out in sampler order; a worker that dies (SIGKILL, segfault, out of memory) is
restarted and its in-flight batches re-issued, up to ``max_retries`` times per batch; no batch is lost,
duplicated or reordered. ``state_dict()`` taken between two batches resumes exactly at the next one.
Workers and slabs are released at the end of an epoch, on ``break`` (when the iterator is collected),
on an exception, on KeyboardInterrupt and when the loader and its iterator are garbage collected.
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torchforge._collate import default_collate
from torchforge._device import DeviceStage
from torchforge._sampling import batches, default_sampler
from torchforge._shm import HeapArena, SlabPool
from torchforge._transport import decode
from torchforge._workers import WorkerPool, choose_context, fetch
from torchforge.errors import WorkerError

__all__ = ["DataLoader"]

log = logging.getLogger(__name__)
_ON_ERROR = ("raise", "skip")


class DataLoader:
    """Batches of a map-style dataset, loaded by worker processes into shared memory.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``); ``__getitems__`` is used when
            present and ``on_error="raise"``.
        batch_size: samples per batch.
        sampler: any iterable of indices (a torch ``Sampler``, a ``GlobalSampler``, a list). Samplers with
            ``indices(start, stop)`` are read in slices; ``set_epoch`` is called when present. Default: a
            ``GlobalSampler`` (shuffled with ``seed`` if ``shuffle``, in index order otherwise).
        shuffle: shuffle the default sampler (ignored when ``sampler`` is given).
        seed: seed of the default sampler and of the workers' random generators (``seed + worker_id``).
        drop_last: drop the last, incomplete batch.
        num_workers: worker processes; 0 loads in the calling process.
        collate_fn: ``collate_fn(samples) -> batch``; default: :func:`torchforge._collate.default_collate`,
            which builds the batch tensors directly in shared memory.
        pin_memory: page-lock the slabs; None means "when ``device`` is a CUDA device".
        device: move every batch there (CUDA: asynchronously on a side stream, one batch ahead).
        prefetch: batches in flight (issued to workers and not yet yielded), at least ``num_workers``.
        timeout: seconds to wait for one batch before raising :class:`WorkerError`; None waits forever.
        on_error: ``"raise"`` re-raises an exception of the dataset or collate_fn in the main process as a
            :class:`WorkerError` carrying the worker's traceback; ``"skip"`` leaves the failing sample out
            of its batch, counts it in :attr:`skipped` and logs it.
        max_retries: times one batch may be re-issued after its worker died before the loader raises.
        persistent_workers: keep the worker processes, their memory maps and warm caches, and the slab
            pool from one epoch to the next (stopped by :meth:`close` or when the loader is garbage
            collected). An epoch left early with batches in flight stops them; the next epoch starts anew.
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default fork on Linux while
            CUDA is not initialised (workers start in milliseconds and inherit the dataset's open memory
            maps), spawn otherwise (the dataset is pickled). Fork copies only the calling thread: if the
            program runs threads that may hold locks at that moment, choose spawn or forkserver.

    Raises:
        ValueError: an argument is out of range (the message lists the allowed values).
    """

    def __init__(self, dataset: Any, batch_size: int, *, sampler: Iterable[int] | None = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, num_workers: int = 2,
                 collate_fn: Callable[[list], Any] | None = None, pin_memory: bool | None = None,
                 device: Any = None, prefetch: int = 4, timeout: float | None = None, on_error: str = "raise",
                 max_retries: int = 3, persistent_workers: bool = False,
                 multiprocessing_context: str | None = None):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if int(num_workers) < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of {list(_ON_ERROR)}")
        if int(max_retries) < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 or None")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.sampler = sampler if sampler is not None else default_sampler(dataset, shuffle=shuffle, seed=seed)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_workers = int(num_workers)
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.device = device
        self.prefetch = max(int(prefetch), self.num_workers, 1)
        self.timeout = timeout
        self.on_error = on_error
        self.max_retries = int(max_retries)
        self.multiprocessing_context = multiprocessing_context
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        self._kept: _Resources | None = None  # persistent_workers: what outlives one epoch
        self.skipped = 0  #: samples left out under on_error="skip", over the loader's lifetime
        self._state = {"epoch": 0, "batch": 0}  # position after the last batch yielded
        self._resume: dict[str, int] | None = None  # one-shot start set by load_state_dict / set_epoch
        self._iterator: weakref.ref | None = None

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch`` (forwarded to the sampler).

        Without it, each completed epoch advances the epoch by one; an epoch left early (``break``)
        is restarted from its first batch by the next ``iter()``.
        """
        self._resume = {"epoch": int(epoch), "batch": 0}

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch yielded: ``{"epoch": e, "batch": next batch of epoch e}``."""
        return dict(self._resume if self._resume is not None else self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a position saved by :meth:`state_dict` (the next iteration yields exactly the
        batches that would have followed)."""
        try:
            epoch, batch = int(state["epoch"]), int(state["batch"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"state {state!r} is not a DataLoader state (keys 'epoch' and 'batch')") from None
        if epoch < 0 or batch < 0:
            raise ValueError(f"state {state!r} has a negative epoch or batch")
        self._resume = {"epoch": epoch, "batch": batch}

    def close(self) -> None:
        """Stop the iterator in progress and, with ``persistent_workers``, the kept workers."""
        old = self._iterator() if self._iterator is not None else None
        if old is not None:
            old.close()
        if self._kept is not None:
            self._kept.finalizer()
            self._kept = None

    def _resources(self) -> _Resources:
        """Workers, slab pool and device stage for one epoch, or the kept ones."""
        if self._kept is not None and self._kept.finalizer.alive:
            return self._kept
        res = _Resources(self)
        if self.persistent_workers:
            self._kept = res
        return res

    def __iter__(self) -> Iterator[Any]:
        old = self._iterator() if self._iterator is not None else None
        if old is not None:
            old.close()  # one live iterator per loader, like torch's
        start = self._resume if self._resume is not None else {"epoch": self._state["epoch"], "batch": 0}
        self._resume = None
        self._state = dict(start)
        it = _Iter(self)
        self._iterator = weakref.ref(it)
        return it


class _Resources:
    """What an epoch runs on: the device stage and, with workers, the slab pool and the worker pool."""

    def __init__(self, loader: DataLoader):
        self.stage = DeviceStage(loader.device, loader.pin_memory)
        self.pool = self.workers = None
        if loader.num_workers > 0:
            self.pool = SlabPool(on_map=self.stage.register)
            self.workers = WorkerPool(loader.num_workers, choose_context(loader.multiprocessing_context),
                                      loader.dataset, loader.collate_fn, loader.on_error, loader.seed)
        self.finalizer = weakref.finalize(self, _shutdown, self.workers, self.pool, self.stage)


class _Iter:
    """One epoch: host batches from workers (or in-process), then the device stage one batch ahead."""

    def __init__(self, loader: DataLoader):
        self._loader = loader
        self._state = loader._state
        epoch, start = self._state["epoch"], self._state["batch"]
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        self._plan = batches(loader.sampler, loader.batch_size, loader.drop_last, start)
        self._res = res = loader._resources()
        self._stage, self._pool, self._workers = res.stage, res.pool, res.workers
        self._inflight: dict[int, list] = {}  # seq -> [worker, indices, slab id, retries]
        self._done: dict[int, dict] = {}
        # The epoch's end: kept resources survive it unless batches are still in flight or unread.
        self._finalizer = weakref.finalize(self, _end_epoch, res, loader.persistent_workers, self._inflight,
                                           self._done)
        self._next = start
        self._load = [0] * loader.num_workers
        self._exhausted = False
        self._finished = False
        self._staged: tuple[int, Any] | None = None

    def __iter__(self) -> _Iter:
        return self

    def __next__(self) -> Any:
        if not self._finalizer.alive:
            raise StopIteration  # finished or closed
        try:
            if not self._stage.active:
                seq, batch = self._host_next()
                self._advance(seq)
                return batch
            if self._staged is None:
                self._staged = self._stage_next()
            seq, handle = self._staged
            self._staged = None if seq is None else self._stage_next()
            if seq is None:
                raise StopIteration
            batch = self._stage.finish(handle)
            self._advance(seq)
            return batch
        except StopIteration:
            if not self._finished:
                self._finished = True
                self._state.update(epoch=self._state["epoch"] + 1, batch=0)
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _stage_next(self) -> tuple[int | None, Any]:
        try:
            seq, batch = self._host_next()
        except StopIteration:
            return None, None
        return seq, self._stage.start(batch)

    def _advance(self, seq: int) -> None:
        self._state["batch"] = seq + 1

    def close(self) -> None:
        """Stop the workers and release the slabs (batches already yielded stay valid)."""
        self._exhausted = True
        self._finalizer()

    # --- host batches ---------------------------------------------------------------------------------
    def _host_next(self) -> tuple[int, Any]:
        while True:
            if self._workers is None:
                seq, indices = next(self._plan)
                samples, skipped = fetch(self._loader.dataset, indices, self._loader.on_error)
                self._count_skipped(skipped)
                if not samples:
                    continue
                coll = self._loader.collate_fn
                return seq, coll(samples) if coll is not None else default_collate(samples, HeapArena())
            self._fill()
            if self._next in self._done:
                seq = self._next
                self._next += 1
                batch = self._receive(seq, self._done.pop(seq))
                if batch is not None:
                    return seq, batch
                continue
            if not self._inflight:
                raise StopIteration
            if self._exhausted and not self._loader.persistent_workers:
                for w, load in enumerate(self._load):
                    if load == 0:
                        self._workers.retire(w)
            self._collect()

    def _fill(self) -> None:
        while not self._exhausted and len(self._inflight) + len(self._done) < self._loader.prefetch:
            try:
                seq, indices = next(self._plan)
            except StopIteration:
                self._exhausted = True
                return
            sid, _ = self._pool.acquire()
            self._inflight[seq] = [-1, indices, sid, 0]
            self._issue(seq)

    def _issue(self, seq: int) -> None:
        entry = self._inflight[seq]
        live = [w for w in range(len(self._load)) if not self._workers.retired[w]]
        w = min(live, key=self._load.__getitem__)
        entry[0] = w
        self._load[w] += 1
        self._workers.send(w, [seq, self._pool.path(entry[2]), entry[1]])

    def _collect(self) -> None:
        deadline = None if self._loader.timeout is None else time.monotonic() + self._loader.timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            replies, dead = self._workers.poll(left)
            for w, reply in replies:
                entry = self._inflight.pop(reply["s"], None)
                if entry is not None:
                    self._load[w] -= 1
                    reply["w"] = w
                    reply["slab"] = entry[2]
                    self._done[reply["s"]] = reply
            for w in dead:
                self._respawn(w)
            if replies or dead:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkerError(f"no batch arrived within timeout={self._loader.timeout}s "
                                  f"(waiting for batch {self._next} of epoch {self._state['epoch']})")

    def _respawn(self, w: int) -> None:
        code = self._workers.exitcode(w)
        orphans = sorted(s for s, e in self._inflight.items() if e[0] == w)
        log.warning("worker %d died (exit code %s) with batches %s in flight; restarting it", w, code, orphans)
        self._workers.restart(w)
        self._load[w] = 0
        for seq in orphans:
            entry = self._inflight[seq]
            entry[3] += 1
            if entry[3] > self._loader.max_retries:
                raise WorkerError(f"batch {seq} (indices {entry[1][:8]}{'...' if len(entry[1]) > 8 else ''}) "
                                  f"killed its worker {entry[3]} times (last exit code {code}); "
                                  f"max_retries={self._loader.max_retries}")
            self._issue(seq)

    def _receive(self, seq: int, reply: dict) -> Any:
        sid = reply["slab"]
        if "e" in reply:
            self._pool.release(sid)
            raise WorkerError(f"worker {reply['w']} raised {reply['x']}: {reply['m']} (batch {seq})\n"
                              f"Worker traceback:\n{reply['e']}")
        self._count_skipped(reply["k"])
        if reply["h"] is None:
            self._pool.release(sid)
            return None
        base = self._pool.lease(sid, reply["u"])
        return decode(base, *reply["h"])

    def _count_skipped(self, skipped: list) -> None:
        if skipped:
            self._loader.skipped += len(skipped)
            for index, why in skipped:
                log.warning("skipped sample %s: %s", index, why)


def _end_epoch(res: _Resources, keep: bool, inflight: dict, done: dict) -> None:
    if not keep or inflight or done:
        res.finalizer()


def _shutdown(workers: WorkerPool | None, pool: SlabPool | None, stage: DeviceStage) -> None:
    if workers is not None:
        workers.close()
    stage.close()
    if pool is not None:
        pool.close()
