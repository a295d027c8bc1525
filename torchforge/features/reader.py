"""The read path: one version of a store, its index and shards mapped, gathering rows for a batch of ids.

A :class:`Snapshot` maps the version's index at once and each shard the first time a lookup needs it
(read-only ``mmap``; the header validated by the safetensors parser, the size against the manifest,
the tensors against the schema). :meth:`Snapshot.gather` finds the batch's positions in the index (see
:mod:`torchforge.features.index`), checks each location it will read (shard number and row inside the
shard: a lying index is a CorruptShardError, never a read outside a file) and copies rows into output
tensors made by :func:`torchforge.loader.collate.empty`, which in a torchforge DataLoader worker are the
batch's shared-memory slab.

Every copy is one ``np.take`` per column over the mapped column viewed as one item per row (``uint32``
for a 4-byte row, ``V512`` for a 512-byte one): a single vectorised gather, with ``mode="clip"`` since
the rows are checked already (the default mode buffers the whole output to stay atomic). numpy runs
it on the calling thread; torch's ``index_select`` would fan out to its intra-op threads, which on a
busy machine makes it many times slower, not faster. Rows of one shard go straight into the output
when the whole batch lies in that shard; otherwise each shard's rows are taken together into a
scratch block (in shard order) and one more take puts them in the batch's order.
"""
from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchforge.errors import CorruptShardError, TorchforgeError
from torchforge.features.index import IdIndex
from torchforge.features.layout import Manifest, Schema, ShardEntry
from torchforge.formats.safetensors import parse_header
from torchforge.loader import collate

__all__ = ["MissingIdsError", "Snapshot"]

_SHOWN = 10  # missing ids named in an error message


class MissingIdsError(TorchforgeError, KeyError):
    """Ids asked for are not in the version read. ``ids`` holds them (all of them), ``version`` the
    version; both a TorchforgeError and a KeyError."""

    def __init__(self, reason: str, *, ids: Sequence[int] = (), version: int = 0, path: str | None = None):
        self.ids = list(ids)
        self.version = version
        super().__init__(reason, path=path)


def _items(a: np.ndarray, width: int) -> np.ndarray:
    """A C-contiguous uint8 ``(rows, width)`` array as a 1-D array of one item per row."""
    return a.view(_item(width)).reshape(len(a))


def _item(width: int) -> np.dtype:
    """The numpy dtype of one ``width``-byte row: an unsigned int where one fits, else raw bytes."""
    return _ITEM.get(width) or np.dtype((np.void, width))


_ITEM = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


