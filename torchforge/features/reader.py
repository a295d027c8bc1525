"""The read path: one version of a store, its index and shards mapped, gathering rows for a batch of ids.

A :class:`Snapshot` maps the version's index at once and each shard the first time a lookup needs it
(read-only ``mmap``; the header validated by the safetensors parser, the size against the manifest,
the tensors against the schema). :meth:`Snapshot.gather` finds the batch's positions in the index (see
:mod:`torchforge.features.index`), checks each location it will read (shard number and row inside the
shard: a lying index is a CorruptShardError, never a read outside a file) and copies rows into output
tensors made over :func:`torchforge.loader.collate.empty_bytes`, which in a torchforge DataLoader worker are the
batch's shared-memory slab. The shard's own ``id`` of every row read is gathered too and must be the id
asked for, so a manifest or index that points at the wrong rows is a CorruptShardError, never wrong data.

Every copy is one ``np.take`` per column over the mapped column viewed as one item per row (``uint32``
for a 4-byte row, ``V512`` for a 512-byte one): a single vectorised gather, with ``mode="clip"`` since
the rows are checked already (the default mode buffers the whole output to stay atomic). numpy runs
it on the calling thread; torch's ``index_select`` would fan out to its intra-op threads, which on a
busy machine makes it many times slower, not faster.

A batch's rows lie in many shards (every commit adds some), and one take needs one array. So the
shards of a version are mapped side by side in one reserved range of addresses (:class:`_Region`),
each at its own slot (a shard of 2 MiB or more on a 2 MiB boundary: the huge pages the writer lays out
stay huge pages here; a smaller one on the next page):
a column is then one array of row items over the whole range, and a row's item number is its shard's
first item for that column plus its row. The rows go straight into the output in the batch's order.
A column whose rows do not start on a multiple of its row width in some shard (an odd width such as
3 bytes) takes the other way for the batches that touch that shard: each shard's rows are taken
together into a scratch block (in shard order) and one more take puts them in the batch's order.
So does every column where the range cannot be reserved (a manifest lying about sizes, ``ulimit -v``):
each shard then gets a map of its own, and a lie is found when its shard opens, as a CorruptShardError.
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchforge._vmem import HUGE_PAGE, map_at, reserve, round_up, unmap_with
from torchforge.errors import CorruptShardError, TorchforgeError
from torchforge.features.index import IdIndex
from torchforge.features.layout import (
    Manifest,
    Schema,
    ShardEntry,
    as_values,
    check_cast,
    column_spans,
    open_regular,
)
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
    :func:`_items`); None for a column of empty rows. ``place`` (a snapshot's) maps the file into the
    snapshot's :class:`_Region` and returns its bytes there; without it the shard gets its own map."""

    def __init__(self, root: str, entry: ShardEntry, schema: Schema,
                 place: Callable[[int, int, str], np.ndarray] | None = None):
        path = os.path.join(root, entry.file)
        self.path = path
        try:
            f = open_regular(path)
        except FileNotFoundError:
            raise CorruptShardError("a shard the manifest lists is missing", path=path) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.bytes:
                raise CorruptShardError(f"the shard has {size} bytes, the manifest says {entry.bytes} "
                                        f"({'truncated' if size < entry.bytes else 'grown'})", path=path,
                                        offset=min(size, entry.bytes))
            if place is None:
                buf = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
            else:
                buf = place(f.fileno(), size, path)
        n, infos, _ = parse_header(memoryview(buf), size, path)
        self.rows = entry.rows
        self.offsets: dict[str, int] = {}  # file offset of each column's first row
        want = {"id": ("I64", (entry.rows,), 8)}
        want.update({c: (col.code, (entry.rows, *col.shape), col.row_bytes) for c, col in schema.items()})
        self.cols: dict[str, np.ndarray | None] = {}
        spans = column_spans(schema, entry.rows)  # the writer's layout: a header that moves a column lies
        for name, (code, shape, width) in want.items():
            info = infos.get(name)
            if info is None or info.dtype != code or info.shape != shape:
                raise CorruptShardError(f"tensor {name!r} should be {code} {list(shape)} (manifest rows and "
                                        f"schema), the shard has {info}", path=path, offset=8)
            if info.start != spans[name][0]:
                raise CorruptShardError(f"tensor {name!r} starts at byte {info.start} of the data, where the "
                                        f"store's layout has byte {spans[name][0]}", path=path,
                                        offset=8 + n + info.start)
            at = self.offsets[name] = 8 + n + info.start
            count = info.end - info.start
            self.cols[name] = _items(buf[at:at + count].reshape(entry.rows, width), width) if count else None


