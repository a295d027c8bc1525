"""A dataset of column tensors in safetensors shards, with zero-copy per-sample views, and its writer.

A shard (``shard-00000.safetensors``, …) holds one tensor per column:

* fixed columns: ``name`` of shape ``[n, ...]``; sample ``j`` is ``name[j]``;
* ragged columns: ``name`` of shape ``[total, ...]`` plus ``name.offsets`` (int64, ``n + 1`` values from
  0, non-decreasing, ending at ``total``); sample ``j`` is ``name[offsets[j]:offsets[j + 1]]``.

Every shard is an ordinary safetensors file (the official library opens it); ``__metadata__`` records
``{"format": "torchforge-columns", "version": "2", "samples": "<n>"}`` when torchforge wrote it, and the
last shard also ``"shards": "<N>"``, the number of shards in the dataset: a folder whose shards say
version 2 is read only when one of them says it is the last of exactly the shards there, so a copy or an
upload that stopped part-way (the last shard is uploaded last) is refused instead of read short.
Version 1 shards (torchforge before the marker) and shards written by other tools carry no such claim and
are read as they are.

>>> with SafetensorsShardWriter("data/tok") as w:  # doctest: +SKIP
...     w.write({"ids": torch.tensor([5, 7, 9]), "label": torch.tensor(1)})
>>> SafetensorsDataset("data/tok")[0]["ids"]  # doctest: +SKIP
tensor([5, 7, 9])
"""
from __future__ import annotations

import bisect
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Self

import numpy as np
import torch

from torchforge.datasets.base import ShardDataset, register_format
from torchforge.errors import CorruptShardError, FormatError, NotFoundError
from torchforge.formats.safetensors import (
    DTYPES,
    SafetensorsFile,
    TensorInfo,
    read_header,
    save_safetensors,
)
from torchforge.remote.url import is_remote, local_path
from torchforge.sizes import parse_size

__all__ = ["SafetensorsDataset", "SafetensorsShardWriter"]

SUFFIX = ".safetensors"
OFFSETS = ".offsets"
_META = {"format": "torchforge-columns", "version": "2"}
_LAST = "shards"  # in the last shard's metadata: how many shards the dataset has


def shard_order(names: Iterable[str]) -> list[str]:
    """Shard file names in dataset order: by name, runs of digits by their value (the writer's
    ``shard-100000`` follows ``shard-99999``, where a plain sort put it after ``shard-10000``)."""
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def _shard_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(path, f) for f in shard_order(os.listdir(path))
            if f.endswith(SUFFIX) and not f.startswith(".")]


def _columns(infos: Mapping[str, TensorInfo], path: str) -> tuple[int, dict[str, bool]]:
    """Sample count and column name -> ragged? of one shard, from its header alone."""
    cols: dict[str, bool] = {}
    n: int | None = None
    for name, info in infos.items():
        if name.endswith(OFFSETS) and name[: -len(OFFSETS)] in infos:
            continue
        ragged = name + OFFSETS in infos
        if ragged:
            off = infos[name + OFFSETS]
            if off.dtype != "I64" or len(off.shape) != 1 or off.shape[0] < 1:
                raise CorruptShardError(f"{name + OFFSETS!r} must be a 1-D int64 tensor of n + 1 offsets, "
                                        "got "
                                        f"{off.dtype} {list(off.shape)}", path=path)
            if not info.shape:
                raise CorruptShardError(f"ragged column {name!r} must have at least one dimension", path=path)
            rows = off.shape[0] - 1
        else:
            if not info.shape:
                raise CorruptShardError(f"column {name!r} is 0-dim; expected shape [n, ...]", path=path)
            rows = info.shape[0]
        if info.dtype == "F4" and (len(info.shape) < 2 or info.shape[-1] % 2):  # two values share a byte
            raise FormatError(f"F4 column {name!r} of shape {list(info.shape)} has no rows of whole bytes: a row "
                              "of F4 values needs an even number of them (shape [n, ..., 2k])", path=path)
        if DTYPES.get(info.dtype, (0, None))[1] is None:  # F6 (float8 on an old torch): no torch type
            raise FormatError(f"column {name!r} is {info.dtype}, which this torch has no type for: its rows "
                              "cannot be read as tensors", path=path)
        if rows > sys.maxsize:
            raise CorruptShardError(f"column {name!r} claims {rows} rows, more than any length can be", path=path)
        if n is not None and rows != n:
            raise CorruptShardError(f"column {name!r} has {rows} samples, another column {n}", path=path)
        n = rows
        cols[name] = ragged
    return n or 0, cols


