"""Data loaders on the synthetic multimodal JINX dataset: samples/s, one run, the same batches.

Every loader reads the same JinxDataset and builds its batches of 64 with the same user ``collate_fn``
(``torch_collate``: ids into an int64 tensor, the images padded into one uint8 tensor plus lengths,
the chat messages as lists of plain dicts). The loaders:

* torchforge.DataLoader, 2 workers (and, as a second row, with torchforge's opt-in ``padded_collate``,
  which builds the same batch straight in shared memory);
* torch.utils.data.DataLoader, 2 workers and 0 workers (torch's copies already run on both cores
  through its intra-op threads, so 0 workers is the strong baseline on a 2-core machine).

Each in two loops: (a) a bare consumer that touches every batch; (b) a training loop whose step keeps
the main process waiting 2 ms per batch (``time.sleep``), as a GPU-bound step waits on the device: the
step alone bounds it at 64 / 2 ms = 32k samples/s. Then the same for an IterableDataset that shards
itself by ``get_worker_info()`` (``IterableShards`` in blocks of a batch, so batches come out in the
same order). Each loader object runs ``--epochs`` full epochs (iterator creation, i.e. worker start-up,
included), the loaders taking turns epoch by epoch; the best epoch counts.

``--others`` adds torch's DataLoader over MLDataForge's reader (in the Python 3.12 venv ``.venv-mldf``)
and MosaicML Streaming's StreamingDataLoader over an MDS copy.

``--device cuda`` (on a machine with a GPU) puts every batch on the device: torchforge with
``device="cuda"`` (its slabs page-locked, each batch copied on a side stream one batch ahead) against
torch's DataLoader with ``pin_memory=True`` and ``.to(device, non_blocking=True)`` on every tensor of the
batch in the loop, as torch's documentation recommends. The step of loop (b) is then real device work: a
2 ms kernel queued on the current stream, then a synchronize (as ``loss.item()`` waits in a training step).

Run: ``.venv/bin/python benchmarks/loader.py [--n 20000] [--epochs 3] [--others]``. Targets: (a) torchforge
>= 1.0x torch's 0-worker loop; (b) >= 85% of the step's bound and >= 3.5x torch's 2-worker loader; the
padded collate at least as fast as the user collate; the same for the IterableDataset.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np
import torch
from _measure import memcpy_gb_s

BATCH = 64
WORKERS = 2  # --workers: the worker count of every multi-worker loader (the targets are for 2)
STEP_S = 0.002  # loop (b): the main process waits this long per batch
PERSISTENT = False  # --persistent: every loader keeps its workers across epochs (one loader object each)
DEVICE: torch.device | None = None  # --device: batches end on this device
SLEEP_CYCLES = 0  # with a CUDA device: torch.cuda._sleep cycles that take STEP_S on the device


def _factory(build: Callable[[], Any]) -> Callable[[], Any]:
    """One loader object per configuration, iterated once per epoch as a training loop does (with
    --persistent its workers are kept from one epoch to the next; without, each epoch starts new ones)."""
    loader = build()
    return lambda: loader


def torch_collate(samples: list) -> dict[str, Any]:
    """The batch torchforge's default collate builds, with plain torch/numpy ops (for the other loaders).

    Rows are copied through numpy: ``torch.frombuffer`` on immutable ``bytes`` costs ~10 ms per call.
    """
    images = [s["image"] for s in samples]
    lengths = torch.tensor([len(b) for b in images], dtype=torch.int64)
    data = torch.zeros((len(images), int(lengths.max())), dtype=torch.uint8)
    rows = data.numpy()
    for i, b in enumerate(images):
        rows[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
    return {"id": torch.tensor([int(s["id"]) for s in samples], dtype=torch.int64),
            "image": {"data": data, "lengths": lengths},
            # plain dicts: lazy records may hold memory maps, which cannot be pickled to the main process
            "messages": [[dict(m) for m in s["messages"]] for s in samples]}


def to_device(batch: dict[str, Any]) -> dict[str, Any]:
    """torch's recipe, as a training loop writes it for this batch: ``.to(device, non_blocking=True)`` on
    each of its tensors (pinned by the loader's pin_memory=True)."""
    image = batch["image"]
    return {"id": batch["id"].to(DEVICE, non_blocking=True),
            "image": {"data": image["data"].to(DEVICE, non_blocking=True),
                      "lengths": image["lengths"].to(DEVICE, non_blocking=True)},
            "messages": batch["messages"]}


def device_step() -> None:
    """2 ms of device work on the current stream, then wait for it, as ``loss.item()`` does."""
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()


def calibrate_sleep() -> int:
    """torch.cuda._sleep cycles that keep the device busy for STEP_S."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * STEP_S * 1000 / start.elapsed_time(end))


def consume(loader: Any, step: float = 0.0, move: bool = False) -> tuple[int, int]:
    samples = payload = 0
    for batch in loader:
        if move:
            batch = to_device(batch)
        if step and DEVICE is not None and DEVICE.type == "cuda":
            device_step()
        elif step:
            time.sleep(step)  # the training step: the main process waits on the device
        lengths = batch["image"]["lengths"]
        samples += len(batch["id"])
        payload += int(lengths.sum())
        _ = int(batch["image"]["data"][-1, 0])
        # read every message: a lazy dataset in-process would otherwise never decode them
        payload += sum(len(m["content"]) for msgs in batch["messages"] for m in msgs)
    return samples, payload


def epoch(make: Callable[[], Any], n: int, step: float = 0.0) -> dict[str, float]:
    """One full epoch of a fresh iterator (worker start-up included)."""
    t, cpu = time.perf_counter(), time.process_time()
    loader = make()
    # torch's loaders get their batches moved in the loop; torchforge's arrive on the device
    samples, payload = consume(loader, step, move=DEVICE is not None and not getattr(loader, "_tf_device", False))
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    if samples != n:
        raise RuntimeError(f"loader delivered {samples} samples, expected {n}")
    return {"samples_s": n / dt, "gb_s": payload / dt / 1e9, "seconds": dt, "main_cpu_s": cpu}


def step_only(n: int) -> float:
    """Samples/s of the training loop's steps alone (no loading): the bound loop (b) can reach here, which
    a sleep's overshoot puts below the nominal 64 / 2 ms."""
    batches = -(-n // BATCH)
    t = time.perf_counter()
    for _ in range(batches):
        if DEVICE is not None and DEVICE.type == "cuda":
            device_step()
        else:
            time.sleep(STEP_S)
    return n / (time.perf_counter() - t)


# --- data -------------------------------------------------------------------------------------------------
def write_data(root: str, n: int, seed: int, with_mds: bool = True) -> tuple[str, str]:
    """The JINX dataset (torchforge's JinxWriter) and, when asked, its MDS copy (Streaming's MDSWriter)."""
    import contextlib

    from _synth import synth_samples

    jinx, mds = os.path.join(root, "jinx"), os.path.join(root, "mds")
    done = os.path.join(root, ".complete" if with_mds else ".complete-jinx")
    if not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        from torchforge.formats.jinx import JinxWriter

        t = time.perf_counter()
        with contextlib.ExitStack() as stack:
            jw = stack.enter_context(JinxWriter(jinx, shard_size=2**26, compression="zst", index_compression="zst",
                                                encoding="b64", binary_threshold=1024))
            mw = None
            if with_mds:
                from streaming import MDSWriter

                mw = stack.enter_context(MDSWriter(out=mds, columns={"id": "int64", "image": "bytes",
                                                                     "messages": "json"}))
            for s in synth_samples(n, seed):
                jw.write(s)
                if mw is not None:
                    mw.write(s)
        open(done, "w").close()
        print(f"wrote {n} samples as JINX (torchforge JinxWriter)" + (" and MDS (Streaming MDSWriter)" if with_mds else "") + " "
              f"in {time.perf_counter() - t:.1f} s -> {root}", flush=True)
    return jinx, mds


# --- the loaders ------------------------------------------------------------------------------------------
def _dataset(jinx: str, iterable: bool) -> Any:
    from torchforge.datasets.jinx import JinxDataset
    from torchforge.sampler import GlobalSampler, IterableShards

    ds = JinxDataset(jinx)
    if iterable:  # shards itself by get_worker_info(), a batch-sized block per worker turn
        return IterableShards(ds, GlobalSampler(len(ds), shuffle=False), block_size=BATCH)
    return ds


def torchforge_loader(jinx: str, workers: int, iterable: bool = False, padded: bool = False) -> Callable[[], Any]:
    from torchforge.loader import DataLoader, padded_collate

    ds = _dataset(jinx, iterable)
    collate = padded_collate if padded else torch_collate
    kw = {"persistent_workers": PERSISTENT} if workers else {}
    if DEVICE is not None:
        kw["device"] = DEVICE

    def build() -> Any:
        loader = DataLoader(ds, BATCH, num_workers=workers, collate_fn=collate, **kw)
        loader._tf_device = DEVICE is not None  # batches arrive on the device: the loop moves nothing
        return loader

    return _factory(build)


def torch_loader(jinx: str, workers: int, iterable: bool = False) -> Callable[[], Any]:
    ds = _dataset(jinx, iterable)
    kw: dict[str, Any] = {"persistent_workers": PERSISTENT} if workers else {}
    if DEVICE is not None and DEVICE.type == "cuda":
        kw["pin_memory"] = True
    return _factory(lambda: torch.utils.data.DataLoader(ds, BATCH, num_workers=workers, collate_fn=torch_collate,
                                                        **kw))


def streaming_loader(mds: str) -> Callable[[], Any]:
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=mds, shuffle=False, batch_size=BATCH)
    return _factory(lambda: StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=torch_collate,
                                                persistent_workers=PERSISTENT))


