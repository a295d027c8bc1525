"""MDSDataset: a map-style dataset over an MDS folder (MosaicML Streaming's format).

Example:
    >>> ds = MDSDataset("data/train")  # doctest: +SKIP
    >>> ds[0]["text"], len(ds)  # doctest: +SKIP
"""
from __future__ import annotations

import bisect
import json
import operator
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from torchforge._limits import ensure_open_files
from torchforge.datasets.base import ShardDataset, register_format
from torchforge.errors import CodecError, CorruptShardError, FormatError
from torchforge.formats.mds import INDEX_BASENAME, get_hash, hash_names
from torchforge.formats.mds_reader import MDSShard, ShardMeta, read_index
from torchforge.remote.url import is_remote, local_path

__all__ = ["MDSDataset"]


def _remove_cache(folder: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


class MDSDataset(ShardDataset):
    """Random access and fast sequential iteration over an MDS folder.

    Each shard file is memory-mapped once. Shards with shard-level compression (``.mds.zstd`` and so
    on) are decompressed once, on first use, into a private cache folder that is removed when the
    dataset is garbage-collected or the process exits. Per-sample compression (``sample::zstd``) is
    undone per sample.

    Args:
        path: the dataset folder (holding index.json), or the index.json itself.
        split: a sub-folder of ``path`` to read (Streaming's ``split``).
        columns: decode only these columns (others are skipped without copying).
        lazy: ``__getitem__`` returns a mapping that decodes each column on first lookup.
        allow_unsafe_types: decode ``pkl`` columns (runs pickle: only for data you trust).
        cache_dir: where decompressed shards go (default: a new folder under the system temp dir).
        zero_copy: ``bytes`` columns come back as :class:`~torchforge.formats.values.ByteView`, a
            read-only view into the shard's map (or the decompressed sample) that compares, hashes,
            pickles and collates as ``bytes``, instead of ``bytes`` copies.

    Raises:
        NotFoundError: no index.json (or no folder) at ``path``.
        FormatError: a bad index.json, a shard file missing or of the wrong size, a ``pkl``
            column without ``allow_unsafe_types``.
    """

    format_name = "mds"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) makes a
        :class:`~torchforge.datasets.remote.RemoteMDSDataset` (whose ``cache_dir`` is the node's object
        cache, and which takes ``cache_limit``, ``mode``, ``cache_policy`` and ``storage_options`` too)."""
        path = args[0] if args else kwargs.get("path")
        if cls is MDSDataset and isinstance(path, str) and is_remote(path):
            from torchforge.datasets.remote import RemoteMDSDataset

            return super().__new__(RemoteMDSDataset)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, split: str | None = None, *, columns: list[str] | None = None,
                 lazy: bool = False, allow_unsafe_types: bool = False, cache_dir: str | None = None,
                 zero_copy: bool = True) -> None:
        folder = local_path(os.fspath(path))
        if os.path.basename(folder) == INDEX_BASENAME and os.path.isfile(folder):
            folder = os.path.dirname(folder)
        self.folder = os.path.join(folder, split) if split else folder
        self.metas: list[ShardMeta] = read_index(self.folder)
        self.columns = None if columns is None else list(columns)
        self.lazy = lazy
        self.allow_unsafe_types = allow_unsafe_types
        self.zero_copy = zero_copy
        self._cache_dir = cache_dir
        self._bounds = [0]
        for m in self.metas:
            self._bounds.append(self._bounds[-1] + m.samples)
        self._files = [self._check_file(m) for m in self.metas]
        self._shards: list[MDSShard | None] = [None] * len(self.metas)
        self._room = False  # ensure_open_files done in this process
        if any(m.zip_basename and f.endswith(m.zip_basename) for m, f in zip(self.metas, self._files)):
            self._cache_folder()  # made now so that DataLoader workers share it
        if self.metas:  # a pkl column is refused now, not at the first sample
            self._shard_plan_check()

    # --- files ------------------------------------------------------------------------------------
    def _check_file(self, m: ShardMeta) -> str:
        """The file a shard is read from: its raw file, else its compressed file (checked for size)."""
        raw = os.path.join(self.folder, m.raw_basename)
        if m.zip_basename is None or (os.path.isfile(raw) and os.path.getsize(raw) == m.raw_bytes):
            return self._sized(raw, m.raw_bytes, "shard", m.raw_basename)
        return self._sized(os.path.join(self.folder, m.zip_basename), m.zip_bytes or 0, "compressed shard",
                           f"{m.zip_basename!r} (or {m.raw_basename!r})")

    def _sized(self, path: str, want: int, what: str, names: str) -> str:
        if not os.path.isfile(path):
            raise FormatError(f"index.json names {what} {names}, which is missing",
                              path=os.path.join(self.folder, INDEX_BASENAME))
        size = os.path.getsize(path)
        if size != want:
            raise FormatError(f"{what} is {size} bytes, index.json says {want}", path=path, offset=min(size, want))
        return path

    def _shard_plan_check(self) -> None:
        for m in self.metas:
            from torchforge.formats.mds_encodings import get_encoding

            for name, enc in zip(m.column_names, m.column_encodings):
                if not get_encoding(enc).safe and not self.allow_unsafe_types and (
                        self.columns is None or name in self.columns):
                    raise FormatError(f"column {name!r} is {enc!r}, which runs pickle when read: pass "
                                      "allow_unsafe_types=True only for data you trust",
                                      path=os.path.join(self.folder, INDEX_BASENAME))

    def _cache_folder(self) -> str:
        if self._cache_dir is None:
            self._cache_dir = tempfile.mkdtemp(prefix="torchforge-mds-")
            weakref.finalize(self, _remove_cache, self._cache_dir, os.getpid())
        return self._cache_dir

    def _decompressed(self, k: int) -> str:
        m = self.metas[k]
        src = self._files[k]
        folder = self._cache_folder()
        out = os.path.join(folder, f"{k:05}-{m.raw_basename}")
        if os.path.isfile(out) and os.path.getsize(out) == m.raw_bytes:
            return out  # decompressed earlier (by this process or the one that pickled us)
        with open(src, "rb") as f:
            data = f.read()
        assert m.compression is not None
        raw = m.compression.codec.decompress(data, path=src, offset=0, limit=m.raw_bytes)
        if len(raw) != m.raw_bytes:
            raise CodecError(f"decompresses to {len(raw)} bytes, index.json says {m.raw_bytes}", path=src, offset=0)
        for algo, want in (m.raw.get("raw_data") or {}).get("hashes", {}).items():
            if algo in hash_names() and get_hash(algo, raw) != want:  # checked once, while in memory
                raise CorruptShardError(f"decompressed shard fails its {algo} hash from index.json", path=src,
                                        offset=0)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, out)
        return out

    def _shard(self, k: int) -> MDSShard:
        shard = self._shards[k]
        if shard is None:
            if not self._room:  # the first map in this process (a DataLoader worker, say)
                ensure_open_files(len(self.metas), "MDSDataset")
                self._room = True
            m = self.metas[k]
            path = self._files[k]
            label = None
            if m.zip_basename is not None and path.endswith(m.zip_basename):
                path, label = self._decompressed(k), f"{path} (decompressed)"
            shard = self._shards[k] = MDSShard(path, m, allow_unsafe_types=self.allow_unsafe_types,
                                               columns=self.columns, zero_copy=self.zero_copy, label=label)
        return shard

    # --- ShardDataset -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._bounds[-1]

    def _locate(self, i: int) -> tuple[int, int]:
        k = bisect.bisect_right(self._bounds, i) - 1
        return k, i - self._bounds[k]

    def _get(self, i: int) -> Any:
        k, j = self._locate(i)
        shard = self._shards[k] or self._shard(k)
        return shard.lazy(j) if self.lazy else shard.get(j)

    def __getitem__(self, i: int) -> Any:
        # Inlined bounds check: this is the random-access hot path.
        n = self._bounds[-1]
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for MDSDataset of {n} samples")
        k = bisect.bisect_right(self._bounds, i) - 1
        shard = self._shards[k] or self._shard(k)
        j = i - self._bounds[k]
        return shard.lazy(j) if self.lazy else shard.get(j)

    def __iter__(self) -> Iterator[Any]:
        """Sequential bulk pass, shard by shard in file order."""
        for k in range(len(self.metas)):
            shard = self._shards[k] or self._shard(k)
            if self.lazy:
                yield from (shard.lazy(j) for j in range(shard.samples))
            else:
                yield from shard

    def shard_files(self) -> list[str]:
        return [os.path.join(self.folder, INDEX_BASENAME)] + list(self._files)

    @property
    def root(self) -> str:
        return self.folder

    @property
    def cache_dir(self) -> str | None:
        """The folder of the decompressed copies of compressed shards: the ``cache_dir`` argument, or a
        temporary folder made when the dataset has compressed shards (removed with the dataset), else None."""
        return self._cache_dir

    def keys(self, field_or_fn: str | Callable[[Any], Any], *, cache: bool = True) -> np.ndarray:
        """One key per sample, decoding only what the key needs.

        A fixed-size numeric column is read for all samples in one vectorised pass per shard; a
        callable gets lazy samples, so it decodes only the columns it looks at.
        """
        if isinstance(field_or_fn, str) and self.metas and all(field_or_fn in m.column_names for m in self.metas):
            parts = [self._shard(k).column_array(field_or_fn) for k in range(len(self.metas))]
            if all(p is not None for p in parts):
                return np.concatenate(parts)
            return super().keys(field_or_fn, cache=cache)
        return super().keys(field_or_fn, cache=cache)

    def key_values(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn`` of every sample's lazy view, so it decodes only the columns it looks at."""
        out: list[Any] = []
        for k in range(len(self.metas)):
            shard = self._shard(k)
            out.extend(fn(shard.lazy(j)) for j in range(shard.samples))
        return out

    # --- lifetime and pickling (DataLoader workers) ----------------------------------------------
    def close(self) -> None:
        """Unmap every shard (the dataset reopens them on next use)."""
        for k, shard in enumerate(self._shards):
            if shard is not None:
                shard.close()
                self._shards[k] = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_shards"] = [None] * len(self.metas)
        state["_room"] = False
        return state


def detect(path: str) -> bool:
    """An MDS folder has an index.json whose shards say format "mds" (checked cheaply). An index.json that
    cannot be read or parsed counts too: it is a damaged MDS index, which opening reports (naming the file
    and the byte), not a folder of no known format."""
    index = path if os.path.basename(path) == INDEX_BASENAME else os.path.join(path, INDEX_BASENAME)
    if not os.path.isfile(index):
        return False
    try:
        with open(index, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return True
    if b'"format": "mds"' in head or b'"format":"mds"' in head:
        return True
    try:  # an MDS dataset of no samples (MDSWriter closed with none: no shard says its format)
        obj = json.loads(head)
    except (ValueError, RecursionError):
        return True
    return isinstance(obj, dict) and "shards" in obj


register_format("mds", MDSDataset, detect)
