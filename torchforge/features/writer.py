"""The write path: a writer appends rows to its own shards and publishes them as one version.

Every writer (one per rank, or several per process) has a random name and writes only files that
carry it, so writers never contend for a file and hold no lock. A shard is one safetensors file::

    [8-byte length][header JSON, space-padded to a 4 KiB boundary][stream column][id][other columns]

The *stream column* is the widest column (the embedding, typically): ``write()`` sends its rows
straight from the caller's tensor to the open shard file (``pwrite``, no copy in between unless the
rows need a dtype or device conversion), digesting each piece just before the write, while the piece
is in cache. Its place is known before the row count is, because it comes first and the header has a
fixed, padded size. The narrow columns and ids are copied into small buffers and written after it
when the shard is complete (``shard_size`` bytes, or ``commit()``); then the header goes to page 0.
The digest (:class:`torchforge.checkpoint.digest.BlockDigest` of the whole file) is finished from
the kept page sums, so no byte is read back; the fsync runs on a background thread while the writer
goes on. The shard keeps its temporary name until ``commit()`` names it, just before the claim.

``commit()`` is optimistic and not a collective:

1. complete the shard; sort this commit's ids; read the newest version N (or none);
2. merge N's id index with this writer's rows (last write wins, see :func:`index.overlay`), drop
   shards no id points to any more, write and fsync the new index (all while the shards are fsynced
   in the background), then wait for the shards;
3. name the shards, write the manifest of N + 1 to a temporary file, fsync it, and ``os.link`` it to
   ``v-N+1.json``. The link fails if another committer took N + 1 first; then go back to 2 on top of
   that version. Once the link is made the commit is done (its version may be read), even if the
   fsync of ``versions/`` after it fails: the writer never deletes or reuses a published file.

So concurrent commits each get their own version, in the order they won, and each includes every row
of the versions before it: no commit is lost. A process killed before step 3 leaves only temporary
files, which readers never look at (killed inside it, at most that commit's named shards, which no
manifest names either).
"""
from __future__ import annotations

import json
import os
import platform
import struct
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from torchforge._vmem import HUGE_PAGE
from torchforge.checkpoint.digest import PAGE, BlockDigest, PageSums
from torchforge.errors import FormatError, TorchforgeError
from torchforge.features.index import IdIndex, last_writes, merge, write_index
from torchforge.features.layout import (
    INDEX,
    SHARDS,
    VERSIONS,
    Manifest,
    ShardEntry,
    as_values,
    check_cast,
    claim_version,
    clean_leftovers,
    column_order,
    column_spans,
    list_versions,
    read_manifest,
    schema_to_json,
    temp_name,
    writer_name,
)
from torchforge.formats.safetensors import as_bytes, fsync_dir, write_all
from torchforge.sizes import parse_size

if TYPE_CHECKING:
    from torchforge.features.store import FeatureStore

__all__ = ["FeatureWriter", "as_ids"]

SHARD_FORMAT = "torchforge-feature-shard"


def as_ids(ids: Any) -> np.ndarray:
    """A 1-D int64 numpy array of ids from a tensor (any device), array, sequence or int."""
    if type(ids) is torch.Tensor and ids.dtype == torch.int64 and ids.dim() == 1 and not ids.requires_grad \
            and ids.device.type == "cpu" and ids.is_contiguous():  # a batch's ids (a join's): a view as it is
        return ids.numpy()
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


_PIECE = 4 << 20  # bytes of a stream column digested then written at a time (still in cache for the write)


