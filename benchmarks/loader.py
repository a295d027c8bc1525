"""Data loaders on the synthetic multimodal dataset: samples/s and GB/s, one run, same batches.

Every loader delivers the same batches of 64 samples: ``{"id": int64 (64,), "image": {"data": uint8
(64, max_len) zero-padded, "lengths": int64 (64,)}, "messages": list of 64 message lists}``
(torchforge's default collate; the others get ``collate_fn=torch_collate``, which builds the same
thing with torch ops). The consumer touches every batch (sums the image lengths, reads one image byte and the length of
every message's content).

* torchforge.DataLoader over torchforge's JinxDataset, 2 workers and 0 workers;
* torch.utils.data.DataLoader over the same JinxDataset, 2 workers;
* torch.utils.data.DataLoader over MLDataForge 0.6.10's JinxDatasetReader on the same files, 2 workers
  (run in the Python 3.12 venv ``.venv-mldf`` as a subprocess; reported missing if it is absent);
* MosaicML Streaming 0.13's StreamingDataLoader over an MDS copy written by Streaming's MDSWriter.

Each loader runs ``--epochs`` full epochs (iterator creation, i.e. worker start-up, included), the
loaders taking turns epoch by epoch; the best epoch counts. GB/s is image payload delivered per second, printed next to this machine's memcpy
bandwidth (one large ``np.copyto``).

Run: ``.venv/bin/python benchmarks/loader.py [--n 20000] [--epochs 3]``. Targets: torchforge >= 4x
torch's DataLoader on the same dataset, >= 8x StreamingDataLoader, 2 workers faster than 0.
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

BATCH, WORKERS = 64, 2
PERSISTENT = False  # --persistent: every loader keeps its workers across epochs (one loader object each)


def _factory(build: Callable[[], Any]) -> Callable[[], Any]:
    """A fresh loader per epoch, or with --persistent one loader reused (its workers kept) every epoch."""
    if not PERSISTENT:
        return build
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


def consume(loader: Any) -> tuple[int, int]:
    samples = payload = 0
    for batch in loader:
        lengths = batch["image"]["lengths"]
        samples += len(batch["id"])
        payload += int(lengths.sum())
        _ = int(batch["image"]["data"][-1, 0])
        # read every message: a lazy dataset in-process would otherwise never decode them
        payload += sum(len(m["content"]) for msgs in batch["messages"] for m in msgs)
    return samples, payload


def epoch(make: Callable[[], Any], n: int) -> dict[str, float]:
    """One full epoch of a fresh iterator (worker start-up included)."""
    t = time.perf_counter()
    samples, payload = consume(make())
    dt = time.perf_counter() - t
    if samples != n:
        raise RuntimeError(f"loader delivered {samples} samples, expected {n}")
    return {"samples_s": n / dt, "gb_s": payload / dt / 1e9, "seconds": dt}


def memcpy_gb_s() -> float:
    src = np.ones(1 << 28, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- data -------------------------------------------------------------------------------------------------
def write_data(root: str, n: int, seed: int) -> tuple[str, str]:
    from _synth import synth_samples

    jinx, mds = os.path.join(root, "jinx"), os.path.join(root, "mds")
    if not os.path.exists(os.path.join(root, ".complete")):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        from streaming import MDSWriter

        from torchforge.formats.jinx import JinxWriter

        t = time.perf_counter()
        with JinxWriter(jinx, shard_size=2**26, compression="zst", index_compression="zst", encoding="b64",
                        binary_threshold=1024) as jw, MDSWriter(
                out=mds, columns={"id": "int64", "image": "bytes", "messages": "json"}) as mw:
            for s in synth_samples(n, seed):
                jw.write(s)
                mw.write(s)
        open(os.path.join(root, ".complete"), "w").close()
        print(f"wrote {n} samples as JINX (torchforge JinxWriter) and MDS (Streaming MDSWriter) "
              f"in {time.perf_counter() - t:.1f} s -> {root}", flush=True)
    return jinx, mds


# --- the loaders ------------------------------------------------------------------------------------------
def torchforge_loader(jinx: str, workers: int) -> Callable[[], Any]:
    from torchforge.datasets.jinx import JinxDataset
    from torchforge.loader import DataLoader

    ds = JinxDataset(jinx)
    return _factory(lambda: DataLoader(ds, BATCH, num_workers=workers, persistent_workers=PERSISTENT))


def torch_loader(jinx: str) -> Callable[[], Any]:
    from torchforge.datasets.jinx import JinxDataset

    ds = JinxDataset(jinx)
    return _factory(lambda: torch.utils.data.DataLoader(ds, BATCH, num_workers=WORKERS, collate_fn=torch_collate,
                                                        persistent_workers=PERSISTENT))


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


def main() -> None:
    ap = argparse.ArgumentParser(description="torchforge.DataLoader vs torch, MLDataForge and Streaming loaders")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "torchforge-bench-loader"))
    ap.add_argument("--persistent", action="store_true",
                    help="every loader keeps its worker processes across epochs (persistent_workers=True)")
    ap.add_argument("--mldf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global PERSISTENT
    PERSISTENT = args.persistent
    if args.mldf:
        mldf_child(args.mldf, args.n, 1 if not PERSISTENT else args.epochs)
        return
    jinx, mds = write_data(f"{args.data}-{args.n}-{args.seed}", args.n, args.seed)
    mem = memcpy_gb_s()
    print(f"{args.n} samples, batch {BATCH}, best of {args.epochs} epochs (loaders take turns, epoch by epoch, "
          f"so a busy machine hits them alike); persistent workers: {PERSISTENT}; memcpy on this machine: {mem:.1f} GB/s; "
          f"load average {os.getloadavg()} on {os.cpu_count()} cores", flush=True)
    loaders = {
        "torchforge.DataLoader, JinxDataset, 2 workers": torchforge_loader(jinx, WORKERS),
        "torchforge.DataLoader, JinxDataset, 0 workers": torchforge_loader(jinx, 0),
        "torch DataLoader, torchforge JinxDataset, 2 workers": torch_loader(jinx),
        "torch DataLoader, MLDataForge reader, 2 workers": None,
        "StreamingDataLoader, MDS copy, 2 workers": streaming_loader(mds),
    }
    best: dict[str, Any] = {}
    for _ in range(args.epochs):
        for name, make in loaders.items():
            res = epoch(make, args.n) if make is not None else mldataforge_epoch(jinx, args.n)
            shown = res if isinstance(res, str) else f"{res['samples_s']:.0f} samples/s"
            print(f"    {name}: {shown}", file=sys.stderr, flush=True)
            old = best.get(name)
            if isinstance(res, str) or old is None or (isinstance(old, dict) and res["samples_s"] > old["samples_s"]):
                best[name] = res
    for name, res in best.items():
        if isinstance(res, str):
            print(f"  {name:52s} {res}")
        else:
            print(f"  {name:52s} {res['samples_s']:9.0f} samples/s  {res['gb_s']:6.2f} GB/s "
                  f"({res['gb_s'] / mem * 100:4.1f}% of memcpy)")
    print(f"load average of this machine (1, 5, 15 min) at the end: {os.getloadavg()} on {os.cpu_count()} cores")
    names = list(loaders)
    tf2 = best[names[0]]
    print("ratios, torchforge 2 workers / other:")
    for name, label in ((names[2], "torch DataLoader, same dataset (target >= 4x)"),
                        (names[3], "torch DataLoader over MLDataForge's reader"),
                        (names[4], "StreamingDataLoader over MDS (target >= 8x)"),
                        (names[1], "torchforge with 0 workers (target > 1x)")):
        other = best[name]
        if isinstance(other, dict):
            print(f"  vs {label:48s} {tf2['samples_s'] / other['samples_s']:6.2f}x")
        else:
            print(f"  vs {label:48s} n/a ({other})")


if __name__ == "__main__":
    main()
