"""The loader's iterators: one pass over the data, in process or through the worker pool.

Both subclass torch's ``_BaseDataLoaderIter``, so the base seed is drawn as torch draws it, the index
sampler is iterated as torch iterates it, and the IterableDataset length warning is torch's.

With workers, tasks (one per batch) go to the workers round-robin, as torch sends them, at most
``prefetch_factor * num_workers`` ahead of the batch the user gets; each worker collates its batch
straight into a shared-memory slab and replies with where it is. With ``in_order=True`` batches come
out in task order; with ``in_order=False`` as soon as they are ready. An IterableDataset worker whose
iterator ends is skipped from then on, and tasks already sent to it yield nothing, as in torch.

A receiver thread takes the workers' replies and unpickles the next batches while the main thread is
away (in the training step); the two take turns under one lock, so no state is touched by both at once.

A worker that dies (SIGKILL, segfault, out of memory) is restarted and its tasks re-issued to it (an
IterableDataset worker is fast-forwarded past what it had drawn, or given its last state), up to
``max_retries`` times per batch; then :class:`~torchforge.errors.WorkerError` (a RuntimeError) says
which worker died and how, in torch's words.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import random
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.autograd import profiler as _profiler
from torch.utils.data import _utils
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from torchforge.errors import WorkerError
from torchforge.loader.device import DeviceStage
from torchforge.loader.fetch import SKIPPED, Source, stateful
from torchforge.loader.messages import Forget, NewPass, Reply, Task
from torchforge.loader.resources import Inbox, Resources
from torchforge.loader.state import Position, generators, get_rng, sampler_of, set_rng
from torchforge.loader.transport import decode
from torchforge.loader.worker import seed_everything

__all__ = ["InProcessIter", "WorkerIter"]

log = logging.getLogger(__name__)
_pass_ids = itertools.count(1)
_NOTHING = object()


def batch_seed(base_seed: int, seq: int, pass_no: int = 0) -> int:
    """The seed of batch ``seq`` under per-batch seeding: a 63-bit mix of (base seed, batch number, pass
    number). The pass number counts the passes made under one base seed: persistent workers keep theirs
    from one epoch to the next, and their batches must not draw the same numbers every epoch."""
    x = (base_seed * 0x9E3779B97F4A7C15 + seq * 0xBF58476D1CE4E5B9 + pass_no * 0xD1B54A32D192ED03
         + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) % 2**64
    return (x ^ (x >> 32)) & (2**63 - 1)


_BUSY = object()  #: :meth:`WorkerIter._pick`: no worker has room for another task now


class _Options:
    """The loader options an iterator reads while it runs. An iterator does not hold its loader (a
    loader holds its persistent workers' iterator; the other way round would be a cycle that keeps the
    workers alive until the cyclic GC runs)."""

    def __init__(self, loader: Any):
        self.loader = weakref.ref(loader)
        for name in ("dataset", "in_order", "timeout", "max_retries", "seed_per_batch", "persistent_workers",
                     "on_error"):
            setattr(self, name, getattr(loader, name))

    def _count_skipped(self, skipped: list) -> None:
        loader = self.loader()
        if loader is not None:
            loader._count_skipped(skipped)
        elif skipped:
            log.warning("skipped samples %s", skipped)


class _Iter(_BaseDataLoaderIter):
    """What both iterators share: resume, position bookkeeping, the device stage and ``state_dict``."""

    def __init__(self, loader: Any):
        self._loader = _Options(loader)
        self._iterable = loader._dataset_kind == _DatasetKind.Iterable
        self._begin_pass(loader, first=True)

    # --- a pass ----------------------------------------------------------------------------------------
    def _begin_pass(self, loader: Any, first: bool) -> None:
        resume = loader._take_resume()
        target = sampler_of(loader)
        saved = resume.get("sampler") if resume is not None and not self._iterable else None
        if isinstance(saved, dict) and isinstance(saved.get("epoch"), int):
            now = getattr(target, "epoch", None)
            if isinstance(now, int) and now != saved["epoch"] and now != loader._epoch_at_load:
                # set_epoch() moved the sampler to another epoch since the state was loaded: that epoch
                # begins at its start (set_epoch's rule); the state's pass of the saved epoch is not resumed
                warnings.warn(f"the loader state loaded for epoch {saved['epoch']} was not resumed: the sampler "
                              f"was set to epoch {now} since, which begins at its start", stacklevel=3)
                resume = None
        if resume is not None and resume["sampler"] is not None and not self._iterable:
            try:
                target.load_state_dict(resume["sampler"])
            except BaseException:
                loader._resume = resume  # still the loader's state: the next iter() tries it again, never drops it
                raise
        gens = generators(loader)
        n = max(loader.num_workers, 1)
        prev = getattr(self, "_pos", None)
        self._pos = loader._pos = Position(n)
        self._pos.epoch = getattr(target, "epoch", None) if not self._iterable else None
        carried = loader._take_carried_states()
        if carried is not None and resume is None:  # a pass-end state of persistent workers (see load_state_dict)
            self._pos.worker_state = list(carried)
        found = get_rng(gens)  # before the iterator's own draws (torch's base seed)
        replay = resume is not None and resume.get("rng")
        user_rng = torch.get_rng_state() if replay else None
        # the generators are saved as the pass's first sampler draw finds them (after the base seed was
        # drawn, or not, as the pass began on new or on persistent workers); a version 1 state saved
        # them before the iterator was made, and is replayed from there
        legacy = replay and int(resume.get("version", 1)) < 2
        if legacy:
            set_rng(gens, resume["rng"])
            found = dict(resume["rng"])
        try:
            carried = loader._take_carried_seed()
            if first:
                super().__init__(loader)
                self._pass_no = 0
                if carried is not None:  # persistent workers go on with their seed, drawing nothing
                    set_rng(gens, found)
                    self._base_seed, self._pass_no = carried[0], carried[1] + 1
            else:
                _BaseDataLoaderIter._reset(self, loader)
                self._pass_no = prev.pass_no + 1 if prev is not None else 0
            if resume is not None:
                self._base_seed = int(resume["base_seed"])
                self._pass_no = int(resume.get("pass", 0))
            if replay and not legacy:
                set_rng(gens, resume["rng"])
            self._pos.rng0 = get_rng(gens)  # (a version 1 state's, past its base seed draw: saved as version 2)
            self._pos.pass_no = self._pass_no
            self._primed = _NOTHING
            watch = not self._iterable and stateful(target) and not callable(getattr(target, "state_at", None))
            before = target.state_dict() if watch else None
            self._snapshot = None
            self._primed = self._pull_index()  # the sampler's first draws happen here, in every run
            after = target.state_dict() if watch else None
            # a sampler whose state moves as it yields (torchdata's StatefulDistributedSampler: {"yielded": n})
            # says where it is: it resumes from its state after the last batch yielded, skipping nothing
            self._pos.positional = watch and (after != before or (resume is not None and not resume.get(
                "skip_batches", True)))
            self._snapshot = target.state_dict if self._pos.positional else None
            self._plan_prefetch(loader, target)
            skip = int(resume["batches"]) if resume is not None and resume.get("skip_batches") else 0
        finally:
            if user_rng is not None:
                torch.set_rng_state(user_rng)
        self._seq = 0
        self._pos.base_seed = self._base_seed
        if watch:  # (a positional sampler's start is its state before any draw, which it does not say)
            self._pos.sampler_start = resume["sampler"] if resume is not None else (
                None if self._pos.positional else after)
        self._assigned: list[int] = []
        self._rr = 0
        if resume is not None:
            self._restore_position(resume, target)
        self._draw_seq = self._seq  # the batch the next draw of indices is for
        if self._pos.positional:
            self._pos.snapshots[self._seq] = after
            self._draw_seq += 1
        for _ in range(skip if not self._iterable else 0):
            if self._pull_index() is _NOTHING:  # indices of batches already yielded: drawn, not loaded
                break
        self._staged: Any = None
        self._yielding: Any = None
        self._deferred: BaseException | None = None

    def _plan_prefetch(self, loader: Any, target: Any) -> None:
        """Tell a dataset that can prefetch (``dataset.prefetch(indices)``: remote datasets) the order this
        pass reads, when the sampler can tell it without drawing (``indices()``, a GlobalSampler's)."""
        prefetch, indices = getattr(loader.dataset, "prefetch", None), getattr(target, "indices", None)
        if self._iterable or not callable(prefetch) or not callable(indices):
            return
        try:
            order = indices(0, len(target))
        except Exception as e:  # noqa: BLE001 - a sampler without a pure indices(): no prefetching
            log.debug("no prefetching: %s.indices() failed (%s)", type(target).__name__, e)
            return
        prefetch(order)

    def _restore_position(self, resume: dict, target: Any) -> None:
        self._pos.batches = self._seq = int(resume["batches"])
        self._pos.extra = set(resume.get("extra", []))
        self._pos.samples = int(resume["samples"])
        if resume["sampler"] is not None and callable(getattr(target, "state_at", None)):
            self._pos.base = self._pos.samples  # the sampler resumed there: its own count starts at 0
        self._num_yielded = self._pos.batches + len(self._pos.extra)
        workers = resume.get("workers") or []
        if workers:
            if len(workers) != len(self._pos.worker_state):
                if any(w["state"] is not None or w["drawn"] for w in workers):
                    raise ValueError(f"the loader state was saved with {len(workers)} workers, each with its "
                                     f"own dataset position; resume with num_workers={len(workers)}")
            else:
                self._pos.worker_state = [w["state"] for w in workers]
                self._pos.drawn = [int(w["drawn"]) for w in workers]
                self._pos.ended = [bool(w["ended"]) for w in workers]
        if not workers or len(workers) == len(self._pos.worker_state):  # (the saved run's worker numbers)
            self._assigned = list(resume.get("assigned", []))
            self._rr = int(resume.get("next_worker", 0))

    def _pull_index(self) -> Any:
        if self._primed is not _NOTHING:
            index, self._primed = self._primed, _NOTHING
            return index
        try:
            index = self._next_index()
        except StopIteration:
            return _NOTHING
        if self._snapshot is not None:  # a sampler that says where it is: its state after each batch's draw
            self._pos.snapshots[self._draw_seq] = self._snapshot()
            self._draw_seq += 1
        return index

    # --- yielding ---------------------------------------------------------------------------------------
    def __next__(self) -> Any:
        if _profiler._is_profiler_enabled:
            return super().__next__()  # torch's, with its record_function range for the profiler
        # the batch is never a local of this frame (see _detached)
        return self._counted(self._next_data())

    def _counted(self, data: Any) -> Any:
        self._num_yielded += 1
        if self._iterable and self._IterableDataset_len_called is not None \
                and self._num_yielded > self._IterableDataset_len_called:
            self._warn_length()
        return data

    def _warn_length(self) -> None:
        # torch's warning, word for word
        msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._IterableDataset_len_called}"
               f"(when accessing len(dataloader)), but {self._num_yielded} samples have been fetched. ")
        if self._num_workers > 0:
            msg += ("For multiprocessing data-loading, this could be caused by not properly configuring the "
                    "IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.")
        warnings.warn(msg, stacklevel=3)

    def _next_data(self) -> Any:
        stage: DeviceStage = self._stage
        if not stage.active:
            batch, info = self._host_next()
            self._commit(info)
            return self._pin(batch)
        if self._staged is None:
            if self._deferred is not None:
                raise self._take_deferred()  # not a local: the frame would hold its own exception
            self._staged = self._stage_one()
        self._yielding, self._staged = self._staged, None
        self._stage_ahead()  # the next batch's copy overlaps this batch's step
        self._commit(self._yielding[1])
        # the batch is never a local of this frame: a deferred exception's traceback reaches this frame
        return stage.finish(self._take_yielding())

    def _take_deferred(self) -> BaseException:
        err, self._deferred = self._deferred, None
        return err

    def _take_yielding(self) -> Any:
        handle, self._yielding = self._yielding[0], None
        return handle

    def _stage_ahead(self) -> None:
        try:
            self._staged = self._stage_one()
        except BaseException as e:  # noqa: BLE001 - raised after this batch is yielded, not before
            self._deferred = _detached(e)

    def _stage_one(self) -> tuple[Any, Any]:
        batch, info = self._host_next()
        return self._stage.start(batch), info

    def _pin(self, batch: Any) -> Any:
        if self._pin_memory:
            return _utils.pin_memory.pin_memory(batch, self._pin_memory_device)
        return batch

    def _commit(self, info: tuple) -> None:
        """The batch described by ``info`` reaches the user: advance the position."""
        seq, n_indices, worker, reply = info
        self._note_done(seq, n_indices)
        self._pos.assigned = self._pending_workers()
        self._pos.next_worker = self._rr
        if reply is not None:
            if reply.state is not None:
                self._pos.worker_state[worker] = reply.state
            self._pos.drawn[worker] += reply.count
            if reply.ended:  # its last batch, short: a state saved now resumes with its iterator ended
                self._pos.ended[worker] = True

    def _note_done(self, seq: int, n_indices: int = 0) -> None:
        """Batch ``seq``, of ``n_indices`` sampler indices, was yielded (or consumed: an error, an empty
        batch, counting none): move the position. ``samples`` counts the in-order prefix only: with
        ``in_order=False`` a batch yielded ahead is counted when the prefix reaches it (the sampler's
        position is the prefix's; a slower batch before it was not yielded yet)."""
        pos = self._pos
        if seq == pos.batches:
            pos.batches += 1
            pos.samples += n_indices
            while pos.batches in pos.extra:
                pos.extra.discard(pos.batches)
                pos.samples += pos.ahead.pop(pos.batches, 0)
                pos.batches += 1
            if pos.snapshots:  # only the state after the prefix's last batch is ever saved
                for k in [k for k in pos.snapshots if k < pos.batches - 1]:
                    del pos.snapshots[k]
        else:
            pos.extra.add(seq)
            pos.ahead[seq] = n_indices

    def _count(self, index: Any) -> int:
        if self._iterable:
            return 0
        return len(index) if self._auto_collation else 1

    def _finish(self) -> None:
        self._pos.finished = True

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        loader = self._loader.loader()
        if loader is None:
            raise RuntimeError("the iterator's DataLoader is gone: take state_dict() from the loader")
        return self._pos.state_dict(loader, self._iterable)

    def _pending_workers(self) -> list[int]:
        return []