class _OpenShard:
    """The shard being written: its temporary file, the stream column's bytes so far, the page sums."""

    def __init__(self, folder: str, stem: str, data_start: int):
        self.tmp = temp_name(folder, stem, ".safetensors")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.end = data_start  # where the next stream bytes go: first the held ones, then the next call's
        self.held = bytearray()  # stream bytes past the last 2 MiB boundary written, not written yet
        self.sums = PageSums()

    def stream(self, data: memoryview) -> None:
        """Write ``data`` after the stream bytes so far, in pieces that start and end on 2 MiB file
        offsets: the bytes past the last boundary are held (copied; under 2 MiB) and go out with the
        next call's first piece or with :meth:`drain`. A page-cache folio is made as large as the write
        that fills it, so every whole 2 MiB of the column lands in one huge page, which a reader's map
        reaches through one TLB entry: a random row costs a cache miss, not a page walk too (a batch
        of 4,096 random 512-byte rows took 1.09 ms from 4 KiB pages, 0.87 ms from huge ones).

        All or nothing: if a write fails (a full disk), the shard is as it was before the call (its
        end, held bytes and page sums), the error is raised, and a later call may try again. Bytes a
        failed call wrote past the old end are written over by the next ones."""
        mark = (self.end, self.held, self.sums.mark())  # held is never changed in place once written
        pos = 0
        try:
            while True:
                held = len(self.held)
                stop = min(self.end + held + len(data) - pos, self.end + _PIECE)
                stop -= stop % HUGE_PAGE
                if stop <= self.end:
                    break
                take = stop - self.end - held
                views = [memoryview(self.held), data[pos:pos + take]] if held else [data[pos:pos + take]]
                try:
                    write_all(self.fd, views, self.end)
                    for v in views:  # after the write, so a failed one leaves the sums as they were
                        self.sums.update(v)
                finally:
                    for v in views:  # no export outlives the call (a traceback would pin the held bytes)
                        v.release()
                self.held = bytearray()
                self.end, pos = stop, pos + take
        except BaseException:
            self.end, self.held = mark[0], mark[1]
            self.sums.rollback(mark[2])
            raise
        self.held += data[pos:]

    def drain(self) -> list[memoryview]:
        """The held stream bytes, to be written at ``end`` by the caller (and digested in order)."""
        held, self.held = self.held, bytearray()
        return [memoryview(held)] if held else []

    def discard(self) -> None:
        os.close(self.fd)
        os.unlink(self.tmp)


def _host(v: torch.Tensor, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """``v`` as a contiguous CPU tensor of ``dtype``: ``v`` itself where it is one and ``copy`` is False,
    else a new tensor (same-dtype CPU rows are copied by numpy, which never starts torch's thread pool:
    on a busy machine a parallel ``copy_`` can take a hundred times longer)."""
    plain = v.device.type == "cpu" and v.dtype == dtype and v.is_contiguous() and not (v.is_conj() or v.is_neg())
    if plain and not copy:
        return v
    buf = torch.empty(v.shape, dtype=dtype)
    if plain and v.numel():
        np.copyto(buf.reshape(-1).view(torch.uint8).numpy(), v.reshape(-1).view(torch.uint8).numpy())
    elif v.numel():
        buf.copy_(v)
    return buf


def _finish(fd: int, tmp: str) -> None:
    """fsync and close a complete shard (on the writer's background thread); ``commit()`` names it."""
    try:
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)


