"""The read path: one version of a store, its index and shards mapped, gathering rows for a batch of ids.

A :class:`Snapshot` maps the version's index at once and each shard the first time a lookup needs it
(read-only ``mmap``; the header validated by the safetensors parser, the size against the manifest,
the tensors against the schema). :meth:`Snapshot.gather` finds the batch's positions in the index (see
:mod:`torchforge.features.index`), checks each location it will read (shard number and row inside the
shard: a lying index is a CorruptShardError, never a read outside a file) and copies rows with
``torch.index_select`` (one memcpy per row) into output tensors made by
:func:`torchforge.loader.collate.empty`, which in a torchforge DataLoader worker are the batch's
shared-memory slab. Rows of one shard go straight into the output when the whole batch lies in that
shard; otherwise each shard's rows are taken together into a scratch block (in shard order) and one
more ``index_select`` puts them in the batch's order.
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


class _Shard:
    """One shard mapped: ``cols[name]`` is a uint8 ``(rows, row_bytes)`` tensor view of the column."""

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
            # private and writable (as SafetensorsFile): torch takes the views without a copy or a
            # warning, and a stray write would copy the page, never reach the file
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        n, infos, _ = parse_header(memoryview(self._mm), size, path)
        self.rows = entry.rows
        want = {"id": ("I64", (entry.rows,), 8)}
        want.update({c: (col.code, (entry.rows, *col.shape), col.row_bytes) for c, col in schema.items()})
        self.cols: dict[str, torch.Tensor] = {}
        for name, (code, shape, width) in want.items():
            info = infos.get(name)
            if info is None or info.dtype != code or info.shape != shape:
                raise CorruptShardError(f"tensor {name!r} should be {code} {list(shape)} (manifest rows and "
                                        f"schema), the shard has {info}", path=path, offset=8)
            count = info.end - info.start
            a = torch.frombuffer(self._mm, dtype=torch.uint8, count=count, offset=8 + n + info.start) if count \
                else torch.zeros(0, dtype=torch.uint8)
            self.cols[name] = a.view(entry.rows, width)


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
        out = {c: collate.empty((n, *self.schema[c].shape), self.schema[c].dtype) for c in columns}
        views = {c: _rows_view(t, n) for c, t in out.items()}
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
            for c in columns:
                views[c].numpy()[miss] = _default_row(missing, c, self.schema)
            pos = pos[hit]
        if len(pos):
            self._copy(pos, hit, views, columns)
        return out

    def _copy(self, pos: np.ndarray, hit: np.ndarray | None, views: dict[str, torch.Tensor],
              columns: list[str]) -> None:
        sh = self.index.shard[pos]
        rw = self.index.row[pos]
        k_lo, k_hi = int(sh.min()), int(sh.max())
        if k_lo < 0 or k_hi >= len(self._shards):
            raise CorruptShardError(f"the index names shard {k_lo if k_lo < 0 else k_hi}; the manifest lists "
                                    f"{len(self._shards)}", path=self.index.path)
        if k_lo == k_hi:  # one shard: rows go straight into the output
            rows = self._checked_rows(k_lo, rw)
            for c in columns:
                src = self.shard(k_lo).cols[c]
                if hit is None:
                    torch.index_select(src, 0, rows, out=views[c])
                else:
                    views[c].numpy()[hit] = torch.index_select(src, 0, rows).numpy()
            return
        # several shards: take each shard's rows together (in shard order), then put them in place
        order = np.argsort(sh.astype(np.int16) if k_hi < 2**15 else sh, kind="stable")
        sh_sorted = sh[order]
        rw_sorted = rw[order]
        cuts = [0, *(np.flatnonzero(sh_sorted[1:] != sh_sorted[:-1]) + 1).tolist(), len(order)]
        groups = [(int(sh_sorted[a]), a, b, self._checked_rows(int(sh_sorted[a]), rw_sorted[a:b]))
                  for a, b in itertools.pairwise(cuts)]
        inv = np.empty(len(order), np.int64)
        inv[order] = np.arange(len(order))
        inv_t = torch.from_numpy(inv)
        for c in columns:
            tmp = torch.empty((len(order), views[c].shape[1]), dtype=torch.uint8)
            for k, a, b, rows in groups:
                torch.index_select(self.shard(k).cols[c], 0, rows, out=tmp[a:b])
            if hit is None:
                torch.index_select(tmp, 0, inv_t, out=views[c])
            else:
                views[c].numpy()[hit] = tmp.numpy()[inv]

    def _checked_rows(self, k: int, rows: np.ndarray) -> torch.Tensor:
        n = self.shard(k).rows
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise CorruptShardError(f"the index points at row {int(rows.max())} of shard {k}, which has {n} rows",
                                    path=self.index.path)
        return torch.from_numpy(rows)

    def ids(self) -> np.ndarray:
        """Every id of the version, sorted (a read-only view of the mapped index)."""
        return self.index.ids if self.index is not None else np.zeros(0, np.int64)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """A uint8 ``(n, row_bytes)`` view of an output tensor."""
    if t.numel() == 0:
        return torch.zeros((n, 0), dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8).view(n, -1)


def _default_row(missing: Any, name: str, schema: Schema) -> np.ndarray:
    value = missing[name] if isinstance(missing, dict) else missing
    col = schema[name]
    t = torch.empty(col.shape, dtype=col.dtype)
    t.copy_(torch.as_tensor(value))  # broadcasts a scalar
    return t.reshape(-1).view(torch.uint8).numpy()
