"""Worker -> main process transport of the four objects of the Ray/Arrow serialization study.

Time from the moment a worker process starts sending an object to the moment the main process holds
the rebuilt object (median over repetitions; clocks are CLOCK_MONOTONIC, shared by both processes):

- torchforge: ``torchforge.loader.transport`` -- pickle protocol 5 into a recycled shared-memory slab
  (tensor and array data out of band, copied once), a few integers over a pipe, unpickled with the
  buffers as views of the slab;
- torch.multiprocessing.Queue: what torch's DataLoader uses for non-tensor data (pickle via a pipe);
  and, for the two array objects, the same queue carrying the arrays as torch tensors ("queue tensors"),
  the path torch's DataLoader gives arrays (its default collate makes them tensors, which the queue
  moves into shared memory and passes by file descriptor); the "vs queue" ratio is against the faster;
- plain pickle protocol 5 with out-of-band buffers written into the same kind of slab (the reference
  torchforge's transport is built on; torchforge adds torch tensors out of band and no-copy references
  to data the collate already built in the slab).

Run: ``.venv/bin/python benchmarks/transport.py [--reps N]``. Targets: torchforge >= 10x faster than the
torch queue on the two array objects, and no slower than plain pickle 5 (within noise) on all four.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import statistics
import time

import numpy as np
import orjson
import torch
import torch.multiprocessing as tmp

from torchforge.loader.slabs import SlabPool, SlabWriter
from torchforge.loader.transport import decode, encode


def make_objects() -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {
        "list of 100 arrays": [rng.standard_normal(50_000) for _ in range(100)],
        "dict of 100 arrays": {f"weight-{i}": rng.standard_normal(50_000) for i in range(100)},
        "dict of 100k sets": {i: {f"string1{i}", f"string2{i}"} for i in range(100_000)},
        "list of 200k str": [str(i) for i in range(200_000)],
    }


# --- torchforge and pickle-5 over slabs -----------------------------------------------------------------
@contextlib.contextmanager
def _gc_paused(pause: bool):
    """torchforge pauses the cyclic GC while it builds objects; the "gc off" pickle column does too."""
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause:
            gc.enable()


def _slab_worker(conn, obj, method: str) -> None:
    writer = SlabWriter()
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        sid, path = orjson.loads(msg)
        arena = writer.begin(sid, path)
        t0 = time.perf_counter()
        if method == "torchforge":
            hoff, hlen, buffers = encode(obj, arena)
            conn.send_bytes(orjson.dumps([t0, arena.used, hoff, hlen, buffers]))
        else:
            bufs: list[pickle.PickleBuffer] = []
            with _gc_paused(method == "pickle5-nogc"):
                stream = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
            spans = []
            for b in bufs:
                raw = b.raw()
                off, dst = arena.put(raw.nbytes)
                dst[:] = np.frombuffer(raw, dtype=np.uint8)
                spans.append([off, raw.nbytes])
            off, dst = arena.put(len(stream))
            dst[:] = np.frombuffer(stream, dtype=np.uint8)
            conn.send_bytes(orjson.dumps([t0, arena.used, off, len(stream), spans]))
        writer.end(sid, arena)
    writer.close()


def run_slab(obj, method: str, reps: int) -> list[float]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_slab_worker, args=(child, obj, method), daemon=True)
    p.start()
    pool, times = SlabPool(), []
    try:
        for _ in range(reps + 1):
            sid, path = pool.acquire()
            parent.send_bytes(orjson.dumps([sid, path]))
            reply = orjson.loads(parent.recv_bytes())
            base = pool.lease(sid, reply[1])
            if method == "torchforge":
                got = decode(base, reply[2], reply[3], reply[4])
            else:
                with _gc_paused(method == "pickle5-nogc"):
                    got = pickle.loads(base[reply[2]:reply[2] + reply[3]],
                                       buffers=[base[o:o + n] for o, n in reply[4]])
            times.append(time.perf_counter() - reply[0])
            del got, base  # the slab goes back to the pool for the next round
    finally:
        parent.send_bytes(b"")
        p.join()
        pool.close()
    return times[1:]  # the first round maps fresh pages


# --- torch.multiprocessing queue -------------------------------------------------------------------------
def _as_tensors(obj):
    """The object as torch's default collate leaves it for the queue: its numpy arrays as tensors."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, list):
        return [_as_tensors(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _as_tensors(v) for k, v in obj.items()}
    return obj


def _queue_worker(q, ready, obj, reps: int, tensors: bool) -> None:
    for _ in range(reps + 1):
        ready.get()
        t0 = time.perf_counter()
        q.put((t0, _as_tensors(obj) if tensors else obj))  # (the conversion shares the arrays' memory)
    ready.get()  # alive until the main process has every object: tensors' descriptors are fetched from here


def run_queue(obj, reps: int, tensors: bool = False) -> list[float]:
    ctx = tmp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_queue_worker, args=(q, ready, obj, reps, tensors), daemon=True)
    p.start()
    times = []
    for _ in range(reps + 1):
        ready.put(1)
        t0, got = q.get()
        times.append(time.perf_counter() - t0)
        del got
    ready.put(None)
    p.join()
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    objs = make_objects()
    print(f"load average {os.getloadavg()} on {os.cpu_count()} cores")
    print("median ms from the worker starting to send to the main process holding the object;"
          " ratios = competitor time / torchforge time")
    print(f"{'object':20s} {'torchforge':>10s} {'torch queue':>11s} {'queue tensors':>13s} {'pickle5':>9s} "
          f"{'p5 gc off':>9s} {'vs queue':>9s} {'vs pickle5':>10s} {'vs p5 gc off':>12s}")
    for name, obj in objs.items():
        tf = statistics.median(run_slab(obj, "torchforge", args.reps))
        tq = statistics.median(run_queue(obj, args.reps))
        arrays = "arrays" in name
        tt = statistics.median(run_queue(obj, args.reps, tensors=True)) if arrays else float("nan")
        tp = statistics.median(run_slab(obj, "pickle5", args.reps))
        tn = statistics.median(run_slab(obj, "pickle5-nogc", args.reps))
        best_queue = min(tq, tt) if arrays else tq
        print(f"{name:20s} {tf * 1e3:10.2f} {tq * 1e3:11.2f} {tt * 1e3:13.2f} {tp * 1e3:9.2f} {tn * 1e3:9.2f} "
              f"{best_queue / tf:8.1f}x {tp / tf:9.2f}x {tn / tf:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
