"""Conversions between JSONL, Parquet, JINX, MDS and safetensors shards, streaming with bounded memory.

``convert(src, dst, to="jinx")`` reads any supported source one sample at a time and writes it with the
target format's writer. Malformed JSONL lines are skipped, counted and reported, never fatal.
"""
from __future__ import annotations

import codecs
import gzip
import inspect
import io
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import orjson

from torchforge._proc import drop_dead_stages, host_name
from torchforge.errors import FormatError, TorchforgeError
from torchforge.formats.values import BYTES_LIKE

__all__ = ["ConversionStats", "convert", "infer_mds_columns", "iter_jsonl", "open_source"]

log = logging.getLogger(__name__)
TARGETS = ("jinx", "mds", "safetensors")


@dataclass
class ConversionStats:
    """What a conversion did: samples written, lines skipped (with where), and the output path."""

    written: int = 0
    skipped: int = 0
    skipped_where: list[str] = field(default_factory=list)
    out: str = ""
    #: a pass that only looks ahead (column inference, the up-front check) records its skips without
    #: logging them: the writing pass logs each once
    quiet: bool = field(default=False, repr=False, compare=False)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.skipped_where) < 20:
            self.skipped_where.append(f"{where}: {why}")
        if not self.quiet:
            log.warning("skipped malformed record at %s: %s", where, why)


# --- sources ----------------------------------------------------------------------------------------
def _open_text_stream(path: str) -> io.BufferedIOBase:
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller's `with`
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if path.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


_LONG_DIGITS = re.compile(rb"\d{19}")  # a run of digits that may be an integer past 64 bits


def iter_jsonl(path: str, stats: ConversionStats | None = None) -> Iterator[dict]:
    """Yield one dict per line of a JSONL file (plain, ``.gz`` or ``.zst``).

    A line that is not a JSON object is skipped and recorded in ``stats`` with its line number and byte
    offset (in the uncompressed stream); blank lines are ignored.
    """
    stats = stats if stats is not None else ConversionStats()
    offset = 0
    with _open_text_stream(path) as f:
        for lineno, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if lineno == 1 and line.startswith(codecs.BOM_UTF8):  # (Windows tools start a file with one)
                line = line[len(codecs.BOM_UTF8):]
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                if _LONG_DIGITS.search(line):  # orjson reads an integer past 64 bits as a float: json, exactly
                    obj = json.loads(line)  # (a line orjson took: no NaN, no lone surrogate, no 1e400)
            except (ValueError, RecursionError) as e:  # (orjson's and json's errors, bytes that are not UTF-8)
                stats.skip(f"{path}:{lineno} (byte {start})", f"not JSON ({e})")
                continue
            if not isinstance(obj, dict):
                stats.skip(f"{path}:{lineno} (byte {start})", f"a JSON {type(obj).__name__}, not an object")
                continue
            yield obj


def _iter_parquet(path: str) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise TorchforgeError("reading Parquet needs pyarrow: pip install 'torchforge[parquet]'", path=path) from e
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            yield from batch.to_pylist()


def _materialize(sample: Any) -> Any:
    m = getattr(sample, "materialize", None)
    return m() if callable(m) else sample


def _file_kind(path: str) -> str | None:
    """``jsonl`` or ``parquet`` for such a source path, None for anything else (a dataset folder)."""
    base = path.lower()
    if os.path.isfile(path) and base.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".jsonl.zstd",
                                              ".ndjson")):
        return "jsonl"
    if base.endswith(".parquet") or (os.path.isdir(path) and any(f.endswith(".parquet") for f in os.listdir(path))):
        return "parquet"
    return None