class FeatureWriter:
    """Appends rows to a :class:`~torchforge.FeatureStore`; made by :meth:`FeatureStore.writer`.

    A context manager: leaving the block commits, or aborts if it raised.

    Args:
        store: the store.
        rank: recorded in the manifest and shard metadata (default: the torch.distributed rank, else 0).
        shard_size: bytes of rows after which a shard is completed (an int or ``"256MiB"``).
    """

    def __init__(self, store: FeatureStore, rank: int | None = None, shard_size: int | str = "256MiB"):
        self.store = store
        self.root = store.path
        self.schema = store.schema
        clean_leftovers(self.root)  # (what writers of this host killed before or inside commit() left)
        self.rank = _rank(rank)
        self.name = writer_name()
        self.shard_size = parse_size(shard_size, option="shard_size")
        self._meta = {"format": SHARD_FORMAT, "version": "1", "rank": str(self.rank), "writer": self.name}
        self._stream, self._order = column_order(self.schema)
        self._data_start = -(-(8 + len(self._header(10**15))) // PAGE) * PAGE  # any real row count fits
        self._ids: list[np.ndarray] = []
        self._cols: dict[str, list[torch.Tensor]] = {c: [] for c in self.schema if c != self._stream}
        self._open: _OpenShard | None = None
        self._rows = 0
        self._buffered = 0
        # this commit's shards, their ids and their temporary file (None once named by commit())
        self._written: list[tuple[ShardEntry, np.ndarray, str | None]] = []
        self._pending: list[Future] = []  # shards being fsynced and named
        self._pool: ThreadPoolExecutor | None = None
        self._shard_no = 0
        self._commit_no = 0
        self._closed = False

    def _header(self, rows: int) -> bytes:
        """The header JSON of a shard of ``rows`` rows (unpadded)."""
        head: dict[str, Any] = {"__metadata__": self._meta}
        for name, (start, end) in column_spans(self.schema, rows).items():
            code, shape = ("I64", ()) if name == "id" else (self.schema[name].code, self.schema[name].shape)
            head[name] = {"dtype": code, "shape": [rows, *shape], "data_offsets": [start, end]}
        return json.dumps(head, separators=(",", ":")).encode()

    # --- writing -----------------------------------------------------------------------------------
    def write(self, ids: Any, **columns: Any) -> None:
        """Append rows: ``ids`` (n int64) and every column as an ``(n, *shape)`` tensor or array.

        Values are converted to the column's dtype (a device tensor copied to the host) and are in the
        shard file or the writer's buffers when this returns: the caller may reuse its buffers at once.

        All or nothing: a call that raises (a full disk) has kept none of its rows, and the writer still
        holds every row of the calls before it, so the same call may be made again. A shard that
        reached ``shard_size`` is completed by the next call with rows (or by :meth:`flush`,
        :meth:`commit`), before that call's rows are taken.
        """
        self._check_open()
        arr = as_ids(ids)
        n = len(arr)
        if set(columns) != set(self.schema):
            raise ValueError(f"write() needs every column of the schema {sorted(self.schema)}, got "
                             f"{sorted(columns)}")
        rows = {}
        for name, col in self.schema.items():
            v = as_values(columns[name])
            if tuple(v.shape) != (n, *col.shape):
                raise ValueError(f"column {name!r} has shape {tuple(v.shape)}, expected {(n, *col.shape)} "
                                 f"for {n} ids")
            rows[name] = _host(v.detach(), col.dtype, copy=name != self._stream)
            check_cast(v, rows[name], name, arr)
        if n == 0:
            return
        if self._buffered >= self.shard_size:
            self.flush()
        if self._open is None:
            self._open = _OpenShard(os.path.join(self.root, SHARDS), self.name, self._data_start)
        if self._stream is not None:
            self._open.stream(as_bytes(rows.pop(self._stream)))
        self._ids.append(arr.copy())
        for name, buf in rows.items():
            self._cols[name].append(buf)
        self._rows += n
        self._buffered += n * (8 + sum(c.row_bytes for c in self.schema.values()))

    def flush(self) -> None:
        """Complete the current shard now (its rows stay invisible until :meth:`commit`).

        If a write fails (a full disk), the error is raised and the writer keeps the shard and its rows
        as they were: a later ``flush()`` or ``commit()`` tries again, :meth:`abort` drops them.
        """
        self._check_open()
        shard, n = self._open, self._rows
        if shard is None:
            return
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
        held, mark = shard.held, shard.sums.mark()
        try:
            views = shard.drain() + [as_bytes(torch.from_numpy(ids)) if name == "id" else as_bytes(t)
                                     for name in self._order for t in ([None] if name == "id" else self._cols[name])]
            write_all(shard.fd, views, shard.end)
            for v in views:
                shard.sums.update(v)
            hb = self._header(n)
            head = struct.pack("<Q", self._data_start - 8) + hb + b" " * (self._data_start - 8 - len(hb))
            write_all(shard.fd, [memoryview(head)], 0)
            entry = ShardEntry(f"{SHARDS}/{self.name}-{self._shard_no}.safetensors",
                               self._data_start + shard.sums.nbytes, n, shard.sums.hexdigest(head))
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="torchforge-feature-writer")
            self._pending.append(self._pool.submit(_finish, shard.fd, shard.tmp))
        except BaseException:  # bytes written past the end are written over by the next try
            shard.held = bytearray(held)  # a copy: a view of the old one may live on in the traceback
            shard.sums.rollback(mark)
            raise
        self._written.append((entry, ids, shard.tmp))
        self._shard_no += 1
        self._open = None
        self._drop_open()

    def _drop_open(self) -> None:
        """Forget the buffered rows (and discard the open shard file, if still open)."""
        if self._open is not None:
            self._open.discard()
            self._open = None
        self._ids = []
        self._cols = {c: [] for c in self.schema if c != self._stream}
        self._rows = 0
        self._buffered = 0

    def _wait(self) -> None:
        """Wait until every completed shard is fsynced and named; raise the first failure (the shards
        stay pending until :meth:`abort`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self._pending:
            f.result()
        self._pending = []

    # --- publishing --------------------------------------------------------------------------------
    def commit(self) -> int:
        """Publish every row written since the last commit as one new version; returns its number.

        Not a collective: each rank commits when it likes, and concurrent commits each get a version.
        """
        self.flush()
        mine = [e for e, _, _ in self._written]
        new = None
        if mine:  # this commit's ids, sorted, while the shards are fsynced
            new_ids = np.concatenate([ids for _, ids, _ in self._written])
            new_sh = np.concatenate([np.full(e.rows, j, np.int32) for j, e in enumerate(mine)])
            new_row = np.concatenate([np.arange(e.rows, dtype=np.int64) for e in mine])
            new = last_writes(new_ids, new_sh, new_row)
        attempt = 0
        while True:
            versions = list_versions(self.root)
            latest = versions[-1] if versions else 0
            try:
                parent = read_manifest(self.root, latest) if latest else None
                if parent is not None and parent.schema != self.schema:
                    raise FormatError(f"version {latest} has schema {schema_to_json(parent.schema)}, this writer "
                                      f"{schema_to_json(self.schema)}", path=self.root)
                manifest, index_path = self._manifest(latest, parent, mine, new, attempt)
            except TorchforgeError:
                if list_versions(self.root)[-1:] == [latest]:
                    raise
                attempt += 1  # the parent was pruned under it (a newer version exists): redo on the newest
                continue
            try:  # the index was built while the shards were fsynced; a manifest names only durable files
                self._wait()
                self._name_shards()
                fsync_dir(os.path.join(self.root, SHARDS))
            except BaseException as e:
                if index_path is not None:
                    os.unlink(index_path)
                if isinstance(e, OSError):  # durability unknown: no later commit may name these shards
                    rows = sum(entry.rows for entry in mine)
                    self.abort()
                    raise TorchforgeError(f"this commit's shards could not be made durable ({e}); its {rows} "
                                          "rows were dropped and nothing was published: write them again",
                                          path=os.path.join(self.root, SHARDS)) from e
                raise
            if claim_version(self.root, manifest):
                break
            if index_path is not None:  # another commit took the number: redo on top of it
                os.unlink(index_path)
            attempt += 1
        self._written = []  # published: from here on nothing may undo or reuse this version's files
        self._commit_no += 1
        fsync_dir(os.path.join(self.root, VERSIONS))
        self.store._committed()
        return manifest.version

    def _name_shards(self) -> None:
        """Give this commit's durable shards the names its manifest uses (until then they are temporary
        files, which a writer killed before committing leaves for :func:`stale_temp_files`)."""
        for j, (entry, ids, tmp) in enumerate(self._written):
            if tmp is not None:
                os.rename(tmp, os.path.join(self.root, entry.file))
                self._written[j] = (entry, ids, None)

    def _manifest(self, latest: int, parent: Manifest | None, mine: list[ShardEntry],
                  new: tuple[np.ndarray, np.ndarray, np.ndarray] | None, attempt: int
                  ) -> tuple[Manifest, str | None]:
        writer = {"name": self.name, "rank": self.rank, "host": platform.node(), "pid": os.getpid()}
        base_shards = list(parent.shards) if parent else []
        if new is None:
            return Manifest(latest + 1, latest, self.schema, tuple(base_shards),
                            parent.index if parent else None, parent.rows if parent else 0, writer), None
        if parent is not None and parent.index is not None:
            idx = IdIndex(os.path.join(self.root, parent.index.file), parent.index.rows, parent.index.bytes)
            p_ids, p_sh, p_row = idx.ids, idx.shard, idx.row
        else:
            idx, p_ids, p_sh, p_row = None, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64)
        nid, nsh, nrw = new
        ids, sh, row = merge(p_ids, p_sh, p_row, nid, nsh + np.int32(len(base_shards)), nrw)
        if idx is not None:
            idx.close()
        shards = base_shards + mine
        used = np.bincount(sh, minlength=len(shards)) > 0
        if not used.all():  # shards whose every row was overwritten: leave them out, renumber the rest
            sh = (np.cumsum(used) - 1).astype(np.int32)[sh]
            shards = [s for s, u in zip(shards, used) if u]
        rel = f"{INDEX}/{self.name}-{self._commit_no}-{attempt}-{uuid.uuid4().hex[:8]}.safetensors"  # never reused
        path = os.path.join(self.root, rel)
        size, digest = write_index(path, ids, sh, row)
        entry = ShardEntry(rel, size, len(ids), digest)
        return Manifest(latest + 1, latest, self.schema, tuple(shards), entry, len(ids), writer), path

    def abort(self) -> None:
        """Drop every row written since the last commit (their shard files are deleted)."""
        self._drop_open()
        try:
            self._wait()
        except OSError:
            pass  # a shard that failed to complete was removed by its own task
        self._pending = []
        written, self._written = self._written, []  # forgotten first: no later commit may name them
        for e, _, tmp in written:
            try:
                os.unlink(tmp or os.path.join(self.root, e.file))
            except OSError:
                pass  # (gone already, or left as a file no manifest names, which readers never look at)

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