class _Region:
    """The shards of a version side by side in one reserved range of addresses: shard ``k`` is mapped
    (read-only, when first opened) at ``base + slots[k]``; a shard of 2 MiB or more starts on a
    multiple of 2 MiB (its huge pages stay huge pages here), a smaller one on the next page, so the
    range is about as large as the shards. ``column(width)`` is the whole range as one array of
    ``width``-byte items. Addresses of shards not opened are reserved but unmapped; a row is only read
    after the shard is opened and the row checked against its count. The range is unmapped when the
    last array over it is garbage collected.

    Raises:
        OSError: the address space could not be reserved (a lying manifest's sizes, ``ulimit -v``);
            the snapshot then maps each shard on its own (see :class:`Snapshot`).
    """

    def __init__(self, sizes: list[int]):
        self.slots, end = [], 0
        for size in sizes:
            start = round_up(end, HUGE_PAGE if size >= HUGE_PAGE else mmap.PAGESIZE)
            self.slots.append(start)
            end = start + round_up(size, mmap.PAGESIZE)
        self.size = end
        self.base, raw, raw_size = reserve(self.size, HUGE_PAGE)
        buf = (ctypes.c_uint8 * self.size).from_address(self.base)
        unmap_with(buf, raw, raw_size)
        self._bytes = np.frombuffer(buf, np.uint8)
        self._bytes.flags.writeable = False
        self._columns: dict[int, np.ndarray] = {}

    def place(self, k: int, fd: int, size: int, path: str) -> np.ndarray:
        """Map shard ``k``'s file (``size`` bytes) at its slot; returns its bytes there."""
        map_at(self.base + self.slots[k], size, mmap.PROT_READ, mmap.MAP_SHARED, fd, path)
        return self._bytes[self.slots[k]:self.slots[k] + size]

    def column(self, width: int) -> np.ndarray:
        a = self._columns.get(width)
        if a is None:
            a = self._columns[width] = _items(self._bytes[:self.size - self.size % width].reshape(-1, width), width)
        return a


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
        count = len(manifest.shards) if manifest else 0
        self._shards: list[_Shard | None] = [None] * count
        self._region: _Region | None = None
        if count:
            try:
                self._region = _Region([e.bytes for e in manifest.shards])
            except (OSError, OverflowError):  # no room for it: every column takes the grouped path
                pass
        self._rows_of = np.zeros(count, np.int64)  # rows of each opened shard
        # per column (and "id"): the region item number of each opened shard's first row, -1 where it is not one
        self._width = {"id": 8, **{c: col.row_bytes for c, col in schema.items() if col.row_bytes}}
        self._first = {c: np.full(count, -1, np.int64) for c in self._width}

    def shard(self, k: int) -> _Shard:
        s = self._shards[k]
        if s is None:
            region = self._region
            s = _Shard(self.root, self.manifest.shards[k], self.schema,
                       None if region is None else lambda fd, size, path: region.place(k, fd, size, path))
            for c, first in self._first.items() if region else ():
                at, width = region.slots[k] + s.offsets[c], self._width[c]
                first[k] = at // width if at % width == 0 else -1
            self._shards[k] = s
            self._rows_of[k] = s.rows  # last: a thread that sees the count finds the rest in place
        return s

    def gather(self, q: np.ndarray, columns: list[str], missing: Any) -> dict[str, torch.Tensor]:
        n = len(q)
        out, items = {}, {}
        for c in columns:
            col = self.schema[c]
            if not (col.row_bytes and n):
                out[c] = torch.empty((n, *col.shape), dtype=col.dtype)
                continue
            buf = collate.empty_bytes(n * col.row_bytes)
            out[c] = torch.from_numpy(buf).view(col.dtype).view((n, *col.shape))
            items[c] = buf.view(_item(col.row_bytes))  # the output as one item per row (see _items)
        if self.index is not None:
            pos, found = self.index.lookup(q)
        else:
            pos, found = np.zeros(n, np.int64), np.zeros(n, bool)
        hit = None if found.all() else found.nonzero()[0]
        if hit is not None:
            miss = (~found).nonzero()[0]
            if missing is None:
                raise MissingIdsError(f"{len(miss)} of {n} ids are not in version {self.version}: "
                                      f"{q[miss[:_SHOWN]].tolist()}{' ...' if len(miss) > _SHOWN else ''}; "
                                      "pass missing= to fill a default", ids=q[miss].tolist(),
                                      version=self.version, path=self.root)
            for c, a in items.items():
                a[miss] = _items(_default_row(missing, c, self.schema)[None], self.schema[c].row_bytes)[0]
            pos = pos[hit]
        if len(pos) and items:
            got = np.empty(n, np.uint64)  # the ids the rows read hold: each must be the id asked for
            self._copy(pos, hit, {**items, "id": got})
            asked = q.view(np.uint64)
            wrong = (got != asked).nonzero()[0] if hit is None else hit[got[hit] != asked[hit]]
            if len(wrong):
                self._wrong_row(q, got, pos if hit is None else None, hit, int(wrong[0]))
        return out

    def _wrong_row(self, q: np.ndarray, got: np.ndarray, pos: np.ndarray | None, hit: np.ndarray | None,
                   j: int) -> None:
        p = int(pos[j]) if pos is not None else int(self.index.lookup(q[j:j + 1])[0][0])
        k, r = int(self.index.shard[p]), int(self.index.row[p])
        raise CorruptShardError(f"the index puts id {int(q[j])} at row {r} of shard {k}, and that row holds id "
                                f"{int(got[j].view(np.int64))}: the manifest's list of shards or the index "
                                f"{self.index.path} lies", path=self.shard(k).path)

    def _copy(self, pos: np.ndarray, hit: np.ndarray | None, items: dict[str, np.ndarray]) -> None:
        sh = self.index.shard.take(pos, mode="clip")  # pos < len(index), from lookup
        rw = self.index.row.take(pos, mode="clip")
        count = len(self._shards)
        if int(sh.view(np.uint32).max()) >= count:  # (one reduction: a negative number is a huge unsigned one)
            bad = int(sh[(sh < 0) | (sh >= count)][0])
            raise CorruptShardError(f"the index names shard {bad}; the manifest lists {count}", path=self.index.path)
        if count == 1:  # one shard (a store of one commit): its own columns, no region arithmetic
            self._check_rows(0, rw)
            cols = self.shard(0).cols
            for c, dst in items.items():
                if hit is None:
                    cols[c].take(rw, out=dst, mode="clip")
                else:
                    dst[hit] = cols[c].take(rw, mode="clip")
            return
        # a shard not opened yet counts 0 rows here, so every row of it fails this check and opens it
        if (rw.view(np.uint64) >= self._rows_of.take(sh).view(np.uint64)).any():
            for k in np.unique(sh).tolist():
                self.shard(k)
                self._check_rows(k, rw[sh == k])
        grouped = {}
        for c, dst in items.items():
            at = self._first[c].take(sh)
            if int(at.min()) < 0:  # not aligned in some shard: see the module's docstring
                grouped[c] = dst
                continue
            at += rw
            col = self._region.column(dst.itemsize)
            if hit is None:
                col.take(at, out=dst, mode="clip")
            else:
                dst[hit] = col.take(at, mode="clip")
        if grouped:
            self._copy_grouped(sh, rw, hit, grouped)

    def _copy_grouped(self, sh: np.ndarray, rw: np.ndarray, hit: np.ndarray | None,
                      items: dict[str, np.ndarray]) -> None:
        """Each shard's rows taken together (in shard order), then put in the batch's order."""
        order = np.argsort(sh.astype(np.int16) if len(self._shards) <= 2**15 else sh, kind="stable")
        sh_sorted = sh[order]
        rw_sorted = rw[order]
        cuts = [0, *((sh_sorted[1:] != sh_sorted[:-1]).nonzero()[0] + 1).tolist(), len(order)]
        groups = [(self.shard(int(sh_sorted[a])).cols, a, b) for a, b in itertools.pairwise(cuts)]
        inv = np.empty(len(order), np.int64)
        inv[order] = np.arange(len(order))
        for c, dst in items.items():
            tmp = np.empty(len(order), dst.dtype)
            for cols, a, b in groups:
                cols[c].take(rw_sorted[a:b], out=tmp[a:b], mode="clip")
            if hit is None:
                tmp.take(inv, out=dst, mode="clip")
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
    try:
        v = as_values(value)
        t.copy_(v)  # broadcasts a scalar
        check_cast(v.expand(t.shape), t, name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"missing= for column {name!r} (rows of shape {tuple(col.shape)}, {col.dtype}) "
                         f"does not fit: {e}") from None
    return t.reshape(-1).view(torch.uint8).numpy()
