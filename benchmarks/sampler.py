"""Generate and stream one epoch's indices: GlobalSampler vs torch's DistributedSampler.

Each contender runs in its own fresh subprocess, so its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``)
is its own; the RSS reached before timing starts (imports, and the keys of ``bucketed``) is shown too. Timing covers building the sampler, drawing the
epoch's order and consuming it the way one rank's loader does:

- ``torch``: ``DistributedSampler`` (``torch.randperm(n).tolist()``, then the rank's slice) read in
  batches with ``itertools.islice``, which is what torch's ``BatchSampler`` does;
- ``torch-t``: the same permutation kept as a tensor (``torch.randperm``, the rank's strided slice) and
  read in tensor slices per batch: what a user of torch who wants arrays of indices writes (the like for
  like of ``batches`` and ``chunks``, which the two lines for those compare against);
- ``ints``: ``GlobalSampler`` read the same way (Python ints; torchforge.DataLoader's path, through torch's
  ``BatchSampler``);
- ``batches``: ``GlobalSampler.indices(b * B, (b + 1) * B)`` per batch, numpy (random access to any batch);
- ``chunks``: ``GlobalSampler.chunks(65536)``, numpy arrays (bulk streaming);
- ``bucketed`` (on request): a length-bucketed order -- random int32 lengths, stable argsort, buckets of
  4096 shuffled -- streamed in chunks; sorted orders need the O(n) argsort, so this shows its cost.

Every contender counts what it streamed and reads the first and last index of every batch or chunk;
the counts must agree.

Usage::

    python benchmarks/sampler.py                      # n = 10M and 100M, world size 1, batch 512
    python benchmarks/sampler.py --sizes 1e7 --world-size 8 --repeat 3
    python benchmarks/sampler.py --sizes 1e8 --contenders torch,bucketed
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import time

CONTENDERS = ("torch", "torch-t", "ints", "batches", "chunks", "bucketed")
DEFAULT = "torch,torch-t,ints,batches,chunks"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _child(name: str, n: int, world: int, batch: int) -> dict:
    import torch.utils.data

    from torchforge.sampler import GlobalSampler

    lengths = None
    if name == "bucketed":  # the keys exist before the sampler is built (a dataset's cached keys)
        import numpy as np

        lengths = np.random.default_rng(0).integers(1, 4096, n, dtype=np.int32)
    base = _rss_mb()
    t0 = time.perf_counter()
    count = total = 0
    if name == "torch-t":  # DistributedSampler's order (seed + epoch, randperm, rank stride), as tensors
        g = torch.Generator()
        g.manual_seed(0)
        perm = torch.randperm(n, generator=g)
        if len(perm) % world:  # padded to a multiple of the world size, as DistributedSampler pads
            perm = torch.cat([perm, perm[:world - len(perm) % world]])
        mine = perm[0::world]
        for lo in range(0, len(mine), batch):
            a = mine[lo:lo + batch]
            count += len(a)
            total += int(a[0]) + int(a[-1])
    elif name in ("torch", "ints"):
        if name == "torch":
            class _Len:
                def __len__(self) -> int:
                    return n

            sampler = torch.utils.data.DistributedSampler(_Len(), num_replicas=world, rank=0, shuffle=True, seed=0)
        else:
            sampler = GlobalSampler(n, seed=0, rank=0, world_size=world)
        sampler.set_epoch(0)
        it = iter(sampler)
        while True:
            b = list(itertools.islice(it, batch))
            if not b:
                break
            count += len(b)
            total += b[0] + b[-1]
    else:
        sampler = GlobalSampler(n, seed=0, rank=0, world_size=world, sort_key=lengths,
                                bucket_size=None if lengths is None else 4096)
        sampler.set_epoch(0)
        if name == "batches":
            m = len(sampler)
            for lo in range(0, m, batch):
                a = sampler.indices(lo, lo + batch)
                count += len(a)
                total += int(a[0]) + int(a[-1])
        else:
            for a in sampler.chunks(1 << 16):
                count += len(a)
                total += int(a[0]) + int(a[-1])
    seconds = time.perf_counter() - t0
    return {"name": name, "n": n, "seconds": seconds, "peak_rss_mb": _rss_mb(), "import_rss_mb": base,
            "count": count, "check": total}


def _run(name: str, n: int, world: int, batch: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", name, "--sizes", str(n), "--world-size", str(world),
                          "--batch", str(batch)], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e7,1e8", help="comma-separated epoch sizes")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=1, help="runs per contender (best time, max RSS kept)")
    ap.add_argument("--contenders", default=DEFAULT, help=f"comma-separated, of {CONTENDERS}")
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(_child(args.child, sizes[0], args.world_size, args.batch)))
        return
    names = args.contenders.split(",")
    print(f"world size {args.world_size}, rank 0, batch {args.batch}; seconds (best of {args.repeat}) and peak RSS")
    for n in sizes:
        res: dict[str, dict] = {}
        for _ in range(args.repeat):  # interleave contenders so machine load hits them alike
            for name in names:
                r = _run(name, n, args.world_size, args.batch)
                if name in res:
                    r = {**r, "seconds": min(r["seconds"], res[name]["seconds"]),
                         "peak_rss_mb": max(r["peak_rss_mb"], res[name]["peak_rss_mb"])}
                res[name] = r
        counts = {r["count"] for r in res.values()}
        if len(counts) != 1:
            raise SystemExit(f"contenders streamed different counts: {counts}")
        for name in names:
            r = res[name]
            # arrays of indices against torch's arrays of indices (torch-t), Python ints against Python ints
            ref_name = "torch-t" if name in ("batches", "chunks", "bucketed") and "torch-t" in res else "torch"
            ref = res.get(ref_name)
            line = (f"n={n:>11,} {name:>8}: {r['seconds']:7.2f} s  peak RSS {r['peak_rss_mb']:8.0f} MB "
                    f"(before timing {r['import_rss_mb']:.0f} MB, epoch {r['peak_rss_mb'] - r['import_rss_mb']:7.0f} MB)")
            if ref is not None and name not in ("torch", "torch-t"):
                what = "DistributedSampler" if ref_name == "torch" else "randperm tensor slices"
                line += (f"  time x{r['seconds'] / ref['seconds']:.2f}, peak RSS x{r['peak_rss_mb'] / ref['peak_rss_mb']:.3f}"
                         f" (1/{ref['peak_rss_mb'] / r['peak_rss_mb']:.1f}) of {what}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