class InProcessIter(_Iter):
    """``num_workers=0``: batches are fetched and collated in the calling process."""

    def __init__(self, loader: Any):
        if loader.timeout != 0:  # torch's words and type (it has no worker to wait for)
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        self._stage = DeviceStage(loader.device, None)
        super().__init__(loader)
        self._source = Source(loader.dataset, iterable=self._iterable, auto_collation=self._auto_collation,
                              collate_fn=self._collate_fn, drop_last=self._drop_last, on_error=loader.on_error)
        # the pass's iterator of an IterableDataset is made now, as torch's fetcher makes it at iter(): a
        # state saved before the first batch holds a Stateful iterator's state too
        state = self._pos.worker_state[0]
        if self._pos.ended[0]:  # the saved pass had seen its iterator end: it resumes at that end
            self._source.ended = True
        elif state is not None:  # a Stateful iterator puts itself back where it was, its random state included
            self._source.start(0, state)
        else:
            # a Stateful dataset was put back where it was by load_state_dict; others are fast-forwarded,
            # with the caller's random generators left as they are (the run being resumed drew from
            # them while it yielded those samples, and the caller restores them as they were)
            with _kept_rng():
                self._source.start(0 if stateful(loader.dataset) else self._pos.drawn[0])
        self._pos.worker_state[0] = self._source.state(dataset=False)
        self._pos.own_iterator = self._pos.worker_state[0] is not None and self._source.own_iterator()

    def _host_next(self) -> tuple[Any, tuple]:
        loader = self._loader
        while True:
            index = self._pull_index()
            if index is _NOTHING:
                self._finish()
                raise StopIteration
            seq = self._seq
            self._seq += 1
            if seq in self._pos.extra:  # yielded before the state was saved (in_order=False)
                self._pos.ahead[seq] = self._count(index)
                continue
            try:
                if loader.seed_per_batch:
                    with _kept_rng():
                        seed_everything(batch_seed(self._base_seed, seq, self._pass_no))
                        batch, skipped, drawn = self._source.fetch(index)
                else:
                    batch, skipped, drawn = self._source.fetch(index)
            except StopIteration:
                self._finish()
                raise
            except Exception:
                self._note_done(seq)
                raise
            loader._count_skipped(skipped)
            reply = Reply(0, seq, count=drawn, state=self._source.state(dataset=False),  # (a Stateful iterator's)
                          ended=self._source.ended)
            if batch is SKIPPED:
                self._note_done(seq)
                continue
            return batch, (seq, self._count(index), 0, reply)


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """Leave torch's, ``random``'s and numpy's global generators as they were."""
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])