def mldataforge_epoch(jinx: str, n: int) -> dict[str, float] | str:
    """One epoch in the Python 3.12 venv (MLDataForge needs it): this script with ``--mldf``."""
    python = os.path.join(ROOT, ".venv-mldf", "bin", "python")
    if not os.path.exists(python):
        return f"missing: {python} (tests/interop/setup_mldataforge.sh builds it)"
    cmd = [python, __file__, "--mldf", jinx, "--n", str(n)] + (["--persistent", "--epochs", "2"] if PERSISTENT else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or [""])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mldf_child(jinx: str, n: int, epochs: int) -> None:
    import lz4.frame  # noqa: F401  MLDataForge uses lz4.frame after a bare `import lz4`
    from mldataforge.jinx import JinxDatasetReader

    ds = JinxDatasetReader(jinx, lazy=True, mmap=True)
    make = _factory(lambda: torch.utils.data.DataLoader(ds, BATCH, num_workers=WORKERS, collate_fn=torch_collate,
                                                        persistent_workers=PERSISTENT))
    # with --persistent the first epoch starts the workers and later ones reuse them: best of the epochs
    res = max((epoch(make, n) for _ in range(epochs)), key=lambda r: r["samples_s"])
    print(json.dumps(res))


TORCH0 = "torch, 0 workers"


