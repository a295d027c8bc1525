"""The MLDataForge paper's Table 1 on this machine: format x reader x compression, three access patterns.

Every row reads the same synthetic multimodal chat dataset (``_synth.synth_samples(n, seed)``) written in
one format, and measures three operations, each in its own fresh subprocess so that the peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss`` of that child) belongs to that measurement alone:

* iterate: every sample, in the reader's own sequential order, fully decoded;
* shuffle: ``numpy.random.default_rng(seed).permutation(n)``, random access, every sample fully decoded;
* sort: a key pass reading the text key (see :func:`key_of`) of every sample in order, using the reader's
  cheapest way to get one field (lazy access or column selection where the reader has one), then a
  stable argsort and random access in sorted order, every sample fully decoded.

"Fully decoded" means every field is turned into a Python value (text as ``str``, the image as a
bytes-like object of the right length, zero-copy views allowed) and then consumed by :func:`digest`,
which hashes keys, texts, numbers and one byte of every 4 KiB page of binary values (so that a lazily
mapped value is really read). The digests of each operation must agree with the digests of the samples
as generated: a row whose reader returns other data is marked, not counted silently.

Usage::

    python benchmarks/table1.py [--n 20000] [--seed 0] [--workdir DIR] [--json OUT] [--only SUBSTR]

The readers and their environments are listed in :data:`ROWS`; each names an adapter class in this file.
This file must stay importable by the Python 3.12 MLDataForge venv: only stdlib, numpy and orjson at the
top level.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any
from zlib import crc32

import numpy as np
from _pagecache import read_once

from torchforge.formats.values import ByteView

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MAIN_PY = os.path.join(REPO, ".venv", "bin", "python")
MLDF_PY = os.path.join(REPO, ".venv-mldf", "bin", "python")
OPS = ("iterate", "shuffle", "sort")
MIB = 1 << 20
PAGE = 4096


@dataclass(frozen=True)
class Row:
    """One line of the table: a dataset folder read by one reader."""

    fmt: str
    compression: str
    reader: str
    data: str      # dataset folder name under the work dir
    adapter: str   # adapter class name in this file
    env: str = "main"  # "main" (.venv, Python 3.11) or "mldf" (.venv-mldf, Python 3.12)
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.data}/{self.adapter}"


ROWS: tuple[Row, ...] = (
    Row("JSONL", "none", "orjson (anchor)", "jsonl", "JsonlReader"),
    Row("JINX + sidecar", "none", "torchforge", "jinx-none", "TorchforgeJinx"),
    Row("JINX + sidecar", "none", "MLDataForge 0.6.10", "jinx-none", "MldfJinx", env="mldf"),
    Row("JINX + sidecar", "zst", "torchforge", "jinx-zst", "TorchforgeJinx"),
    Row("JINX + sidecar", "zst", "MLDataForge 0.6.10", "jinx-zst", "MldfJinx", env="mldf"),
    Row("MDS", "none", "torchforge", "mds-none", "TorchforgeMDS"),
    Row("MDS", "none", "Streaming 0.13.0", "mds-none", "StreamingMDS"),
    Row("MDS", "none", "Streaming + torchforge.streaming.patch()", "mds-none", "PatchedStreamingMDS"),
    Row("MDS", "shard zstd", "torchforge", "mds-zstd", "TorchforgeMDS"),
    Row("MDS", "shard zstd", "Streaming 0.13.0", "mds-zstd", "StreamingMDS"),
    Row("MDS", "shard zstd", "Streaming + torchforge.streaming.patch()", "mds-zstd", "PatchedStreamingMDS"),
    Row("MDS", "sample::zstd", "torchforge", "mds-sample-zstd", "TorchforgeMDS"),
    Row("MDS", "sample::zstd", "Streaming 0.13.0", "mds-sample-zstd", "StreamingMDS",
        note="Streaming 0.13.0 cannot read per-sample compression (MLDataForge's layout) unpatched"),
    Row("MDS", "sample::zstd", "Streaming + torchforge.streaming.patch()", "mds-sample-zstd",
        "PatchedStreamingMDS"),
)

# torchforge writer options per dataset folder (JINX: MLDataForge's options; images go to the sidecar).
JINX_OPTS = {"jinx-none": {"compression": None}, "jinx-zst": {"compression": "zst"}}
JINX_COMMON = {"encoding": "b64", "binary_threshold": 1024, "index_compression": None}
MDS_OPTS = {"mds-none": None, "mds-zstd": "zstd", "mds-sample-zstd": "sample::zstd"}


# --- what every reader must produce ------------------------------------------------------------------
def _walk(v: Any, h: int) -> int:
    t = type(v)
    if t is str:  # exact-type checks first: this runs for every value of every sample
        return crc32(v.encode(), crc32(b"s", h))
    if t is dict or (t is not list and isinstance(v, Mapping)):
        for k in sorted(v):
            h = _walk(v[k], crc32(k.encode(), h))
        return h
    if t is list or t is tuple:
        h = crc32(b"l%d" % len(v), h)
        for x in v:
            h = _walk(x, h)
        return h
    if t is bytes or t is memoryview or t is bytearray or t is np.ndarray or t is ByteView:
        mv = memoryview(v)
        if mv.ndim != 1 or mv.format != "B":
            mv = memoryview(np.ascontiguousarray(v)).cast("B")
        return crc32(mv[::PAGE].tobytes(), crc32(b"b%d" % mv.nbytes, h))
    if t is bool or t is np.bool_:
        return crc32(b"T" if v else b"F", h)
    if isinstance(v, (int, np.integer)):
        return crc32(b"i%d" % int(v), h)
    if isinstance(v, (float, np.floating)):
        return crc32(repr(float(v)).encode(), h)
    if v is None:
        return crc32(b"N", h)
    if isinstance(v, str):
        return _walk(str(v), h)
    if isinstance(v, (bytes, bytearray)):
        return _walk(bytes(v), h)
    raise TypeError(f"digest: unexpected value type {type(v).__name__}")


def digest(sample: Any) -> int:
    """A 32-bit digest of a fully decoded sample, independent of key order and of the mapping type."""
    return _walk(sample, 0)


def key_of(sample: Any, path: list) -> str:
    """The sort key: the value at ``path`` (keys and list indexes), e.g. ``["turns", 0, "text"]``."""
    v = sample
    for p in path:
        v = v[p]
    return v


def find_text_path(sample: Mapping, binary: set[str]) -> list:
    """The first text value of a sample, depth first over sorted keys (binary fields skipped)."""
    def go(v: Any, path: list) -> list | None:
        if isinstance(v, str):
            return path
        if isinstance(v, Mapping):
            for k in sorted(v):
                if not (len(path) == 0 and k in binary):
                    found = go(v[k], [*path, k])
                    if found is not None:
                        return found
        if isinstance(v, (list, tuple)) and v:
            return go(v[0], [*path, 0])
        return None
    path = go(sample, [])
    if path is None:
        raise ValueError("the synthetic samples hold no text field to sort by")
    return path


def combine(digests: list[int], ordered: bool) -> str:
    """One value for a whole operation: order-sensitive for shuffle/sort, a sum for iterate."""
    arr = np.asarray(digests, dtype=np.uint32)
    if ordered:
        return f"{zlib.crc32(arr.tobytes()):08x}:{len(arr)}"
    return f"{int(arr.astype(np.uint64).sum()):x}:{len(arr)}"


# --- adapters: one per reader ------------------------------------------------------------------------
class Adapter:
    """A reader under test. ``iterate`` yields samples in order; ``get`` is random access; ``keys``
    returns the sort key of every sample in order (default: from a full iteration). By default the
    reader is the object :meth:`open` returns, iterated and indexed as a sequence."""

    modules: tuple[str, ...] = ()

    def __init__(self, folder: str, meta: dict) -> None:
        self.folder = folder
        self.meta = meta
        self.ds = self.open(folder)

    def open(self, folder: str) -> Any:
        return None

    @classmethod
    def setup(cls) -> None:
        """Imports and global set-up, done before the clock starts (opening the data is timed)."""
        for mod in cls.modules:
            importlib.import_module(mod)

    def iterate(self) -> Iterator[Any]:
        return iter(self.ds)

    def get(self, i: int) -> Any:
        return self.ds[i]

    def keys(self) -> list:
        path = self.meta["key_path"]
        return [key_of(s, path) for s in self.iterate()]


class JsonlReader(Adapter):
    """The anchor: one JSON object per line, parsed with orjson; binary fields as base64 text.

    Random access uses a line-offset index built (and timed) at the start of the operation from 16 MiB
    sequential reads, then one ``os.pread`` per sample: no whole-file load.
    """

    modules = ("base64", "orjson")

    def __init__(self, folder: str, meta: dict) -> None:
        import base64

        import orjson
        super().__init__(folder, meta)
        self.path = os.path.join(folder, "data.jsonl")
        self.binary = meta["binary_fields"]
        self.loads = orjson.loads
        self.b64 = base64.b64decode
        self.offsets: np.ndarray | None = None
        self.fd = -1

    def _decode(self, s: dict) -> dict:
        for k in self.binary:
            s[k] = self.b64(s[k])
        return s

    def iterate(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            for line in f:
                yield self._decode(self.loads(line))

    def _index(self) -> np.ndarray:
        starts = [np.zeros(1, np.int64)]
        pos = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(16 * MIB):
                nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
                starts.append(nl.astype(np.int64) + (pos + 1))
                pos += len(chunk)
        self.fd = os.open(self.path, os.O_RDONLY)
        return np.concatenate(starts)

    def get(self, i: int) -> Any:
        if self.offsets is None:
            self.offsets = self._index()
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self._decode(self.loads(os.pread(self.fd, b - a, a)))

    def keys(self) -> list:
        path = self.meta["key_path"]
        with open(self.path, "rb") as f:
            return [key_of(self.loads(line), path) for line in f]


class TorchforgeJinx(Adapter):
    """``torchforge.JinxDataset(folder)`` (lazy samples: only what is accessed is decoded)."""

    modules = ("torchforge.datasets.jinx",)

    def open(self, folder: str) -> Any:
        import torchforge
        return torchforge.JinxDataset(folder)


class MldfJinx(Adapter):
    """MLDataForge 0.6.10 ``JinxDatasetReader(folder, lazy=True, mmap=True)`` (its fastest setting)."""

    modules = ("mldataforge.jinx",)

    def open(self, folder: str) -> Any:
        from mldataforge.jinx import JinxDatasetReader
        return JinxDatasetReader(folder, lazy=True, mmap=True)


class TorchforgeMDS(Adapter):
    """``torchforge.MDSDataset(folder)``; the key pass is ``MDSDataset.keys(fn)``, which hands ``fn`` lazy
    samples, so only the key's column is decoded."""

    modules = ("torchforge.datasets.mds",)

    def open(self, folder: str) -> Any:
        import torchforge
        return torchforge.MDSDataset(folder)

    def keys(self) -> list:
        path = self.meta["key_path"]
        return list(self.ds.keys(lambda s: key_of(s, path)))


