"""``torchforge inspect`` and ``torchforge verify`` on a feature store (the CLI's detection branch calls
:func:`is_store`, then :func:`store_info` or :func:`verify_store`)."""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from torchforge.errors import CorruptShardError, TorchforgeError
from torchforge.features.index import IdIndex, _directory
from torchforge.features.layout import (
    SCHEMA_FILE,
    VERSIONS,
    PrunedError,
    list_versions,
    live_versions,
    read_manifest,
)
from torchforge.features.reader import _Shard
from torchforge.features.store import FeatureStore
from torchforge.features.writer import file_digest

__all__ = ["is_store", "store_info", "verify_store"]


def is_store(path: str) -> bool:
    """A folder with a feature store's ``schema.json`` and ``versions/``."""
    return os.path.isfile(os.path.join(path, SCHEMA_FILE)) and os.path.isdir(os.path.join(path, VERSIONS))


def store_info(path: str) -> dict[str, Any]:
    """What ``inspect`` prints: the newest version, its rows, columns and files."""
    store = FeatureStore(path)
    m = store._snap.manifest
    files = ([m.index] if m and m.index else []) + list(m.shards if m else [])
    ids = store.ids()
    return {
        "path": path,
        "format": "feature-store",
        "version": store.version,
        "versions": len(live_versions(store.path)),
        "rows": len(store),
        "id range": [int(ids[0]), int(ids[-1])] if len(ids) else None,
        "columns": {k: f"{str(c.dtype).removeprefix('torch.')} {list(c.shape)}" for k, c in store.schema.items()},
        "files": len(files),
        "bytes": sum(f.bytes for f in files),
        "shards": [{"file": f.file, "bytes": f.bytes} for f in files],
    }


def verify_store(path: str) -> tuple[int, list[str]]:
    """Check every version: manifests, shard and index sizes, headers and digests, and that each index
    is sorted, unique, in range, agrees with its bucket directory and points every id at a row holding
    that id. Returns (rows checked, problems)."""
    problems: list[str] = []
    checked = 0
    try:
        store = FeatureStore(path)
        versions = list_versions(store.path)
    except TorchforgeError as e:
        return 0, [str(e)]
    digests: dict[str, str] = {}
    # (file, bytes, rows) checked against a manifest entry: its rows' ids, copied (a shard kept mapped would
    # hold a file descriptor, and a store's versions may name more shards than a process may open)
    opened: dict[tuple[str, int, int], _Ids] = {}
    for v in versions:
        try:
            try:
                m = read_manifest(store.path, v)
            except PrunedError:
                continue  # (its files are gone with it)
            for entry in (*m.shards, *([m.index] if m.index else [])):
                f = os.path.join(store.path, entry.file)
                if entry in m.shards and (entry.file, entry.bytes, entry.rows) not in opened:
                    # size, header, tensors against this entry and schema
                    shard = _Shard(store.path, entry, m.schema)
                    ids = shard.cols["id"]
                    opened[(entry.file, entry.bytes, entry.rows)] = _Ids(
                        shard.path, shard.rows, np.array(ids.view(np.int64)) if ids is not None else None)
                    del shard, ids
                if entry.file not in digests:
                    digests[entry.file] = file_digest(f) if os.path.isfile(f) else "missing"
                if digests[entry.file] != entry.digest:
                    problems.append(str(CorruptShardError(f"version {v}: digest {digests[entry.file]} differs "
                                                          f"from the manifest's {entry.digest}", path=f)))
            if m.index is not None:
                _check_index(IdIndex(os.path.join(store.path, m.index.file), m.index.rows, m.index.bytes),
                             [opened[(s.file, s.bytes, s.rows)] for s in m.shards])
            checked += m.rows
        except TorchforgeError as e:
            problems.append(f"version {v}: {e}")
    return checked, problems


class _Ids(NamedTuple):
    path: str
    rows: int
    ids: np.ndarray | None  # (None: no rows)


def _check_index(idx: IdIndex, shards: list[_Ids]) -> None:
    ids, sh, row = idx.ids, idx.shard, idx.row
    shard_rows = [s.rows for s in shards]
    if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
        raise CorruptShardError("ids are not strictly increasing", path=idx.path)
    if len(sh) and (sh.min() < 0 or sh.max() >= len(shard_rows)):
        raise CorruptShardError(f"shard numbers outside 0..{len(shard_rows) - 1}", path=idx.path)
    if len(row) and ((row < 0).any() or (row >= np.asarray(shard_rows, np.int64)[sh]).any()):
        raise CorruptShardError("rows outside their shard", path=idx.path)
    for k, s in enumerate(shards):  # every row the index points at holds the id it is listed under
        mine = sh == k
        held = s.ids[row[mine]] if s.ids is not None else np.zeros(0, np.int64)
        if not np.array_equal(held, ids[mine]):
            j = int(np.flatnonzero(held != ids[mine])[0])
            raise CorruptShardError(f"the index puts id {int(ids[mine][j])} at row {int(row[mine][j])} of shard {k}, "
                                    f"which holds id {int(held[j])}", path=s.path)
    if len(ids):
        d, base, shift, steps = _directory(np.asarray(ids))
        if not np.array_equal(d, idx.dir) or (base, shift) != (idx.base, idx.shift) or steps > idx.steps:
            raise CorruptShardError("the bucket directory disagrees with the ids", path=idx.path)