class _Shard:
    """One shard mapped: ``cols[name]`` is a 1-D numpy array of the column, one item per row (see
    :func:`_items`); None for a column of empty rows."""

    def __init__(self, root: str, entry: ShardEntry, schema: Schema):
        path = os.path.join(root, entry.file)
        self.path = path
        if not os.path.isfile(path):
            raise CorruptShardError("a shard the manifest lists is missing", path=path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.bytes:
                raise CorruptShardError(f"the shard has {size} bytes, the manifest says {entry.bytes} "
                                        f"({'truncated' if size < entry.bytes else 'grown'})", path=path,
                                        offset=min(size, entry.bytes))
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        n, infos, _ = parse_header(memoryview(self._mm), size, path)
        self.rows = entry.rows
        want = {"id": ("I64", (entry.rows,), 8)}
        want.update({c: (col.code, (entry.rows, *col.shape), col.row_bytes) for c, col in schema.items()})
        self.cols: dict[str, np.ndarray | None] = {}
        for name, (code, shape, width) in want.items():
            info = infos.get(name)
            if info is None or info.dtype != code or info.shape != shape:
                raise CorruptShardError(f"tensor {name!r} should be {code} {list(shape)} (manifest rows and "
                                        f"schema), the shard has {info}", path=path, offset=8)
            count = info.end - info.start
            self.cols[name] = _items(np.frombuffer(self._mm, np.uint8, count, 8 + n + info.start).reshape(
                entry.rows, width), width) if count else None


class Snapshot:
    """A version of a store, open for reading (``manifest`` None: the empty version 0)."""

    def __init__(self, root: str, schema: Schema, manifest: Manifest | None):
        self.root = root
        self.schema = schema
        self.manifest = manifest
        self.version = manifest.version if manifest else 0
        self.rows = manifest.rows if manifest else 0
        self.index: IdIndex | None = None
        if manifest is not None and manifest.index is not None:
            m = manifest.index
            self.index = IdIndex(os.path.join(root, m.file), m.rows, m.bytes)
        self._shards: list[_Shard | None] = [None] * (len(manifest.shards) if manifest else 0)

    def shard(self, k: int) -> _Shard:
        s = self._shards[k]
        if s is None:
            s = self._shards[k] = _Shard(self.root, self.manifest.shards[k], self.schema)
        return s

    def gather(self, q: np.ndarray, columns: list[str], missing: Any) -> dict[str, torch.Tensor]:
        n = len(q)
        out, items = {}, {}
        for c in columns:
            col = self.schema[c]
            t = out[c] = collate.empty((n, *col.shape), col.dtype)
            if col.row_bytes and n:  # the output as one item per row (see _items)
                items[c] = t.view(-1).view(torch.uint8).numpy().view(_item(col.row_bytes))
        if self.index is not None:
            pos, found = self.index.lookup(q)
        else:
            pos, found = np.zeros(n, np.int64), np.zeros(n, bool)
        hit = None if found.all() else np.flatnonzero(found)
        if hit is not None:
            miss = np.flatnonzero(~found)
            if missing is None:
                raise MissingIdsError(f"{len(miss)} of {n} ids are not in version {self.version}: "
                                      f"{q[miss[:_SHOWN]].tolist()}{' ...' if len(miss) > _SHOWN else ''}; "
                                      "pass missing= to fill a default", ids=q[miss].tolist(),
                                      version=self.version, path=self.root)
            for c, a in items.items():
                a[miss] = _items(_default_row(missing, c, self.schema)[None], self.schema[c].row_bytes)[0]
            pos = pos[hit]
        if len(pos) and items:
            self._copy(pos, hit, items)
        return out

    def _copy(self, pos: np.ndarray, hit: np.ndarray | None, items: dict[str, np.ndarray]) -> None:
        sh = np.take(self.index.shard, pos, mode="clip")  # pos < len(index), from lookup
        rw = np.take(self.index.row, pos, mode="clip")
        if len(self._shards) == 1:  # (one reduction: a negative shard number is a huge unsigned one)
            k_lo = k_hi = 0
            if int(sh.view(np.uint32).max()) != 0:
                raise CorruptShardError(f"the index names shard {int(sh[sh != 0][0])}; the manifest lists 1",
                                        path=self.index.path)
        else:
            k_lo, k_hi = int(sh.min()), int(sh.max())
            if k_lo < 0 or k_hi >= len(self._shards):
                raise CorruptShardError(f"the index names shard {k_lo if k_lo < 0 else k_hi}; the manifest lists "
                                        f"{len(self._shards)}", path=self.index.path)
        if k_lo == k_hi:  # one shard: rows go straight into the output
            self._check_rows(k_lo, rw)
            cols = self.shard(k_lo).cols
            for c, dst in items.items():
                if hit is None:
                    np.take(cols[c], rw, out=dst, mode="clip")
                else:
                    dst[hit] = np.take(cols[c], rw, mode="clip")
            return
        # several shards: take each shard's rows together (in shard order), then put them in place
        order = np.argsort(sh.astype(np.int16) if k_hi < 2**15 else sh, kind="stable")
        sh_sorted = sh[order]
        rw_sorted = rw[order]
        cuts = [0, *(np.flatnonzero(sh_sorted[1:] != sh_sorted[:-1]) + 1).tolist(), len(order)]
        groups = []
        for a, b in itertools.pairwise(cuts):
            k = int(sh_sorted[a])
            self._check_rows(k, rw_sorted[a:b])
            groups.append((self.shard(k).cols, a, b))
        inv = np.empty(len(order), np.int64)
        inv[order] = np.arange(len(order))
        for c, dst in items.items():
            tmp = np.empty(len(order), dst.dtype)
            for cols, a, b in groups:
                np.take(cols[c], rw_sorted[a:b], out=tmp[a:b], mode="clip")
            if hit is None:
                np.take(tmp, inv, out=dst, mode="clip")
            else:
                dst[hit] = tmp[inv]

    def _check_rows(self, k: int, rows: np.ndarray) -> None:
        n = self.shard(k).rows
        if len(rows) and int(rows.view(np.uint64).max()) >= n:  # a negative row is a huge unsigned one
            bad = int(rows[(rows < 0) | (rows >= n)][0])
            raise CorruptShardError(f"the index points at row {bad} of shard {k}, which has {n} rows",
                                    path=self.index.path)

    def ids(self) -> np.ndarray:
        """Every id of the version, sorted (a read-only view of the mapped index)."""
        return self.index.ids if self.index is not None else np.zeros(0, np.int64)


def _default_row(missing: Any, name: str, schema: Schema) -> np.ndarray:
    value = missing[name] if isinstance(missing, dict) else missing
    col = schema[name]
    t = torch.empty(col.shape, dtype=col.dtype)
    t.copy_(torch.as_tensor(value))  # broadcasts a scalar
    return t.reshape(-1).view(torch.uint8).numpy()