class StreamingMDS(Adapter):
    """MosaicML Streaming's ``StreamingDataset(local=folder, shuffle=False, batch_size=1, predownload=n)``.

    ``predownload`` is raised to the dataset size, as Streaming's Performance Tuning guide recommends when
    samples are not prepared far enough ahead ("increase the ``predownload`` parameter",
    https://docs.mosaicml.com/projects/streaming/en/stable/distributed_training/performance_tuning.html):
    its default (8 x batch_size) makes the "ready" thread sleep a 7 ms tick every 8 samples, which caps a
    bare iterator at about 8 samples per tick (~1,140 samples/s) whatever the reader costs.
    ``mds_vs_streaming.py`` prints the default beside the tuned figure.
    """

    patched = False
    modules = ("streaming",)

    @classmethod
    def setup(cls) -> None:
        from streaming.base.util import clean_stale_shared_memory
        clean_stale_shared_memory()
        if cls.patched:
            import torchforge.streaming
            torchforge.streaming.patch()

    def open(self, folder: str) -> Any:
        from streaming import StreamingDataset
        n = max(64, self.meta["n"])
        return StreamingDataset(local=folder, shuffle=False, batch_size=1, predownload=n)


class PatchedStreamingMDS(StreamingMDS):
    """Streaming's ``StreamingDataset`` after ``torchforge.streaming.patch()`` (torchforge's MDS reader)."""

    patched = True


