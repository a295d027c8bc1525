"""Worker processes: the loop that turns tasks into batches in shared memory, and the pool that
supervises it (see :mod:`torchforge.loader.messages` for the protocol).

A worker starts as torch's does: fatal-signal handlers, one torch thread, ``random`` and torch seeded
with ``base_seed + worker_id`` and numpy with torch's ``_generate_state(base_seed, worker_id)``,
``torch.utils.data.get_worker_info()`` set, then ``worker_init_fn(worker_id)``. A DataPipe is seeded and
sharded as torch's workers do it: each pass's shufflers from the pass's shared seed (the same in every
worker), then sharded over ``num_workers x world_size`` before ``worker_init_fn``. On Linux it runs as a
batch job (``SCHED_BATCH``, same priority), so a worker woken by its next task does not preempt the
training process that sent it (``worker_init_fn`` may set another policy). An exception there (or
in a dataset's ``__iter__``) is reported with the first task, as torch does. A worker exits on its own
when the main process disappears (it polls ``getppid``) and ignores SIGINT (the main process owns
Ctrl-C and shuts the pool down).
"""
from __future__ import annotations

import ctypes
import gc
import os
import pickle
import random
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy.random  # noqa: F401 - imported here, in the main process: a forked worker that imports it
import torch  # on its first seed spends ~10 ms of every epoch's start-up on it
import torch.utils.data._utils.worker as torch_worker
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data._utils import signal_handling
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

from torchforge._proc import pid_alive
from torchforge.errors import TorchforgeError
from torchforge.loader import collate
from torchforge.loader.fetch import SKIPPED, Source
from torchforge.loader.messages import Forget, NewPass, Reply, Task
from torchforge.loader.slabs import SlabWriter
from torchforge.loader.transport import encode

__all__ = ["WorkerPool", "WorkerSpec", "seed_everything"]


