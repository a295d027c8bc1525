"""A version's id index: sorted int64 ids -> (shard number, row), memory-mapped, plus a bucket directory.

The index is an ordinary safetensors file of four 1-D tensors:

* ``id`` (I64 [n]): every id of the version, strictly increasing;
* ``shard`` (I32 [n]) and ``row`` (I64 [n]): where the id's row lies (shard number in the manifest's
  list, row in that shard);
* ``dir`` (I64 [buckets + 1]): ``dir[b]`` is the first position whose id has bucket ``>= b``, where the
  bucket of an id is ``(id - base) >> shift`` (``base``, ``shift`` and ``steps`` in ``__metadata__``).

A lookup of a batch of ids narrows each id to its bucket's range through ``dir`` (one gather) and then
runs ``steps`` rounds of a binary search over the whole batch at once: every round is a handful of numpy
operations on the batch, whose memory loads are independent of each other (``np.searchsorted`` probes
one id after the other). ``shift`` is chosen so that buckets hold about two ids on average; ``steps``
is the bit length of the fullest bucket, so skewed ids cost more rounds but never a wrong answer. Where
``steps`` is large the batch is sorted and handed to ``np.searchsorted`` instead.

Every process maps the file read-only: nothing is rebuilt per process and no Python dict of ids
exists. Values read from the file are never trusted for memory safety: positions are clipped to the
array and a hit is only a hit where ``id[pos]`` equals the id asked for.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from torchforge.errors import CorruptShardError
from torchforge.formats.safetensors import parse_header, save_safetensors

__all__ = ["IdIndex", "overlay", "write_index"]

INDEX_FORMAT = "torchforge-feature-index"
_BUCKET_FILL = 2  # ids per bucket on average
_MAX_ROUNDS = 10  # beyond this many rounds np.searchsorted is faster
_SPEC = {"id": ("I64", np.int64), "shard": ("I32", np.int32), "row": ("I64", np.int64), "dir": ("I64", np.int64)}


def overlay(ids: np.ndarray, shard: np.ndarray, row: np.ndarray, new_ids: np.ndarray, new_shard: np.ndarray,
            new_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A parent index overlaid by new rows: an id in ``new_ids`` takes its last new location (last write
    wins), every other id keeps its parent location. Returns sorted ``(ids, shard, row)``."""
    order = np.argsort(new_ids, kind="stable")
    s = new_ids[order]
    last = np.ones(len(s), dtype=bool)
    last[:-1] = s[1:] != s[:-1]  # the last of each run of equal ids is the last written
    pick = order[last]
    nid, nsh, nrw = s[last], new_shard[pick], new_row[pick]
    if len(ids) and len(nid):
        pos = np.minimum(np.searchsorted(nid, ids), len(nid) - 1)
        keep = nid[pos] != ids
        ids, shard, row = ids[keep], shard[keep], row[keep]
    all_ids = np.concatenate([ids, nid])
    order = np.argsort(all_ids, kind="stable")  # two sorted runs: timsort merges them in linear time
    return all_ids[order], np.concatenate([shard, nsh])[order], np.concatenate([row, nrw])[order]


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
    buckets = off >> np.uint64(shift)
    nb = (span >> shift) + 1
    d = np.searchsorted(buckets, np.arange(nb + 1, dtype=np.uint64)).astype(np.int64)
    steps = int(np.diff(d).max()).bit_length()
    return d, base, shift, steps


def write_index(path: str, ids: np.ndarray, shard: np.ndarray, row: np.ndarray) -> None:
    """Write (and fsync) the index of sorted unique ``ids``."""
    d, base, shift, steps = _directory(ids)
    meta = {"format": INDEX_FORMAT, "version": "1", "base": str(base), "shift": str(shift), "steps": str(steps)}
    tensors = {"id": torch.from_numpy(np.ascontiguousarray(ids, np.int64)),
               "shard": torch.from_numpy(np.ascontiguousarray(shard, np.int32)),
               "row": torch.from_numpy(np.ascontiguousarray(row, np.int64)), "dir": torch.from_numpy(d)}
    save_safetensors(tensors, path, meta, fsync=True)


class IdIndex:
    """One index file, mapped read-only. ``ids``, ``shard``, ``row`` are numpy views of the map.

    Raises:
        CorruptShardError: the file is not an index (tensors, dtypes, lengths or metadata disagree).
        SafetensorsError: the file is not valid safetensors.
    """

    def __init__(self, path: str, expect_rows: int, expect_bytes: int):
        self.path = path
        with open(path, "rb") as f:
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

    def lookup(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the int64 ids ``q`` in the index and whether each was found."""
        n = self.n
        if n == 0 or len(q) == 0:
            return np.zeros(len(q), np.int64), np.zeros(len(q), bool)
        if self.steps > _MAX_ROUNDS:
            order = np.argsort(q, kind="stable")
            pos = np.empty(len(q), np.int64)
            pos[order] = np.searchsorted(self.ids, q[order])  # sorted keys: each search starts at the last
        else:
            nb = len(self.dir) - 1
            b = (q.view(np.uint64) - np.uint64(self.base % 2**64)) >> np.uint64(self.shift)
            np.minimum(b, np.uint64(nb - 1), out=b)  # outside the range: any bucket, the id check says no
            b = b.view(np.int64)
            lo, hi = np.take(self.dir, b), np.take(self.dir, b + 1)
            np.clip(lo, 0, n, out=lo)  # a lying directory narrows wrongly but never out of bounds
            np.clip(hi, 0, n, out=hi)
            last = n - 1
            for _ in range(self.steps):
                mid = lo + hi
                mid >>= 1
                np.minimum(mid, last, out=mid)
                less = np.take(self.ids, mid) < q
                active = lo < hi
                lo = np.where(less & active, mid + 1, lo)
                hi = np.where(active & ~less, mid, hi)
            pos = lo
        np.minimum(pos, n - 1, out=pos)
        return pos, np.take(self.ids, pos) == q

    def close(self) -> None:
        self.ids = self.shard = self.row = self.dir = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the map goes with it
            pass