def check_whole(metas: list[Mapping[str, str] | None], files: list[str], folder: str) -> None:
    """A folder of shards that torchforge wrote with the completion marker (version 2) holds the shard that
    says it is the last, and exactly as many shards as that one says (``metas``: each file's
    ``__metadata__``, in name order).

    Raises:
        CorruptShardError: the dataset is incomplete, or holds shards of two datasets (names the folder,
            or the shard whose count disagrees).
    """
    ours = [(f, m) for f, m in zip(files, metas) if m and m.get("format") == _META["format"]]
    marked = [(f, m[_LAST]) for f, m in ours if _LAST in m]
    if not marked and not any(m.get("version", "1") != "1" for _, m in ours):
        return  # written before the marker, or by another tool
    if not marked:
        raise CorruptShardError(f"the dataset is incomplete: none of its {len(files)} shards is the last one "
                                "(torchforge writes it last and marks it); an upload or copy still in "
                                "progress, one that failed, or a folder holding only some of a dataset's "
                                f"shards (the last one here is {os.path.basename(files[-1])})", path=folder)
    if len(marked) > 1:
        raise CorruptShardError(f"{len(marked)} shards say they are the last one "
                                f"({', '.join(os.path.basename(f) for f, _ in marked[:3])}): shards of "
                                "more than one dataset in one folder", path=folder)
    where, said = marked[0]
    if where != files[-1]:
        raise CorruptShardError(f"the shard marked last is not the last in name order (that is "
                                f"{os.path.basename(files[-1])}): shards renamed, or of more than one dataset",
                                path=where)
    if said != str(len(files)):
        raise CorruptShardError(f"the last shard says the dataset has {said} shards, the folder holds "
                                f"{len(files)}: an incomplete copy or upload, or shards of more than one "
                                "dataset", path=where)


def check_offsets(off: np.ndarray, n: int, rows: int, column: str, path: str, at: int) -> np.ndarray:
    """A ragged column's ``n + 1`` offsets (stored at byte ``at`` of ``path``), checked to rise from 0 to its
    ``rows``; returns them.

    Raises:
        CorruptShardError: they do not (names the first offset that breaks the rule and its byte offset).
    """
    falls = np.flatnonzero(np.diff(off) < 0)
    if len(off) != n + 1 or off[0] != 0 or off[-1] != rows or falls.size:
        j = int(falls[0]) + 1 if falls.size else (0 if len(off) and off[0] != 0 else len(off) - 1)
        raise CorruptShardError(f"offsets of ragged column {column!r} must rise from 0 to {rows}; offset {j} is "
                                f"{off[j] if 0 <= j < len(off) else None}", path=path, offset=at + 8 * max(j, 0))
    return off


