"""Checkpoint save / restore speed: torchforge.Checkpointer vs torch.save/torch.load and safetensors.

A model plus AdamW state of about 1 GiB (float32) is saved and restored into the existing model and
optimizer, in the same run, alternating the contenders over several rounds; the best round of each is
reported. torchforge always fsyncs its files and folders (a checkpoint that is not on disk is not
committed); the competitors are timed both as they ship (no fsync) and with an fsync of their files and
folder added ("+fsync"), which is the like-for-like comparison. Before every timed save the previous
files are deleted and ``os.sync()`` runs (both untimed), so each contender starts with no dirty pages and
pays no deletion: torchforge's compared saves keep every step (``keep_last=None``) and the benchmark
deletes their old step folders untimed, as it unlinks the others' files; that is a first save into new
files. The steady state of a training loop, where each save replaces the last one, is timed on three more
rows and compared on a line of its own: ``save_file`` + fsync over the files of the save before (which
it truncates and writes again), ``save_file`` + fsync into new files and then the deletion of the save
before (the line compares against the faster of the two), and a ``Checkpointer(keep_last=1)``, which
prunes the step it replaces before ``save`` returns and writes the next step over that step's files
(``recycle``; see :class:`~torchforge.checkpoint.Checkpointer`). The contenders' order within a round
alternates from round to round.
Restores copy every tensor into the existing parameters and optimizer state, twice per round: warm,
from files in the page cache (all contenders alike: torchforge writes large files with O_DIRECT, which
leaves them out of the cache, so they are read once, untimed, before the restores), then cold, each
after the page cache is dropped (``drop_caches`` as root, else ``POSIX_FADV_DONTNEED`` on the files). Two floors are measured in the same rounds, as yardsticks
for the targets: the fastest plain write of as many bytes this disk takes (O_DIRECT from huge pages, no
copy or checksum, + fsync) and one copy of the state in memory (the least a non-blocking save, which must
snapshot before it returns, can block for). The load average is printed: other processes share the CPUs
and the disk, so compare within one run.

With ``--device cuda`` the model and optimizer live on the GPU: every saver copies the state to the host
(torchforge into its pinned staging buffer, safetensors and torch.save through ``.cpu()``), restores copy
back onto the device, and the copy floor is one device-to-host copy of the state into pinned memory.

    .venv/bin/python benchmarks/checkpoint.py [--gib 1.0] [--rounds 5] [--dir /tmp/tf-ckpt-bench] [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from _pagecache import read_once
from safetensors.torch import load_file, save_file

from torchforge.checkpoint import Checkpointer
from torchforge.checkpoint.writer import huge_page_buffer
from torchforge.formats.safetensors import fsync_dir


def build(gib: float, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    dim = 2048
    layers = max(1, round(gib * 2**30 / 3 / (4 * (dim * dim + dim))))  # params + 2 AdamW moments
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates exp_avg / exp_avg_sq / step
    for p in model.parameters():
        p.grad = None
    return model, opt


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Flat name -> tensor maps of the model and the optimizer state (the destinations of a restore)."""
    m = dict(model.state_dict())
    o = {f"state.{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    return m, o


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_floor(folder: str, nbytes: int, threads: int = 8, run: int = 32 << 20) -> float:
    """The fastest write of ``nbytes`` this benchmark knows on this disk, as a yardstick: one new file,
    O_DIRECT, ``threads`` writes of ``run`` bytes in flight from huge-page buffers (no copy, no checksum),
    then fsync of the file and the folder. No saver that puts the same bytes on the disk is expected to
    beat it by much, so ``save_file+fsync`` / this is about the best save ratio the disk allows."""
    if not getattr(os, "O_DIRECT", 0):
        return float("nan")
    bufs = [huge_page_buffer(run) for _ in range(threads)]
    for b in bufs:
        b[:] = os.urandom(len(b))
    path = os.path.join(folder, "disk-floor.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda i: os.pwrite(fd, bufs[i % threads], i * run), range(-(-nbytes // run))))
        os.fsync(fd)
        fsync_dir(folder)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)


def copy_floor(tensors: list[torch.Tensor], dst: np.ndarray, pool: ThreadPoolExecutor) -> float:
    """One copy of every tensor into a preallocated buffer, one tensor per task on ``pool`` (numpy
    releases the GIL): what any save that snapshots the state before it returns must pay at least.
    Device tensors: one device-to-host copy each into a pinned buffer, then a synchronize."""
    if tensors and tensors[0].is_cuda:
        pinned = torch.from_numpy(dst)
        t0 = time.perf_counter()
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            pinned[pos: pos + n].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
            pos += n
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    jobs, pos = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        jobs.append((dst[pos: pos + n], t.view(-1).view(torch.uint8).numpy()))
        pos += n
    t0 = time.perf_counter()
    list(pool.map(lambda j: np.copyto(*j), jobs))
    return time.perf_counter() - t0


OVER = "safetensors save_file+fsync, over its files"  # steady state: replaces the last save's files
NEW = "safetensors save_file+fsync, new files, old deleted"  # steady state: writes anew, then deletes the last
PRUNE = "torchforge save (fsync), keep_last=1"  # steady state: replaces (prunes) the last step


def drop_page_cache(paths: list[str]) -> str:
    """Write back everything, then drop the page cache: the whole cache where this process may
    (``/proc/sys/vm/drop_caches``, root), else each of ``paths``' clean pages (``POSIX_FADV_DONTNEED``).
    Returns which of the two ran."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise(DONTNEED)"


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/tf-ckpt-bench")
    ap.add_argument("--threads", type=int, default=None, help="torchforge writer threads (default: its own)")
    ap.add_argument("--device", default="cpu", help="where the model and optimizer live (cpu, cuda)")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    torch.manual_seed(0)
    model, opt = build(args.gib, args.device)
    mt, ot = tensors_of(model, opt)
    total = sum(t.numel() * t.element_size() for t in (*mt.values(), *ot.values()))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "host memory"
    print(f"model + AdamW state: {total / 2**30:.3f} GiB in {len(mt) + len(ot)} tensors on {where}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")

    tpath, sm, so = (os.path.join(args.dir, n) for n in ("torch.pt", "model.safetensors", "opt.safetensors"))
    ck = Checkpointer(os.path.join(args.dir, "tf"), keep_last=None, threads=args.threads)
    ck_prune = Checkpointer(os.path.join(args.dir, "tf-prune"), keep_last=1, threads=args.threads)
    prune_step = iter(range(10**6))
    ck_prune.save(next(prune_step), model=model, optimizer=opt)  # so that each timed save of it replaces a step

    def drop_steps() -> None:  # torchforge's old steps are removed before the timed saves (not timed)
        for s in ck.steps():
            shutil.rmtree(ck.path(s))

    def unlink(*paths: str) -> None:  # old files are removed before the timed saves (not timed)
        for q in paths:
            if os.path.exists(q):
                os.unlink(q)

    def torch_save(sync: bool) -> None:
        torch.save({"model": mt, "optimizer": ot}, tpath)
        if sync:
            fsync_file(tpath)
            fsync_dir(args.dir)

    def st_save(sync: bool) -> None:
        save_file(mt, sm)
        save_file(ot, so)
        if sync:
            fsync_file(sm)
            fsync_file(so)
            fsync_dir(args.dir)

    # steady state without overwriting: each save writes a new pair of files, then deletes the pair before it
    pairs_of = [tuple(os.path.join(args.dir, f"{ab}-{n}.safetensors") for n in ("model", "opt")) for ab in "ab"]
    turn = iter(range(10**6))

    def st_save_new() -> None:
        i = next(turn)
        new, old = pairs_of[i % 2], pairs_of[(i + 1) % 2]
        save_file(mt, new[0])
        save_file(ot, new[1])
        for q in new:
            fsync_file(q)
        unlink(*old)
        fsync_dir(args.dir)

    st_save_new()  # (untimed: the first timed one has a save to replace)
    step = iter(range(10**6))
    saves = {
        "torch.save": lambda: torch_save(False),
        "torch.save+fsync": lambda: torch_save(True),
        "safetensors save_file": lambda: st_save(False),
        "safetensors save_file+fsync": lambda: st_save(True),
        OVER: lambda: st_save(True),
        NEW: st_save_new,
        "torchforge save (fsync)": lambda: ck.save(next(step), model=model, optimizer=opt),
        PRUNE: lambda: ck_prune.save(next(prune_step), model=model, optimizer=opt),
    }

    @torch.no_grad()
    def copy_into(src: dict, dst: dict) -> None:
        for k, v in dst.items():
            v.copy_(src[k])

    def torch_restore() -> None:
        sd = torch.load(tpath, weights_only=True)
        copy_into(sd["model"], mt)
        copy_into(sd["optimizer"], ot)

    def st_restore() -> None:
        copy_into(load_file(sm), mt)
        copy_into(load_file(so), ot)

    restores = {
        "torch.load + copy_": torch_restore,
        "safetensors load_file + copy_": st_restore,
        "torchforge restore": lambda: ck.restore(model=model, optimizer=opt),
    }
    nb_return, nb_write = "torchforge save(blocking=False) returns", "torchforge background write"
    flat = [t for t in (*mt.values(), *ot.values()) if t.numel()]
    on_device = bool(flat) and flat[0].is_cuda
    floor_disk = "floor: bare O_DIRECT write + fsync"
    floor_copy = "floor: one copy of the state " + ("(device to pinned host)" if on_device else "(2 threads)")
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    copy_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy() if on_device else np.empty(nbytes, np.uint8)
    copy_dst.fill(0)  # its pages are touched before any timing, like the checkpointer's staging buffer
    copy_pool = ThreadPoolExecutor(2)
    cold = {f"{k} (cold)": fn for k, fn in restores.items()}
    dropped = []  # how each cold restore's page cache was dropped
    res: dict[str, list[float]] = {k: [] for k in (*saves, *restores, *cold, nb_return, nb_write, floor_disk,
                                                   floor_copy)}
    ratios = []
    for r in range(args.rounds):
        # the order alternates from round to round (a contender right after a 1 GiB write meets the disk
        # still busy with it; every contender meets that in some rounds)
        for name, fn in (list(saves.items()) if r % 2 == 0 else list(saves.items())[::-1]):
            if name == OVER:  # that one replaces the files of a save before it
                if not (os.path.exists(sm) and os.path.exists(so)):
                    st_save(True)  # (untimed)
            else:
                unlink(tpath, sm, so)
            drop_steps()
            os.sync()  # every contender starts with no dirty pages (not timed)
            res[name].append(timed(fn))
        ck.save(next(step), model=model, optimizer=opt, blocking=False)  # warms the staging arena
        ck.wait()
        drop_steps()
        os.sync()
        res[nb_return].append(timed(lambda: ck.save(next(step), model=model, optimizer=opt, blocking=False)))
        res[nb_write].append(timed(ck.wait))
        ratios.append(res[nb_return][-1] / res["torchforge save (fsync)"][-1])
        os.sync()
        res[floor_disk].append(disk_floor(args.dir, total))
        res[floor_copy].append(copy_floor(flat, copy_dst, copy_pool))
        torch_save(False)  # the files the restores read
        st_save(False)
        folder = ck.path(ck.latest())  # torchforge wrote with O_DIRECT: bring its files into the cache too
        read_once(os.path.join(folder, name) for name in os.listdir(folder))
        for name, fn in restores.items():
            res[name].append(timed(fn))
        for name, fn in cold.items():
            dropped.append(drop_page_cache([tpath, sm, so, *(os.path.join(folder, n) for n in os.listdir(folder))]))
            res[name].append(timed(fn))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    gib = total / 2**30
    print(f"load average at the end {os.getloadavg()[0]:.1f} (other processes share the CPUs and the disk)")
    print(f"\n{'contender':42s} {'best s':>8s} {'median s':>9s} {'GiB/s':>7s}")
    for name, ts in res.items():
        print(f"{name:42s} {min(ts):8.3f} {statistics.median(ts):9.3f} {gib / min(ts):7.2f}")
    b = {k: min(v) for k, v in res.items()}
    ours, st_sync = b["torchforge save (fsync)"], "safetensors save_file+fsync"
    pairs = statistics.median(a / o for a, o in zip(res[st_sync], res["torchforge save (fsync)"]))
    r, st_load = b["torchforge restore"], b["safetensors load_file + copy_"]
    print("\nratios (best of rounds; > 1 means torchforge is faster)")
    print(f"save vs safetensors save_file+fsync:        {b[st_sync] / ours:5.2f}x  (target >= 1.5; median of "
          f"same-round ratios {pairs:.2f}x)")
    rival = OVER if b[OVER] <= b[NEW] else NEW  # the faster way safetensors replaces a checkpoint, this run
    steady = statistics.median(a / o for a, o in zip(res[rival], res[PRUNE]))
    print(f"steady state, each save replacing the last: torchforge keep_last=1 vs the faster of safetensors' two "
          f"({rival.removeprefix('safetensors save_file+fsync, ')}): {b[rival] / b[PRUNE]:5.2f}x  (median of "
          f"same-round ratios {steady:.2f}x; over its files {b[OVER] / b[PRUNE]:.2f}x, new files "
          f"{b[NEW] / b[PRUNE]:.2f}x)")
    print(f"save vs safetensors save_file (no fsync):   {b['safetensors save_file'] / ours:5.2f}x")
    print(f"save vs torch.save+fsync:                   {b['torch.save+fsync'] / ours:5.2f}x")
    print(f"save vs torch.save (no fsync):              {b['torch.save'] / ours:5.2f}x")
    print(f"restore time / (load_file + copy_) time:    {r / st_load:5.2f}   (target <= 1.2)")
    print(f"restore vs torch.load + copy_:              {b['torch.load + copy_'] / r:5.2f}x  (target >= 10)")
    rc, st_cold = b["torchforge restore (cold)"], b["safetensors load_file + copy_ (cold)"]
    how = " and ".join(sorted(set(dropped)))
    print(f"cold restore / (load_file + copy_) cold:    {rc / st_cold:5.2f}   (target <= 1.0; median of same-round "
          f"ratios {statistics.median(a / o for a, o in zip(res['torchforge restore (cold)'], res['safetensors load_file + copy_ (cold)'])):.2f}; page cache dropped by {how})")
    print(f"non-blocking save blocks the caller for:    {b[nb_return] / ours:6.1%} of a blocking save, "
          f"best to best; median of same-round ratios {statistics.median(ratios):.1%} (target <= 10%)")
    print(f"\nfloors on this machine, same run: the disk allows a save at most {b[st_sync] / b[floor_disk]:.2f}x "
          f"faster than save_file+fsync; a snapshot copy alone is {b[floor_copy] / ours:.1%} of torchforge's "
          f"blocking save")
    ck.close()
    ck_prune.close()
    copy_pool.shutdown()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
