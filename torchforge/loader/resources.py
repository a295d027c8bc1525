"""What a worker iterator runs on, and the receiver thread.

:class:`Resources`: the worker pool, the slab pool and the device stage, shut down by one finalizer
(kept across passes with ``persistent_workers``).

:class:`Inbox`: the tables of one iterator's batches in flight and received, and the receiver thread
that fills them. While the main thread is away (in the training step) the thread takes the workers'
replies and unpickles the next batches, so that ``next()`` finds them ready. The main thread holds
the inbox's lock for the whole of ``next()``; the thread takes it between, so no table is touched by
both at once. The thread holds the inbox, never the iterator: the iterator is always finalized by the
thread that drops it (joining worker processes from a second thread races the user's own joins).
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
import weakref
from typing import Any

from torch.utils.data.dataloader import _DatasetKind

from torchforge.loader.device import DeviceStage
from torchforge.loader.messages import Reply
from torchforge.loader.slabs import SlabPool
from torchforge.loader.transport import decode
from torchforge.loader.worker import WorkerPool, WorkerSpec

__all__ = ["Inbox", "Resources"]


class Resources:
    """What passes run on: the worker pool, the slab pool and the device stage (kept across passes
    with ``persistent_workers``). Without pinning, the slab pool is the loader's and outlives the
    iterator: the next epoch's workers write into slabs already grown and populated."""

    def __init__(self, loader: Any, base_seed: int, world_size: int = 1, rank: int = 0,
                 shared_seed: int | None = None):
        self.tasks: dict[int, list] = {}  # seq -> [worker, index, slab id (None once leased), retries]
        self.ready: dict[int, tuple[int, Reply, list]] = {}  # seq -> (worker, reply, task entry)
        self.stale: dict[int, int] = {}  # slab id -> worker: tasks of a dropped pass still running
        self.stage = DeviceStage(loader.device, True if loader.pin_memory else None)
        shared = loader._slab_pool() if not self.stage.pin else None
        window = loader.prefetch_factor * loader.num_workers
        self.pool = shared if shared is not None else SlabPool(on_map=self.stage.register, keep=window + 4)
        spec = WorkerSpec(dataset=loader.dataset, iterable=loader._dataset_kind == _DatasetKind.Iterable,
                          auto_collation=loader._auto_collation, collate_fn=loader.collate_fn,
                          drop_last=loader.drop_last, on_error=loader.on_error,
                          worker_init_fn=loader.worker_init_fn, num_workers=loader.num_workers,
                          base_seed=base_seed, world_size=world_size, rank=rank, shared_seed=shared_seed)
        self.workers = WorkerPool(loader.num_workers, loader._context(), spec)
        self.stop = threading.Event()  # tells the receiver thread to end
        self.threads: list[threading.Thread] = []  # the receiver thread, joined at shutdown
        self.finalizer = weakref.finalize(self, _shutdown, os.getpid(), self.workers, self.pool, shared is None,
                                          self.stage, self.tasks, self.ready, self.stale, self.stop, self.threads)


def _shutdown(owner: int, workers: WorkerPool, pool: SlabPool, own_pool: bool, stage: DeviceStage, tasks: dict,
              ready: dict, stale: dict, stop: threading.Event, threads: list[threading.Thread]) -> None:
    if os.getpid() != owner:
        # A forked child (another loader's worker) whose garbage collector met this process's garbage
        # iterator: its workers, pipes and slabs are the parent's, which shuts them down itself. Touching
        # them here told the parent's workers to stop and failed to join them ("can only join a child
        # process"), leaving the parent's iterator with workers it could no longer account for.
        return
    stop.set()
    workers.close()  # first: no worker writes into a slab after this
    for t in threads:  # the thread holds the pools until it ends: join it, so that shutdown frees them now
        if t is not threading.current_thread():
            t.join(timeout=5.0)
    threads.clear()
    stage.close()
    if own_pool:
        pool.close()
        return
    for entry in itertools.chain(tasks.values(), (e for _, _, e in ready.values())):
        if entry[2] is not None:  # None: leased ahead, released with its batch
            pool.release(entry[2])  # slabs of batches nobody will read go back to the loader's pool
    for sid in stale:
        pool.release(sid)
    tasks.clear()
    ready.clear()
    stale.clear()


class Inbox:
    """One iterator's batches in flight (``tasks``), received (``ready``), unpickled ahead
    (``decoded``), and the slabs of a dropped pass still being written (``stale``)."""

    def __init__(self, res: Resources):
        self.res = res
        self.tasks, self.ready, self.stale = res.tasks, res.ready, res.stale
        self.decoded: dict[int, Any] = {}  # seq -> batch unpickled ahead by the receiver thread
        self.lock = threading.Lock()
        self.pass_id = 0

    def start_receiver(self) -> None:
        thread = threading.Thread(target=_receive_loop, args=(self,), daemon=True, name="torchforge-receiver")
        self.res.threads.append(thread)
        thread.start()

    def accept(self, replies: list[tuple[int, Reply]]) -> bool:
        """File replies under their batch numbers; True if any belongs to the current pass."""
        got = False
        for w, reply in replies:
            entry = self.tasks.get(reply.seq) if reply.pass_id == self.pass_id else None
            if entry is None or entry[0] != w:
                if self.stale.pop(reply.slab, None) is not None:
                    self.res.pool.release(reply.slab)  # a dropped pass's task is done with its slab
                continue
            del self.tasks[reply.seq]
            self.ready[reply.seq] = (w, reply, entry)
            got = True
        return got

    def pump(self) -> bool:
        """Receiver thread, under the lock: take the replies that arrived and unpickle one waiting
        batch. Returns whether there was anything to do."""
        replies, _ = self.res.workers.poll(0)  # deaths are left to the main thread (sentinels stay set)
        did = self.accept(replies)
        for seq in sorted(self.ready):
            if seq in self.decoded:
                continue
            _, reply, entry = self.ready[seq]
            if reply.stream is None:
                continue
            base = self.res.pool.lease(entry[2], reply.used)
            entry[2] = None  # the lease owns the slab now: it goes back when the batch dies
            self.decoded[seq] = decode(base, reply.stream[0], reply.stream[1], reply.buffers)
            return True
        return did


def _receive_loop(inbox: Inbox) -> None:
    stop, workers = inbox.res.stop, inbox.res.workers
    idle = 0.0
    while not stop.is_set():
        watch = [c for w, c in enumerate(workers.conns) if not workers.retired[w]]
        try:
            mp.connection.wait(watch, 0.01)
        except (OSError, ValueError):  # a pipe closed under us: a restart, or the end
            pass
        if idle:
            time.sleep(idle)  # nothing to do although a pipe looked ready (a dead worker's EOF)
        # the lock with a timeout: shutdown may run in the main thread while it holds the lock, and joins us
        if not inbox.lock.acquire(timeout=0.01):
            continue
        try:
            if stop.is_set():
                return
            did = inbox.pump()
        except Exception:  # noqa: BLE001 - the main thread meets the same failure and reports it
            return
        finally:
            inbox.lock.release()
        idle = 0.0 if did else min(max(idle * 2, 0.0005), 0.01)
