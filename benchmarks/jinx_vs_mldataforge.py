"""torchforge's JINX reader against MLDataForge 0.6.10's, on the same files, in one process.

The data: 20k synthetic chat samples (1-4 text turns and a 10-90 KiB incompressible "image" each, see
``_synth.py``), written once by MLDataForge's ``JinxDatasetWriter`` with zstd, b64 and a 1 KiB sidecar
threshold. Then, alternating the two readers run by run, best of ``--repeat`` runs:

* iterate:        sequential pass reading one small field (``id``)
* iterate+image:  sequential pass reading every byte of each image (its crc32)
* shuffle:        random access in a seeded global permutation, reading ``id``
* sort:           key pass over a text field (the first message), argsort, access in sorted order

MLDataForge reads with ``JinxDatasetReader(lazy=True, mmap=True)``, torchforge with ``JinxDataset``
(lazy). A bare ``orjson.loads`` per line over the same mmap is printed as the ceiling. Rates are printed
by wall clock and by this process's CPU time (steadier on a machine other jobs share).

Needs Python >= 3.12 with mldataforge and torch (``tests/interop/setup_mldataforge.sh`` builds
``.venv-mldf``):  ``.venv-mldf/bin/python benchmarks/jinx_vs_mldataforge.py``
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np
import orjson
from _synth import N_DEFAULT, synth_samples

from torchforge import GlobalSampler
from torchforge.datasets.jinx import JinxDataset


def write_dataset(path: str, n: int, seed: int) -> None:
    from mldataforge.jinx import JinxDatasetWriter

    marker = os.path.join(path, f".complete-{n}-{seed}")
    if os.path.exists(marker):
        return
    t = time.perf_counter()
    with JinxDatasetWriter(path, shard_size=2**26, compression="zst", index_compression="zst",
                           encoding="b64", binary_threshold=1024) as w:
        for s in synth_samples(n, seed):
            w.write(s)
    open(marker, "w").close()
    print(f"wrote {n} samples with MLDataForge in {time.perf_counter() - t:.1f} s -> {path}")


def task_iterate(ds: Any) -> int:
    acc = 0
    for s in ds:
        acc += s["id"]
    return acc


def task_image(ds: Any) -> int:
    acc = 0
    for s in ds:  # every byte of the image is read (a zero-copy view would otherwise touch one page of it)
        acc += zlib.crc32(s["image"])
    return acc


def task_shuffle(ds: Any, perm: list[int]) -> int:
    acc = 0
    for i in perm:
        acc += ds[i]["id"]
    return acc


def first_message(s: Any) -> str:
    return s["messages"][0]["content"]


def task_sort(ds: Any) -> int:
    """Each reader's own sort path: MLDataForge's sort_permutation is np.argsort over the list of keys
    (mldataforge/indexing.py); torchforge's is GlobalSampler(sort_key=...), which reads the keys with the
    dataset's sequential key pass and orders string keys with Python's stable sort."""
    if isinstance(ds, JinxDataset):
        order = GlobalSampler(ds, shuffle=False, sort_key=first_message)
    else:
        order = np.argsort([first_message(s) for s in ds], kind="stable").tolist()
    acc = 0
    for i in order:
        acc += ds[i]["id"]
    return acc


def ceiling(tf_ds: Any) -> int:
    """Bare orjson.loads per line over the same mmaps: the most any lazy reader can do."""
    acc = 0
    loads = orjson.loads
    for shard in tf_ds.shards:
        mv, offs = shard._mv, shard.offsets.tolist()
        for j in range(shard.num_samples):
            acc += len(loads(mv[offs[j]:offs[j + 1]]))
    return acc


def best(fns: list[Callable[[], Any]], n: int, repeat: int) -> list[tuple[float, float]]:
    """(samples/s by wall clock, samples/s by this process's CPU time) of each function, best of
    ``repeat`` runs, the functions interleaved (A B A B ...) so that both see the same machine load.
    CPU time leaves out the time other processes on a busy machine take from this one."""
    wall = [float("inf")] * len(fns)
    cpu = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[k] = min(wall[k], time.perf_counter() - t)
            cpu[k] = min(cpu[k], time.process_time() - c)
    return [(n / w, n / c) for w, c in zip(wall, cpu)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="/tmp/torchforge-bench/jinx-chat")
    ap.add_argument("-n", type=int, default=N_DEFAULT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from mldataforge.jinx import JinxDatasetReader

    write_dataset(args.data, args.n, args.seed)
    mdf = JinxDatasetReader(args.data, lazy=True, mmap=True)
    tf = JinxDataset(args.data)
    n = len(tf)
    assert len(mdf) == n == args.n, (len(mdf), n)
    perm = np.random.default_rng(args.seed).permutation(n).tolist()

    # Same answers from both readers (and a warm page cache for both).
    for name, task in (("iterate", task_iterate), ("image", task_image), ("sort", task_sort)):
        assert task(mdf) == task(tf), name
    assert task_shuffle(mdf, perm) == task_shuffle(tf, perm)

    ((rate, rate_cpu),) = best([lambda: ceiling(tf)], n, args.repeat)
    print(f"python {sys.version.split()[0]}, {n} samples, {len(tf.shards)} shard(s) in {args.data}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"ceiling: bare orjson.loads per line  {rate:>10,.0f} samples/s (CPU time: {rate_cpu:,.0f}/s)")
    print(f"{'':<16}{'---------- wall clock ----------':>38}{'--- CPU time ---':>26}")
    print(f"{'task':<16}{'MLDataForge/s':>15}{'torchforge/s':>15}{'ratio':>8}"
          f"{'MLDataForge/s':>15}{'torchforge/s':>15}{'ratio':>8}")
    tasks = [("iterate", task_iterate, ()), ("iterate+image", task_image, ()),
             ("shuffle", task_shuffle, (perm,)), ("sort", task_sort, ())]
    for name, task, extra in tasks:
        (w_mdf, c_mdf), (w_tf, c_tf) = best([lambda t=task, x=extra: t(mdf, *x), lambda t=task, x=extra: t(tf, *x)],
                                            n, args.repeat)
        print(f"{name:<16}{w_mdf:>15,.0f}{w_tf:>15,.0f}{w_tf / w_mdf:>7.1f}x"
              f"{c_mdf:>15,.0f}{c_tf:>15,.0f}{c_tf / c_mdf:>7.1f}x")

if __name__ == "__main__":
    main()
