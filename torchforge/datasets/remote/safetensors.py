"""Safetensors column shards at a URL: :class:`RemoteSafetensorsDataset` (see
:mod:`torchforge.datasets.remote`)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchforge.datasets.remote.shards import _RemoteShards, _Spans, as_urls, content_version, read_twice
from torchforge.datasets.safetensors import (
    OFFSETS,
    SafetensorsDataset,
    check_offsets,
    check_whole,
    shard_order,
)
from torchforge.errors import FormatError
from torchforge.formats.safetensors import MAX_HEADER_SIZE, SafetensorsFile, parse_header, storage_shape


class RemoteSafetensorsDataset(_RemoteShards, SafetensorsDataset):
    """A folder of safetensors column shards at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``).

    Opening lists the folder (an ``http(s)://`` one is probed for ``shard-00000.safetensors``, ...) and
    reads each shard's header with two small range reads (its columns and sample count), pinning every
    object's ETag; a shard is fetched whole into the node's cache on first use, held in use while mapped
    and read as a local shard (a sample's tensors are copies, as a local dataset's by default, so a batch
    drawn from many shards does not keep them mapped). ``cache_limit``, ``cache_policy`` and prefetching work as for
    :class:`RemoteMDSDataset`. With
    ``mode="ranges"`` no shard is fetched: a batch's rows are read by byte ranges, one coalesced read per
    shard it touches, into tensors of their own.

    Args:
        url: the folder's URL, or one ``.safetensors`` object's: that shard alone, as a local file opens
            (no check that the dataset is whole).
        columns: as :class:`~torchforge.datasets.safetensors.SafetensorsDataset`.
        cache_dir, cache_limit, cache_policy, storage_options: as :class:`RemoteMDSDataset`.
        mode: ``"shards"`` or ``"ranges"``.

    Raises:
        RemoteNotFoundError: nothing at the URL.
        FormatError: no ``*.safetensors`` objects there.
        SafetensorsError, CorruptShardError: a shard's header is invalid (names the URL and offset).
        CorruptShardError: the dataset is incomplete (torchforge marks its last shard: an upload that
            stopped part-way is refused, not read short).
    """

    _FORMAT = "SafetensorsDataset"

    def __init__(self, url: str, *, columns: Any = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self._remote_setup(url, None, cache_dir, cache_limit, mode, cache_policy, storage_options)
        self.zero_copy = False  # (samples are copies, as a local dataset's by default: none keeps its shard)
        client = self._client()
        one = self._one_object(client, (".safetensors",))  # a URL naming one shard object: that shard alone
        listed = self._listing(client, (".safetensors",)) if one is None else one
        names = shard_order(n for n in listed if n.endswith(".safetensors") and not n.startswith("."))
        if not names:
            raise FormatError("folder holds no *.safetensors objects", path=self.url)
        self.path = self.url
        self._cols, self._ends = [], []
        self._remote_objs = []
        self._heads: list[tuple[int, dict[str, Any]]] = []  # (data start, header entries) per shard
        metas = []
        def header(u: str, size: int, etag: str | None) -> tuple[int, Any, Any]:
            (head,) = client.get_ranges(u, [(0, min(8, size))], etag=etag, storage_options=self.storage_options)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if n <= MAX_HEADER_SIZE and 8 + n <= size:
                    (rest,) = client.get_ranges(u, [(8, 8 + n)], etag=etag, storage_options=self.storage_options)
                    head += rest
            return parse_header(head, size, u)

        for name in names:
            u, size, etag = listed[name]
            n, infos, meta = read_twice(lambda u=u, size=size, etag=etag: header(u, size, etag))
            self._add_shard(infos, meta, columns, u)
            metas.append(meta)
            self._remote_objs.append([(u, size, etag, None)])
            self._heads.append((8 + n, infos))
        if one is None:  # (one shard of a dataset may be read on its own, as a local file)
            check_whole(metas, [listed[n][0] for n in names], self.url)
        pinned = json.dumps(sorted(listed[n] for n in names))
        self.version = hashlib.sha256(pinned.encode()).hexdigest()[:32]  # every shard's URL, size and ETag
        #: the version without the URLs (a loader state's check: a byte-identical copy elsewhere is the same)
        self.content_version = content_version({n: listed[n] for n in names})
        self._files = [""] * len(names)
        self._open = {}
        self._first = [0, *self._ends]
        self._ragged: dict[tuple[int, str], np.ndarray] = {}  # (shard, column) -> offsets (mode="ranges")
        self._warn_unversioned()

    # --- mode="ranges" ------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        if self.mode == "ranges":
            return self._read(self._checked([i]))[0]
        return super().__getitem__(i)

    def _get(self, i: int) -> Any:
        if self.mode == "ranges":
            return self._read([i])[0]
        return super()._get(i)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples; in ``mode="ranges"`` each sample's rows are read by byte ranges, one
        coalesced read per shard the batch touches. In ``mode="shards"`` with no ``cache_limit`` the rows
        of shards neither mapped here nor cached on the node are read the same way from the shards'
        downloads into the cache, as their parts arrive (:meth:`_early_batch`)."""
        idx = self._checked(indices)
        if self.mode == "ranges":
            return self._read(idx)
        if self.cache_limit is not None:
            return self._limited_batch(idx)
        return self._early_batch(idx)

    def _at_hand(self, k: int) -> bool:
        return self._open.get(k) is not None or super()._at_hand(k)

    def _read(self, idx: list[int], early: bool = False) -> list[Any]:
        """The samples at ``idx`` (valid) by byte ranges, one coalesced read per shard; with ``early`` from
        the shards' downloads into the node's cache."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(idx):
            s = self._shard_index(i)
            by_shard.setdefault(s, []).append((pos, i - self._first[s]))

        span_of: dict[tuple[int, int, str], tuple[int, int]] = {}  # (shard, row, column) -> its bytes

        def spans(client: Any, s: int) -> list[tuple[int, int]]:
            for _, j in by_shard[s]:
                for c in self._cols[s]:
                    span_of[(s, j, c)] = self._row_span(client, s, c, j, early)
            return [span_of[(s, j, c)] for _, j in by_shard[s] for c in self._cols[s]]

        got = self._read_spans(list(by_shard), spans, early)
        out: list[Any] = [None] * len(idx)
        for s, rows in by_shard.items():
            for pos, j in rows:
                out[pos] = {c: self._row_tensor(s, c, j, span_of[(s, j, c)], got[s]) for c in self._cols[s]}
        return out

    def _row_span(self, client: Any, s: int, c: str, j: int, early: bool = False) -> tuple[int, int]:
        """The bytes of sample ``j`` of column ``c`` in shard ``s``: row ``j`` of the column as a local shard
        exposes it, or a ragged column's rows ``offsets[j]:offsets[j + 1]`` (its offsets read once, one
        range, and checked as a local shard's are)."""
        start, infos = self._heads[s]
        info = infos[c]
        url = self._objects(s)[0][0]
        rows = storage_shape(info, url)[1][0]
        width = (info.end - info.start) // rows if rows else 0  # bytes per row
        lo, hi = j, j + 1
        if self._cols[s][c]:
            off = self._ragged.get((s, c))
            if off is None:
                oi = infos[c + OFFSETS]
                span = [(start + oi.start, start + oi.end)]
                (raw,) = (self._download_read(client, s, span) if early
                          else client.get_ranges(url, span, etag=self._objects(s)[0][2],
                                                 storage_options=self.storage_options))
                off = self._ragged[(s, c)] = check_offsets(np.frombuffer(raw, dtype="<i8"), oi.shape[0] - 1, rows,
                                                           c, url, start + oi.start)
            lo, hi = int(off[j]), int(off[j + 1])
        return start + info.start + lo * width, start + info.start + hi * width

    def _row_tensor(self, s: int, c: str, j: int, span: tuple[int, int], spans: _Spans) -> torch.Tensor:
        """Sample ``j``'s value of column ``c`` (its bytes ``span``) from the bytes read: what a local shard's
        ``t[j]`` (or ``t[offsets[j]:offsets[j + 1]]``) holds, as a tensor of its own."""
        dtype, shape = storage_shape(self._heads[s][1][c], self._objects(s)[0][0])
        b, e = span
        off = self._ragged.get((s, c))
        out = (*(() if off is None else (int(off[j + 1] - off[j]),)), *shape[1:])
        if e == b:
            return torch.empty(out, dtype=dtype)
        return torch.frombuffer(bytearray(spans.get(b, e)), dtype=torch.uint8).view(dtype).reshape(out)

    def _shard(self, s: int) -> Any:
        return self._held_shard(s, lambda: self._open.get(s), 0)

    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        return self._remote_objs[k]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        self._files[k] = paths[0]
        with as_urls({paths[0]: self._remote_objs[k][0][0]}):  # (its checks name the URL, not the cache file)
            f = SafetensorsFile(paths[0])
            return self._load(k, f), [f._buf]

    def _drop(self, k: int | None) -> None:
        if k is None:
            self._open = {}
        else:
            self._open.pop(k, None)

    def shard_files(self) -> list[str]:
        return [p for k in sorted(self._fetched) for p in self._fetched[k]]

    def __getstate__(self) -> dict[str, Any]:
        return self._remote_state(super().__getstate__())