class SafetensorsDataset(ShardDataset):
    """Map-style dataset over a folder (or a single file) of safetensors column shards.

    Samples are dicts of column name -> tensor: each row copied out of the shard's mmap, or with
    ``zero_copy=True`` a view into it.

    Args:
        path: a folder of ``*.safetensors`` shards (taken in name order) or one shard file.
        columns: only these columns (default: all).
        zero_copy: samples are views into the map (no copy). The files are never written, but an in-place
            change to a sample (a transform's ``x.sub_(mean)``) stays in this process's map: the next read
            of that row, the next epoch's, sees it changed. Off by default: a row's copy is one memcpy.
    """

    format_name = "safetensors"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) makes a
        :class:`~torchforge.datasets.remote.RemoteSafetensorsDataset` (which takes ``cache_dir``,
        ``cache_limit``, ``cache_policy`` and ``storage_options`` too)."""
        path = args[0] if args else kwargs.get("path")
        if cls is SafetensorsDataset and isinstance(path, str) and is_remote(path):
            from torchforge.datasets.remote import RemoteSafetensorsDataset

            return super().__new__(RemoteSafetensorsDataset)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, *, columns: Iterable[str] | None = None, zero_copy: bool = False):
        self.zero_copy = bool(zero_copy)
        self.path = local_path(os.fspath(path))
        if not os.path.exists(self.path):
            raise NotFoundError("no such file or folder", path=self.path)
        self._files = _shard_files(self.path)
        if not self._files:
            raise FormatError(f"no *{SUFFIX} shards in the folder", path=self.path)
        self._cols: list[dict[str, bool]] = []
        self._ends: list[int] = []
        metas = []
        for f in self._files:
            try:
                _, infos, meta = read_header(f)
            except FileNotFoundError:  # listed, then gone (a link to nothing, a file removed meanwhile)
                raise NotFoundError("a shard the folder lists cannot be opened (a link to nothing?)", path=f) from None
            self._add_shard(infos, meta, columns, f)
            metas.append(meta)
        if os.path.isdir(self.path):  # (one shard file of a dataset may be read on its own)
            check_whole(metas, self._files, self.path)
        self._open: dict[int, tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]] = {}

    def _add_shard(self, infos: Mapping[str, TensorInfo], meta: Mapping[str, str] | None,
                   columns: Iterable[str] | None, where: str) -> None:
        """Count the next shard's samples and check its columns, from its header."""
        n, cols = _columns(infos, where)
        if meta and meta.get("format") == _META["format"] and meta.get("samples") != str(n):
            raise CorruptShardError(f"metadata says {meta.get('samples')} samples, the columns {n}", path=where)
        if columns is not None:
            missing = sorted(set(columns) - set(cols))
            if missing:
                raise FormatError(f"columns {missing} not in the shard (it has {sorted(cols)})", path=where)
            cols = {c: cols[c] for c in columns}
        if self._cols and set(cols) != set(self._cols[0]):
            raise CorruptShardError(f"shard has columns {sorted(cols)}, the first shard "
                                    f"{sorted(self._cols[0])}", path=where)
        # A column's dtype is the same in every shard (its row shape may differ: a shard whose rows agree
        # stores them fixed, another ragged, and each one's fixed rows may have their own shape).
        kinds = {c: infos[c].dtype for c in cols}
        first = self._kinds if self._cols else kinds
        for c, kind in kinds.items():
            if kind != first[c]:
                raise CorruptShardError(f"column {c!r} is {kind}, the first shard's is {first[c]}", path=where)
        total = (self._ends[-1] if self._ends else 0) + n
        if total > sys.maxsize:
            raise CorruptShardError(f"the shards so far hold {total} rows, more than any length can be", path=where)
        self._kinds = first
        self._cols.append(cols)
        self._ends.append(total)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes re-map the shards themselves: the open mmaps are not sent along.
        return {**self.__dict__, "_open": {}}

    def shard_files(self) -> list[str]:
        return list(self._files)

    @property
    def columns(self) -> list[str]:
        """Column names."""
        return sorted(self._cols[0]) if self._cols else []

    def _shard(self, s: int) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        got = self._open.get(s)
        if got is None:
            got = self._load(s, SafetensorsFile(self._files[s]))
        return got

    def _load(self, s: int, f: SafetensorsFile) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Shard ``s``'s columns from its open file, checked, and kept."""
        path = f.path
        n = self._ends[s] - (self._ends[s - 1] if s else 0)
        now, cols = _columns(f.infos, path)
        changed = [c for c, ragged in self._cols[s].items()
                   if cols.get(c) != ragged or f.infos[c].dtype != self._kinds[c]]
        if now != n or changed:  # rewritten since its header was read: the old row counts would mix versions
            raise FormatError(f"shard changed since the dataset was opened: it held {n} rows, now {now}"
                              + (f" (columns {changed} differ)" if changed else ""), path=path)
        data, offsets = {}, {}
        for c, ragged in self._cols[s].items():
            data[c] = f[c]
            if ragged:
                offsets[c] = check_offsets(f[c + OFFSETS].numpy(), n, data[c].shape[0], c, path,
                                           f.data_start + f.infos[c + OFFSETS].start)
        got = self._open[s] = (data, offsets)
        return got

    def _get(self, i: int) -> dict[str, torch.Tensor]:
        s = bisect.bisect_right(self._ends, i)
        j = i - (self._ends[s - 1] if s else 0)
        data, offsets = self._shard(s)
        out = {}
        for c, t in data.items():
            off = offsets.get(c)
            row = t[j] if off is None else t[int(off[j]): int(off[j + 1])]
            # (a copy by default: an in-place change to a view would stay in the map, seen by the next read)
            out[c] = row if self.zero_copy else row.clone()
        return out


