"""The write path: a writer appends rows to its own shards and publishes them as one version.

Every writer (one per rank, or several per process) has a random name and writes only files that
carry it, so writers never contend for a file and hold no lock. ``write()`` copies the rows into the
writer's buffer (from any device, converting to the column's dtype); once the buffer reaches
``shard_size`` it goes to disk as one safetensors shard (written from the buffers with ``pwritev``,
digested on the way, fsynced, then renamed from its temporary name).

``commit()`` is optimistic and not a collective:

1. flush the buffer; read the newest version N (or none);
2. overlay N's id index with this writer's rows (last write wins, see :func:`index.overlay`), drop
   shards no id points to any more, write and fsync the new index;
3. write the manifest of N + 1 to a temporary file, fsync it, and ``os.link`` it to ``v-N+1.json``.
   The link fails if another committer took N + 1 first; then go back to 2 on top of that version.

So concurrent commits each get their own version, in the order they won, and each includes every row
of the versions before it: no commit is lost. A process killed before step 3 leaves only files no
manifest names, which readers never look at.
"""
from __future__ import annotations

import os
import platform
import uuid
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from torchforge.checkpoint.digest import BlockDigest
from torchforge.errors import FormatError, TorchforgeError
from torchforge.features.index import IdIndex, overlay, write_index
from torchforge.features.layout import (
    INDEX,
    SHARDS,
    Manifest,
    ShardEntry,
    claim_version,
    list_versions,
    read_manifest,
    schema_to_json,
    temp_name,
)
from torchforge.formats.safetensors import as_bytes, fsync_dir, plan, write_all
from torchforge.sizes import parse_size

if TYPE_CHECKING:
    from torchforge.features.store import FeatureStore

__all__ = ["FeatureWriter", "as_ids"]

SHARD_FORMAT = "torchforge-feature-shard"