class WorkerIter(_Iter):
    """``num_workers > 0``: batches loaded by the worker pool into shared memory."""

    def __init__(self, loader: Any):
        self._res = None
        self._stage = DeviceStage(None, False)
        super().__init__(loader)
        self._res = Resources(loader, self._base_seed, self._world_size, self._rank, self._shared_seed)
        self._inbox = inbox = Inbox(self._res)
        # the inbox's tables, under the names the pass works with (the same objects)
        self._tasks, self._ready, self._stale, self._decoded = inbox.tasks, inbox.ready, inbox.stale, inbox.decoded
        self._lock = inbox.lock
        inbox.start_receiver()
        self._stage = self._res.stage
        self._window = loader.prefetch_factor * loader.num_workers
        self._start_workers()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """A new pass over the same workers (``persistent_workers``), as torch's ``_reset``."""
        if not self._res.finalizer.alive:
            raise RuntimeError("the DataLoader's persistent workers were shut down")
        with self._lock:
            self._drop_pass()
            self._begin_pass(loader, first=False)
            self._start_workers()

    def _next_data(self) -> Any:
        with self._lock:
            return super()._next_data()

    def _start_workers(self) -> None:
        self._inbox.pass_id = next(_pass_ids)
        self._sampler_done = False
        workers = self._res.workers
        for w in range(len(workers)):
            workers.retired[w] = False if workers.procs[w].is_alive() else workers.retired[w]
            self._new_pass(w, self._pos.worker_state[w], self._pos.drawn[w])
        self._fill()

    def _new_pass(self, w: int, state: Any, drawn: int) -> None:
        """Start worker ``w``'s pass from a dataset state, or (IterableDataset without one) ``drawn``
        samples into its iterator."""
        skip = drawn if state is None and self._iterable else 0
        self._res.workers.send(w, NewPass(self._inbox.pass_id, dataset_state=state, skip=skip,
                                          shared_seed=self._shared_seed))

    def _drop_pass(self) -> None:
        """Forget the previous pass's batches. Slabs of batches already received go back to the pool;
        a slab a worker may still be writing into goes back when that task's late reply arrives (it is
        recognised by its pass id), never before."""
        for _, _, entry in self._ready.values():
            if entry[2] is not None:  # None: leased ahead, released with its batch
                self._res.pool.release(entry[2])
        self._stale.update((e[2], e[0]) for e in self._tasks.values())
        self._tasks.clear()
        self._ready.clear()
        self._decoded.clear()
        self._staged, self._deferred = None, None

    # --- issuing ------------------------------------------------------------------------------------
    def _fill(self) -> None:
        while len(self._tasks) + len(self._ready) < self._window and not self._sampler_done:
            w = self._pick()
            if w is None:
                self._sampler_done = True
                return
            if w is _BUSY:
                return
            index = self._pull_index()
            if index is _NOTHING:
                self._sampler_done = True
                return
            seq = self._seq
            self._seq += 1
            if seq in self._pos.extra:  # yielded before the state was saved (in_order=False)
                self._pos.ahead[seq] = self._count(index)
                continue
            sid, _ = self._res.pool.acquire()
            self._tasks[seq] = [w, index, sid, 0]
            self._send(seq)

    def _pick(self) -> Any:
        """The worker of the next task: a worker saved as assigned, else the next active one in turn;
        None when every worker's iterator ended. With ``in_order=False``, as torch's loader does, a worker
        gets a task only while it has fewer than its share of the window in flight (one stuck on a slow
        sample is passed over), and :data:`_BUSY` when none has room."""
        while self._assigned:
            w = self._assigned.pop(0)
            if not self._pos.ended[w]:  # (a task the saved run gave a worker whose iterator had ended: none)
                return w
        n = len(self._pos.ended)
        active = n - sum(self._pos.ended)
        if not active:
            return None
        share = self._window // active if not self._loader.in_order else None
        busy = collections.Counter(entry[0] for entry in self._tasks.values()) if share is not None else None
        for k in range(n):
            w = (self._rr + k) % n
            if not self._pos.ended[w] and (busy is None or busy[w] < share):
                self._rr = (w + 1) % n
                return w
        return _BUSY

    def _send(self, seq: int) -> None:
        w, index, sid, _ = self._tasks[seq]
        seed = batch_seed(self._base_seed, seq, self._pass_no) if self._loader.seed_per_batch else None
        self._res.workers.send(w, Task(self._inbox.pass_id, seq, sid, self._res.pool.path(sid), index, seed))

    # --- receiving ----------------------------------------------------------------------------------
    def _host_next(self) -> tuple[Any, tuple]:
        while True:
            got = self._take_ready()
            if got is not None:
                seq, w, reply, entry = got
                batch = self._receive(seq, w, reply, entry)
                if batch is not _NOTHING:
                    return batch, (seq, self._count(entry[1]), w, reply)
                continue
            if not self._tasks and not self._ready:
                self._fill()
                if not self._tasks:
                    self._finish()
                    raise StopIteration
                continue
            self._collect()

    def _take_ready(self) -> tuple | None:
        if self._loader.in_order:
            seq = min(itertools.chain(self._tasks, self._ready), default=None)
            if seq is None or seq not in self._ready:
                return None
        elif self._ready:
            seq = min(self._ready)
        else:
            return None
        w, reply, entry = self._ready.pop(seq)
        return seq, w, reply, entry

    def _receive(self, seq: int, w: int, reply: Reply, entry: list) -> Any:
        pool = self._res.pool
        if reply.stream is None:
            pool.release(entry[2])
            if reply.ended:
                self._pos.ended[w] = True
                if reply.state is not None:  # as the worker's copy ends the pass (its __iter__ may change it)
                    self._pos.worker_state[w] = reply.state
            self._note_done(seq)
            self._fill()
            if reply.error is not None:
                reply.error.reraise()
            self._loader._count_skipped(reply.skipped)
            return _NOTHING
        self._loader._count_skipped(reply.skipped)
        batch = self._decoded.pop(seq, _NOTHING)
        if batch is _NOTHING:
            base = pool.lease(entry[2], reply.used)
            batch = decode(base, reply.stream[0], reply.stream[1], reply.buffers)
        gone = pool.take_detached()
        if gone:
            self._res.workers.broadcast(Forget(gone))
        self._fill()
        if self._sampler_done:
            self._retire_idle()  # its exit overlaps the last batches' steps, not the end of the pass
        return batch

    def _collect(self) -> None:
        try:
            self._wait()
        except BaseException:
            self._shutdown_workers()  # a timeout, a worker past max_retries, Ctrl-C: the pass is over
            raise

    def _wait(self) -> None:
        timeout = self._loader.timeout
        deadline = None if not timeout else time.monotonic() + timeout
        workers = self._res.workers
        while True:
            if self._sampler_done:
                self._retire_idle()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            replies, dead = workers.poll(left)
            got = self._inbox.accept(replies)
            for w in dead:
                self._respawn(w)
            if got or dead:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds")

    def _retire_idle(self) -> None:
        """The sampler is done: let each worker with no task left exit now (not with persistent workers)."""
        if self._loader.persistent_workers:
            return
        workers = self._res.workers
        busy = {e[0] for e in self._tasks.values()}
        for w in range(len(workers)):
            if w not in busy:
                workers.retire(w)  # the pass has no more work for it

    def _respawn(self, w: int) -> None:
        workers = self._res.workers
        why = workers.describe_death(w)
        orphans = sorted(s for s, e in self._tasks.items() if e[0] == w)
        log.warning("%s Restarting it; re-issuing batches %s", why, orphans)
        workers.restart(w)
        for sid in [sid for sid, ww in self._stale.items() if ww == w]:
            del self._stale[sid]
            self._res.pool.release(sid)  # its writer is dead
        # the new worker goes on where its predecessor's replies (yielded or waiting) left off
        waiting = [r for _, (ww, r, _) in sorted(self._ready.items()) if ww == w]
        state = next((r.state for r in reversed(waiting) if r.state is not None), self._pos.worker_state[w])
        self._new_pass(w, state, self._pos.drawn[w] + sum(r.count for r in waiting))
        for seq in orphans:
            entry = self._tasks[seq]
            entry[3] += 1
            if entry[3] > self._loader.max_retries:
                raise WorkerError(f"{why} Batch {seq} was re-issued {entry[3] - 1} times "
                                  f"(max_retries={self._loader.max_retries}); indices {_short(entry[1])}")
            self._send(seq)

    @property
    def _workers(self) -> list[Any]:
        """The worker processes (torch's iterator attribute of the same name)."""
        return list(self._res.workers.procs) if self._res is not None else []

    def _pending_workers(self) -> list[int]:
        seqs = sorted(itertools.chain(self._tasks, self._ready))
        pending = [self._tasks[s][0] if s in self._tasks else self._ready[s][0] for s in seqs]
        if self._staged is not None:
            pending.insert(0, self._staged[1][2])
        return pending + list(self._assigned)

    def _finish(self) -> None:
        super()._finish()
        if not self._loader.persistent_workers:
            self._res.finalizer()

    def _shutdown_workers(self) -> None:
        if self._res is not None:
            self._res.finalizer()

    def _alive(self) -> bool:
        return self._res is not None and self._res.finalizer.alive

    def close(self) -> None:
        """Stop the workers and release the slabs (batches already yielded stay valid)."""
        self._shutdown_workers()

    def __del__(self) -> None:
        self._shutdown_workers()


def _short(index: Any) -> str:
    if isinstance(index, (list, tuple)) and len(index) > 8:
        return f"{list(index[:8])}..."
    return repr(index)


def _detached(err: BaseException) -> BaseException:
    """An exception to raise later, without the data of the frames it passed through.

    Its traceback's frames (and the frames that called them) stay alive as long as the iterator keeps
    it: their locals are cleared (the lines stay), so no batch is kept in a cycle that only the garbage
    collector frees. That matters with a CUDA stage: a process forked before the collector runs
    (another loader's worker) would free those device tensors in the child, which aborts it.
    """
    tb = err.__traceback__
    if tb is not None:
        traceback.clear_frames(tb.tb_next)  # the first frame, _stage_ahead's, is still running
    return err