def _column_value(name: str, v: Any, i: int, out: str) -> torch.Tensor:
    """A sample's value as a CPU tensor a shard can hold: numbers, arrays (any byte order or strides) and
    tensors; anything else is a FormatError naming the column."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    a = np.asarray(v)
    if a.dtype.kind in "biufc" and a.dtype.byteorder not in ("=", "|"):
        a = a.astype(a.dtype.newbyteorder("="))  # big-endian: the same values in this machine's order
    try:
        return torch.as_tensor(a if a.flags.c_contiguous else a.copy())  # (ascontiguousarray makes 0-d 1-d)
    except (TypeError, ValueError, RuntimeError):
        raise FormatError(f"column {name!r} of sample {i} holds {type(v).__name__} ({a.dtype}): safetensors "
                          "shards hold numbers, arrays and tensors of numbers", path=out) from None


class SafetensorsShardWriter:
    """Writes samples (dicts of tensors, numpy arrays or numbers) into safetensors column shards.

    A column whose values all have the same shape within a shard is stored fixed (stacked); otherwise
    ragged (concatenated along the first dimension, with ``name.offsets``); columns named in ``ragged``
    are always ragged. Every sample must have the same columns and, per column, the same dtype.

    Args:
        out: the folder to create (must not hold shards already).
        max_shard_size: start a new shard when a shard's data would pass this size (``"256MB"``, ``"1GiB"``
            or bytes; :mod:`torchforge.sizes`).
        samples_per_shard: or after this many samples.
        ragged: columns to store ragged even when their shapes agree.
    """

    def __init__(self, out: str | os.PathLike, *, max_shard_size: int | str = "256MB",
                 samples_per_shard: int | None = None, ragged: Iterable[str] = ()):
        self.out = os.fspath(out)
        os.makedirs(self.out, exist_ok=True)
        if _shard_files(self.out):
            raise FormatError(f"folder already holds *{SUFFIX} shards; write into an empty folder",
                              path=self.out)
        self.max_bytes = parse_size(max_shard_size, option="max_shard_size")
        if samples_per_shard is not None and samples_per_shard < 1:
            raise ValueError(f"samples_per_shard={samples_per_shard!r} must be >= 1")
        self.samples_per_shard = samples_per_shard
        self.ragged = set(ragged)
        self._rows: list[dict[str, torch.Tensor]] = []
        self._bytes = 0
        self._shards = 0
        self._schema: dict[str, torch.dtype] | None = None
        self._full = False  # the rows held fill a shard: written by the next write(), or by close() as the last
        self.files: list[str] = []
        self.samples = 0

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample."""
        if self._full:
            self._flush()
        row = {}
        for k, v in sample.items():
            if not isinstance(k, str) or k.endswith(OFFSETS) or k == "__metadata__":
                raise FormatError(f"column name {k!r} must be a str not ending in {OFFSETS!r}")
            row[k] = _column_value(k, v, self.samples, self.out)
        schema = {k: t.dtype for k, t in row.items()}
        if self._schema is None:
            self._schema = schema
        elif schema != self._schema:
            raise FormatError(f"sample {self.samples} has columns/dtypes {schema}, earlier samples "
                              f"{self._schema}", path=self.out)
        nbytes = sum(t.numel() * t.element_size() for t in row.values())
        if self._rows and self._bytes + nbytes > self.max_bytes:  # it would pass the limit: it starts the next
            self._flush()
        self._rows.append(row)
        self.samples += 1
        self._bytes += nbytes
        full = self.samples_per_shard is not None and len(self._rows) >= self.samples_per_shard
        self._full = self._bytes >= self.max_bytes or full

    def _flush(self, last: bool = False) -> None:
        """Write the rows held as the next shard (``last``: marked as the dataset's last one)."""
        self._full = False
        if not self._rows:
            return
        tensors: dict[str, torch.Tensor] = {}
        for c in self._rows[0]:
            vals = [r[c] for r in self._rows]
            if c not in self.ragged and all(v.shape == vals[0].shape for v in vals):
                tensors[c] = torch.stack(vals)
                continue
            if any(v.dim() == 0 or v.shape[1:] != vals[0].shape[1:] for v in vals):
                raise FormatError(f"column {c!r} is ragged: its values need >= 1 dimension and equal "
                                  "trailing "
                                  f"dimensions, got shapes {sorted({tuple(v.shape) for v in vals})[:4]}",
                                  path=self.out)
            tensors[c] = torch.cat(vals)
            tensors[c + OFFSETS] = torch.tensor([0] + [v.shape[0] for v in vals], dtype=torch.int64).cumsum(0)
        path = os.path.join(self.out, f"shard-{self._shards:05d}{SUFFIX}")
        meta = {**_META, "samples": str(len(self._rows))}
        if last:
            meta[_LAST] = str(self._shards + 1)
        save_safetensors(tensors, path, meta)
        self.files.append(path)
        self._shards += 1
        self._rows, self._bytes = [], 0

    def close(self) -> None:
        """Write the last shard (marked as the last: see the module docstring)."""
        self._flush(last=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()


def detect(path: str) -> bool:
    """A ``.safetensors`` file, or a folder of them that is not a checkpoint (no ``*.index.json``)."""
    if os.path.isfile(path):
        return path.endswith(SUFFIX)
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith(SUFFIX) and not n.startswith(".") for n in names) and not any(
        n.endswith(".safetensors.index.json") for n in names)


register_format("safetensors", SafetensorsDataset, detect)
