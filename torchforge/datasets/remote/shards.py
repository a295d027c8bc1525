"""What every dataset at a URL shares: fetcher connections, shards fetched whole into the node's cache
and held while mapped, prefetching in the sampler's order, and coalesced byte-range reads."""
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
import threading
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from torchforge._limits import ensure_open_files
from torchforge.errors import CorruptShardError, FormatError, TorchforgeError
from torchforge.remote import FetcherClient, RemoteCorruptError, RemoteError, RemoteNotFoundError, connect
from torchforge.sizes import parse_size

log = logging.getLogger(__name__)

MODES = ("shards", "ranges")
POLICIES = ("belady", "lru")
NEXT_USE = 64  # shards named as "needed next" in each fetch request, at least (Belady's rule evicts the others first)
MAX_NEXT_USE = 1024  # and at most (see _horizon)
BEHIND = 8  # shards before a fetched one that its fetch names too (see _needed_after)
RANGE_WASTE = 0.1  # bytes between merged ranges, as a share of the bytes a batch reads
READERS = 8  # shards whose ranges a process reads at once (one fetcher connection each)
BYPASS_SHARE = 0.1  # whole shards downloaded serving fewer samples than this share of one: read ranges instead
# (0: never switch to ranges, for either reason; see _limited_batch)
BYPASS_AFTER = 4  # downloads before that is judged