def open_source(path: str,
                **remote: Any) -> tuple[str, Callable[[ConversionStats], Iterable[Any]], int | None]:
    """Return the source kind, a function that starts a fresh pass over its plain samples, and the sample
    count when it is known up front (datasets).

    The pass function takes the :class:`ConversionStats` that records skipped records. A dataset is
    opened once; every pass iterates that one object.

    Args:
        path: a JSONL or Parquet file, a dataset folder, or a dataset URL.
        **remote: for a URL, ``cache_dir``, ``cache_limit``, ``mode``, ``storage_options`` (ignored for a
            local path).
    """
    from torchforge.remote.url import is_remote, local_path

    if is_remote(path):
        from torchforge.datasets.base import open_dataset

        ds = open_dataset(path, **remote)
        return ds.format_name, lambda stats: (_materialize(s) for s in ds), len(ds)
    path = local_path(path)
    kind = _file_kind(path)
    if kind == "jsonl":
        return kind, lambda stats: iter_jsonl(path, stats), None
    if kind == "parquet":
        return kind, lambda stats: _iter_parquet(path), None
    from torchforge.datasets.base import open_dataset

    ds = open_dataset(path)
    return ds.format_name, lambda stats: (_materialize(s) for s in ds), len(ds)


# --- MDS column inference ---------------------------------------------------------------------------
_NP_SCALARS = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64"}