def as_ids(ids: Any) -> np.ndarray:
    """A 1-D int64 numpy array of ids from a tensor (any device), array, sequence or int."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f")):
        raise TypeError(f"ids must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63:
        raise ValueError("ids must fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _rank(rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class FeatureWriter:
    """Appends rows to a :class:`~torchforge.FeatureStore`; made by :meth:`FeatureStore.writer`.

    A context manager: leaving the block commits, or aborts if it raised.

    Args:
        store: the store.
        rank: recorded in the manifest and shard metadata (default: the torch.distributed rank, else 0).
        shard_size: buffered bytes after which a shard is written (an int or ``"256MiB"``).
    """

    def __init__(self, store: FeatureStore, rank: int | None = None, shard_size: int | str = "256MiB"):
        self.store = store
        self.root = store.path
        self.schema = store.schema
        self.rank = _rank(rank)
        self.name = uuid.uuid4().hex[:16]
        self.shard_size = parse_size(shard_size, option="shard_size")
        self._ids: list[np.ndarray] = []
        self._cols: dict[str, list[torch.Tensor]] = {c: [] for c in self.schema}
        self._buffered = 0
        self._written: list[tuple[ShardEntry, np.ndarray]] = []  # this commit's shards and their ids
        self._shard_no = 0
        self._commit_no = 0
        self._closed = False

    # --- writing -----------------------------------------------------------------------------------
    def write(self, ids: Any, **columns: Any) -> None:
        """Append rows: ``ids`` (n int64) and every column as an ``(n, *shape)`` tensor or array.

        Values are copied (a device tensor straight into the writer's host buffer) and converted to the
        column's dtype; the caller may reuse its buffers at once.
        """
        self._check_open()
        arr = as_ids(ids)
        n = len(arr)
        if set(columns) != set(self.schema):
            raise ValueError(f"write() needs every column of the schema {sorted(self.schema)}, got "
                             f"{sorted(columns)}")
        rows = {}
        for name, col in self.schema.items():
            v = columns[name]
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(np.ascontiguousarray(v)) if v.dtype.kind in "biufc" else v
            if not isinstance(v, torch.Tensor):
                v = torch.as_tensor(v)
            if tuple(v.shape) != (n, *col.shape):
                raise ValueError(f"column {name!r} has shape {tuple(v.shape)}, expected {(n, *col.shape)} "
                                 f"for {n} ids")
            buf = torch.empty((n, *col.shape), dtype=col.dtype)
            buf.copy_(v.detach())
            rows[name] = buf
        self._ids.append(arr.copy())
        for name, buf in rows.items():
            self._cols[name].append(buf)
        self._buffered += n * (8 + sum(c.row_bytes for c in self.schema.values()))
        if self._buffered >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows to a new shard now (they stay invisible until :meth:`commit`)."""
        self._check_open()
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
        n = len(ids)
        if n == 0:
            self._ids = []
            self._cols = {c: [] for c in self.schema}
            return
        placeholders = {"id": torch.empty((), dtype=torch.int64).expand(n)}
        for name, col in self.schema.items():
            placeholders[name] = torch.empty((), dtype=col.dtype).expand(n, *col.shape)
        meta = {"format": SHARD_FORMAT, "version": "1", "writer": self.name, "rank": str(self.rank)}
        head, layout = plan(placeholders, meta)
        views = [memoryview(head)]
        for name, _, _ in layout:
            parts = [torch.from_numpy(ids)] if name == "id" else self._cols[name]
            views += [as_bytes(t) for t in parts]
        rel = f"{SHARDS}/{self.name}-{self._shard_no}.safetensors"
        folder = os.path.join(self.root, SHARDS)
        tmp = temp_name(folder, self.name, ".safetensors")
        digest = BlockDigest()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, views, 0)
            for v in views:
                digest.update(v)
            size = sum(len(v) for v in views)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, os.path.join(self.root, rel))
        self._written.append((ShardEntry(rel, size, n, digest.hexdigest()), ids))
        self._shard_no += 1
        self._ids = []
        self._cols = {c: [] for c in self.schema}
        self._buffered = 0

    # --- publishing --------------------------------------------------------------------------------
    def commit(self) -> int:
        """Publish every row written since the last commit as one new version; returns its number.

        Not a collective: each rank commits when it likes, and concurrent commits each get a version.
        """
        self.flush()
        fsync_dir(os.path.join(self.root, SHARDS))
        mine = [e for e, _ in self._written]
        new_ids = np.concatenate([ids for _, ids in self._written]) if mine else np.zeros(0, np.int64)
        attempt = 0
        while True:
            versions = list_versions(self.root)
            latest = versions[-1] if versions else 0
            parent = read_manifest(self.root, latest) if latest else None
            if parent is not None and parent.schema != self.schema:
                raise FormatError(f"version {latest} has schema {schema_to_json(parent.schema)}, this writer "
                                  f"{schema_to_json(self.schema)}", path=self.root)
            manifest, index_path = self._manifest(latest, parent, mine, new_ids, attempt)
            if claim_version(self.root, manifest):
                break
            if index_path is not None:  # another commit took the number: redo on top of it
                os.unlink(index_path)
            attempt += 1
        self._written = []
        self._commit_no += 1
        self.store.refresh()
        return manifest.version

    def _manifest(self, latest: int, parent: Manifest | None, mine: list[ShardEntry], new_ids: np.ndarray,
                  attempt: int) -> tuple[Manifest, str | None]:
        writer = {"name": self.name, "rank": self.rank, "host": platform.node(), "pid": os.getpid()}
        base_shards = list(parent.shards) if parent else []
        if not mine:
            return Manifest(latest + 1, latest, self.schema, tuple(base_shards),
                            parent.index if parent else None, parent.rows if parent else 0, writer), None
        if parent is not None and parent.index is not None:
            idx = IdIndex(os.path.join(self.root, parent.index.file), parent.index.rows, parent.index.bytes)
            p_ids, p_sh, p_row = idx.ids, idx.shard, idx.row
        else:
            idx, p_ids, p_sh, p_row = None, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64)
        k0 = len(base_shards)
        new_sh = np.concatenate([np.full(e.rows, k0 + j, np.int32) for j, e in enumerate(mine)])
        new_row = np.concatenate([np.arange(e.rows, dtype=np.int64) for e in mine])
        ids, sh, row = overlay(p_ids, p_sh, p_row, new_ids, new_sh, new_row)
        if idx is not None:
            idx.close()
        shards = base_shards + mine
        used = np.bincount(sh, minlength=len(shards)) > 0
        if not used.all():  # shards whose every row was overwritten: leave them out, renumber the rest
            sh = (np.cumsum(used) - 1).astype(np.int32)[sh]
            shards = [s for s, u in zip(shards, used) if u]
        rel = f"{INDEX}/{self.name}-{self._commit_no}-{attempt}.safetensors"
        path = os.path.join(self.root, rel)
        write_index(path, ids, sh, row)
        entry = ShardEntry(rel, os.path.getsize(path), len(ids), file_digest(path))
        return Manifest(latest + 1, latest, self.schema, tuple(shards), entry, len(ids), writer), path

    def abort(self) -> None:
        """Drop every row written since the last commit (their shard files are deleted)."""
        for e, _ in self._written:
            try:
                os.unlink(os.path.join(self.root, e.file))
            except FileNotFoundError:
                pass
        self._written = []
        self._ids = []
        self._cols = {c: [] for c in self.schema}
        self._buffered = 0

    def close(self) -> None:
        """Abort what is not committed; the writer takes no more rows."""
        if not self._closed:
            self.abort()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TorchforgeError("this FeatureWriter is closed; make a new one with store.writer()")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None and not self._closed:
            self.commit()
        self.close()


def file_digest(path: str) -> str:
    """The BlockDigest of a whole file, read in 16 MiB pieces."""
    d = BlockDigest()
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            d.update(memoryview(buf)[:k])
    return d.hexdigest()