_ALL = (JsonlReader, TorchforgeJinx, MldfJinx, TorchforgeMDS, StreamingMDS, PatchedStreamingMDS)
ADAPTERS: dict[str, type[Adapter]] = {c.__name__: c for c in _ALL}


# --- one measurement (runs in a child process) -------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class _AnonPeak(threading.Thread):
    """Samples RssAnon every 20 ms: the anonymous (non-file-backed) part of the peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status_kib("RssAnon:")
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, _status_kib("RssAnon:"))


def run_op(adapter_cls: type[Adapter], folder: str, meta: dict, op: str) -> dict:
    """Open the reader and run one operation; returns rate, RSS figures and the digest."""
    n, seed = meta["n"], meta["seed"]
    adapter_cls.setup()
    base_rss = _status_kib("VmRSS:") * 1024
    sampler = _AnonPeak()
    sampler.start()
    t0 = time.perf_counter()
    reader = adapter_cls(folder, meta)
    if op == "iterate":
        digests = [digest(s) for s in reader.iterate()]
    else:
        if op == "shuffle":
            order = np.random.default_rng(seed).permutation(n)
        elif op == "sort":
            keys = reader.keys()
            if len(keys) != n:
                raise RuntimeError(f"key pass returned {len(keys)} keys for {n} samples")
            order = np.argsort(np.array(keys), kind="stable")
        else:
            raise ValueError(f"op={op!r} is not one of {OPS}")
        get = reader.get
        digests = [digest(get(int(i))) for i in order]
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    return {"op": op, "samples": len(digests), "seconds": seconds, "rate": len(digests) / seconds,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "base_rss": base_rss,
            "peak_anon": sampler.peak * 1024, "digest": combine(digests, ordered=op != "iterate")}


def child_main(args: argparse.Namespace) -> int:
    with open(os.path.join(args.workdir, "meta.json")) as f:
        meta = json.load(f)
    try:
        out = run_op(ADAPTERS[args.adapter], args.folder, meta, args.op)
    except Exception as e:  # noqa: BLE001 reported by the parent, never dropped
        out = {"op": args.op, "error": f"{type(e).__name__}: {e}"[:500]}
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


# --- building the datasets (one child process) -------------------------------------------------------
def _files(folder: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            p = os.path.join(root, name)
            out[os.path.relpath(p, folder)] = os.path.getsize(p)
    return out


def _reference(samples: list[dict], meta: dict) -> dict[str, str]:
    t0 = time.perf_counter()
    digests = [digest(s) for s in samples]
    meta["digest_rate"] = len(samples) / (time.perf_counter() - t0)
    n, seed, path = meta["n"], meta["seed"], meta["key_path"]
    order = np.argsort(np.array([key_of(s, path) for s in samples]), kind="stable")
    perm = np.random.default_rng(seed).permutation(n)
    return {"iterate": combine(digests, False), "shuffle": combine([digests[i] for i in perm], True),
            "sort": combine([digests[i] for i in order], True)}


def build(workdir: str, n: int, seed: int) -> dict:
    """Write every dataset folder from ``synth_samples(n, seed)``; returns (and saves) meta.json."""
    import base64

    import orjson

    import torchforge
    from torchforge.convert import infer_mds_columns
    sys.path.insert(0, HERE)
    from _synth import synth_samples

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    samples = list(synth_samples(n, seed))
    binary = sorted(k for k, v in samples[0].items() if isinstance(v, (bytes, bytearray)))
    meta: dict[str, Any] = {"n": n, "seed": seed, "binary_fields": binary,
                            "key_path": find_text_path(samples[0], set(binary)), "build_seconds": {}}
    meta["reference"] = _reference(samples, meta)

    def timed(name: str, fn: Callable[[str], None]) -> None:
        t0 = time.perf_counter()
        fn(os.path.join(workdir, name))
        meta["build_seconds"][name] = time.perf_counter() - t0

    def jsonl(folder: str) -> None:
        os.makedirs(folder)
        with open(os.path.join(folder, "data.jsonl"), "wb") as f:
            for s in samples:
                row = {k: (base64.b64encode(v).decode() if k in binary else v) for k, v in s.items()}
                f.write(orjson.dumps(row) + b"\n")

    def jinx(opts: dict) -> Callable[[str], None]:
        def write(folder: str) -> None:
            with torchforge.JinxWriter(folder, **JINX_COMMON, **opts) as w:
                for s in samples:
                    w.write(s)
        return write

    def mds(compression: str | None) -> Callable[[str], None]:
        columns = infer_mds_columns(samples)

        def write(folder: str) -> None:
            with torchforge.MDSWriter(folder, columns, compression=compression) as w:
                for s in samples:
                    w.write(s)
        return write

    timed("jsonl", jsonl)
    for name, opts in JINX_OPTS.items():
        timed(name, jinx(opts))
    for name, comp in MDS_OPTS.items():
        timed(name, mds(comp))
    meta["files"] = {name: _files(os.path.join(workdir, name)) for name in meta["build_seconds"]}
    meta["storage"] = {name: sum(files.values()) for name, files in meta["files"].items()}
    with open(os.path.join(workdir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _warm(folder: str, files: dict[str, int]) -> None:
    """Read every file of a dataset once, so that each measurement starts with the data in the page cache
    (otherwise the first operation measured after other work pays for the disk, and the others do not)."""
    read_once(os.path.join(folder, rel) for rel in files)


def _link_copy(src: str, dst: str, files: dict[str, int]) -> None:
    """A hard-linked copy of a dataset folder: each reader gets its own, so that what it adds
    (Streaming decompresses shards next to them) or deletes (Streaming evicts shard files it cannot
    account for) never reaches the next measurement."""
    shutil.rmtree(dst, ignore_errors=True)
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        os.link(os.path.join(src, rel), os.path.join(dst, rel))


# --- the parent: build, measure every (row, op), render ----------------------------------------------
@functools.cache
def python_for(env: str) -> tuple[str | None, str]:
    if env == "main":
        return (MAIN_PY if os.path.exists(MAIN_PY) else sys.executable), ""
    if os.path.exists(MLDF_PY):
        probe = subprocess.run([MLDF_PY, "-c", "import mldataforge.jinx"], capture_output=True, timeout=120,
                               check=False)
        if probe.returncode == 0:
            return MLDF_PY, ""
    return None, ("MLDataForge needs Python >= 3.12: its venv .venv-mldf is missing or cannot import "
                  "mldataforge.jinx (build it with tests/interop/setup_mldataforge.sh)")


def measure(row: Row, op: str, workdir: str, meta: dict, timeout: float) -> dict:
    """Run one (row, op) in a fresh child process; the result or the reason it failed."""
    py, why = python_for(row.env)
    if py is None:
        return {"op": op, "error": why}
    files = meta["files"][row.data]
    folder = os.path.join(workdir, "_scratch", row.data)
    _link_copy(os.path.join(workdir, row.data), folder, files)
    _warm(folder, files)
    cmd = [py, os.path.abspath(__file__), "--child", "--workdir", workdir, "--folder", folder,
           "--adapter", row.adapter, "--op", op]
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED="0")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
                              check=False)
    except subprocess.TimeoutExpired:
        proc = None
    deleted = sorted(set(files) - set(_files(folder)))
    shutil.rmtree(folder, ignore_errors=True)
    if proc is None:
        out = {"op": op, "error": f"timed out after {timeout:.0f} s"}
    else:
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith("RESULT "):
                out = json.loads(line[7:])
                break
        else:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            out = {"op": op, "error": f"exit {proc.returncode}: {tail}"[:500]}
    expected = meta["reference"][op]
    if "digest" in out and out["digest"] != expected:
        got_n, want_n = int(out["digest"].split(":")[1]), int(expected.split(":")[1])
        out["error"] = (f"wrong data: {got_n} of {want_n} samples returned, no error raised"
                        if got_n != want_n else f"wrong data: digest {out['digest']} != expected {expected}")
    if deleted:
        msg = (f"the reader deleted {len(deleted)} of the dataset's {len(files)} files "
               f"({', '.join(deleted[:3])})")
        out["error"] = f"{out['error']}; {msg}" if "error" in out else msg
    return out


def load_or_build(workdir: str, n: int, seed: int, rebuild: bool = False) -> dict:
    """The datasets' meta.json, building them first when missing, for other (n, seed), or asked to."""
    path = os.path.join(workdir, "meta.json")
    if os.path.exists(path) and not rebuild:
        with open(path) as f:
            meta = json.load(f)
        if meta.get("n") == n and meta.get("seed") == seed:
            return meta
    proc = subprocess.run([MAIN_PY if os.path.exists(MAIN_PY) else sys.executable, os.path.abspath(__file__),
                           "--build", "--workdir", workdir, "--n", str(n), "--seed", str(seed)],
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"table1: building the datasets failed (exit {proc.returncode})")
    with open(path) as f:
        return json.load(f)