def names() -> tuple[str, str, str]:
    """Row names of the multi-worker loaders (their worker count is --workers)."""
    return (f"torchforge, {WORKERS} workers", f"torchforge padded_collate, {WORKERS} workers",
            f"torch, {WORKERS} workers")


def main() -> None:
    ap = argparse.ArgumentParser(description="torchforge.DataLoader vs torch's DataLoader (2 and 0 workers)")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "torchforge-bench-loader"))
    ap.add_argument("--persistent", action="store_true",
                    help="every loader keeps its worker processes across epochs (persistent_workers=True)")
    ap.add_argument("--others", action="store_true", help="also MLDataForge's reader and StreamingDataLoader")
    ap.add_argument("--workers", type=int, default=2, help="workers of every multi-worker loader (default 2)")
    ap.add_argument("--device", help="put every batch on this device (e.g. cuda): see the module docstring")
    ap.add_argument("--mldf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global PERSISTENT, DEVICE, SLEEP_CYCLES, WORKERS
    PERSISTENT, WORKERS = args.persistent, args.workers
    TF, TF_PAD, TORCH2 = names()
    others = (f"torch, MLDataForge reader, {WORKERS} workers", f"StreamingDataLoader, MDS copy, {WORKERS} workers")
    if args.device:
        if args.others:
            ap.error("--others measures host batches; run it without --device")
        DEVICE = torch.device(args.device)
        if DEVICE.type == "cuda":
            torch.cuda.init()
            SLEEP_CYCLES = calibrate_sleep()
    if args.mldf:
        mldf_child(args.mldf, args.n, 1 if not PERSISTENT else args.epochs)
        return
    jinx, mds = write_data(f"{args.data}-{args.n}-{args.seed}", args.n, args.seed, with_mds=args.others)
    mem = memcpy_gb_s()
    print(f"{args.n} samples, batch {BATCH}, best of {args.epochs} epochs (loaders take turns, epoch by epoch, "
          f"so a busy machine hits them alike); persistent workers: {PERSISTENT}; memcpy on this machine: "
          f"{mem:.1f} GB/s; load average {os.getloadavg()} on {os.cpu_count()} cores", flush=True)
    if DEVICE is not None:
        name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else str(DEVICE)
        print(f"batches on {DEVICE} ({name}): torchforge device={DEVICE}; torch pin_memory=True and "
              f".to(device, non_blocking=True) in the loop; step (b): {SLEEP_CYCLES} sleep cycles = "
              f"{STEP_S * 1000:.0f} ms on the device, then synchronize", flush=True)
    runs: dict[str, tuple[Callable[[], Any] | None, float]] = {}
    for kind, iterable in (("map-style", False), ("IterableDataset", True)):
        makers = {TF: torchforge_loader(jinx, WORKERS, iterable), TF_PAD: torchforge_loader(jinx, WORKERS, iterable, True),
                  TORCH2: torch_loader(jinx, WORKERS, iterable), TORCH0: torch_loader(jinx, 0, iterable)}
        for loop, step in (("(a) bare", 0.0), ("(b) 2 ms step", STEP_S)):
            for name, make in makers.items():
                runs[f"{kind} {loop}: {name}"] = (make, step)
    if args.others:
        runs[f"map-style (a) bare: {others[0]}"] = (None, 0.0)
        runs[f"map-style (a) bare: {others[1]}"] = (streaming_loader(mds), 0.0)
    best: dict[str, Any] = {}
    for _ in range(args.epochs):
        for name, (make, step) in runs.items():
            res = epoch(make, args.n, step) if make is not None else mldataforge_epoch(jinx, args.n)
            shown = res if isinstance(res, str) else f"{res['samples_s']:.0f} samples/s"
            print(f"    {name}: {shown}", file=sys.stderr, flush=True)
            old = best.get(name)
            if isinstance(res, str) or old is None or (isinstance(old, dict) and res["samples_s"] > old["samples_s"]):
                best[name] = res
    for name, res in best.items():
        if isinstance(res, str):
            print(f"  {name:62s} {res}")
        else:
            print(f"  {name:62s} {res['samples_s']:9.0f} samples/s  {res['gb_s']:6.2f} GB/s  "
                  f"main process {res['main_cpu_s'] / res['seconds'] * 100:4.0f}% CPU")
    print(f"load average of this machine (1, 5, 15 min) at the end: {os.getloadavg()} on {os.cpu_count()} cores")
    bound = BATCH / STEP_S
    measured = max(step_only(args.n) for _ in range(3))
    print(f"the step alone (no loading), best of 3: {measured:.0f} samples/s ({measured / bound * 100:.1f}% of the "
          f"nominal {bound:.0f}/s)")
    for kind in ("map-style", "IterableDataset"):
        a = {name: best[f"{kind} (a) bare: {name}"]["samples_s"] for name in (TF, TF_PAD, TORCH2, TORCH0)}
        b = {name: best[f"{kind} (b) 2 ms step: {name}"]["samples_s"] for name in (TF, TF_PAD, TORCH2, TORCH0)}
        print(f"ratios, {kind}:")
        print(f"  (a) torchforge / torch 0 workers {a[TF] / a[TORCH0]:6.2f}x (target >= 1.0x); "
              f"/ torch {WORKERS} workers {a[TF] / a[TORCH2]:6.2f}x; padded_collate / user collate {a[TF_PAD] / a[TF]:5.2f}x")
        print(f"  (b) torchforge {b[TF] / bound * 100:5.1f}% of the step's bound of {bound:.0f}/s (target >= 85%), "
              f"{b[TF] / measured * 100:5.1f}% of the measured step-only loop; "
              f"/ torch {WORKERS} workers {b[TF] / b[TORCH2]:6.2f}x (target >= 3.5x); / torch 0 workers "
              f"{b[TF] / b[TORCH0]:5.2f}x; padded_collate / user collate {b[TF_PAD] / b[TF]:5.2f}x")
    if args.others:
        tf = best[f"map-style (a) bare: {TF}"]["samples_s"]
        for name in others:
            other = best[f"map-style (a) bare: {name}"]
            shown = f"{tf / other['samples_s']:6.2f}x" if isinstance(other, dict) else f"n/a ({other})"
            print(f"  (a) torchforge / {name}: {shown}")


if __name__ == "__main__":
    main()
