"""Datasets in object storage: ``open_dataset("s3://bucket/train")`` (MDS, JINX or safetensors shards).

MDS (:class:`RemoteMDSDataset`): ``index.json`` is read when the dataset is opened and pins the version the run reads: its ETag keys the
node-local cache, so a dataset overwritten at the same URL is a new cache entry, never mixed into the
files of the old one. Each shard is fetched whole into the node-local cache on its first use, through
the node's fetcher process (:mod:`torchforge.remote`: one download per shard per node whatever the
number of ranks and DataLoader workers, in parts fetched concurrently; size and the hashes index.json
records checked before the file enters the cache), then memory-mapped as a local shard. Until a shard
is complete, a batch (with no ``cache_limit``) reads its samples from the download itself: the parts
that hold them are fetched before any other, so a first batch that touches every shard waits for a few
parts, not for the whole dataset (a shard whose index records a hash is served only once verified).
DataLoader workers, forked or spawned, reach the fetcher themselves; no process here ever imports the
object-store client.

``mode="ranges"`` fetches no whole shard: each shard's offset table is read once (one small range), and
a sample's bytes are one range of its shard. A batch (``__getitems__``, which torch's and torchforge's
loaders call with a batch's indices) is read with one request per shard touched, its samples'
ranges merged where the bytes between them cost at most ``RANGE_WASTE`` of what the batch reads (so the
bytes fetched stay within 1.1x of the samples' bytes while neighbours share a GET). This is an exact
global shuffle over a dataset of any size with no cache at all. It needs shards that are not compressed
as a whole (``sample::`` compression is fine).

Prefetching (``mode="shards"``): :meth:`RemoteMDSDataset.prefetch` takes the indices a process will
read, in order, and fetches their shards in the order of first use on a background thread of that
process, each request carrying the shards needed next (what Belady's eviction rule needs).
``torchforge.DataLoader`` calls it at the start of every pass whose sampler can tell its future order
(a :class:`~torchforge.sampler.GlobalSampler`, whose ``indices()`` is pure); with torch's loader, call it
yourself. With a ``cache_limit`` it runs at most half the limit ahead.

A mapped shard is held in use until its map is gone (see ``_RemoteShards._mapped``): no eviction
removes a file a reader maps, so the disk the cache uses is the files it can count. With a
``cache_limit`` each process keeps at most its share of half the limit mapped.

JINX (:class:`RemoteJinxDataset`) and safetensors column shards (:class:`RemoteSafetensorsDataset`) have
no index of the whole dataset: the folder is listed (probed over ``http(s)://``), each shard's footer or
header is read with small range reads, and every object's ETag is pinned; shards (and JINX sidecars) are
then fetched whole on first use like MDS shards. Safetensors shards also read in ``mode="ranges"``: a
sample is one row of each column (a ragged column's rows between two of its offsets, read once per shard),
a batch one coalesced read per shard as for MDS. JINX reads in ``mode="shards"`` only.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import operator
import os
import shutil
import struct
import tempfile
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
import torch

from torchforge._limits import ensure_open_files
from torchforge.datasets.jinx import JinxDataset
from torchforge.datasets.mds import MDSDataset
from torchforge.datasets.safetensors import OFFSETS, SafetensorsDataset, check_offsets
from torchforge.errors import CorruptShardError, FormatError, SafetensorsError
from torchforge.formats.jinx_reader import JinxShard
from torchforge.formats.mds import INDEX_BASENAME
from torchforge.formats.mds_reader import SampleDecoder, ShardMeta
from torchforge.formats.safetensors import MAX_HEADER_SIZE, SafetensorsFile, parse_header, storage_shape
from torchforge.remote import FetcherClient, RemoteNotFoundError, connect, is_remote
from torchforge.sizes import parse_size

__all__ = ["RemoteJinxDataset", "RemoteMDSDataset", "RemoteSafetensorsDataset", "is_remote"]

log = logging.getLogger(__name__)

MODES = ("shards", "ranges")
POLICIES = ("belady", "lru")
NEXT_USE = 8  # shards named as "needed next" in each fetch request (Belady's rule evicts the others first)
RANGE_WASTE = 0.1  # bytes between merged ranges, as a share of the bytes a batch reads
READERS = 8  # shards whose ranges a process reads at once (one fetcher connection each)
BYPASS_SHARE = 0.1  # whole shards downloaded serving fewer samples than this share of one: read ranges instead
BYPASS_AFTER = 4  # dropped maps before that is judged


class _RemoteShards:
    """What every dataset at a URL shares in ``mode="shards"``: this process's fetcher connections, shards
    fetched whole into the node's cache and held in use while mapped, the least recently used maps
    dropped under a ``cache_limit``, and prefetching in the sampler's order.

    A subclass lists each shard's stored objects (:meth:`_objects`), maps fetched files (:meth:`_map`)
    and drops its own maps (:meth:`_drop`); ``_first`` holds the first sample index of every shard (and
    the total last).
    """

    url: str
    mode: str
    _first: list[int]

    _FORMAT = "dataset"  # named in index errors
    _EARLY = False  # reads samples of shards still downloading (mode="shards", no cache_limit): RemoteMDSDataset

    def _remote_setup(self, url: str, split: str | None, cache_dir: str | os.PathLike | None,
                      cache_limit: int | str | None, mode: str, cache_policy: str,
                      storage_options: Mapping[str, Any] | None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {list(MODES)}")
        if cache_policy not in POLICIES:
            raise ValueError(f"cache_policy={cache_policy!r} is not one of {list(POLICIES)}")
        self.cache_policy = cache_policy
        self.url = url.rstrip("/") + (f"/{split.strip('/')}" if split else "")
        self.mode = mode
        self.storage_options = dict(storage_options or {})
        self.cache_limit = None if cache_limit is None else parse_size(cache_limit, option="cache_limit")
        self._remote_cache = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self._client_of: tuple[Any, ...] | None = None  # (pid, connections, thread pool)
        self._held: tuple[int, OrderedDict[int, int]] | None = None  # (pid, this process's mapped shards)
        self._fetched: dict[int, list[str]] = {}  # shard -> its files in the cache, as last fetched
        self._plan: list[int] = []  # shards in the order of first use, as the last prefetch() was told
        self._prefetcher: tuple[int, threading.Thread, threading.Event] | None = None  # (pid, thread, stop)
        self._bypass = False  # this process reads uncached shards by ranges (see RemoteMDSDataset)
        self._complete: set[int] = set()  # shards seen cached or mapped (mode="shards", no cache_limit)

    # --- what a subclass supplies -------------------------------------------------------------------
    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        """Shard ``k``'s stored objects: (URL, size, pinned ETag or None, hashes or None)."""
        raise NotImplementedError

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        """Shard ``k`` mapped from its fetched files (raises FileNotFoundError if one is gone), and its
        mmap objects (the shard is held in use while any of them lives)."""
        raise NotImplementedError

    def _drop(self, k: int | None) -> None:
        """Forget this process's map of shard ``k`` (every map with None); it goes when unused."""
        raise NotImplementedError

    # --- connections --------------------------------------------------------------------------------
    def _client(self) -> Any:
        """This process's connection to the node's fetcher (a forked worker opens its own)."""
        return self._clients()[0]

    def _clients(self) -> list[Any]:
        """This process's ``READERS`` connections to the fetcher (one request at a time each) and the
        threads that use them to read several shards' ranges at once."""
        n = READERS if self.mode == "ranges" or self._bypass or (self._EARLY and self.cache_limit is None) else 1
        if self._client_of is None or self._client_of[0] != os.getpid() or len(self._client_of[1]) < n:
            # the first is the process's shared client (the calling thread's); the reader threads each get
            # their own connection: a client serves one request at a time
            mine = self._client_of is not None and self._client_of[0] == os.getpid()
            clients = self._client_of[1] if mine else [connect(self._remote_cache)]
            clients += [FetcherClient(self._remote_cache) for _ in range(n - len(clients))]
            self._client_of = (os.getpid(), clients, ThreadPoolExecutor(n, thread_name_prefix="torchforge-ranges"))
        return self._client_of[1]

    def _listing(self, client: Any, suffixes: tuple[str, ...]) -> dict[str, tuple[str, int, str | None]]:
        """The folder's top-level objects: name -> (URL, size, ETag). An ``http(s)://`` folder cannot be
        listed: ``shard-00000<suffix>``, ``shard-00001<suffix>``, ... are looked for instead (the first
        suffix names the shard, the others its companions), until the first shard missing."""
        if self.url.split("://", 1)[0] in ("http", "https"):
            return self._probe(client, suffixes)
        out = {}
        for u, size, etag in client.list_versions(self.url + "/", storage_options=self.storage_options):
            name = u[len(self.url) + 1:]
            if "/" not in name:
                out[name] = (u, size, etag)
        if not out:
            raise RemoteNotFoundError("no objects below this URL", url=self.url)
        return out

    def _probe(self, client: Any, suffixes: tuple[str, ...]) -> dict[str, tuple[str, int, str | None]]:
        out: dict[str, tuple[str, int, str | None]] = {}
        for k in itertools.count():
            for name in (f"shard-{k:05d}{suffix}" for suffix in suffixes):
                u = f"{self.url}/{name}"
                try:
                    info = client.head(u, storage_options=self.storage_options)
                except RemoteNotFoundError:
                    if name.endswith(suffixes[0]):
                        if not out:
                            raise
                        return out
                    continue
                out[name] = (u, info.size, info.etag)
        raise AssertionError("unreachable")

    def _checked(self, indices: list[int]) -> list[int]:
        """A batch's indices as non-negative ints; IndexError (naming the format) for one out of range."""
        n = len(self)
        idx = [operator.index(i) for i in indices]
        for i in idx:
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for {self._FORMAT} of {n} samples")
        return [i + n if i < 0 else i for i in idx]

    # --- reading byte ranges (mode="ranges", and early reads of downloads in progress) ------------------
    def _read_spans(self, shards: list[int], spans_of: Callable[[Any, int], list[tuple[int, int]]],
                    early: bool = False) -> dict[int, _Spans]:
        """Each shard's byte spans ``spans_of(client, k)`` (merged where the gaps cost at most
        ``RANGE_WASTE`` of the bytes wanted), read with one request per shard, ``READERS`` shards at a time
        on their own connections: by range GETs, or with ``early`` from the shards' downloads into the
        node's cache (:meth:`_download_read`)."""
        clients = self._clients()

        def read(n: int, k: int) -> _Spans:
            client = clients[n % len(clients)]
            merged = _merge(sorted(set(spans_of(client, k))), RANGE_WASTE)
            if early:
                return _Spans(merged, self._download_read(client, k, merged))
            url, _, etag, _ = self._objects(k)[0]
            return _Spans(merged, client.get_ranges(url, merged, etag=etag, gap=0,
                                                    storage_options=self.storage_options))

        if len(shards) == 1:
            return {shards[0]: read(0, shards[0])}
        assert self._client_of is not None
        return dict(zip(shards, self._client_of[2].map(read, range(len(shards)), shards)))

    def _download_read(self, client: Any, k: int, spans: list[tuple[int, int]]) -> list[bytes]:
        """``spans`` of shard ``k`` read from its download into the node's cache (see
        :meth:`RemoteMDSDataset._early_batch`); a shard found complete is mapped from then on."""
        url, size, etag, hashes = self._objects(k)[0]
        blobs, path = client.read(url, size, spans, hashes=hashes, etag=etag, cache_limit=self.cache_limit,
                                  policy=self.cache_policy, next_use=self._next_use(k),
                                  storage_options=self.storage_options)
        if path is not None:
            self._fetched[k] = [path]
            self._complete.add(k)
        return blobs

    # --- fetching and holding -----------------------------------------------------------------------
    def _mapped(self, k: int) -> Any:
        """Shard ``k`` mapped, fetched into the node's cache first if absent.

        A mapped shard is held in use (:meth:`ObjectCache.hold`) until its maps are gone (the last sample
        or zero-copy value that needs them included), so no process's eviction removes a file a reader
        has mapped: an unlinked file that is still mapped keeps its disk space, which the cache could not
        count. With a ``cache_limit`` a process keeps at most its share of half the limit mapped (the
        limit over twice the node's reading processes: ``LOCAL_WORLD_SIZE`` times the DataLoader's
        workers), dropping its least recently used maps first, and holds nothing more while it waits for
        room.
        """
        held = self._held_here()
        size = self._stored_bytes(k)
        self._make_room(held, size)
        cache = self._client().cache  # the client's view of the node's cache (no folders made per map)
        pins: list[int] = []
        try:
            for url, *_ in self._objects(k):
                pins.append(cache.hold(url))
            for attempt in range(3):
                paths = self._fetched.get(k)
                if not paths or not all(os.path.exists(p) for p in paths):  # evicted before it was held
                    client = self._client()
                    paths = self._fetched[k] = self._fetch(client, k, self._next_use(k))
                    if client.downloaded:  # (the last object) came over the network, not from the cache
                        self._on_download(k)
                try:
                    shard, maps = self._map(k, paths)
                    break
                except FileNotFoundError:
                    self._fetched.pop(k, None)
                    if attempt == 2:
                        raise
        except BaseException:
            for fd in pins:
                os.close(fd)
            raise
        maps = [m for m in maps if isinstance(m, mmap.mmap)]
        release = _Release(pins, len(maps))
        for m in maps:
            weakref.finalize(m, release.one_gone)  # let go when the maps are gone, not before
        held[k] = size
        self._maps_made += 1
        shards = len(self._first) - 1
        if self.cache_limit is not None and self._maps_made == 8 * shards + 1:
            warnings.warn(f"{self.url}: this process mapped its shards {self._maps_made - 1} times ({shards} shards): "
                          f"cache_limit={self.cache_limit} bytes is small for this read order, and whole shards are "
                          "fetched again and again for a few samples each. mode='ranges' reads only the samples' "
                          "bytes; GlobalSampler(bucket_size=\"shards\") reads one shard at a time",
                          RuntimeWarning, stacklevel=2)
        return shard

    def _held_here(self) -> OrderedDict[int, int]:
        """This process's mapped shards (shard -> bytes), least recently used first. A forked worker
        drops the maps it inherited (its copies of their holds go with them)."""
        if self._held is None or self._held[0] != os.getpid():
            if self._held is not None:
                self._drop(None)
            self._held = (os.getpid(), OrderedDict())
            self._maps_made = 0
            self._new_process()
        return self._held[1]

    def _new_process(self) -> None:
        """This process maps its first shard (a subclass may reset its per-process state)."""

    def _make_room(self, held: OrderedDict[int, int], size: int) -> None:
        if self.cache_limit is None:
            return
        import torch.utils.data

        procs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        info = torch.utils.data.get_worker_info()
        if info is not None:
            procs *= max(1, info.num_workers)
        budget = self.cache_limit / (2 * procs)
        total = sum(held.values())
        while held and total + size > budget:
            old, nbytes = held.popitem(last=False)
            self._drop(old)  # unmapped, and its hold released, once nothing uses it
            total -= nbytes

    def _on_download(self, k: int) -> None:
        """This process's fetch of shard ``k`` downloaded it (a subclass may keep count)."""

    def _fetch(self, client: Any, k: int, next_use: list[str]) -> list[str]:
        """Shard ``k``'s objects in the node's cache (fetched if absent): their paths."""
        return [client.fetch(url, size, hashes=hashes, etag=etag, cache_limit=self.cache_limit,
                             policy=self.cache_policy, storage_options=self.storage_options, next_use=next_use)
                for url, size, etag, hashes in self._objects(k)]

    def _url_of(self, k: int) -> str:
        """The URL of shard ``k``'s (first) stored object."""
        return self._objects(k)[0][0]

    def _stored_bytes(self, k: int) -> int:
        """The bytes of shard ``k``'s stored objects."""
        return sum(size for _, size, _, _ in self._objects(k))

    def _next_use(self, k: int) -> list[str]:
        """The URLs needed after shard ``k``: from the planned order when there is one, else the next
        shards in index order."""
        plan = self._plan
        if k in plan:
            at = plan.index(k) + 1
            after = plan[at:at + NEXT_USE]
        else:
            after = list(range(k + 1, min(k + 1 + NEXT_USE, len(self._first) - 1)))
        return [url for j in after for url, *_ in self._objects(j)]

    # --- prefetching --------------------------------------------------------------------------------
    def shard_order(self, indices: Any) -> list[int]:
        """The shards that ``indices`` read, in the order of their first use."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        ks = np.searchsorted(np.asarray(self._first, dtype=np.int64), idx, side="right") - 1
        _, first = np.unique(ks, return_index=True)
        return ks[np.sort(first)].tolist()

    def prefetch(self, indices: Any, *, wait: bool = False) -> None:
        """Fetch the shards of ``indices`` (the samples this process's loader will read, in order) into the
        node's cache in the order of first use, on a background thread; returns at once, or when every
        fetch is done with ``wait=True`` (to warm a cache before training). A new call replaces the
        previous plan. Errors are left to the read that needs the shard (it raises them, typed and naming
        the URL). Nothing to do in ``mode="ranges"``."""
        self.stop_prefetch()
        if self.mode != "shards":
            return
        order = self.shard_order(indices)
        self._plan = order
        if not order:
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._prefetch_run, args=(order, stop), daemon=True,
                                  name="torchforge-prefetch")
        self._prefetcher = (os.getpid(), thread, stop)
        thread.start()
        if wait:
            thread.join()

    def stop_prefetch(self) -> None:
        """Stop this process's prefetching after the fetch in flight (waits for it)."""
        running, self._prefetcher = self._prefetcher, None
        if running is not None and running[0] == os.getpid():
            running[2].set()
            running[1].join()

    def _prefetch_run(self, order: list[int], stop: threading.Event) -> None:
        budget = self.cache_limit / 2 if self.cache_limit is not None else float("inf")
        client = FetcherClient(self._remote_cache)  # its own connection, closed when done
        try:
            ahead = 0
            for pos, k in enumerate(order):
                ahead += self._stored_bytes(k)
                if stop.is_set() or ahead > budget:
                    return
                try:
                    self._fetch(client, k, [url for j in order[pos + 1:pos + 1 + NEXT_USE]
                                            for url, *_ in self._objects(j)])
                except Exception as e:  # noqa: BLE001 - the reader that needs this shard raises it
                    log.debug("prefetch of %s stopped: %s", self._url_of(k), e)
                    return
        finally:
            client.close()

    def _remote_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a pickled dataset's) without this process's connections, maps and threads."""
        state["_client_of"] = None  # a connection does not travel: the other process opens its own
        state["_held"] = None
        state["_prefetcher"] = None
        return state


class _Release:
    """Closes the hold descriptors once ``maps`` maps are gone (at once when there are none)."""

    def __init__(self, fds: list[int], maps: int) -> None:
        self.fds, self.left = fds, maps
        if maps == 0:
            self.one_gone(final=True)

    def one_gone(self, final: bool = False) -> None:
        self.left -= 0 if final else 1
        if self.left <= 0:
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)


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
        self.version = info.etag  # the pinned version of the dataset
        index = client.fetch(index_url, info.size, etag=info.etag, storage_options=self.storage_options)
        key = hashlib.sha256(f"{index_url}\0{info.etag}\0{info.size}".encode()).hexdigest()[:32]
        folder = os.path.join(client.cache_dir, "datasets", key)
        _place(index, os.path.join(folder, INDEX_BASENAME))
        super().__init__(folder, **kwargs)
        self._first = list(self._bounds)
        self._offsets: dict[int, list[int]] = {}
        self._decoders: dict[int, Any] = {}
        if mode == "ranges":
            whole = [m.zip_basename for m in self.metas if m.zip_basename is not None]
            if whole:
                raise ValueError(f"mode='ranges' needs shards that are not compressed as a whole; {whole[0]!r} "
                                 "is: use mode='shards'")

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
            (data,) = (self._download_read(client, k, span) if early
                       else client.get_ranges(url, span, storage_options=self.storage_options))
            if len(data) < head or struct.unpack_from("<I", data)[0] != m.samples:
                raise CorruptShardError(f"the shard's header does not hold {m.samples} samples as index.json "
                                        "says", path=url, offset=0)
            offs = list(struct.unpack_from(f"<{m.samples + 1}I", data, 4))
            if not (head <= offs[0] and offs[-1] == m.raw_bytes
                    and all(a <= b for a, b in itertools.pairwise(offs))):
                raise CorruptShardError("the shard's sample offsets are out of order or outside the shard",
                                        path=url, offset=4)
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
            for pos, j in rows:
                out[pos] = self._decode(k, j, got[k].get(offs[j], offs[j + 1]))
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
                return self._early_batch(indices)
            return self._limited_batch(indices)
        return self._read(self._checked(indices))

    def __iter__(self) -> Any:
        if self.mode != "ranges":
            yield from super().__iter__()
            return
        step = 256
        for first in range(0, len(self), step):
            yield from self._read(list(range(first, min(first + step, len(self)))))

    # --- mode="shards" ---------------------------------------------------------------------------------
    def _early_batch(self, indices: list[int]) -> list[Any]:
        """A batch in ``mode="shards"`` with no ``cache_limit``. Samples of shards this process has mapped
        or the node has cached are read from their maps. The others are read from their shards' downloads
        into the cache (:meth:`FetcherClient.read`: started if not in progress, the parts holding these
        samples fetched first), so a batch waits for a few parts, not for every whole shard it touches: an
        exactly shuffled first batch touches nearly every shard. The downloads go on to whole shards, once
        per node, and the next batches map them once complete. Shards compressed as a whole are mapped."""
        idx = self._checked(indices)
        out: list[Any] = [None] * len(idx)
        early: list[int] = []
        downloading: dict[int, bool] = {}  # shard -> read from its download (decided once per batch)
        for pos, i in enumerate(idx):
            k = bisect.bisect_right(self._bounds, i) - 1
            if k not in downloading:
                downloading[k] = (self._shards[k] is None and self.metas[k].zip_basename is None
                                  and k not in self._complete and self._cached(k) is None)
                if not downloading[k]:
                    self._complete.add(k)
            if downloading[k]:
                early.append(pos)
            else:
                out[pos] = self[i]
        if early:
            for pos, sample in zip(early, self._read([idx[pos] for pos in early], early=True)):
                out[pos] = sample
        return out

    # --- mode="shards" under a cache_limit ----------------------------------------------------------
    def _limited_batch(self, indices: list[int]) -> list[Any]:
        """A batch under a ``cache_limit``, read shard by shard (each shard this process touches is mapped
        once for the batch, not once per sample).

        When the whole shards this process downloads serve few samples each (fewer than ``BYPASS_SHARE`` of
        a shard's samples per download, judged after ``BYPASS_AFTER`` downloads: an order with no locality,
        such as an exact global shuffle, over a cache much smaller than the dataset, where the limit evicts
        a shard before much of it is read), it stops downloading whole shards for a few samples: from then on a shard it has mapped or the node has
        cached is read from its map, any other sample by its byte ranges as in ``mode="ranges"``. The
        decision is left in the dataset's folder of the node cache, so the next epoch's workers of the
        same training process start with it.
        """
        self._held_here()
        bounds = self._bounds
        idx = self._checked(indices)
        by_shard: dict[int, list[int]] = {}
        for pos, i in enumerate(idx):
            by_shard.setdefault(bisect.bisect_right(bounds, i) - 1, []).append(pos)
        out: list[Any] = [None] * len(idx)
        ranged: list[int] = []
        for k in sorted(by_shard):
            positions = by_shard[k]
            if self._bypass and self._shards[k] is None and self._cached(k) is None:
                ranged += positions
                continue
            for pos in positions:
                out[pos] = self[idx[pos]]
            self._served += len(positions)
        if ranged:
            for pos, sample in zip(ranged, self._read([idx[pos] for pos in ranged])):
                out[pos] = sample
        return out

    def _cached(self, k: int) -> str | None:
        url, size, etag, hashes = self._objects(k)[0]
        return self._client().cached(url, size, hashes=hashes, etag=etag)

    def _new_process(self) -> None:
        self._served = self._downloads = 0  # samples read from maps, whole shards downloaded: this process's
        self._bypass = os.path.exists(self._bypass_marker())

    def _on_download(self, k: int) -> None:
        self._downloads += 1
        before = self._downloads - 1  # what the downloads before this one served
        if self._bypass or before < BYPASS_AFTER or any(m.zip_basename for m in self.metas):
            return
        if self._served / before < BYPASS_SHARE * len(self) / len(self.metas):
            self._bypass = True
            with contextlib.suppress(OSError):
                open(self._bypass_marker(), "a").close()
            log.info("%s: the whole shards this process downloaded served %.1f samples each under "
                     "cache_limit=%d; reading uncached shards by byte ranges", self.url, self._served / before,
                     self.cache_limit)

    def _bypass_marker(self) -> str:
        """Where the decision is left for the next workers of the same training process (their parent)."""
        return os.path.join(self.folder, f".ranges-below-{self.cache_limit}-{os.getppid()}")

    def _check_file(self, m: ShardMeta) -> str:
        return ""  # fetched on first use (see _shard)

    def _shard(self, k: int) -> Any:
        if self.mode == "ranges":
            raise ValueError("mode='ranges' maps no shard: this needs mode='shards'")
        held = self._held_here()
        shard = self._shards[k]
        if shard is not None:
            held.move_to_end(k)
            return shard
        if not self._room:  # a map and a hold per shard
            ensure_open_files(2 * len(self.metas), "RemoteMDSDataset")
            self._room = True
        return self._mapped(k)

    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        m = self.metas[k]
        whole = m.zip_basename is not None  # the stored file is the compressed one
        entry = m.raw.get("zip_data" if whole else "raw_data") or {}
        hashes = entry.get("hashes") if isinstance(entry, dict) else None
        return [(f"{self.url}/{m.zip_basename or m.raw_basename}", (m.zip_bytes or 0) if whole else m.raw_bytes,
                 None, hashes if isinstance(hashes, dict) else None)]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        self._files[k] = paths[0]
        shard = MDSDataset._shard(self, k)
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
        return self._remote_state(super().__getstate__())


class _Spans:
    """Merged byte spans of one object and their bytes; :meth:`get` cuts out any range inside them."""

    def __init__(self, merged: list[tuple[int, int]], blobs: list[bytes]) -> None:
        self.merged = merged
        self.blobs = blobs

    def get(self, b: int, e: int) -> bytes:
        r = bisect.bisect_right(self.merged, (b, float("inf"))) - 1
        start = self.merged[r][0]
        return bytes(self.blobs[r][b - start:e - start])


def _merge(spans: list[tuple[int, int]], waste: float) -> list[tuple[int, int]]:
    """Sorted byte ranges merged across their smallest gaps while the gap bytes fetched stay within
    ``waste`` of the bytes the ranges hold (touching ranges always merge)."""
    if not spans:
        return []
    budget = waste * sum(e - s for s, e in spans)
    gaps = sorted((spans[i + 1][0] - spans[i][1], i) for i in range(len(spans) - 1))
    join = set()
    for gap, i in gaps:
        if gap > 0 and gap > budget:
            break
        join.add(i)
        budget -= max(gap, 0)
    out = [list(spans[0])]
    for i in range(1, len(spans)):
        if i - 1 in join:
            out[-1][1] = max(out[-1][1], spans[i][1])
        else:
            out.append(list(spans[i]))
    return [(s, e) for s, e in out]


def _place(src: str, dst: str) -> None:
    """Copy the fetched index.json to ``dst`` atomically (once: the folder is keyed by its version)."""
    if os.path.exists(dst):
        return
    folder = os.path.dirname(dst)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class RemoteJinxDataset(_RemoteShards, JinxDataset):
    """A JINX dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``): the folder's
    ``shard-NNNNN.jinx`` objects and their ``.binx`` sidecars, ``mode="shards"``.

    Opening lists the folder (``http(s)://``, which cannot list, is probed for ``shard-00000.jinx``,
    ``shard-00001.jinx``, ... instead) and reads each shard's footer with one or two small range reads
    (its sample count and split), so nothing is downloaded whole until a sample needs it. Every object's
    ETag is pinned then: a shard overwritten at the same URL afterwards raises
    :class:`~torchforge.remote.RemoteChangedError` naming it, never mixed into an epoch. A shard and its
    sidecar are fetched whole into the node's cache on first use (one download per node), held in use
    while mapped, and read as local shards; prefetching, ``cache_limit`` and ``cache_policy`` work as for
    :class:`RemoteMDSDataset`.

    Args:
        url: the folder's URL.
        lazy, split, on_error: as :class:`~torchforge.datasets.jinx.JinxDataset`.
        cache_dir, cache_limit, cache_policy, storage_options: as :class:`RemoteMDSDataset`.
        mode: ``"shards"`` only for JINX (``"ranges"`` raises ValueError: a JINX sample's line and its
            sidecar values are two dependent reads; use MDS for ranges).

    Raises:
        RemoteNotFoundError: nothing at the URL.
        FormatError: no ``shard-*.jinx`` objects there.
        CorruptShardError: a shard's footer is not a JINX footer (names the URL and byte offset).
    """

    def __init__(self, url: str, lazy: bool = True, split: str | None = None, on_error: str = "raise", *,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} is not one of ['raise', 'skip']")
        self._remote_setup(url, None, cache_dir, cache_limit, mode, cache_policy, storage_options)
        self._shards = None
        self.lazy = lazy
        self.split = split
        self.on_error = on_error
        self.skipped = 0
        self._room = False
        client = self._client()
        listed = self._listing(client, (".jinx", ".binx"))
        names = sorted(n for n in listed if n.startswith("shard-") and n.endswith(".jinx"))
        if not names:
            raise FormatError("folder holds no shard-*.jinx objects", path=self.url)
        if mode == "ranges":
            raise ValueError(f"{self.url}: mode='ranges' reads MDS and safetensors datasets; a JINX dataset at a "
                             "URL is read with mode='shards'")
        kept = []
        for name in names:
            u, size, etag = listed[name]
            count, shard_split = _jinx_footer(client, u, size, etag, self.storage_options)
            if split is not None and shard_split != split:
                continue
            objs: list[tuple[str, int, str | None, dict[str, str] | None]] = [(u, size, etag, None)]
            side = listed.get(name[:-len(".jinx")] + ".binx")
            if side is not None:
                objs.append((side[0], side[1], side[2], None))
            kept.append((objs, count, shard_split))
        self.shard_splits = [shard_split for _, _, shard_split in kept]  # from the footers
        self._remote_objs = [objs for objs, _, _ in kept]
        self._counts = [count for _, count, _ in kept]
        self._all_paths = [listed[n][0] for n in names]
        self._paths = [objs[0][0] for objs in self._remote_objs]
        self._starts, self._ends, total = [], [], 0
        for c in self._counts:
            self._starts.append(total)
            total += c
            self._ends.append(total)
        self._n = total
        self._first = [*self._starts, total]
        self._jshards: list[JinxShard | None] = [None] * len(self._remote_objs)
        pinned = json.dumps(sorted((u, n, e) for u, n, e in listed.values()))
        self.version = hashlib.sha256(pinned.encode()).hexdigest()[:32]  # every object's ETag and size
        self._folder = os.path.join(client.cache_dir, "datasets", self.version)
        os.makedirs(self._folder, exist_ok=True)

    # --- _RemoteShards ------------------------------------------------------------------------------
    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        return self._remote_objs[k]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        objs = self._remote_objs[k]
        shard = JinxShard(paths[0], bin_path=paths[1] if len(paths) > 1 else paths[0] + ".no-sidecar")
        if len(paths) > 1:
            shard._open_sidecar(0)  # mapped now, so that its map is held with the shard's
        if shard.num_samples != self._counts[k] or not self._wanted(shard):
            raise FormatError(f"the shard holds {shard.num_samples} samples, its footer said {self._counts[k]} "
                              "when the dataset was opened", path=objs[0][0])
        shard.path = objs[0][0]  # errors from now on name the URL
        shard.bin_path = objs[1][0] if len(objs) > 1 else os.path.splitext(objs[0][0])[0] + ".binx"
        self._jshards[k] = shard
        return shard, [shard._mm, shard._bin_mm]

    def _drop(self, k: int | None) -> None:
        if k is None:
            self._jshards = [None] * len(self._remote_objs)
            self._set_shards(None)
            self._room = False
        else:
            self._jshards[k] = None

    # --- JinxDataset --------------------------------------------------------------------------------
    def _shard(self, k: int) -> JinxShard:
        held = self._held_here()
        shard = self._jshards[k]
        if shard is not None:
            held.move_to_end(k)
            return shard
        if not self._room:  # a map per shard and sidecar, and a hold for each
            ensure_open_files(4 * len(self._remote_objs), "RemoteJinxDataset")
            self._room = True
        return self._mapped(k)

    def _open(self) -> Any:
        shards = _LazyShards(self)
        self._set_shards(shards)
        return shards

    def shard_files(self) -> list[str]:
        return [p for k in sorted(self._fetched) for p in self._fetched[k]]

    @property
    def root(self) -> str:
        """The dataset's folder in the node's cache (key caches go there)."""
        return self._folder

    def __getstate__(self) -> dict[str, Any]:
        state = self._remote_state(super().__getstate__())
        state["_jshards"] = [None] * len(self._remote_objs)
        return state


class RemoteSafetensorsDataset(_RemoteShards, SafetensorsDataset):
    """A folder of safetensors column shards at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``).

    Opening lists the folder (an ``http(s)://`` one is probed for ``shard-00000.safetensors``, ...) and
    reads each shard's header with two small range reads (its columns and sample count), pinning every
    object's ETag; a shard is fetched whole into the node's cache on first use, held in use while mapped
    and read as a local shard (zero-copy views into its map: a sample keeps its shard mapped while it
    lives). ``cache_limit``, ``cache_policy`` and prefetching work as for :class:`RemoteMDSDataset`. With
    ``mode="ranges"`` no shard is fetched: a batch's rows are read by byte ranges, one coalesced read per
    shard it touches, into tensors of their own.

    Args:
        url: the folder's URL.
        columns: as :class:`~torchforge.datasets.safetensors.SafetensorsDataset`.
        cache_dir, cache_limit, cache_policy, storage_options: as :class:`RemoteMDSDataset`.
        mode: ``"shards"`` or ``"ranges"``.

    Raises:
        RemoteNotFoundError: nothing at the URL.
        FormatError: no ``*.safetensors`` objects there.
        SafetensorsError, CorruptShardError: a shard's header is invalid (names the URL and offset).
    """

    _FORMAT = "SafetensorsDataset"

    def __init__(self, url: str, *, columns: Any = None, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self._remote_setup(url, None, cache_dir, cache_limit, mode, cache_policy, storage_options)
        client = self._client()
        listed = self._listing(client, (".safetensors",))
        names = sorted(n for n in listed if n.endswith(".safetensors") and not n.startswith("."))
        if not names:
            raise FormatError("folder holds no *.safetensors objects", path=self.url)
        self.path = self.url
        self._cols, self._ends = [], []
        self._remote_objs = []
        self._heads: list[tuple[int, dict[str, Any]]] = []  # (data start, header entries) per shard
        for name in names:
            u, size, etag = listed[name]
            (head,) = client.get_ranges(u, [(0, min(8, size))], etag=etag, storage_options=self.storage_options)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if n <= MAX_HEADER_SIZE and 8 + n <= size:
                    (rest,) = client.get_ranges(u, [(8, 8 + n)], etag=etag, storage_options=self.storage_options)
                    head += rest
            n, infos, meta = parse_header(head, size, u)
            self._add_shard(infos, meta, columns, u)
            self._remote_objs.append([(u, size, etag, None)])
            self._heads.append((8 + n, infos))
        self._files = [""] * len(names)
        self._open = {}
        self._first = [0, *self._ends]
        self._ragged: dict[tuple[int, str], np.ndarray] = {}  # (shard, column) -> offsets (mode="ranges")

    # --- mode="ranges" ------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        if self.mode == "ranges":
            return self.__getitems__([i])[0]
        return super().__getitem__(i)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples; in ``mode="ranges"`` each sample's rows are read by byte ranges, one
        coalesced read per shard the batch touches."""
        idx = self._checked(indices)
        if self.mode != "ranges":
            return [self._get(i) for i in idx]
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(idx):
            s = bisect.bisect_right(self._ends, i)
            by_shard.setdefault(s, []).append((pos, i - (self._ends[s - 1] if s else 0)))

        span_of: dict[tuple[int, int, str], tuple[int, int]] = {}  # (shard, row, column) -> its bytes

        def spans(client: Any, s: int) -> list[tuple[int, int]]:
            for _, j in by_shard[s]:
                for c in self._cols[s]:
                    span_of[(s, j, c)] = self._row_span(client, s, c, j)
            return [span_of[(s, j, c)] for _, j in by_shard[s] for c in self._cols[s]]

        got = self._read_spans(list(by_shard), spans)
        out: list[Any] = [None] * len(idx)
        for s, rows in by_shard.items():
            for pos, j in rows:
                out[pos] = {c: self._row_tensor(s, c, j, span_of[(s, j, c)], got[s]) for c in self._cols[s]}
        return out

    def _row_span(self, client: Any, s: int, c: str, j: int) -> tuple[int, int]:
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
                (raw,) = client.get_ranges(url, [(start + oi.start, start + oi.end)], etag=self._objects(s)[0][2],
                                           storage_options=self.storage_options)
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
        held = self._held_here()
        got = self._open.get(s)
        if got is not None:
            held.move_to_end(s)
            return got
        return self._mapped(s)

    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        return self._remote_objs[k]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        self._files[k] = paths[0]
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


class _LazyShards(Sequence):
    """A remote JINX dataset's shards, each fetched and mapped on first access."""

    def __init__(self, ds: RemoteJinxDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds._remote_objs)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return self.ds._jshards[k] or self.ds._shard(k)


def _jinx_footer(client: Any, url: str, size: int, etag: str | None,
                 storage_options: Mapping[str, Any]) -> tuple[int, str | None]:
    """A remote JINX shard's sample count and split, from its footer: one range read of the file's tail
    (a second one when the footer is longer than the tail)."""
    tail = min(size, 8 << 10)
    (data,) = client.get_ranges(url, [(size - tail, size)], etag=etag, storage_options=storage_options)
    base = size - tail
    if len(data) < 2 or data[-1:] != b"\n":
        raise CorruptShardError("the file does not end with the footer-offset line (truncated or not a JINX "
                                "shard)", path=url, offset=size)
    nl = data.rfind(b"\n", 0, len(data) - 1)
    digits = data[nl + 1:-1]
    if nl < 0 or not digits.isdigit():
        raise CorruptShardError(f"last line {digits[-24:]!r} is not the footer's byte offset (truncated or not "
                                "a JINX shard)", path=url, offset=base + max(nl + 1, 0))
    foot = int(digits)
    if foot >= base + nl:
        raise CorruptShardError(f"footer offset {foot} is not before the last line", path=url, offset=base + nl + 1)
    if foot >= base:
        raw = data[foot - base:nl]
    else:
        (raw,) = client.get_ranges(url, [(foot, base + nl)], etag=etag, storage_options=storage_options)
    try:
        footer = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CorruptShardError(f"footer is not valid JSON ({e})", path=url, offset=foot) from None
    n = footer.get("num_samples") if isinstance(footer, dict) else None
    if type(n) is not int or n < 0:
        raise CorruptShardError(f"footer num_samples={n!r} is not a non-negative integer", path=url, offset=foot)
    split = footer.get("split")
    return n, split if isinstance(split, str) else None


def open_remote(url: str, **kwargs: Any) -> Any:
    """The dataset at ``url``: MDS when the folder (or its ``split`` sub-folder) holds index.json, else
    JINX (``shard-*.jinx`` objects, ``split`` selecting by footer as for local JINX), else safetensors
    column shards (``*.safetensors``)."""
    split = kwargs.get("split")
    folder = url.rstrip("/") + (f"/{split.strip('/')}" if split else "")
    client = connect(None if kwargs.get("cache_dir") is None else os.path.abspath(os.fspath(kwargs["cache_dir"])))
    try:
        client.head(f"{folder}/{INDEX_BASENAME}", storage_options=kwargs.get("storage_options"))
        return RemoteMDSDataset(url, **kwargs)
    except RemoteNotFoundError:
        pass
    found = False  # any object below the folder
    for cls in (RemoteJinxDataset, RemoteSafetensorsDataset):
        try:
            return cls(url, **kwargs)
        except RemoteNotFoundError:  # nothing listed (or, over http, no shard-00000 of that format)
            continue
        except (CorruptShardError, SafetensorsError):
            raise
        except FormatError:  # objects, none of this format
            found = True
    if not found:
        raise RemoteNotFoundError("no dataset here: no index.json (MDS) and no shards below the folder",
                                  url=f"{folder}/{INDEX_BASENAME}")
    raise FormatError("not a dataset at this URL: no index.json (MDS), no shard-*.jinx (JINX) and no "
                      "*.safetensors objects", path=url)
