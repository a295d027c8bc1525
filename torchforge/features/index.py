"""A version's id index: sorted int64 ids -> (shard number, row), memory-mapped, plus a bucket directory.

The index is an ordinary safetensors file of four 1-D tensors:

* ``id`` (I64 [n]): every id of the version, strictly increasing;
* ``shard`` (I32 [n]) and ``row`` (I64 [n]): where the id's row lies (shard number in the manifest's
  list, row in that shard);
* ``dir`` (I64 [buckets + 1]): ``dir[b]`` is the first position whose id has bucket ``>= b``, where the
  bucket of an id is ``(id - base) >> shift`` (``base``, ``shift`` and ``steps`` in ``__metadata__``).

A lookup of a batch of ids narrows each id to its bucket through ``dir`` (one gather) and then
counts, in ``steps`` rounds over the whole batch at once, how many ids of the bucket are smaller
(binary lifting: every round is one gather and three element-wise numpy operations, and the memory
loads of a round are independent of each other, where ``np.searchsorted`` probes one id after the
other). ``shift`` is chosen so that buckets hold about two ids on average; ``steps`` is the bit length
of the fullest bucket, so skewed ids cost more rounds but never a wrong answer. Where ``steps`` is
large the batch is sorted and handed to ``np.searchsorted`` instead, and a batch of a few ids (a
DataLoader batch's, in a join) goes to ``np.searchsorted`` as it is: for 64 ids the rounds' dozen numpy
calls cost more than 64 binary searches.

Every process maps the file read-only: nothing is rebuilt per process and no Python dict of ids
exists. Values read from the file are never trusted for memory safety: positions are clipped to the
array and a hit is only a hit where ``id[pos]`` equals the id asked for.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from torchforge.checkpoint.digest import BlockDigest
from torchforge.errors import CorruptShardError
from torchforge.features.layout import open_regular, temp_name
from torchforge.formats.safetensors import as_bytes, fsync_dir, parse_header, plan, write_all

__all__ = ["IdIndex", "last_writes", "merge", "overlay", "write_index"]

INDEX_FORMAT = "torchforge-feature-index"
_BUCKET_FILL = 2  # ids per bucket on average
_MAX_ROUNDS = 10  # beyond this many rounds np.searchsorted is faster
_FEW = 256  # batches of at most this many ids are searched one by one (np.searchsorted)
_SPEC = {"id": ("I64", np.int64), "shard": ("I32", np.int32), "row": ("I64", np.int64), "dir": ("I64", np.int64)}


def last_writes(ids: np.ndarray, shard: np.ndarray, row: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique ``ids`` with the location of each id's last occurrence (the last write wins)."""
    order = np.argsort(ids)  # the fast unstable sort: right unless an id repeats
    s = ids[order]
    last = np.ones(len(s), dtype=bool)
    np.not_equal(s[1:], s[:-1], out=last[:-1])
    if not last.all():  # repeats: the stable order says which occurrence was written last
        order = np.argsort(ids, kind="stable")
        s = ids[order]
    pick = order[last]  # the last of each run of equal ids is the last written
    return s[last], shard[pick], row[pick]


