"""MDS datasets in object storage, ``mode="shards"``: ``open_dataset("s3://bucket/train")``.

``index.json`` is read when the dataset is opened and pins the version the run reads: its ETag keys the
node-local cache, so a dataset overwritten at the same URL is a new cache entry, never mixed into the
files of the old one. Each shard is fetched whole into the node-local cache on its first use, through
the node's fetcher process (:mod:`torchforge.remote`: one download per shard per node whatever the
number of ranks and DataLoader workers, size and the hashes index.json records checked before the file
is used, nothing partial ever read), then memory-mapped as a local shard. DataLoader workers, forked
or spawned, reach the fetcher themselves; no process here ever imports the object-store client.

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

A mapped shard is held in use until its map is gone (see ``_shard``): no eviction removes a file a
reader maps, so the disk the cache uses is the files it can count. With a ``cache_limit`` each process
keeps at most its share of half the limit mapped.

Not yet here (issue 13): JINX and safetensors datasets at a URL.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import operator
import os
import shutil
import struct
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from torchforge._limits import ensure_open_files
from torchforge.datasets.mds import MDSDataset
from torchforge.errors import CorruptShardError
from torchforge.formats.mds import INDEX_BASENAME
from torchforge.formats.mds_reader import SampleDecoder, ShardMeta
from torchforge.remote import FetcherClient, ObjectCache, connect, is_remote
from torchforge.sizes import parse_size

__all__ = ["RemoteMDSDataset", "is_remote"]

log = logging.getLogger(__name__)

MODES = ("shards", "ranges")
POLICIES = ("belady", "lru")
NEXT_USE = 8  # shards named as "needed next" in each fetch request (Belady's rule evicts the others first)
RANGE_WASTE = 0.1  # bytes between merged ranges, as a share of the bytes a batch reads
READERS = 4  # shards whose ranges a process reads at once (one fetcher connection each)


class RemoteMDSDataset(MDSDataset):
    """An MDS dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``).

    Args:
        url: the dataset's folder URL (the one holding index.json).
        split: a sub-folder.
        cache_dir: the node-local cache (default: the per-user cache folder, never the data folder).
        cache_limit: the most bytes the cache may hold (bytes or ``"50GB"``); None for no limit.
        mode: ``"shards"`` (whole shards fetched on first use) or ``"ranges"`` (byte ranges per batch).
        cache_policy: what the cache evicts when ``cache_limit`` needs room: ``"belady"`` (the shard needed
            furthest in the future, as far as the fetches in flight tell) or ``"lru"``.
        storage_options: endpoint, region, credentials, anonymous, allow_http; the standard environment
            variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... ``AWS_ALLOW_HTTP``) apply too.
        **kwargs: :class:`~torchforge.datasets.mds.MDSDataset`'s options (columns, lazy, zero_copy, ...).

    Raises:
        RemoteNotFoundError: no index.json at the URL (names it).
        RemoteError: the store refused or failed (names the URL).
    """

    def __init__(self, url: str, split: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {list(MODES)}")
        if cache_policy not in POLICIES:
            raise ValueError(f"cache_policy={cache_policy!r} is not one of {list(POLICIES)}")
        self.cache_policy = cache_policy
        self._held: tuple[int, OrderedDict[int, int]] | None = None  # (pid, this process's mapped shards)
        self._plan: list[int] = []  # shards in the order of first use, as the last prefetch() was told
        self._prefetcher: tuple[int, threading.Thread, threading.Event] | None = None  # (pid, thread, stop)
        if mode == "ranges" and kwargs.get("lazy"):
            raise ValueError("lazy=True needs mode='shards' (a lazy sample maps its shard)")
        self.url = url.rstrip("/") + (f"/{split.strip('/')}" if split else "")
        self.mode = mode
        self.storage_options = dict(storage_options or {})
        self.cache_limit = None if cache_limit is None else parse_size(cache_limit, option="cache_limit")
        self._remote_cache = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self._client_of: tuple[Any, ...] | None = None  # (pid, connections, thread pool)
        client = self._client()
        index_url = f"{self.url}/{INDEX_BASENAME}"
        info = client.head(index_url, storage_options=self.storage_options)
        self.version = info.etag  # the pinned version of the dataset
        index = client.fetch(index_url, info.size, etag=info.etag, storage_options=self.storage_options)
        key = hashlib.sha256(f"{index_url}\0{info.etag}\0{info.size}".encode()).hexdigest()[:32]
        folder = os.path.join(client.cache_dir, "datasets", key)
        _place(index, os.path.join(folder, INDEX_BASENAME))
        super().__init__(folder, **kwargs)
        self._offsets: dict[int, list[int]] = {}
        self._decoders: dict[int, Any] = {}
        if mode == "ranges":
            whole = [m.zip_basename for m in self.metas if m.zip_basename is not None]
            if whole:
                raise ValueError(f"mode='ranges' needs shards that are not compressed as a whole; {whole[0]!r} "
                                 "is: use mode='shards'")

    def _client(self) -> Any:
        """This process's connection to the node's fetcher (a forked worker opens its own)."""
        return self._clients()[0]

    def _clients(self) -> list[Any]:
        """This process's ``READERS`` connections to the fetcher (one request at a time each) and the
        threads that use them to read several shards' ranges at once."""
        if self._client_of is None or self._client_of[0] != os.getpid():
            n = READERS if self.mode == "ranges" else 1
            # the first is the process's shared client (the calling thread's); the reader threads each get
            # their own connection: a client serves one request at a time
            clients = [connect(self._remote_cache)] + [FetcherClient(self._remote_cache) for _ in range(n - 1)]
            self._client_of = (os.getpid(), clients, ThreadPoolExecutor(n, thread_name_prefix="torchforge-ranges"))
        return self._client_of[1]

    # --- mode="ranges" ------------------------------------------------------------------------------
    def _shard_url(self, k: int) -> str:
        return f"{self.url}/{self.metas[k].raw_basename}"

    def _offsets_of(self, k: int, client: Any = None) -> list[int]:
        """Shard ``k``'s sample offsets, read once (one small range) and checked like a local shard's."""
        offs = self._offsets.get(k)
        if offs is None:
            m, url = self.metas[k], self._shard_url(k)
            head = 4 + 4 * (m.samples + 1)
            (data,) = (client or self._client()).get_ranges(url, [(0, min(head, m.raw_bytes))],
                                                            storage_options=self.storage_options)
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

    def _read(self, indices: list[int]) -> list[Any]:
        """The samples at ``indices`` (in order): one coalesced read per shard they touch."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            k, j = self._locate(i)
            by_shard.setdefault(k, []).append((pos, j))
        out: list[Any] = [None] * len(indices)
        clients = self._clients()

        def read(n: int, k: int) -> tuple[list[tuple[int, int]], list[bytes]]:
            client = clients[n % len(clients)]
            offs = self._offsets_of(k, client)
            merged = _merge(sorted({(offs[j], offs[j + 1]) for _, j in by_shard[k]}), RANGE_WASTE)
            return merged, client.get_ranges(self._shard_url(k), merged, gap=0, storage_options=self.storage_options)

        shards = list(by_shard)
        if len(shards) == 1:
            results = [read(0, shards[0])]
        else:  # the shards' requests at once, one connection each (READERS at a time)
            assert self._client_of is not None
            results = list(self._client_of[2].map(read, range(len(shards)), shards))
        for k, (merged, blobs) in zip(shards, results):
            offs = self._offsets[k]
            for pos, j in by_shard[k]:
                b, e = offs[j], offs[j + 1]
                r = bisect.bisect_right(merged, (b, float("inf"))) - 1
                start = merged[r][0]
                out[pos] = self._decode(k, j, bytes(blobs[r][b - start:e - start]))
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
            return [self[i] for i in indices]
        n = len(self)
        idx = [operator.index(i) for i in indices]
        for i in idx:
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for MDSDataset of {n} samples")
        return self._read([i + n if i < 0 else i for i in idx])

    def __iter__(self) -> Any:
        if self.mode != "ranges":
            yield from super().__iter__()
            return
        step = 256
        for first in range(0, len(self), step):
            yield from self._read(list(range(first, min(first + step, len(self)))))

    def _check_file(self, m: ShardMeta) -> str:
        return ""  # fetched on first use (see _shard)

    def _shard(self, k: int) -> Any:
        """Shard ``k`` mapped, fetched into the node's cache first if absent.

        A mapped shard is held in use (:meth:`ObjectCache.hold`) until its map is gone (the last sample
        or zero-copy value that needs it included), so no process's eviction removes a file a reader has
        mapped: an unlinked file that is still mapped keeps its disk space, which the cache could not
        count. With a ``cache_limit`` a process keeps at most its share of half the limit mapped (the
        limit over twice the node's reading processes: ``LOCAL_WORLD_SIZE`` times the DataLoader's
        workers), dropping its least recently used maps first, and holds nothing while it waits for room.
        """
        if self.mode == "ranges":
            raise ValueError("mode='ranges' maps no shard: this needs mode='shards'")
        held = self._held_here()
        shard = self._shards[k]
        if shard is not None:
            held.move_to_end(k)
            return shard
        self._make_room(held, self._stored_bytes(k))
        if not self._room:  # a map and a hold per shard
            ensure_open_files(2 * len(self.metas), "RemoteMDSDataset")
            self._room = True
        pin = ObjectCache(self._client().cache_dir).hold(self._url_of(k))
        try:
            for attempt in range(3):
                if not self._files[k] or not os.path.exists(self._files[k]):  # evicted before it was held
                    self._files[k] = self._fetch(self._client(), k, self._next_use(k))
                try:
                    shard = super()._shard(k)
                    break
                except FileNotFoundError:
                    self._files[k] = ""
                    if attempt == 2:
                        raise
        except BaseException:
            os.close(pin)
            raise
        if shard._mm is None:  # an empty shard maps nothing
            os.close(pin)
        else:
            weakref.finalize(shard._mm, os.close, pin)  # let go when the map is gone, not before
        held[k] = self._stored_bytes(k)
        return shard

    def _held_here(self) -> OrderedDict[int, int]:
        """This process's mapped shards (shard -> bytes), least recently used first. A forked worker
        drops the maps it inherited (its copies of their holds go with them)."""
        if self._held is None or self._held[0] != os.getpid():
            if self._held is not None:
                self._shards = [None] * len(self.metas)
                self._room = False
            self._held = (os.getpid(), OrderedDict())
        return self._held[1]

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
            self._shards[old] = None  # unmapped, and its hold released, once nothing uses it
            total -= nbytes

    def _fetch(self, client: Any, k: int, next_use: list[str]) -> str:
        """Shard ``k`` in the node's cache (fetched if absent): its path."""
        m = self.metas[k]
        entry = m.raw.get("zip_data" if m.zip_basename is not None else "raw_data") or {}
        hashes = entry.get("hashes") if isinstance(entry, dict) else None
        return client.fetch(self._url_of(k), self._stored_bytes(k),
                            hashes=hashes if isinstance(hashes, dict) else None, cache_limit=self.cache_limit,
                            policy=self.cache_policy, storage_options=self.storage_options, next_use=next_use)

    def _url_of(self, k: int) -> str:
        """The URL of shard ``k``'s stored file (the compressed one for a shard compressed as a whole)."""
        m = self.metas[k]
        return f"{self.url}/{m.zip_basename or m.raw_basename}"

    def _stored_bytes(self, k: int) -> int:
        """The size of shard ``k``'s stored file."""
        m = self.metas[k]
        return (m.zip_bytes or 0) if m.zip_basename is not None else m.raw_bytes

    def _next_use(self, k: int) -> list[str]:
        """The shards needed after shard ``k``: from the planned order when there is one, else the next ones
        in index order."""
        plan = self._plan
        if k in plan:
            at = plan.index(k) + 1
            after = plan[at:at + NEXT_USE]
        else:
            after = list(range(k + 1, min(k + 1 + NEXT_USE, len(self.metas))))
        return [self._url_of(j) for j in after]

    # --- prefetching --------------------------------------------------------------------------------
    def shard_order(self, indices: Any) -> list[int]:
        """The shards that ``indices`` read, in the order of their first use."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        ks = np.searchsorted(np.asarray(self._bounds, dtype=np.int64), idx, side="right") - 1
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
                    self._fetch(client, k, [self._url_of(j) for j in order[pos + 1:pos + 1 + NEXT_USE]])
                except Exception as e:  # noqa: BLE001 - the reader that needs this shard raises it
                    log.debug("prefetch of %s stopped: %s", self._url_of(k), e)
                    return
        finally:
            client.close()

    def shard_files(self) -> list[str]:
        return [os.path.join(self.folder, INDEX_BASENAME)] + [f for f in self._files if f]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_client_of"] = None  # a connection does not travel: the other process opens its own
        state["_held"] = None
        state["_prefetcher"] = None
        return state


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