@contextlib.contextmanager
def as_urls(names: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name objects by their URLs, not by their files in the node's cache: a
    TorchforgeError whose path is one of ``names`` (cache file -> URL) is raised with that URL as its path
    (its type, offset and the rest kept), and the cache files named in its reason become URLs too."""
    try:
        yield
    except TorchforgeError as e:
        if e.path in names:
            for local, url in names.items():
                e.reason = e.reason.replace(local, url).replace(os.path.basename(local), url)
            e.path = names[e.path]
            e.args = (str(e),)
        raise



def content_version(listed: Mapping[str, tuple[str, int, str | None]]) -> str:
    """A dataset's version from its objects' names, sizes and ETags (``listed``: name -> (URL, size, ETag)),
    without their URLs: a copy of it elsewhere whose store gives the same ETags has the same version."""
    pinned = json.dumps(sorted((name, size, etag) for name, (_, size, etag) in listed.items()))
    return hashlib.sha256(pinned.encode()).hexdigest()[:32]


def read_twice(fn: Callable[[], Any]) -> Any:
    """``fn()``, a read of bytes over the network and their checks, once more if the checks fail: bytes
    damaged on the way (the right length, over plain HTTP) pass the second time; the same failure twice
    stands."""
    try:
        return fn()
    except (CorruptShardError, FormatError):
        return fn()


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
    version: str  # the pinned version: index.json's ETag, or a hash of every object's ETag
    format_name: str
    _first: list[int]
    _key_cache_file: Callable[[Any], str | None]  # ShardDataset's

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
        self._plan_at: dict[int, int] = {}  # shard -> its place in _plan (a fetch looks its shard up there)
        self._horizon_n: int | None = None  # see _horizon
        self._store_sizes: dict[str, int] = {}  # object URL -> the size the store gave where the index differs
        self._prefetcher: tuple[int, threading.Thread, threading.Event] | None = None  # (pid, thread, stop)
        self._bypass = False  # this process reads uncached shards by ranges (see _limited_batch)
        self._judging = False  # a _limited_batch is fetching: its downloads count toward the switch
        self._bypass_token = uuid.uuid4().hex  # names the switch's marker: this dataset object's workers only
        self._complete: set[int] = set()  # shards seen cached or mapped (mode="shards", no cache_limit)
        self._done_objects: dict[int, dict[int, str]] = {}  # shard -> its objects whose downloads an early read saw end

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

    def _warn_unversioned(self) -> None:
        """Warn, naming the first one, where objects have no version to pin: the server gives neither an
        ETag nor a Last-Modified time, and no hash is recorded for them. Then nothing tells a shard rewritten
        at the same URL and size from the one in the node's cache, and such a rewrite is not detected."""
        bare = [url for k in range(len(self._first) - 1) for url, _, etag, hashes in self._objects(k)
                if etag is None and not hashes]
        if bare:
            more = f" (and {len(bare) - 1} more)" if len(bare) > 1 else ""
            warnings.warn(f"{bare[0]}{more}: the server gives neither an ETag nor a Last-Modified time, and no "
                          "hash is recorded: a shard rewritten at the same size cannot be told from the one in "
                          "the cache (serve ETags, or record shard hashes in the index)", stacklevel=3)

    # --- connections --------------------------------------------------------------------------------
    def _client(self) -> Any:
        """This process's connection to the node's fetcher (a forked worker opens its own)."""
        return self._clients()[0]

    def _clients(self, wide: bool = False) -> list[Any]:
        """This process's ``READERS`` connections to the fetcher (one request at a time each) and the
        threads that use them to read several shards' ranges at once (one connection where this process
        reads whole shards only, unless ``wide``: opening a dataset reads every shard's head)."""
        n = READERS if wide or self.mode == "ranges" or self._bypass or (self._EARLY and self.cache_limit is None) \
            else 1
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

    def _one_object(self, client: Any, suffixes: tuple[str, ...]) -> dict[str, tuple[str, int, str | None]] | None:
        """A URL naming one shard object (ending in ``suffixes[0]``), opened as a local dataset opens one file:
        that object and its companions beside it (the other suffixes, e.g. a JINX shard's ``.binx``), found by
        HEAD requests, with no listing; the object first. None where the URL does not end so, or where no such
        object exists (a folder whose name ends so is listed as a folder).

        Raises:
            RemoteAccessError: access denied.
        """
        if not self.url.endswith(suffixes[0]):
            return None
        folder, name = self.url.rsplit("/", 1)
        stem = name[:-len(suffixes[0])]
        out: dict[str, tuple[str, int, str | None]] = {}
        for n in (name, *(stem + s for s in suffixes[1:])):
            try:
                info = client.head(f"{folder}/{n}", storage_options=self.storage_options)
            except RemoteNotFoundError:
                if n == name:
                    return None
                continue
            out[n] = (f"{folder}/{n}", info.size, info.etag)
        return out

    def _probe(self, client: Any, suffixes: tuple[str, ...]) -> dict[str, tuple[str, int, str | None]]:
        """The shards found by HEAD requests, ``READERS`` shards' names at a time."""
        out: dict[str, tuple[str, int, str | None]] = {}

        def head(client: Any, name: str) -> Any:
            try:
                return client.head(f"{self.url}/{name}", storage_options=self.storage_options)
            except RemoteNotFoundError as e:
                return e

        canary = f".torchforge-no-such-object-{uuid.uuid4().hex}"
        if not isinstance(head(client, canary), RemoteNotFoundError):
            # (a "soft 404": the probe below would look for shard after shard for ever)
            raise RemoteError(f"the server answers for an object that does not exist ({self.url}/{canary}), so missing "
                              "shards cannot be told from present ones and the dataset's end cannot be found: "
                              "serve it from a server that answers 404 for a missing path (or from object "
                              "storage, which lists a folder)", url=self.url)
        for first in itertools.count(0, READERS):
            shards = [f"shard-{k:05d}" for k in range(first, first + READERS)]
            names = [shard + suffix for shard in shards for suffix in suffixes]
            got = dict(zip(names, self._spread(head, names, wide=True)))
            for shard in shards:  # up to the first shard missing
                if isinstance(got[shard + suffixes[0]], RemoteNotFoundError):
                    if not out:
                        raise got[shard + suffixes[0]]
                    return out
                for name in (shard + suffix for suffix in suffixes):
                    info = got[name]
                    if not isinstance(info, RemoteNotFoundError):
                        out[name] = (f"{self.url}/{name}", info.size, info.etag)
        raise AssertionError("unreachable")

    def _checked(self, indices: list[int]) -> list[int]:
        """A batch's indices as non-negative ints; IndexError (naming the format) for one out of range."""
        n = len(self)
        idx = [operator.index(i) for i in indices]
        for i in idx:
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for {self._FORMAT} of {n} samples")
        return [i + n if i < 0 else i for i in idx]

    # --- mode="shards" with no cache_limit: batches read from downloads in progress -------------------
    def _early_batch(self, idx: list[int]) -> list[Any]:
        """A batch (valid indices) in ``mode="shards"`` with no ``cache_limit``. Samples of shards this
        process has mapped or the node has cached are read from their maps. The others are read by byte
        ranges from their shards' downloads into the cache (:meth:`FetcherClient.read`: started if not in
        progress, the parts holding these samples fetched first), so a batch waits for a few parts, not
        for every whole shard it touches: an exactly shuffled first batch touches nearly every shard. The
        downloads go on to whole files, once per node, and the next batches map them once complete.
        A format gives :meth:`_shard_index`, :meth:`_at_hand` and ``_read(indices, early=True)``."""
        out: list[Any] = [None] * len(idx)
        early: list[int] = []
        downloading: dict[int, bool] = {}  # shard -> read from its download (decided once per batch)
        for pos, i in enumerate(idx):
            k = self._shard_index(i)
            if k not in downloading:
                downloading[k] = k not in self._complete and not self._at_hand(k)
                if not downloading[k]:
                    self._complete.add(k)
            if downloading[k]:
                early.append(pos)
            else:
                out[pos] = self._get(i)
        if early:
            for pos, sample in zip(early, self._read([idx[pos] for pos in early], early=True)):
                out[pos] = sample
        return out

    def _shard_index(self, i: int) -> int:
        """The shard holding sample ``i``."""
        return bisect.bisect_right(self._first, i) - 1

    def _at_hand(self, k: int) -> bool:
        """Whether shard ``k`` is read from a map (mapped here, or every object of it cached on the node)
        rather than from its downloads."""
        client = self._client()
        return all(client.cached(url, size, hashes=hashes, etag=etag) is not None
                   for url, size, etag, hashes in self._objects(k))

    # --- mode="shards" under a cache_limit: whole shards, or byte ranges once they serve few samples ---
    def _limited_batch(self, idx: list[int]) -> list[Any]:
        """A batch (valid indices) under a ``cache_limit``, read shard by shard (each shard this process
        touches is mapped once for the batch, not once per sample).

        When the whole shards this process downloads serve few samples each (fewer than ``BYPASS_SHARE`` of
        a shard's samples per download, judged after ``BYPASS_AFTER`` downloads: an order with no locality,
        such as an exact global shuffle, over a cache much smaller than the dataset, where the limit evicts
        a shard before much of it is read), or at once when one batch needs more bytes of shards not at
        hand than the whole ``cache_limit`` (they would evict each other inside the batch), it stops
        downloading whole shards for a few samples: from then on a shard it has mapped or the node has
        cached is read from its map, any other sample by its byte ranges as in ``mode="ranges"``. Only the
        downloads of these batches count (a sequential pass, such as a key pass or ``__iter__``, serves its
        shards whole and is not judged). The decision is left in
        the dataset's folder of the node cache under a name drawn when the dataset object was made, so the
        next epoch's workers of this dataset object start with it, and no other dataset, split or later
        run does. A format gives :meth:`_at_hand` and ``_read(indices)``.
        """
        self._held_here()
        self._judging = True
        try:
            return self._limited_read(idx)
        finally:
            self._judging = False

    def _limited_read(self, idx: list[int]) -> list[Any]:
        by_shard: dict[int, list[int]] = {}
        for pos, i in enumerate(idx):
            by_shard.setdefault(self._shard_index(i), []).append(pos)
        if (self._judging and not self._bypass and BYPASS_SHARE > 0 and self._ranges_ok()
                and sum(map(self._stored_bytes, by_shard)) > self.cache_limit):  # (no I/O: the index's sizes)
            need = sum(self._stored_bytes(k) for k in by_shard if not self._at_hand(k))
            if need > self.cache_limit:  # whole shards would evict each other inside this one batch
                self._switch_to_ranges(f"one batch needs {need} bytes of shards not at hand, more than "
                                       f"cache_limit={self.cache_limit}")
        out: list[Any] = [None] * len(idx)
        ranged: list[int] = []
        for k in sorted(by_shard):
            positions = by_shard[k]
            if self._bypass and not self._at_hand(k):
                ranged += positions
                continue
            for pos in positions:
                out[pos] = self._get(idx[pos])
            self._served += len(positions)
        if ranged:
            for pos, sample in zip(ranged, self._read([idx[pos] for pos in ranged])):
                out[pos] = sample
        return out

    def _new_process(self) -> None:
        """This process maps its first shard: its counts start at zero, and it reads by ranges from the
        start if an earlier worker of the same training process decided so."""
        self._served = self._downloads = 0  # samples read from maps, whole shards downloaded: this process's
        self._bypass = self.cache_limit is not None and os.path.exists(self._bypass_marker())

    def _on_download(self, k: int) -> None:
        """This process's fetch of shard ``k`` downloaded it: after ``BYPASS_AFTER`` downloads, whether whole
        shards still pay (see :meth:`_limited_batch`)."""
        if not self._judging:
            return
        self._downloads += 1
        before = self._downloads - 1  # what the downloads before this one served
        if self._bypass or before < BYPASS_AFTER or not self._ranges_ok():
            return
        if self._served / before < BYPASS_SHARE * len(self) / (len(self._first) - 1):  # type: ignore[arg-type]
            self._switch_to_ranges(f"the whole shards this process downloaded served "
                                   f"{self._served / before:.1f} samples each under cache_limit={self.cache_limit}")

    def _switch_to_ranges(self, why: str) -> None:
        """From now on read shards not at hand by byte ranges, and leave the decision for the next workers
        of this dataset object."""
        self._bypass = True
        with contextlib.suppress(OSError):
            open(self._bypass_marker(), "a").close()
        log.info("%s: %s; reading uncached shards by byte ranges", self.url, why)

    def _ranges_ok(self) -> bool:
        """Whether every sample can be read by byte ranges (a format may say no)."""
        return True

    def _node_folder(self) -> str:
        """The dataset's folder in the node's cache, keyed by its pinned version (made if absent)."""
        folder = os.path.join(self._client().cache_dir, "datasets", self.version)
        os.makedirs(folder, exist_ok=True)
        return folder

    def _bypass_marker(self) -> str:
        """Where the decision is left for the next workers of this dataset object (an empty file)."""
        return os.path.join(self._node_folder(), f".ranges-{self._bypass_token}")

    # --- reading byte ranges (mode="ranges", and early reads of downloads in progress) ------------------
    def _read_spans(self, shards: list[int], spans_of: Callable[[Any, int], list[tuple[int, int]]],
                    early: bool = False, obj: int = 0) -> dict[int, _Spans]:
        """Each shard's byte spans ``spans_of(client, k)`` of its stored object ``obj`` (merged where the
        gaps cost at most ``RANGE_WASTE`` of the bytes wanted), read with one request per shard, ``READERS``
        shards at a time on their own connections: by range GETs, or with ``early`` from the shards'
        downloads into the node's cache (:meth:`_download_read`)."""
        def read(client: Any, k: int) -> _Spans:
            merged = _merge(sorted(set(spans_of(client, k))), RANGE_WASTE)
            if early:
                return _Spans(merged, self._download_read(client, k, merged, obj))
            url, _, etag, _ = self._objects(k)[obj]
            return _Spans(merged, client.get_ranges(url, merged, etag=etag, gap=0,
                                                    storage_options=self.storage_options))

        return dict(zip(shards, self._spread(read, shards)))

    def _spread(self, fn: Callable[[Any, Any], Any], items: list[Any], wide: bool = False) -> list[Any]:
        """``fn(client, item)`` for each item, ``READERS`` at a time on their own connections (in this
        thread for a single item; see :meth:`_clients` for ``wide``); the results in order."""
        clients = self._clients(wide)
        if len(items) == 1:
            return [fn(clients[0], items[0])]
        assert self._client_of is not None
        return list(self._client_of[2].map(lambda n, item: fn(clients[n % len(clients)], item),
                                           range(len(items)), items))

    def _download_read(self, client: Any, k: int, spans: list[tuple[int, int]], obj: int = 0) -> list[bytes]:
        """``spans`` of shard ``k``'s stored object ``obj`` read from its download into the node's cache
        (see :meth:`_early_batch`); a shard found complete (every object of it) is mapped
        from then on."""
        objs = self._objects(k)
        url, size, etag, hashes = self._sized(objs[obj])
        blobs, path = client.read(url, size, spans, hashes=hashes, etag=etag, cache_limit=self.cache_limit,
                                  policy=self.cache_policy, next_use=self._next_use(k),
                                  storage_options=self.storage_options)
        if path is not None:
            done = self._done_objects.setdefault(k, {})
            done[obj] = path
            if len(done) == len(objs):
                self._fetched[k] = [done[o] for o in range(len(objs))]
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

    def _held_shard(self, k: int, current: Callable[[], Any], files: int) -> Any:
        """Shard ``k`` for a read in ``mode="shards"``: this process's map (``current()``, asked after a forked
        worker has dropped the maps it inherited) made the most recently used, else fetched and mapped.
        ``files``: open files a shard needs (its maps and holds), made room for once per process."""
        if self.mode == "ranges":
            raise ValueError("mode='ranges' maps no shard: this needs mode='shards'")
        held = self._held_here()
        shard = current()
        if shard is not None:
            held.move_to_end(k)
            return shard
        if files and not self._room:
            ensure_open_files(files * (len(self._first) - 1), type(self).__name__)
            self._room = True
        return self._mapped(k)

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

    def _fetch(self, client: Any, k: int, next_use: list[str]) -> list[str]:
        """Shard ``k``'s objects in the node's cache (fetched if absent): their paths."""
        return [client.fetch(url, size, hashes=hashes, etag=etag, cache_limit=self.cache_limit,
                             policy=self.cache_policy, storage_options=self.storage_options, next_use=next_use)
                for url, size, etag, hashes in map(self._sized, self._objects(k))]

    def _sized(self, obj: tuple[str, int, str | None, Any]) -> tuple[str, int, str | None, Any]:
        """``obj`` of :meth:`_objects`, unless the store gave another size for it when the dataset opened
        (``_store_sizes``, which a format fills when it opens): then a RemoteCorruptError for that object, before
        its size is trusted for a download (a lying index must not size an allocation or a reservation)."""
        have = self._store_sizes.get(obj[0])
        if have is not None:
            raise RemoteCorruptError(f"the object has {have} bytes, the index records {obj[1]}", url=obj[0])
        return obj

    def _url_of(self, k: int) -> str:
        """The URL of shard ``k``'s (first) stored object."""
        return self._objects(k)[0][0]

    def _stored_bytes(self, k: int) -> int:
        """The bytes of shard ``k``'s stored objects."""
        return sum(size for _, size, _, _ in self._objects(k))

    def _horizon(self) -> int:
        """How many shards a fetch names as needed next: twice as many as the cache holds, from ``NEXT_USE`` to
        ``MAX_NEXT_USE``. A cached shard past the horizon counts as never needed again, and among those
        the least recently used goes first, which is LRU: a shorter horizon than the cache evicted the
        shards an epoch's end left in the cache before the dead ones, though the next epoch needs them."""
        if self._horizon_n is None:
            n = len(self._first) - 1
            if self.cache_limit is None or n == 0:
                self._horizon_n = NEXT_USE
            else:
                mean = max(1, sum(self._stored_bytes(k) for k in range(n)) // n)
                self._horizon_n = int(min(MAX_NEXT_USE, max(NEXT_USE, 2 * self.cache_limit // mean)))
        return self._horizon_n

    def _next_use(self, k: int) -> list[str]:
        """The URLs needed after shard ``k``: from the planned order when there is one (see
        :meth:`_needed_after`), else the next shards in index order."""
        at = self._plan_at.get(k)
        if at is not None:
            return self._needed_after(self._plan, at)
        after = list(range(k + 1, min(k + 1 + self._horizon(), len(self._first) - 1)))
        return [url for j in after for url, *_ in self._objects(j)]

    def _needed_after(self, order: list[int], at: int, ahead: bool = False) -> list[str]:
        """The URLs of the shards ``order`` needs after its shard at ``at``, in the order of their use (up
        to the horizon), and those of the ``BEHIND`` shards before it: the loader's workers read the same
        order a batch or two apart, so a shard this process has passed may still be read. For a reader's
        fetch they are named last (after every shard with a known next use, before those named nowhere:
        passed long ago, or past the horizon); for the prefetcher's (``ahead``), which runs ahead of the
        readers, first: the readers are there now."""
        after, behind = order[at + 1:at + 1 + self._horizon()], order[max(0, at - BEHIND):at][::-1]
        wanted = behind + after if ahead else after + behind
        return [url for j in wanted for url, *_ in self._objects(j)]

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
        self._plan_at = {j: i for i, j in enumerate(order)}
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
                    self._fetch(client, k, self._needed_after(order, pos, ahead=True))
                except Exception as e:  # noqa: BLE001 - the reader that needs this shard raises it
                    log.debug("prefetch of %s stopped: %s", self._url_of(k), e)
                    return
        finally:
            client.close()

    def key_values(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(sample)`` for every sample; in ``mode="ranges"`` read as batches of 256 (one request round per
        batch, not per sample; a bad sample raises: one key per index)."""
        if self.mode != "ranges":
            return super().key_values(fn)  # type: ignore[misc]
        n, step = len(self), 256  # type: ignore[arg-type]
        return [fn(s) for first in range(0, n, step)
                for s in self.__getitems__(list(range(first, min(first + step, n))))]  # type: ignore[attr-defined]

    def _key_cache_path(self, field: str) -> str | None:
        """A key cache keyed by the dataset's URL and pinned version (and split), not by the files this
        process happens to have fetched: in ``mode="ranges"`` there are none."""
        if self.version is None:  # a server that gives no ETag: nothing to key by
            return None
        split = getattr(self, "split", None)
        h = hashlib.sha256(f"{self.format_name}\0{field}\0{self.url}\0{self.version}\0{split}".encode())
        return self._key_cache_file(h)

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

class _Spans:
    """Merged byte spans of one object and their bytes; :meth:`get` cuts out any range inside them."""

    def __init__(self, merged: list[tuple[int, int]], blobs: list[bytes]) -> None:
        self.merged = merged
        self.blobs = blobs

    def get(self, b: int, e: int) -> bytes:
        r = bisect.bisect_right(self.merged, (b, float("inf"))) - 1
        start = self.merged[r][0]
        return bytes(self.blobs[r][b - start:e - start])

    def covers(self, b: int, e: int) -> bool:
        """Whether the bytes ``b..e`` lie inside one of the spans read."""
        r = bisect.bisect_right(self.merged, (b, float("inf"))) - 1
        return r >= 0 and self.merged[r][1] >= e

    def __getitem__(self, span: slice) -> bytes:
        """``spans[b:e]``: the bytes ``b..e`` of the object (a file's map is sliced the same way)."""
        return self.get(span.start, span.stop)


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