def merge(ids: np.ndarray, shard: np.ndarray, row: np.ndarray, new_ids: np.ndarray, new_shard: np.ndarray,
          new_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A parent index overlaid by the sorted unique ``new_ids`` (see :func:`last_writes`): an id in
    ``new_ids`` takes its new location, every other id keeps its parent location. Both inputs are
    sorted runs, which a stable sort merges in linear time; an id in both is then a pair, parent first."""
    every = np.concatenate([ids, new_ids])
    order = np.argsort(every, kind="stable")
    s = every[order]
    keep = np.ones(len(s), dtype=bool)
    np.not_equal(s[1:], s[:-1], out=keep[:-1])  # of an id in both, keep the second (new) one
    if not keep.all():
        order, s = order[keep], s[keep]
    return (s, np.concatenate([shard, new_shard]).astype(np.int32, copy=False)[order],
            np.concatenate([row, new_row]).astype(np.int64, copy=False)[order])


def overlay(ids: np.ndarray, shard: np.ndarray, row: np.ndarray, new_ids: np.ndarray, new_shard: np.ndarray,
            new_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A parent index overlaid by new rows: an id in ``new_ids`` takes its last new location (last write
    wins), every other id keeps its parent location. Returns sorted ``(ids, shard, row)``."""
    return merge(ids, shard, row, *last_writes(new_ids, new_shard, new_row))


def _directory(ids: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    """(dir, base, shift, steps) of sorted unique ids."""
    n = len(ids)
    base = int(ids[0])
    span = int(ids[-1]) - base
    target = max(1, n // _BUCKET_FILL)
    shift = max(0, (span // target).bit_length())
    while shift and (span >> (shift - 1)) + 1 <= target:
        shift -= 1
    shift = min(shift, 63)
    off = ids.view(np.uint64) - np.uint64(base % 2**64)  # wraps exactly as ids - base does in 64 bits
    nb = (span >> shift) + 1
    counts = np.bincount((off >> np.uint64(shift)).view(np.int64), minlength=nb)  # ids per bucket
    d = np.zeros(nb + 1, np.int64)
    np.cumsum(counts, out=d[1:])
    steps = int(counts.max()).bit_length()
    return d, base, shift, steps


def write_index(path: str, ids: np.ndarray, shard: np.ndarray, row: np.ndarray) -> tuple[int, str]:
    """Write (and fsync) the index of sorted unique ``ids``; returns its size and digest (computed from
    memory on the way, so the file is never read back)."""
    d, base, shift, steps = _directory(ids)
    meta = {"format": INDEX_FORMAT, "version": "1", "base": str(base), "shift": str(shift), "steps": str(steps)}
    tensors = {"id": torch.from_numpy(np.ascontiguousarray(ids, np.int64)),
               "shard": torch.from_numpy(np.ascontiguousarray(shard, np.int32)),
               "row": torch.from_numpy(np.ascontiguousarray(row, np.int64)), "dir": torch.from_numpy(d)}
    head, layout = plan(tensors, meta)
    views = [memoryview(head)] + [as_bytes(t) for _, t, _ in layout]
    digest = BlockDigest()
    folder = os.path.dirname(os.path.abspath(path))
    tmp = temp_name(folder, "index", ".safetensors")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, views, 0)
        for v in views:
            digest.update(v)
        os.fsync(fd)
        os.close(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.rename(tmp, path)
    fsync_dir(folder)
    return sum(len(v) for v in views), digest.hexdigest()


class IdIndex:
    """One index file, mapped read-only. ``ids``, ``shard``, ``row`` are numpy views of the map.

    Raises:
        CorruptShardError: the file is not an index (tensors, dtypes, lengths or metadata disagree).
        SafetensorsError: the file is not valid safetensors.
    """

    def __init__(self, path: str, expect_rows: int, expect_bytes: int):
        self.path = path
        try:
            f = open_regular(path)
        except FileNotFoundError:
            raise CorruptShardError("the index the manifest lists is missing", path=path) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != expect_bytes:
                raise CorruptShardError(f"the index has {size} bytes, the manifest says {expect_bytes} "
                                        f"({'truncated' if size < expect_bytes else 'grown'})", path=path,
                                        offset=min(size, expect_bytes))
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        n, infos, meta = parse_header(memoryview(self._mm), size, path)
        start = 8 + n
        arrays = {}
        for name, (code, dt) in _SPEC.items():
            info = infos.get(name)
            if info is None or info.dtype != code or len(info.shape) != 1:
                raise CorruptShardError(f"an index needs a 1-D {code} tensor {name!r}, found {info}", path=path)
            arrays[name] = np.frombuffer(self._mm, dtype=dt, count=info.shape[0], offset=start + info.start)
            if name == "id":
                self._id_offset = start + info.start
        self.ids, self.shard, self.row, self.dir = arrays["id"], arrays["shard"], arrays["row"], arrays["dir"]
        self.n = len(self.ids)
        if self.n != expect_rows or len(self.shard) != self.n or len(self.row) != self.n:
            raise CorruptShardError(f"index lengths id={self.n}, shard={len(self.shard)}, row={len(self.row)}; "
                                    f"the manifest says {expect_rows} rows", path=path)
        try:
            if (meta or {}).get("format") != INDEX_FORMAT:
                raise ValueError("format")
            self.base, self.shift, self.steps = (int(meta[k]) for k in ("base", "shift", "steps"))
            if not (-2**63 <= self.base < 2**63 and 0 <= self.shift < 64 and 0 <= self.steps <= 64):
                raise ValueError("range")
        except (KeyError, ValueError):
            raise CorruptShardError(f"index metadata {meta!r} lacks format={INDEX_FORMAT!r} and int base, "
                                    "shift (0..63), steps (0..64)", path=path) from None
        if len(self.dir) < 2:
            raise CorruptShardError("the bucket directory needs at least 2 entries", path=path)
        self._sorted = False  # the ids were checked to increase strictly (at the first miss)

    def lookup(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the int64 ids ``q`` in the index and whether each was found."""
        n = self.n
        if n == 0 or len(q) == 0:
            return np.zeros(len(q), np.int64), np.zeros(len(q), bool)
        rounds = False  # (the searches below trust nothing but the sorted ids; the rounds trust the metadata)
        if len(q) <= _FEW:  # a few ids: one binary search each costs less than the rounds' numpy calls
            pos = self.ids.searchsorted(q)
        elif self.steps > _MAX_ROUNDS:
            order = np.argsort(q, kind="stable")
            pos = np.empty(len(q), np.int64)
            pos[order] = self.ids.searchsorted(q[order])  # sorted keys: each search starts at the last
        else:
            nb = len(self.dir) - 1
            b = (q.view(np.uint64) - np.uint64(self.base % 2**64)) >> np.uint64(self.shift)
            np.minimum(b, np.uint64(nb - 1), out=b)  # outside the range: any bucket, the id check says no
            lo = self.dir.take(b.view(np.int64), mode="clip")
            np.clip(lo, 0, n, out=lo)  # a lying directory narrows wrongly but never out of bounds
            # count the ids of the bucket below q, one bit per round from the highest: ids past the bucket
            # are above q (sorted), so the count never runs past it and needs no upper bound
            first = lo - 1
            count = np.zeros(len(q), np.int64)
            for bit in range(self.steps - 1, -1, -1):
                t = count + (1 << bit)
                below = self.ids.take(first + t, mode="clip") < q
                count = np.where(below, t, count)
            pos = lo + count
            rounds = True
        np.minimum(pos, n - 1, out=pos)
        found = self.ids.take(pos, mode="clip") == q
        if not found.all():
            if not self._sorted:
                self._check_sorted()
            if rounds:
                self._check_misses(q[~found])
        return pos, found

    def _check_sorted(self) -> None:
        """Every search trusts the ids to increase strictly: before the first miss is reported (or given
        the ``missing=`` default), check that they do, once per process, in pieces (a hit needs no check: its
        row holds its id, which the reader compares). A damaged id that keeps the order is only found by the
        index's digest (``torchforge verify``)."""
        ids, piece = self.ids, 1 << 20
        for a in range(0, self.n - 1, piece):
            b = min(a + piece + 1, self.n)
            bad = (ids[a + 1:b] <= ids[a:b - 1]).nonzero()[0]
            if len(bad):
                k = a + int(bad[0]) + 1
                raise CorruptShardError(f"the index's ids do not increase at position {k} ({int(ids[k - 1])} then "
                                        f"{int(ids[k])}): it is damaged", path=self.path,
                                        offset=self._id_offset + 8 * k)
        self._sorted = True

    def _check_misses(self, miss: np.ndarray) -> None:
        """The rounds trust the directory and ``steps`` of the file: an id they miss is searched again
        in the sorted ids alone, so a damaged directory or ``steps`` is an error, never a present id
        reported missing (or, with ``missing=``, silently given the default row)."""
        pos = np.minimum(self.ids.searchsorted(miss), self.n - 1)
        there = self.ids.take(pos) == miss
        if there.any():
            raise CorruptShardError(f"the bucket directory or steps={self.steps} in the index's metadata miss "
                                    f"id {int(miss[there][0])}, which the index holds", path=self.path)

    def close(self) -> None:
        self.ids = self.shard = self.row = self.dir = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the map goes with it
            pass