def best_of(runs: list[dict]) -> dict:
    """The fastest of repeated runs (its peak RSS with it); any failure wins over success, marked."""
    failed = [r for r in runs if "error" in r]
    if failed:
        out = dict(failed[0])
        if len(failed) < len(runs):
            out["error"] += f" (in {len(failed)} of {len(runs)} runs)"
        return out
    return {**max(runs, key=lambda r: r["rate"]), "rates": [r["rate"] for r in runs]}


def run_table(n: int, seed: int, workdir: str, only: str | None = None, timeout: float = 600.0,
              log: Callable[[str], None] = print, rebuild: bool = False, repeat: int = 1) -> dict:
    """Build (or reuse) the datasets and measure every row ``repeat`` times, in rounds over all rows
    (so that a busy spell of the machine hits every row alike); keeps the fastest run of each."""
    meta = load_or_build(workdir, n, seed, rebuild)
    load_start = os.getloadavg()
    rows = [row for row in ROWS if not only or only in row.key]
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(1, repeat + 1):
        for row in rows:
            for op in OPS:
                r = measure(row, op, workdir, meta, timeout)
                runs.setdefault((row.key, op), []).append(r)
                log(f"[{rnd}/{repeat}] {row.fmt:15} {row.compression:12} {row.reader:42} {op:8} " +
                    (f"{r['rate']:10.0f}/s  peak {r['peak_rss'] / MIB:7.0f} MiB" if "error" not in r
                     else f"FAILED: {r['error']}"))
    table = [{**asdict(row), "storage": meta["storage"][row.data],
              "results": {op: best_of(runs[(row.key, op)]) for op in OPS}} for row in rows]
    return {"n": n, "seed": seed, "repeat": repeat, "key_path": meta["key_path"],
            "build_seconds": meta["build_seconds"], "digest_rate": meta.get("digest_rate"),
            "loadavg": {"start": load_start, "end": os.getloadavg()}, "rows": table}


