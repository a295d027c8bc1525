"""Worker processes: the loop that turns index lists into encoded batches, and the pool that supervises it.

Protocol (orjson bytes over one duplex pipe per worker, never pickle):

- main -> worker: ``[seq, slab_path, [indices...]]``; an empty message means "stop".
- worker -> main: ``{"s": seq, "u": bytes_used, "h": [header_offset, header_length], "k": skipped}``, or
  ``{"s": seq, "e": traceback_text, "x": exception_type, "m": message}`` when user code raised.

A worker exits on its own when the main process disappears (it polls ``getppid``), ignores SIGINT (the
main process owns Ctrl-C and shuts the pool down) and runs torch with one thread.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import torch

from torchforge._collate import default_collate
from torchforge._shm import SlabWriter
from torchforge._transport import encode

__all__ = ["WorkerPool", "choose_context", "fetch"]


def fetch(dataset: Any, indices: list[int], on_error: str) -> tuple[list, list]:
    """The samples at ``indices``; with ``on_error="skip"`` failing ones are left out and reported.

    Returns:
        ``(samples, skipped)`` where ``skipped`` lists ``[index, "Type: message"]`` pairs.
    """
    if on_error == "raise":
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices)), []
        return [dataset[i] for i in indices], []
    samples, skipped = [], []
    for i in indices:
        try:
            samples.append(dataset[i])
        except Exception as e:  # noqa: BLE001 - the policy is to skip whatever user code raises
            skipped.append([i, f"{type(e).__name__}: {e}"])
    return samples, skipped


def _worker_main(wid: int, conn: Any, dataset: Any, collate_fn: Callable | None, on_error: str, seed: int,
                 parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Objects inherited from the parent (torch, the dataset, ...) never become garbage here: keep the
    # collector off them, so that collections stay cheap and do not touch (and copy) inherited pages.
    gc.freeze()
    torch.set_num_threads(1)
    random.seed(seed + wid)
    np.random.seed((seed + wid) % 2**32)
    torch.manual_seed(seed + wid)
    writer = SlabWriter()
    try:
        while True:
            while not conn.poll(0.5):
                if os.getppid() != parent:
                    return
            msg = conn.recv_bytes()
            if not msg:
                break
            seq, path, indices = orjson.loads(msg)
            conn.send_bytes(orjson.dumps(_run(seq, path, indices, dataset, collate_fn, on_error, writer)))
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        writer.close()
    # A clean stop: skip interpreter teardown (tens of ms of finalisers over the inherited heap); the
    # worker holds nothing that needs flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(seq: int, path: str, indices: list[int], dataset: Any, collate_fn: Callable | None, on_error: str,
         writer: SlabWriter) -> dict:
    arena = writer.begin(path)
    try:
        samples, skipped = fetch(dataset, indices, on_error)
        if not samples:
            return {"s": seq, "u": 0, "h": None, "k": skipped}
        batch = collate_fn(samples) if collate_fn is not None else default_collate(samples, arena)
        del samples
        header = encode(batch, arena)
        return {"s": seq, "u": arena.used, "h": list(header), "k": skipped}
    except Exception as e:  # noqa: BLE001 - reported to the main process, which applies the policy
        return {"s": seq, "e": traceback.format_exc(), "x": type(e).__qualname__, "m": str(e)}
    finally:
        writer.end(path, arena)


def choose_context(name: str | None) -> mp.context.BaseContext:
    """The multiprocessing context: ``name`` if given, else fork on Linux while CUDA is not initialised
    (fastest start, the dataset is inherited instead of pickled), else spawn."""
    if name is not None:
        return mp.get_context(name)
    if sys.platform.startswith("linux") and not torch.cuda.is_initialized():
        return mp.get_context("fork")
    return mp.get_context("spawn")


class WorkerPool:
    """``n`` supervised worker processes, each with its own pipe; dead workers are restarted in place."""

    def __init__(self, n: int, ctx: mp.context.BaseContext, dataset: Any, collate_fn: Callable | None,
                 on_error: str, seed: int):
        self._ctx = ctx
        self._args = (dataset, collate_fn, on_error, seed, os.getpid())
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        self.restarts = 0
        self.pending = [0] * n  # tasks sent and not answered, per worker
        self.retired = [False] * n  # told to stop early: the epoch has no more work for it
        for w in range(n):
            self._start(w)

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=_worker_main, args=(w, child, *self._args), daemon=True,
                              name=f"torchforge-worker-{w}")
        p.start()
        child.close()
        self.procs[w], self.conns[w] = p, parent

    def __len__(self) -> int:
        return len(self.procs)

    def send(self, w: int, task: list) -> bool:
        """Send a task; False if the worker's pipe is broken (it died: the next poll reports it)."""
        try:
            self.conns[w].send_bytes(orjson.dumps(task))
        except OSError:
            return False
        self.pending[w] += 1
        return True

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, dict]], list[int]]:
        """Wait up to ``timeout`` s; returns ``(replies, dead_workers)``. Replies a worker sent before
        it died are returned too."""
        by_obj = {}
        for w, (c, p) in enumerate(zip(self.conns, self.procs)):
            if not self.retired[w]:  # a retired worker's exit is expected, not a death
                by_obj[c] = w
                by_obj[p.sentinel] = w
        ready = mp.connection.wait(list(by_obj), timeout)
        replies, dead = [], []
        for w in sorted({by_obj[r] for r in ready}):
            conn, alive = self.conns[w], True
            try:
                while conn.poll():
                    replies.append((w, orjson.loads(conn.recv_bytes())))
                    self.pending[w] -= 1
            except (EOFError, OSError):
                alive = False
            if not alive or not self.procs[w].is_alive():
                dead.append(w)
        return replies, dead

    def exitcode(self, w: int) -> int | None:
        self.procs[w].join(timeout=1.0)
        return self.procs[w].exitcode

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
        the end of an epoch does not wait for process exits."""
        if not self.retired[w] and self.pending[w] == 0:
            self.retired[w] = True
            try:
                self.conns[w].send_bytes(b"")
            except OSError:
                pass

    def close(self, grace: float = 0.5) -> None:
        """Stop every worker and close every pipe. Idle workers are asked to stop and given ``grace``
        seconds; workers still busy with tasks nobody will read (``break``, an error) are terminated at
        once: they hold nothing but their own mappings of slabs the main process owns."""
        for w, c in enumerate(self.conns):
            if not self.retired[w]:
                try:
                    c.send_bytes(b"")
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