def _json_problem(v: Any, where: str) -> str | None:
    """Why ``v`` cannot be stored in an MDS ``json`` column (None when it can)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return None
    if isinstance(v, Mapping):
        for k, x in v.items():
            p = _json_problem(x, f"{where}.{k}")
            if p:
                return p
        return None
    if isinstance(v, (list, tuple)):
        for j, x in enumerate(v):
            p = _json_problem(x, f"{where}[{j}]")
            if p:
                return p
        return None
    return f"{where} holds {type(v).__name__}, which an MDS json column cannot hold"


def _kind(v: Any) -> tuple:
    import torch

    if isinstance(v, torch.Tensor):
        v = v.numpy()
    if isinstance(v, bool):
        return ("json",)
    if isinstance(v, str):
        return ("str",)
    if isinstance(v, int):
        return ("int",) if -(2**63) <= v < 2**63 else ("json",)
    if isinstance(v, float):
        return ("float64",)
    if isinstance(v, BYTES_LIKE):  # before ndarray: a ByteView is one
        return ("bytes",)
    if isinstance(v, (np.generic, np.ndarray)) and v.ndim == 0 and v.dtype.name in _NP_SCALARS:
        return (v.dtype.name,)  # numpy scalars and 0-d arrays and tensors
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.name, v.shape)
    return ("json",)


def infer_mds_columns(samples: Iterable[Any]) -> dict[str, str]:
    """One pass over plain samples to choose an MDS encoding per field, or refuse with the field named.

    Raises:
        FormatError: a field MDS cannot hold (nested bytes or arrays, mixed kinds, missing in a sample).
    """
    kinds: dict[str, set] = {}
    names: list[str] | None = None
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise FormatError(f"sample {i} is a {type(s).__name__}, MDS needs a mapping of columns")
        if names is None:
            names = list(s)
            kinds = {k: set() for k in names}
        elif set(s) != set(names):
            raise FormatError(f"sample {i} has fields {sorted(s)} but sample 0 has {sorted(names)}: every MDS "
                              "sample needs the same columns")
        for k, v in s.items():
            try:
                kind = _kind(v)
            except TypeError as e:  # a tensor numpy has no type for (bfloat16, float8): no MDS encoding holds it
                what = getattr(v, "dtype", type(v).__name__)
                raise FormatError(f"field {k!r} cannot be converted to MDS (sample {i}): its {what} values have "
                                  f"no numpy type ({e}); cast the column (to float32, say) first") from None
            if kind[0] == "ndarray" and kind[1] not in _NP_SCALARS:
                raise FormatError(f"field {k!r} cannot be converted to MDS (sample {i}): its values are "
                                  f"{kind[1]} arrays, and an MDS ndarray column holds "
                                  f"{', '.join(sorted(_NP_SCALARS))}; cast the column (bool to uint8, say) "
                                  "first")
            if kind == ("json",):
                p = _json_problem(v, k)
                if p:
                    raise FormatError(f"field {k!r} cannot be converted to MDS (sample {i}): {p}")
            kinds[k].add(kind)
    cols = {}
    for k in names or []:
        ks = kinds[k]
        heads = {x[0] for x in ks}
        if len(heads) == 1 and len(ks) == 1:
            (kind,) = ks
            cols[k] = kind[0] if kind[0] != "ndarray" else f"ndarray:{kind[1]}:{','.join(map(str, kind[2]))}"
            if kind[0] == "ndarray" and not kind[2]:
                cols[k] = f"ndarray:{kind[1]}"
        elif heads == {"ndarray"}:
            dtypes = {x[1] for x in ks}
            cols[k] = f"ndarray:{dtypes.pop()}" if len(dtypes) == 1 else "ndarray"
        elif heads <= {"json", "str", "int", "float64"}:
            cols[k] = "json"
        else:
            raise FormatError(f"field {k!r} mixes kinds {sorted(heads)} across samples; MDS needs one encoding "
                              "per column")
    return cols


# --- the conversion ---------------------------------------------------------------------------------
def _progress(total: int | None, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar, same result
        return None
    return tqdm(total=total, desc=desc, unit="sample", unit_scale=True, dynamic_ncols=True,
                disable=None)


def _tensor_row(sample: Any, i: int) -> dict[str, Any]:
    """A sample as safetensors columns: numbers, arrays and tensors as they are, bytes as uint8 arrays.

    Raises:
        FormatError: a field safetensors cannot hold (text, nested containers, None), named.
    """
    import torch

    if not isinstance(sample, Mapping):
        raise FormatError(f"sample {i} is a {type(sample).__name__}, safetensors shards need a mapping")
    row = {}
    for k, v in sample.items():
        if isinstance(v, (bytes, bytearray, memoryview)):
            v = np.frombuffer(bytearray(v), dtype=np.uint8)  # writable: torch wants that
        elif isinstance(v, (bool, int, float, np.generic)):
            v = np.asarray(v)
        elif not isinstance(v, (np.ndarray, torch.Tensor)) or getattr(v, "dtype", None) == object:
            raise FormatError(f"field {k!r} cannot be converted to safetensors (sample {i}): it holds "
                              f"{type(v).__name__}; safetensors shards hold numbers, arrays, tensors and bytes")
        row[k] = v
    return row


class _TensorRows:
    """Feeds a SafetensorsShardWriter rows converted by :func:`_tensor_row`."""

    def __init__(self, writer: Any) -> None:
        self.writer, self.i = writer, 0

    def write(self, sample: Any) -> None:
        self.writer.write(_tensor_row(sample, self.i))
        self.i += 1

    def __enter__(self) -> Self:
        self.writer.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self.writer.__exit__(*exc)


def _check_options(to: str, cls: type, options: dict[str, Any], taken: tuple[str, ...]) -> None:
    """A ValueError naming the options ``cls`` (the target's writer) does not take, and those it does."""
    params = inspect.signature(cls).parameters
    known = sorted(k for k, p in params.items()
                   if k not in taken and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    wrong = sorted(k for k in options if k not in known and k != "columns")
    if wrong:
        raise ValueError(f"the {to} writer ({cls.__name__}) takes no option {', '.join(map(repr, wrong))}; its "
                         f"options: {', '.join(known)}")


def writer_class(to: str) -> type:
    """The writer class of format ``to`` (its options are ``convert``'s keyword options)."""
    if to == "jinx":
        from torchforge.formats.jinx import JinxWriter

        return JinxWriter
    if to == "mds":
        from torchforge.formats.mds import MDSWriter

        return MDSWriter
    if to == "safetensors":
        from torchforge.datasets.safetensors import SafetensorsShardWriter

        return SafetensorsShardWriter
    raise TorchforgeError(f"{to=} is not one of {list(TARGETS)}")


def _writer(to: str, dst: str, start_pass: Callable[[ConversionStats], Iterable[Any]], options: dict[str, Any]):
    cls = writer_class(to)
    if to == "jinx":
        _check_options(to, cls, options, ("path",))
        return cls(dst, **options)
    if to == "mds":
        _check_options(to, cls, options, ("out",))
        columns = options.pop("columns", None) or infer_mds_columns(start_pass(ConversionStats(quiet=True)))
        if not columns:
            raise FormatError("the source holds no samples to infer MDS columns from: give them (columns=, "
                              "--columns) to write an empty MDS dataset")
        return cls(out=dst, columns=columns, **options)
    _check_options(to, cls, options, ("out",))  # safetensors
    n = 0
    for n, sample in enumerate(start_pass(ConversionStats(quiet=True)), 1):  # refuse before writing anything
        _tensor_row(sample, n - 1)
    if n == 0:
        raise FormatError("the source holds no samples: a safetensors dataset is its shards' columns, and "
                          "an empty one has none to write")
    return _TensorRows(cls(dst, **options))


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, progress: bool = False,
            cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
            mode: str | None = None, storage_options: Mapping[str, Any] | None = None,
            **options: Any) -> ConversionStats:
    """Convert ``src`` (JSONL, Parquet, or a JINX/MDS/safetensors dataset) into format ``to`` at ``dst``.

    A URL destination (``s3://``, ``gs://``, ``az://``; ``http(s)://`` is read-only) is written into a
    temporary folder under the cache folder first, then uploaded with the dataset's data files first and
    the file that makes it whole last (MDS ``index.json``; JINX the last shard, whose footer ends the
    chain; see :mod:`torchforge.remote.upload`), and the temporary folder removed: a reader never sees a
    half-written dataset, and a failed upload leaves no index at the destination. ``file://`` URLs are
    local paths.

    Args:
        src: a JSONL file (plain, .gz, .zst), a Parquet file or folder, a dataset folder, or a dataset URL.
        dst: the output folder, or a folder URL.
        to: ``"jinx"``, ``"mds"`` or ``"safetensors"``.
        progress: show a tqdm bar with samples/s (and one with the bytes uploaded).
        cache_dir: the node-local cache folder for a URL (source or destination); also where a URL
            destination is staged. Default: the per-user cache folder.
        cache_limit: the most bytes the cache may hold while a URL source is read.
        mode: how a URL source is read (``"shards"`` or ``"ranges"``).
        storage_options: endpoint, region, credentials, ... for URLs (see :mod:`torchforge.remote.url`).
        **options: the target writer's options (e.g. ``compression="zst"``, ``columns=...`` for MDS). For a
            URL destination ``overwrite=True`` replaces the dataset the destination holds (the new one is
            uploaded beside it first, so a failed upload leaves the old one intact; see
            :func:`torchforge.remote.upload`); without it a destination holding any object is refused
            before anything is converted.

    Returns:
        ConversionStats with the samples written and the malformed records skipped.

    Raises:
        FormatError: the data cannot be held by the target format; raised before anything is written.
        RemoteExistsError: the destination URL holds objects and ``overwrite`` was not given.
        RemoteReadOnlyError: the destination is an ``http(s)://`` URL.
        RemoteError: the upload failed (names the object's URL); the destination holds no index.
    """
    from torchforge.remote.url import is_remote, local_path

    src, dst = os.fspath(src), os.fspath(dst)
    if to not in TARGETS:
        raise TorchforgeError(f"{to=} is not one of {list(TARGETS)}")
    remote = {k: v for k, v in (("cache_dir", cache_dir), ("cache_limit", cache_limit), ("mode", mode),
                                ("storage_options", storage_options)) if v is not None}
    clash = overlap(src, dst)
    if clash:  # the destination is written (with overwrite, its old files deleted) while the source is read
        raise TorchforgeError(f"{clash}; write to a destination outside the source")
    if is_remote(dst):
        return _convert_to_url(src, dst, to, progress, remote, options)
    return _convert(src, local_path(dst), to, progress, remote, options)


def overlap(src: str, dst: str) -> str:
    """Why ``dst`` cannot be written (and, with overwrite, its old files deleted) without touching ``src``,
    or ``''``. URLs are compared as the store sees them (``s3a://`` is ``s3://``, the scheme's case and
    slashes around the key do not matter), local paths after resolving links."""
    from torchforge.remote.url import is_remote, local_path

    if is_remote(src) != is_remote(dst):
        return ""
    if is_remote(src):
        s, d = _object_place(src), _object_place(dst)
        sep = "/"
    else:
        s, d = (os.path.realpath(local_path(p)) for p in (src, dst))
        sep = os.sep
    if s == d:
        return f"DST {dst} is SRC {src}"
    if s.startswith(d.rstrip(sep) + sep):
        return f"DST {dst} contains SRC {src}"
    if d.startswith(s.rstrip(sep) + sep):
        return f"DST {dst} lies inside SRC {src}"
    return ""


def _object_place(url: str) -> str:
    """``scheme://root/key`` of a folder URL as the store sees it (a bucket's root has an empty key)."""
    from torchforge.remote.url import split_url

    scheme, root, key = split_url(url.rstrip("/") + "/_")
    if scheme in ("http", "https"):
        root = root.lower()
    return f"{scheme}://{root}/{key[:-1].strip('/')}".rstrip("/")


def _convert(src: str, dst: str, to: str, progress: bool, remote: dict[str, Any],
             options: dict[str, Any]) -> ConversionStats:
    stats = ConversionStats(out=dst)
    kind, start_pass, total = open_source(src, **remote)
    bar = _progress(total, f"{kind} -> {to}") if progress else None
    with _writer(to, dst, start_pass, dict(options)) as w:
        names = set(w.column_names) if to == "mds" else None
        for sample in start_pass(stats):
            if names is not None:  # MDS keeps its columns only: a field beyond them would be lost
                extra = sorted(k for k in sample if k not in names)
                if extra:
                    raise FormatError(f"sample {stats.written} has fields {extra} that the MDS columns "
                                      f"{sorted(names)} do not hold: list them in columns= (--columns), or "
                                      "they would be dropped", path=src)
            try:
                w.write(sample)
            except FormatError as e:  # the sample and the source, not the output being written
                raise FormatError(f"sample {stats.written}: {e.reason}", path=src) from e
            stats.written += 1
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return stats


def _convert_to_url(src: str, dst: str, to: str, progress: bool, remote: dict[str, Any],
                    options: dict[str, Any]) -> ConversionStats:
    """Convert into a temporary folder under the cache folder, then publish it at ``dst``."""
    import tempfile

    from torchforge.cache import user_cache_dir
    from torchforge.remote import connect
    from torchforge.remote.upload import check_destination, upload

    options = dict(options)
    overwrite = bool(options.pop("overwrite", False))
    options.pop("exist_ok", None)
    single = to == "jinx" and "shard_size" in options and options["shard_size"] is None
    cache_dir = remote.get("cache_dir")
    storage_options = remote.get("storage_options")
    check_destination(dst, overwrite=overwrite, single=single, client=connect(cache_dir),
                      storage_options=storage_options)  # refused before any work
    base = (os.path.join(os.path.abspath(os.fspath(cache_dir)), "uploads") if cache_dir is not None
            else user_cache_dir("uploads"))
    os.makedirs(base, mode=0o700, exist_ok=True)
    _drop_stale_staging(base)
    tmp = tempfile.mkdtemp(prefix=f"convert-h{host_name()}-p{os.getpid()}-", dir=base)
    try:
        local = os.path.join(tmp, "dataset")
        stats = _convert(src, local, to, progress, remote, options)
        bar = None
        if progress:
            total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(local) for f in fs) \
                if os.path.isdir(local) else os.path.getsize(local)
            bar = _upload_progress(total, dst)
        try:
            upload(local, dst, overwrite=overwrite, cache_dir=cache_dir, storage_options=storage_options,
                   on_file=None if bar is None else (lambda url, size: bar.update(size)))
        finally:
            if bar is not None:
                bar.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats.out = dst
    return stats


def _drop_stale_staging(base: str) -> None:
    """Remove the staging folders of converts on this host whose process is gone (killed mid-upload: its
    ``finally`` never ran). Another host's, on a shared cache folder, are left alone."""
    drop_dead_stages(base, rf"convert-h{re.escape(host_name())}-p(\d+)-.+")


def _upload_progress(total: int, dst: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"upload -> {dst}", unit="B", unit_scale=True, dynamic_ncols=True,
                disable=None)