@dataclass
class WorkerSpec:
    """What every worker of a pool is started with (pickled for spawn and forkserver)."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    on_error: str
    worker_init_fn: Any
    num_workers: int
    base_seed: int
    world_size: int = 1  #: torch.distributed's, for sharding a DataPipe across ranks and workers
    rank: int = 0
    shared_seed: int | None = None  #: an IterDataPipe's first-pass seed (later passes: NewPass's)


def seed_everything(seed: int) -> None:
    """Seed ``random``, torch and numpy as torch seeds a worker (numpy through torch's state mixer)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return
    np.random.seed(torch_worker._generate_state(seed, 0))


def _seed_datapipe(dataset: Any, shared_seed: int | None) -> None:
    """Seed an IterDataPipe's shufflers from the pass's shared seed, as torch's workers do."""
    if shared_seed is not None and isinstance(dataset, IterDataPipe):
        rng = torch.Generator()
        rng.manual_seed(shared_seed)
        apply_random_seed(dataset, rng)


def _worker_main(wid: int, conn: Any, spec: WorkerSpec, parent: int) -> None:
    # the process this one was forked from: the loader's (fork, spawn) or forkserver's server, which exits
    # with the loader's process; either way the worker is reparented when the loader's process is gone
    forked_from = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal_handling._set_worker_signal_handlers()
    torch.multiprocessing._set_thread_name("pt_data_worker")
    # Objects inherited from the parent never become garbage here: keep the collector off them, so that
    # collections stay cheap and do not touch (and copy) inherited pages.
    gc.freeze()
    torch.set_num_threads(1)
    _keep_freed_memory()
    _batch_scheduling()
    seed = spec.base_seed + wid
    random.seed(seed)
    torch.manual_seed(seed)
    import numpy as np

    np.random.seed(torch_worker._generate_state(spec.base_seed, wid))
    dataset = spec.dataset
    _seed_datapipe(dataset, spec.shared_seed)
    torch_worker._worker_info = torch_worker.WorkerInfo(id=wid, num_workers=spec.num_workers, seed=seed,
                                                        dataset=dataset)
    where = f"in DataLoader worker process {wid}"
    init_error = None
    try:
        if isinstance(dataset, (IterDataPipe, MapDataPipe)):  # torch's _sharding_worker_init_fn
            apply_sharding(dataset, spec.num_workers * spec.world_size, wid * spec.world_size + spec.rank)
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(wid)
    except Exception:  # noqa: BLE001 - reported with the first task, as torch does
        init_error = Caught(where=where)
    source = Source(dataset, iterable=spec.iterable, auto_collation=spec.auto_collation,
                    collate_fn=spec.collate_fn, drop_last=spec.drop_last, on_error=spec.on_error)
    writer = SlabWriter()
    try:
        while True:
            while not conn.poll(0.5):
                if os.getppid() != forked_from or not pid_alive(parent):
                    return
            msg = conn.recv()
            if msg is None:
                break
            if isinstance(msg, Forget):
                writer.forget(msg.slabs)
            elif isinstance(msg, NewPass):
                if init_error is None:
                    try:
                        _seed_datapipe(dataset, msg.shared_seed)
                        source.start(msg.skip, msg.dataset_state)
                    except Exception:  # noqa: BLE001 - an error in __iter__ comes with the first task
                        init_error = Caught(where=where)
            else:
                if init_error is not None:
                    reply, init_error = Reply(msg.pass_id, msg.seq, msg.slab, error=init_error), None
                else:
                    reply = _run(msg, source, writer, where)
                if reply.error is None:
                    reply.state = source.state()
                conn.send(reply)
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        writer.close()
    # A clean stop: skip interpreter teardown (tens of ms of finalisers over the inherited heap); the
    # worker holds nothing that needs flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Caught(ExceptionWrapper):
    """torch's ``ExceptionWrapper``, which re-raises ``type(e)(message)`` in the main process. A torchforge
    error travels pickled and is re-raised as itself, the worker's traceback added as a note: rebuilt from
    its message, it lost its attributes (``url``, ``path``, ``offset``), and a remote error, whose
    constructor takes ``url=``, came back as a plain RuntimeError (``except RemoteError`` missed it)."""

    def __init__(self, exc_info: Any = None, where: str = "in background") -> None:
        exc_info = exc_info or sys.exc_info()
        super().__init__(exc_info, where)
        self.original: bytes | None = None
        if isinstance(exc_info[1], TorchforgeError):
            try:
                self.original = pickle.dumps(exc_info[1])
            except Exception:  # noqa: BLE001 - an attribute that does not pickle: torch's way, below
                self.original = None

    def reraise(self) -> None:
        exc = None
        if self.original is not None:
            try:
                exc = pickle.loads(self.original)
            except Exception:  # noqa: BLE001 - torch's way
                exc = None
        if exc is None:
            super().reraise()
        exc.add_note(f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}")
        raise exc


def _batch_scheduling() -> None:
    """Linux: schedule this worker as a batch job (``SCHED_BATCH``, the same priority): a worker woken by
    its next task no longer preempts the training process that sent it, which otherwise pays the switch
    inside its ``write``."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _keep_freed_memory() -> None:
    """glibc only: keep freed heap memory for the next batch instead of returning it to the kernel and
    faulting fresh zeroed pages in again (a collate that allocates a few MiB per batch pays that on
    every batch otherwise)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: the most glibc allows
    except (OSError, AttributeError):
        pass


def _run(task: Task, source: Source, writer: SlabWriter, where: str) -> Reply:
    if task.seed is not None:
        seed_everything(task.seed)
    try:
        arena = writer.begin(task.slab, task.path)
    except OSError as e:
        return Reply(task.pass_id, task.seq, task.slab, error=Caught(
            (RuntimeError, RuntimeError(f"cannot open the batch's shared-memory slab {task.path}: {e}"), None),
            where=where))
    collate.set_arena(arena)
    try:
        batch, skipped, drawn = source.fetch(task.index)
        if batch is SKIPPED:
            return Reply(task.pass_id, task.seq, task.slab, skipped=skipped)
        stream_off, stream_len, buffers = encode(batch, arena)
        del batch
        return Reply(task.pass_id, task.seq, task.slab, used=arena.used, stream=(stream_off, stream_len), buffers=buffers,
                     skipped=skipped, count=drawn, ended=source.ended)  # (a last, partial batch: the end seen)
    except StopIteration:
        return Reply(task.pass_id, task.seq, task.slab, ended=True)
    except Exception:  # noqa: BLE001 - re-raised in the main process with this traceback
        return Reply(task.pass_id, task.seq, task.slab, error=Caught(where=where))
    finally:
        collate.set_arena(None)
        writer.end(task.slab, arena)


class WorkerPool:
    """``n`` supervised worker processes, each with its own pipe; dead workers are restarted in place.

    Args:
        n: workers.
        ctx: the multiprocessing context they start in.
        spec: what each is started with.
    """

    def __init__(self, n: int, ctx: Any, spec: WorkerSpec):
        self._ctx = ctx
        self._spec = spec
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        self.restarts = 0
        self.pending = [0] * n  # tasks sent and not answered, per worker
        self.retired = [False] * n  # told to stop early: the pass has no more work for it
        self._watch: Any = None  # (pipes and retirements it was built for, select.poll, fd -> (worker, pipe?))
        for w in range(n):
            self._start(w)

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_worker_main, args=(w, child, self._spec, os.getpid()), daemon=True,
                              name=f"torchforge-worker-{w}")
        p.start()
        child.close()
        self.procs[w], self.conns[w] = p, parent

    def __len__(self) -> int:
        return len(self.procs)

    def send(self, w: int, msg: Any) -> bool:
        """Send a message; False if the worker's pipe is broken (it died: the next poll reports it)."""
        try:
            self.conns[w].send(msg)
        except OSError:
            return False
        if isinstance(msg, Task):
            self.pending[w] += 1
        return True

    def broadcast(self, msg: Any) -> None:
        for w in range(len(self.procs)):
            if not self.retired[w]:
                self.send(w, msg)

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, Reply]], list[int]]:
        """Wait up to ``timeout`` s (None: forever); returns ``(replies, dead_workers)``. Replies a
        worker sent before it died are returned too. One ``select.poll`` object watches every pipe and
        process sentinel, registered once (not a selector built per call)."""
        poller, owner = self._poller()
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        events = poller.poll(ms)
        replies, dead, seen = [], [], set()
        while events:
            for fd, _ in events:
                w, is_pipe = owner[fd]
                if not is_pipe:
                    seen.add(w)  # its process ended
                    continue
                try:
                    replies.append((w, self.conns[w].recv()))
                    self.pending[w] -= 1
                except (EOFError, OSError):
                    seen.add(w)
                    poller.unregister(fd)
            events = [(fd, e) for fd, e in poller.poll(0) if owner[fd][1]]  # drain what else arrived
        for w in sorted(seen):
            if not self.procs[w].is_alive():
                dead.append(w)
        return replies, dead

    def _poller(self) -> tuple[Any, dict[int, tuple[int, bool]]]:
        key = tuple((id(c), self.retired[w]) for w, c in enumerate(self.conns))
        if self._watch is None or self._watch[0] != key:
            poller, owner = select.poll(), {}
            for w, (c, p) in enumerate(zip(self.conns, self.procs)):
                if not self.retired[w]:  # a retired worker's exit is expected, not a death
                    poller.register(c.fileno(), select.POLLIN)
                    poller.register(p.sentinel, select.POLLIN)
                    owner[c.fileno()] = (w, True)
                    owner[p.sentinel] = (w, False)
            self._watch = (key, poller, owner)
        return self._watch[1], self._watch[2]

    def describe_death(self, w: int) -> str:
        """torch's words for a dead worker: ``DataLoader worker (pid N) is killed by signal: ...``."""
        p = self.procs[w]
        p.join(timeout=1.0)
        code = p.exitcode
        if code is not None and code < 0:
            try:
                name = signal.strsignal(-code) or signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"DataLoader worker (pid {p.pid}) is killed by signal: {name}."
        return f"DataLoader worker (pid {p.pid}) exited unexpectedly with exit code {code}."

    def restart(self, w: int) -> None:
        old = self.procs[w]
        old.join(timeout=1.0)
        if old.is_alive():
            old.kill()
            old.join()
        self.conns[w].close()
        self.pending[w] = 0
        self.retired[w] = False
        self.restarts += 1
        self._start(w)

    def retire(self, w: int) -> None:
        """Let an idle worker exit now, while the main process still consumes the last batches, so that
        the end of a pass does not wait for process exits."""
        if not self.retired[w] and self.pending[w] == 0:
            self.retired[w] = True
            try:
                self.conns[w].send(None)
            except OSError:
                pass

    def close(self, grace: float = 0.5) -> None:
        """Stop every worker and close every pipe. Idle workers are asked to stop and given ``grace``
        seconds; workers still busy with tasks nobody will read (``break``, an error) are terminated at
        once: they hold nothing but their own mappings of slabs the main process owns."""
        for w, c in enumerate(self.conns):
            if not self.retired[w]:
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (grace if not any(self.pending) else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
