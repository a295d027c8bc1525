"""An MDS dataset at a URL: :class:`RemoteMDSDataset` (see :mod:`torchforge.datasets.remote`)."""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import operator
import os
import struct
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

from torchforge.datasets.mds import MDSDataset
from torchforge.datasets.remote.shards import _RemoteShards, as_urls, read_twice
from torchforge.errors import CorruptShardError, TorchforgeError
from torchforge.formats.mds import INDEX_BASENAME
from torchforge.formats.mds_reader import SampleDecoder, ShardMeta
from torchforge.remote import RemoteAccessError, RemoteChangedError

log = logging.getLogger(__name__)



class RemoteMDSDataset(_RemoteShards, MDSDataset):
    """An MDS dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``).

    Args:
        url: the dataset's folder URL (the one holding index.json).
        split: a sub-folder.
        cache_dir: the node-local cache (default: the per-user cache folder, never the data folder).
        cache_limit: the most bytes the cache may hold (bytes or ``"50GB"``); None for no limit.
        mode: ``"shards"`` (whole shards fetched on first use, samples served from a download in progress)
            or ``"ranges"`` (byte ranges per batch).
        cache_policy: what the cache evicts when ``cache_limit`` needs room: ``"belady"`` (the shard needed
            furthest in the future, as far as the fetches in flight tell) or ``"lru"``.
        storage_options: endpoint, region, credentials, anonymous, allow_http; the standard environment
            variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... ``AWS_ALLOW_HTTP``) apply too.
        **kwargs: :class:`~torchforge.datasets.mds.MDSDataset`'s options (columns, lazy, zero_copy, ...).
            With a ``cache_limit``, ``zero_copy`` defaults to False: a sample's values are copies, so a batch
            whose samples come from many shards does not keep every one of them mapped (held in use, which
            the limit would have to make room for); lazy samples keep their shard mapped while they live.

    Raises:
        RemoteNotFoundError: no index.json at the URL (names it).
        RemoteChangedError: index.json was overwritten while the dataset opened (between its read and the
            folder's listing, which would pin the new shards against the old index).
        RemoteError: the store refused or failed (names the URL).
    """

    _FORMAT = "MDSDataset"
    _EARLY = True

    def __init__(self, url: str, split: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if mode == "ranges" and kwargs.get("lazy"):
            raise ValueError("lazy=True needs mode='shards' (a lazy sample maps its shard)")
        self._remote_setup(url, split, cache_dir, cache_limit, mode, cache_policy, storage_options)
        if self.cache_limit is not None:  # a sample's values are copies: the batch does not hold its shards
            kwargs.setdefault("zero_copy", False)
        client = self._client()
        index_url = f"{self.url}/{INDEX_BASENAME}"
        info = client.head(index_url, storage_options=self.storage_options)
        self._index_pin = info.etag
        if info.etag is not None:  # the pinned version of the dataset: its index's ETag (or Last-Modified)
            self.version = info.etag
            index = client.fetch(index_url, info.size, etag=info.etag, storage_options=self.storage_options)
            key = hashlib.sha256(f"{index_url}\0{info.etag}\0{info.size}".encode()).hexdigest()[:32]
            folder = os.path.join(client.cache_dir, "datasets", key)
            _place(index, os.path.join(folder, INDEX_BASENAME))
        else:  # nothing pins index.json: it is read afresh, and its bytes are the version
            (raw,) = client.get_ranges(index_url, [(0, info.size)], storage_options=self.storage_options)
            digest = hashlib.sha256(raw).hexdigest()[:32]
            self.version = f"sha256:{digest}"
            folder = os.path.join(client.cache_dir, "datasets", hashlib.sha256(
                f"{index_url}\0{digest}".encode()).hexdigest()[:32])
            _place_bytes(raw, os.path.join(folder, INDEX_BASENAME))
        with as_urls({os.path.join(folder, INDEX_BASENAME): index_url}):
            super().__init__(folder, **kwargs)
        self._first = list(self._bounds)
        self._etags = self._pinned(client)
        self._warn_unversioned()
        self._offsets: dict[int, list[int]] = {}
        self._decoders: dict[int, Any] = {}
        if mode == "ranges":
            whole = [m.zip_basename for m in self.metas if m.zip_basename is not None]
            if whole:
                raise ValueError(f"mode='ranges' needs shards that are not compressed as a whole; {whole[0]!r} "
                                 "is: use mode='shards'")
            hashed = self._hashed
            if hashed:
                warnings.warn(f"{index_url} records {'/'.join(hashed)} hashes of whole shards, which reads by "
                              "byte ranges cannot check: mode='ranges' serves samples unverified (mode='shards' "
                              "serves a shard only once its hashes check out)", stacklevel=2)

    def _pinned(self, client: Any) -> dict[str, str]:
        """Every shard's ETag as the folder's listing gives it when the dataset opens (one LIST request per
        1,000 objects): a shard is then read at that version or raises RemoteChangedError, whether or not
        index.json records its hashes, and the node's cache finds it by that version without a request.
        A folder that cannot be listed (``http(s)://``, or a listing the credentials deny) pins each shard
        by a HEAD of its own instead."""
        if self.url.split("://", 1)[0] in ("http", "https"):
            return self._headed(client)
        try:
            listed = client.list_versions(self.url + "/", storage_options=self.storage_options)
        except RemoteAccessError as e:
            log.debug("%s: no listing (%s); every shard is pinned by a HEAD", self.url, e)
            return self._headed(client)
        self._check_sizes({u: size for u, size, _ in listed})
        pins = {u: etag for u, _, etag in listed if etag}
        index_url = f"{self.url}/{INDEX_BASENAME}"
        now = client.head(index_url, storage_options=self.storage_options).etag  # (as read: same API, same form)
        if self._index_pin and now != self._index_pin:
            # overwritten between the index's read and the listing: these ETags may be the new shards'
            raise RemoteChangedError(f"index.json was overwritten while the dataset opened (ETag {now} after the "
                                     f"listing, {self._index_pin} when read): open it again", url=index_url)
        return pins

    def _headed(self, client: Any) -> dict[str, str]:
        """Every shard's ETag from a HEAD of its own (``READERS`` at a time), for a folder that cannot be
        listed: the whole dataset is pinned when it opens, so no epoch mixes shards of two versions."""
        urls = [self._stored(m)[0] for m in self.metas]
        infos = self._spread(lambda client, url: client.head(url, storage_options=self.storage_options),
                             urls, wide=True) if urls else []
        self._check_sizes({u: info.size for u, info in zip(urls, infos)})
        return {u: info.etag for u, info in zip(urls, infos) if info.etag}

    def _check_sizes(self, sizes: Mapping[str, int]) -> None:
        """Keep each shard's size as the store gave it at open (listing or HEAD) where it differs from the
        size index.json records: such a shard is a RemoteCorruptError when it is fetched (see
        ``_RemoteShards._sized``), before anything is allocated or reserved in the cache on the index's word; the
        other shards still read (``verify`` reports that shard and goes on)."""
        self._store_sizes = {}
        for m in self.metas:
            url, size = self._stored(m)
            have = sizes.get(url)
            if have is not None and have != size:
                self._store_sizes[url] = have

    def _stored(self, m: ShardMeta) -> tuple[str, int]:
        """The URL and size of the object shard ``m`` is stored as (the compressed file where it has one)."""
        whole = m.zip_basename is not None
        return f"{self.url}/{m.zip_basename or m.raw_basename}", (m.zip_bytes or 0) if whole else m.raw_bytes

    # --- mode="ranges" ------------------------------------------------------------------------------
    def _shard_url(self, k: int) -> str:
        return f"{self.url}/{self.metas[k].raw_basename}"

    def _offsets_of(self, k: int, client: Any = None, early: bool = False) -> list[int]:
        """Shard ``k``'s sample offsets, read once (one small range; ``early``: from the shard's download,
        see :meth:`_early_batch`) and checked like a local shard's."""
        offs = self._offsets.get(k)
        if offs is None:
            m, url = self.metas[k], self._shard_url(k)
            head = 4 + 4 * (m.samples + 1)
            span = [(0, min(head, m.raw_bytes))]
            client = client or self._client()
            if early:  # (a download's bytes are what a second read would get too)
                (data,) = self._download_read(client, k, span)
                offs = _offsets(data, m, head, url)
            else:
                offs = read_twice(lambda: _offsets(client.get_ranges(url, span, etag=self._etags.get(url),
                                                                     storage_options=self.storage_options)[0],
                                                   m, head, url))
            self._offsets[k] = offs
        return offs

    def _decoder(self, k: int) -> Any:
        dec = self._decoders.get(k)
        if dec is None:
            dec = self._decoders[k] = SampleDecoder(self.metas[k], self._shard_url(k),
                                                    allow_unsafe_types=self.allow_unsafe_types,
                                                    columns=self.columns, zero_copy=self.zero_copy)
        return dec

    def _decode(self, k: int, j: int, data: bytes) -> Any:
        m = self.metas[k]
        begin = self._offsets_of(k)[j]
        if m.compression is not None and m.compression.per_sample:
            data = m.compression.codec.decompress(data, path=self._shard_url(k), offset=begin)
        return self._decoder(k).decode(data, begin)

    def _read(self, indices: list[int], early: bool = False) -> list[Any]:
        """The samples at ``indices`` (in order): one coalesced read per shard they touch, by range GETs, or
        with ``early`` from the shards' downloads into the node's cache (:meth:`_early_batch`)."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            k, j = self._locate(i)
            by_shard.setdefault(k, []).append((pos, j))

        def spans(client: Any, k: int) -> list[tuple[int, int]]:
            offs = self._offsets_of(k, client, early)
            return [(offs[j], offs[j + 1]) for _, j in by_shard[k]]

        got = self._read_spans(list(by_shard), spans, early)
        out: list[Any] = [None] * len(indices)
        for k, rows in by_shard.items():
            offs = self._offsets[k]
            try:
                for pos, j in rows:
                    out[pos] = self._decode(k, j, got[k].get(offs[j], offs[j + 1]))
            except TorchforgeError:
                if early:
                    raise
                # read once more: bytes damaged on the way decode the second time; the same bytes twice
                # are the object's own, and the error stands
                again = self._read_spans([k], spans)[k]
                if all(again.get(offs[j], offs[j + 1]) == got[k].get(offs[j], offs[j + 1]) for _, j in rows):
                    raise
                for pos, j in rows:
                    out[pos] = self._decode(k, j, again.get(offs[j], offs[j + 1]))
        return out

    def _get(self, i: int) -> Any:
        if self.mode == "ranges":
            return self._read([i])[0]
        return super()._get(i)

    def __getitem__(self, i: int) -> Any:
        if self.mode == "ranges":
            n = len(self)
            i = operator.index(i)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"index {i} out of range for MDSDataset of {n} samples")
            return self._read([i])[0]
        return super().__getitem__(i)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples (torch's DataLoader calls this with a batch's indices)."""
        if self.mode != "ranges":
            if self.cache_limit is None:
                return self._early_batch(self._checked(indices))
            return self._limited_batch(self._checked(indices))
        return self._read(self._checked(indices))

    def __iter__(self) -> Any:
        if self.mode != "ranges":
            yield from super().__iter__()
            return
        step = 256
        for first in range(0, len(self), step):
            yield from self._read(list(range(first, min(first + step, len(self)))))

    # --- mode="shards" ---------------------------------------------------------------------------------
    def _at_hand(self, k: int) -> bool:  # (shards compressed as a whole are always mapped)
        return self._shards[k] is not None or self.metas[k].zip_basename is not None or super()._at_hand(k)

    # --- mode="shards" under a cache_limit ----------------------------------------------------------
    def _ranges_ok(self) -> bool:
        # a shard compressed as a whole has no sample ranges; hashes of whole shards cannot check a range, and
        # mode="shards" serves a shard with hashes only once they check out
        return not any(m.zip_basename for m in self.metas) and not self._hashed

    @functools.cached_property
    def _hashed(self) -> list[str]:
        """The hash algorithms index.json records for the shards' stored files (none: []); found once (asked
        per batch while a cache limit's switch to ranges is judged)."""
        found: set[str] = set()
        for k in range(len(self.metas)):
            hashes = self._objects(k)[0][3]
            found.update(hashes or ())
        return sorted(found)

    def _node_folder(self) -> str:
        return self.folder

    def _check_file(self, m: ShardMeta) -> str:
        return ""  # fetched on first use (see _shard)

    def _shard(self, k: int) -> Any:
        return self._held_shard(k, lambda: self._shards[k], 2)  # a map and a hold per shard

    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        m = self.metas[k]
        whole = m.zip_basename is not None  # the stored file is the compressed one
        entry = m.raw.get("zip_data" if whole else "raw_data") or {}
        hashes = entry.get("hashes") if isinstance(entry, dict) else None
        url, size = self._stored(m)
        return [(url, size, self._etags.get(url),
                 hashes if isinstance(hashes, dict) else None)]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        self._files[k] = paths[0]
        m = self.metas[k]
        url = self._stored(m)[0]
        names = {paths[0]: url}  # errors name the URL, not the file in the node's cache
        if m.zip_basename is not None:  # (offsets then count in the decompressed shard)
            names[os.path.join(self._cache_folder(), f"{k:05}-{m.raw_basename}")] = f"{url} (decompressed)"
        with as_urls(names):
            shard = MDSDataset._shard(self, k)
        shard.path = shard.decoder.path = names.get(shard.path, url)
        return shard, [shard._mm]

    def _drop(self, k: int | None) -> None:
        if k is None:
            self._shards = [None] * len(self.metas)
            self._room = False
        else:
            self._shards[k] = None

    def shard_files(self) -> list[str]:
        return [os.path.join(self.folder, INDEX_BASENAME)] + [f for f in self._files if f]

    def __getstate__(self) -> dict[str, Any]:
        state = self._remote_state(super().__getstate__())
        state["_decoders"] = {}  # struct.Structs do not pickle; each process makes its own
        return state


def _offsets(data: bytes, m: ShardMeta, head: int, url: str) -> list[int]:
    """A shard's sample offsets from its first ``head`` bytes, checked against its index entry."""
    if len(data) < head or struct.unpack_from("<I", data)[0] != m.samples:
        raise CorruptShardError(f"the shard's header does not hold {m.samples} samples as index.json says",
                                path=url, offset=0)
    offs = list(struct.unpack_from(f"<{m.samples + 1}I", data, 4))
    if not (head <= offs[0] and offs[-1] == m.raw_bytes and all(a <= b for a, b in itertools.pairwise(offs))):
        raise CorruptShardError("the shard's sample offsets are out of order or outside the shard", path=url,
                                offset=4)
    return offs


def _place(src: str, dst: str) -> None:
    """Copy the fetched index.json to ``dst`` atomically (once: the folder is keyed by its version)."""
    if not os.path.exists(dst):
        with open(src, "rb") as f:
            _place_bytes(f.read(), dst)


def _place_bytes(data: bytes, dst: str) -> None:
    """Write index.json's bytes to ``dst`` atomically (once: the folder is keyed by its version)."""
    if os.path.exists(dst):
        return
    folder = os.path.dirname(dst)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