# --- rendering ---------------------------------------------------------------------------------------
def _cell(r: dict, notes: list[str]) -> tuple[str, str]:
    if "error" in r:
        notes.append(r["error"])
        return f"failed [{len(notes)}]", "—"
    return f"{r['rate']:,.0f}", f"{r['peak_rss'] / MIB:,.0f} ({r['peak_anon'] / MIB:,.0f})"


def table_markdown(result: dict) -> str:
    """Table 1 as markdown: samples/s and peak RSS (MiB; anonymous part in brackets) per operation."""
    head = ["Format", "Compression", "Reader", "Storage (MiB)"]
    for op in OPS:
        head += [f"{op} (samples/s)", f"{op} peak RSS (anon), MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    notes: list[str] = []
    for row in result["rows"]:
        cells = [row["fmt"], row["compression"], row["reader"], f"{row['storage'] / MIB:,.0f}"]
        for op in OPS:
            cells += _cell(row["results"][op], notes)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines).rstrip() + "\n"


def ratios(result: dict) -> list[dict]:
    """torchforge's rate divided by every other reader's rate on the same folder, and by the anchor's."""
    rows = result["rows"]
    anchor = next((r for r in rows if r["data"] == "jsonl"), None)
    out = []
    for tf in (r for r in rows if r["reader"] == "torchforge"):
        others = [r for r in rows if r["data"] == tf["data"] and r is not tf] + ([anchor] if anchor else [])
        for other in others:
            line = {"format": f"{tf['fmt']} {tf['compression']}", "versus": f"{other['reader']}"
                    + ("" if other["data"] == tf["data"] else f" ({other['fmt']})")}
            for op in OPS:
                a, b = tf["results"][op], other["results"][op]
                line[op] = a["rate"] / b["rate"] if "error" not in a and "error" not in b else None
            out.append(line)
    return out


def ratios_markdown(result: dict) -> str:
    """The speed-ups as a markdown table (x = torchforge samples/s / competitor samples/s)."""
    lines = ["| torchforge on | versus | " + " | ".join(OPS) + " |", "|---|---|" + "---:|" * len(OPS)]
    for r in ratios(result):
        cells = [f"{r[op]:.2f}x" if r[op] is not None else "n/a" for op in OPS]
        lines.append(f"| {r['format']} | {r['versus']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=os.path.join(REPO, "build", "bench-table1"))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="only rows whose '<data>/<adapter>' contains this")
    ap.add_argument("--rebuild", action="store_true", help="write the datasets again even if present")
    ap.add_argument("--repeat", type=int, default=2, help="measure every (row, op) this often, keep the best")
    ap.add_argument("--timeout", type=float, help="seconds per measurement (default: 60 + n / 200)")
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.build:
        build(args.workdir, args.n, args.seed)
        return 0
    timeout = args.timeout if args.timeout is not None else 60 + args.n / 200
    result = run_table(args.n, args.seed, os.path.abspath(args.workdir), args.only, timeout,
                       rebuild=args.rebuild, repeat=args.repeat)
    print(table_markdown(result))
    print(ratios_markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
