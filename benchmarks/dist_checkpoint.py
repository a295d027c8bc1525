"""Distributed checkpoint speed: torchforge.Checkpointer vs torch.distributed.checkpoint (DCP), one run.

The state: an FSDP2 model (``fully_shard`` of every layer of a stack of 2048x2048 Linear layers on a CPU
device mesh) plus AdamW ``exp_avg`` / ``exp_avg_sq`` after one optimizer step, about ``--gib`` GiB of
unique state (float32), spread over the ranks of a gloo process group. Ranks are spawned processes; each
uses ``cores // world`` torch threads (what torchrun's OMP_NUM_THREADS=1 amounts to on a small box).

Saves, at world size 2, every file fsynced by everyone (torchforge always fsyncs; DCP's FileSystemWriter
with ``sync_files=True``, its default), with the same number of writer threads (``--threads``, default 8,
torchforge's default; DCP is also shown at its default ``thread_count=1``, beside, never alone):

* ``Checkpointer(root, threads=N).save(step, model=, optimizer=)`` vs ``dcp.save({"model":
  get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, storage_writer=FileSystemWriter(...))``
  (getting the state dicts is part of DCP's timed save, as it is inside torchforge's);
* non-blocking saves: the time until ``save(blocking=False)`` / ``dcp.async_save`` returns (the time the
  training loop is blocked) and until the write is committed. DCP runs with the stager its
  FileSystemWriter brings (new CPU buffers each save) and with a ``DefaultStager`` kept across saves
  (cached, unpinned buffers: like torchforge's reused staging arena). Their yardstick is one bare
  ``copy_`` of this rank's local state into a preallocated buffer: the least a snapshot can cost.

Each timed operation starts on all ranks after a barrier; a rank's time runs from there to its own
return, and the step's time is the slowest rank's. Before every timed save the previous checkpoints are
deleted and ``os.sync()`` runs (untimed). One warm-up round (discarded; it fills the reused staging
buffers) is followed by ``--rounds`` rounds, each contender once per round in alternating order (the
non-blocking saves and the bare copy side by side); best and median are reported, and each ratio both
best to best and as the median of same-round ratios, which other processes' load disturbs less.

Restore, resharded from 2 to 3 ranks: a fresh FSDP2 model and AdamW at world size 3 (their tensors zeroed
before each restore, untimed) get ``Checkpointer.restore(model=, optimizer=)`` vs ``dcp.load(state_dict,
storage_reader=FileSystemReader(path))`` + ``set_model_state_dict`` / ``set_optimizer_state_dict``.
Cold: the page cache is dropped before (``echo 3 > /proc/sys/vm/drop_caches``, needs root; without it
the output says the cache was warm). Warm: the same restore again right after. Bytes read per rank, against the
bytes the rank needs (its local shards): torchforge's own ``last_restore`` count (it reads through mmap,
which ``rchar`` does not see), DCP's ``rchar`` from ``/proc/self/io`` (bytes through read syscalls), and
for both ``read_bytes`` (what came from the disk in cold restores), compared summed over the ranks: they
share one page cache, so per rank it says which rank's readahead fetched a page first. Every restore is
checked bitwise against the first one and against nonzero values. Bytes written per rank and the header
overhead (file bytes minus tensor payload) come from the files of one more save of each.

The machine's cores and load average are printed: other processes share the CPUs and the disk, so
compare within one run.

    .venv/bin/python benchmarks/dist_checkpoint.py [--gib 1.0] [--rounds 5] [--threads 8] [--dir /tmp/tf-dist-ckpt-bench]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchforge.checkpoint import Checkpointer

DIM = 2048
SAVE_WORLD, RESTORE_WORLD = 2, 3
TF, DCP_N, DCP_1 = "torchforge save", "DCP save, N threads", "DCP save, 1 thread (default)"
TF_ASYNC, DCP_ASYNC, DCP_ASYNC_CACHED = ("torchforge save(blocking=False)", "DCP async_save, writer's stager",
                                         "DCP async_save, cached DefaultStager")
COPY = "bare copy_ of the rank's state"
TF_LOAD, DCP_LOAD = "torchforge restore", "DCP load + set_state_dict"


# --- the state -----------------------------------------------------------------------------------------
def build(world: int, gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 Linear stack + AdamW after one step: params + 2 moments = ``gib`` GiB over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = max(1, round(gib * 2**30 / 3 / (4 * (DIM * DIM + DIM))))
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's part of every model and optimizer tensor (its local shards), by name."""
    out = {}
    for k, v in get_model_state_dict(model).items():
        out[f"model.{k}"] = v.to_local() if hasattr(v, "to_local") else v
    for fqn, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{fqn}.{k}"] = v.to_local() if hasattr(v, "to_local") else v
    return out


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f if ": " in line)}


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --- the ranks -----------------------------------------------------------------------------------------
def save_phase(rank: int, world: int, job: dict) -> dict:
    model, opt = build(world, job["gib"])
    mine = local_state(model, opt)
    n, root = job["threads"], job["dir"]
    ck = Checkpointer(os.path.join(root, "tf"), keep_last=0, threads=n)  # old steps deleted untimed, below
    stager = DefaultStager(StagingOptions(False, False, False, False))  # kept: caches its CPU buffers
    copy_dst = {k: torch.zeros_like(t) for k, t in mine.items()}  # pages touched before any timing
    step = iter(range(10**6))
    dcp_dirs = iter(range(10**6))

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            for name in os.listdir(ck.root):
                shutil.rmtree(os.path.join(ck.root, name), ignore_errors=True)
            for name in os.listdir(root):
                if name.startswith("dcp-"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.sync()
        dist.barrier()

    def new_dcp_dir() -> str:
        return os.path.join(root, f"dcp-{next(dcp_dirs)}")

    def tf_async() -> dict:
        t = time.perf_counter()
        ck.save(next(step), model=model, optimizer=opt, blocking=False)
        blocked = time.perf_counter() - t
        ck.wait()
        return {"blocked": blocked}

    def dcp_async(cached: bool) -> dict:
        t = time.perf_counter()
        fut = dcp.async_save(dcp_state(model, opt), storage_writer=FileSystemWriter(new_dcp_dir(), thread_count=n),
                             async_stager=stager if cached else None)
        blocked = time.perf_counter() - t
        fut.result()
        return {"blocked": blocked}

    @torch.no_grad()
    def bare_copy() -> dict:
        for k, t in mine.items():
            copy_dst[k].copy_(t)
        return {}

    contenders: dict[str, Callable[[], Any]] = {
        TF: lambda: ck.save(next(step), model=model, optimizer=opt),
        DCP_N: lambda: dcp.save(dcp_state(model, opt),
                                storage_writer=FileSystemWriter(new_dcp_dir(), thread_count=n, sync_files=True)),
        DCP_1: lambda: dcp.save(dcp_state(model, opt), storage_writer=FileSystemWriter(new_dcp_dir())),
        DCP_ASYNC: lambda: dcp_async(False),  # the async ones and the copy side by side (same load)
        TF_ASYNC: tf_async,
        COPY: bare_copy,
        DCP_ASYNC_CACHED: lambda: dcp_async(True),
    }
    res: dict[str, list[dict]] = {k: [] for k in contenders}
    for r in range(job["rounds"] + 1):  # round 0: warm-up, discarded
        order = list(contenders) if r % 2 else list(reversed(contenders))
        for name in order:
            clean()
            io0 = io_counters()
            t = time.perf_counter()
            extra = contenders[name]()
            took = time.perf_counter() - t
            io1 = io_counters()
            if r:
                res[name].append({"s": took, "write_bytes": io1["write_bytes"] - io0["write_bytes"],
                                  **(extra if isinstance(extra, dict) else {})})
        if rank == 0:
            print(f"save round {r}/{job['rounds']} done{' (warm-up)' if not r else ''}", flush=True)
    clean()  # the checkpoints the restores read and the file sizes come from (untimed)
    ck.save(10**6, model=model, optimizer=opt)
    dcp.save(dcp_state(model, opt), storage_writer=FileSystemWriter(os.path.join(root, "dcp-final"),
                                                                   thread_count=n))
    ck.close()
    stager.close()
    return {"times": res, "state_bytes": nbytes(mine.values()), "tf_step": ck.path(10**6)}


def restore_phase(rank: int, world: int, job: dict) -> dict:
    model, opt = build(world, job["gib"])
    ck = Checkpointer(job["tf_root"], keep_last=0, threads=job["threads"])
    need = nbytes(local_state(model, opt).values())
    ref: dict[str, torch.Tensor] = {}

    def tf_restore() -> dict:
        ck.restore(model=model, optimizer=opt)
        return {"logical_read": ck.last_restore["bytes_read"], "logical_needed": ck.last_restore["bytes_needed"]}

    def dcp_restore() -> dict:
        sd = dcp_state(model, opt)
        dcp.load(sd, storage_reader=FileSystemReader(job["dcp_path"]))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        return {}

    @torch.no_grad()
    def check(name: str) -> None:
        now = local_state(model, opt)
        if not ref:
            if not all(t.ne(0).any() for k, t in now.items() if k.endswith(("weight", "exp_avg", "exp_avg_sq"))):
                raise RuntimeError(f"{name}: a restored tensor is all zeros")
            ref.update({k: t.clone() for k, t in now.items()})
        bad = [k for k in ref if k not in now or not torch.equal(ref[k], now[k])]
        if bad or len(now) != len(ref):
            raise RuntimeError(f"{name} restored different values than the first restore: {bad[:5]}")

    @torch.no_grad()
    def zero() -> None:
        for t in local_state(model, opt).values():
            t.zero_()

    contenders = {TF_LOAD: tf_restore, DCP_LOAD: dcp_restore}
    res: dict[str, list[dict]] = {f"{k} ({c})": [] for k in contenders for c in ("cold", "warm")}
    dropped = True
    for r in range(job["rounds"] + 1):  # round 0: warm-up, discarded
        order = list(contenders) if r % 2 else list(reversed(contenders))
        for name in order:
            for cond in ("cold", "warm"):
                zero()
                dist.barrier()
                if cond == "cold" and rank == 0:
                    dropped = drop_page_cache() and dropped
                dist.barrier()
                io0 = io_counters()
                t = time.perf_counter()
                extra = contenders[name]()
                took = time.perf_counter() - t
                io1 = io_counters()
                check(name)
                if r:
                    res[f"{name} ({cond})"].append({"s": took, "read_bytes": io1["read_bytes"] - io0["read_bytes"],
                                                    "rchar": io1["rchar"] - io0["rchar"], "needed": need, **extra})
        if rank == 0:
            print(f"restore round {r}/{job['rounds']} done{' (warm-up)' if not r else ''}", flush=True)
    ck.close()
    return {"times": res, "state_bytes": need, "dropped": dropped}


def rank_main(rank: int, world: int, init: str, job: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = (save_phase if job["phase"] == "save" else restore_phase)(rank, world, job)
        with open(os.path.join(job["out"], f"{job['phase']}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def spawn(world: int, job: dict, timeout: float = 1800) -> list[dict]:
    """Run ``world`` ranks of ``job`` in spawned processes; their results, by rank."""
    ctx = mp.get_context("spawn")
    init = f"file://{job['out']}/store-{job['phase']}"
    procs = [ctx.Process(target=rank_main, args=(r, world, init, job)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):  # one rank failed: the others would hang
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise SystemExit(f"{job['phase']} phase failed: exit codes {codes}")
    out = []
    for r in range(world):
        with open(os.path.join(job["out"], f"{job['phase']}-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


# --- the files -----------------------------------------------------------------------------------------
def tf_files(folder: str, world: int) -> dict:
    """Bytes written per rank, tensor payload and the rest (safetensors headers, JSON) of a torchforge step."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    written, payload = [0] * world, 0
    for name in os.listdir(folder):
        size = os.path.getsize(os.path.join(folder, name))
        written[int(name.split("-")[1].split(".")[0]) if name.startswith("rank-") else 0] += size
    for e in manifest["tensors"].values():
        payload += sum(c["range"][1] - c["range"][0] for c in e["chunks"])
    return {"written": written, "payload": payload, "json": sum(os.path.getsize(os.path.join(folder, n))
                                                                 for n in os.listdir(folder) if n.endswith(".json"))}


def dcp_files(folder: str, world: int) -> dict:
    """The same for a DCP checkpoint (``__<rank>_<k>.distcp`` files and ``.metadata``)."""
    md = FileSystemReader(folder).read_metadata()
    written, payload = [0] * world, 0
    for name in os.listdir(folder):
        size = os.path.getsize(os.path.join(folder, name))
        written[int(name.split("_")[2]) if name.startswith("__") else 0] += size
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            esize = torch.empty((), dtype=m.properties.dtype).element_size()
            for c in m.chunks:
                md.storage_data[MetadataIndex(fqn, c.offsets)]  # every chunk is stored
                n = esize
                for s in c.sizes:
                    n *= s
                payload += n
    return {"written": written, "payload": payload, "json": os.path.getsize(os.path.join(folder, ".metadata"))}


# --- the report ----------------------------------------------------------------------------------------
def per_round(results: list[dict], name: str, key: str = "s") -> list[float]:
    """The slowest rank's figure of each round."""
    rounds = len(results[0]["times"][name])
    return [max(r["times"][name][i][key] for r in results) for i in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="unique model + AdamW state in GiB (all ranks)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8, help="writer threads of torchforge and of DCP")
    ap.add_argument("--dir", default="/tmp/tf-dist-ckpt-bench")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "tf"))
    cores = os.cpu_count() or 1
    print(f"{cores} CPUs, load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}, "
          f"gloo, FSDP2 on a CPU mesh, {max(1, cores // SAVE_WORLD)} torch thread(s) per rank, writer threads "
          f"N={args.threads}", flush=True)
    job = {"gib": args.gib, "rounds": args.rounds, "threads": args.threads, "dir": args.dir, "out": args.dir}
    try:
        saves = spawn(SAVE_WORLD, {**job, "phase": "save"})
        tf_disk = tf_files(saves[0]["tf_step"], SAVE_WORLD)
        dcp_path = os.path.join(args.dir, "dcp-final")
        dcp_disk = dcp_files(dcp_path, SAVE_WORLD)
        loads = spawn(RESTORE_WORLD, {**job, "phase": "restore", "tf_root": os.path.dirname(saves[0]["tf_step"]),
                                      "dcp_path": dcp_path})
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    report(args, saves, loads, tf_disk, dcp_disk)


def report(args: argparse.Namespace, saves: list[dict], loads: list[dict], tf_disk: dict, dcp_disk: dict) -> None:
    total = sum(r["state_bytes"] for r in saves)
    gib = total / 2**30
    n = args.threads
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (other processes share the CPUs and the disk)")
    each = "/".join(f"{r['state_bytes'] / 2**20:.0f}" for r in saves)
    print(f"state: {gib:.3f} GiB unique model + AdamW state, saved by {SAVE_WORLD} ranks "
          f"({each} MiB each), restored by {RESTORE_WORLD}; "
          f"{args.rounds} rounds after a warm-up, times are the slowest rank's")

    def row(name: str, ts: list[float], label: str | None = None, rate: bool = True) -> None:
        speed = f"{gib / min(ts):7.2f}" if rate else f"{'':7s}"
        print(f"{label or name:52s} {min(ts):8.3f} {statistics.median(ts):9.3f} {speed}")

    print(f"\n{'save, world size 2, fsync (N = ' + str(n) + ' threads)':52s} {'best s':>8s} {'median s':>9s} "
          f"{'GiB/s':>7s}")
    s = {k: per_round(saves, k) for k in (TF, DCP_N, DCP_1, TF_ASYNC, DCP_ASYNC, DCP_ASYNC_CACHED, COPY)}
    blocked = {k: per_round(saves, k, "blocked") for k in (TF_ASYNC, DCP_ASYNC, DCP_ASYNC_CACHED)}
    row(TF, s[TF])
    row(DCP_N, s[DCP_N], f"DCP save, {n} threads")
    row(DCP_1, s[DCP_1])
    for k in (TF_ASYNC, DCP_ASYNC, DCP_ASYNC_CACHED):
        row(k, blocked[k], f"{k}: blocked", rate=False)
        row(k, s[k], f"{k}: until committed")
    row(COPY, s[COPY], rate=False)

    def written(d: dict, label: str) -> None:
        w = d["written"]
        mean = sum(w) / len(w)
        over = sum(w) - d["payload"]
        print(f"{label:12s} {' / '.join(f'{x / 2**20:.1f}' for x in w)} MiB   max/mean {max(w) / mean:.3f}   "
              f"overhead {over / 2**10:.1f} KiB = {over / d['payload']:.4%} of the {d['payload'] / 2**20:.1f} MiB "
              f"payload (metadata files {d['json'] / 2**10:.1f} KiB)")

    print("\nbytes written per rank (rank 0 / rank 1; the files of one save; overhead = file bytes - tensor payload)")
    written(tf_disk, "torchforge")
    written(dcp_disk, "DCP")
    for k in (TF, DCP_N):
        wb = [statistics.median(x["write_bytes"] for x in r["times"][k]) for r in saves]
        print(f"{k + ' /proc/self/io write_bytes':52s} {' / '.join(f'{x / 2**20:.1f}' for x in wb)} MiB")

    dropped = all(r["dropped"] for r in loads)
    cold = "page cache dropped before" if dropped else "COULD NOT drop the page cache: 'cold' is warm"
    print(f"\nresharded restore 2 -> 3 ranks ({cold} cold restores)")
    print(f"{'contender':52s} {'best s':>8s} {'median s':>9s} {'GiB/s':>7s}")
    lt = {k: per_round(loads, k) for k in loads[0]["times"]}
    for k, ts in lt.items():
        row(k, ts)
    print("\nbytes read by each rank of 3 (cold restores, median of rounds) / the bytes it needs (its local shards);"
          "\nthe ratio is the worst rank's, or all ranks' sum for read_bytes: the ranks share one page cache, so a page"
          "\none rank's readahead brought in is not read from disk again by the rank that needs it, and read_bytes"
          "\nper rank says who faulted it in first, not what each rank needed")
    needed = " / ".join(f"{r['state_bytes'] / 2**20:.1f}" for r in loads)
    print(f"  {'needed':50s} {needed} MiB")

    read = {}
    for k, key, what in ((TF_LOAD, "logical_read", "its own count (last_restore)"),
                         (DCP_LOAD, "rchar", "through read() (rchar)"),
                         (TF_LOAD, "read_bytes", "from disk (read_bytes)"),
                         (DCP_LOAD, "read_bytes", "from disk (read_bytes)")):
        per = [statistics.median(x[key] for x in r["times"][f"{k} (cold)"]) for r in loads]
        if key == "read_bytes":
            worst, how = sum(per) / sum(r["state_bytes"] for r in loads), "all ranks"
        else:
            worst, how = max(p / r["state_bytes"] for p, r in zip(per, loads)), "worst rank"
        read[(k, key)] = worst
        print(f"  {k + ', ' + what:50s} {' / '.join(f'{p / 2**20:.1f}' for p in per)} MiB   {worst:.2f}x {how}")

    b = {k: min(v) for k, v in s.items()}
    bb = {k: min(v) for k, v in blocked.items()}
    cold_tf, cold_dcp = lt[f"{TF_LOAD} (cold)"], lt[f"{DCP_LOAD} (cold)"]
    warm_tf, warm_dcp = lt[f"{TF_LOAD} (warm)"], lt[f"{DCP_LOAD} (warm)"]
    dcp_blocked = [min(x, y) for x, y in zip(blocked[DCP_ASYNC], blocked[DCP_ASYNC_CACHED])]

    def paired(a: list[float], d: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, d))

    # (label, best / best, median of same-round ratios, target or None)
    rows = [
        (f"save time / DCP save ({n} threads)", b[TF] / b[DCP_N], paired(s[TF], s[DCP_N]), 0.8),
        ("save time / DCP save (1 thread, its default)", b[TF] / b[DCP_1], paired(s[TF], s[DCP_1]), None),
        ("async blocked / one bare copy of the state", bb[TF_ASYNC] / b[COPY], paired(blocked[TF_ASYNC], s[COPY]),
         1.1),
        ("async blocked / DCP async_save blocked (better stager)", bb[TF_ASYNC] / min(dcp_blocked),
         paired(blocked[TF_ASYNC], dcp_blocked), 1.0),
        ("async blocked / DCP async_save blocked (writer's stager)", bb[TF_ASYNC] / bb[DCP_ASYNC],
         paired(blocked[TF_ASYNC], blocked[DCP_ASYNC]), None),
        ("async until committed / DCP (cached stager)", b[TF_ASYNC] / b[DCP_ASYNC_CACHED],
         paired(s[TF_ASYNC], s[DCP_ASYNC_CACHED]), None),
        ("resharded restore time / DCP (cold)", min(cold_tf) / min(cold_dcp), paired(cold_tf, cold_dcp), 1.0),
        ("resharded restore time / DCP (warm)", min(warm_tf) / min(warm_dcp), paired(warm_tf, warm_dcp), None),
    ]
    print(f"\n{'ratios (< 1: torchforge takes less time)':58s} {'best/best':>9s} {'same-round median':>18s}  target")
    for label, best, med, target in rows:
        print(f"{label:58s} {best:9.2f} {med:18.2f}  {'' if target is None else f'<= {target}'}")

    tf_read = max(read[(TF_LOAD, "read_bytes")], read[(TF_LOAD, "logical_read")])
    dcp_read = read[(DCP_LOAD, "rchar")]
    print("\ntargets (met: by best of rounds and by the median of same-round ratios; mixed: by one of them):")
    names = {0: "save <= 0.8x DCP's time (same threads)", 2: "async blocked <= 1.1x one bare copy",
             3: "async blocked <= DCP async_save's", 6: "resharded restore <= DCP's time (cold)"}
    for i, what in names.items():
        _, best, med, target = rows[i]
        ok = (best <= target) + (med <= target)
        verdict = ("NOT MET", "mixed", "met")[ok]
        print(f"  {what:42s} {verdict:8s} ({best:.2f}x best/best, {med:.2f}x same-round median)")
    print(f"  {'resharded restore reads <= 1.1x needed':42s} {'met' if tf_read <= 1.1 else 'NOT MET':8s} "
          f"({tf_read:.2f}x: worst rank's own count, all ranks' disk reads; DCP's worst rank reads {dcp_read:.2f}x)")
    fast = DCP_N if b[DCP_N] <= b[DCP_1] else DCP_1  # the faster of DCP's two set-ups in this run
    print(f"headline: distributed save {b[fast] / b[TF]:.2f}x faster than DCP's faster set-up in this run "
          f"({n if fast == DCP_N else 1} thread(s), fsync, 2 ranks; {1 / paired(s[TF], s[fast]):.2f}x by the median of "
          f"same-round ratios); resharded restore 2->3 {min(cold_dcp) / min(cold_tf):.2f}x faster than DCP (cold; "
          f"{1 / paired(cold_tf, cold_dcp):.2f}x by the median), reading {tf_read:.2f}x the needed bytes")

if __name__ == "__main__":
    main()
