"""The client side of the fetcher (:mod:`torchforge.remote.fetcher`): every process of a node asks the one
fetcher for its cache folder, starting it (a fresh interpreter) when there is none. Never imports obstore,
so a process using it forks safely."""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Client, Connection
from typing import Any

from torchforge.cache import user_cache_dir
from torchforge.remote.cache import ObjectCache, version_of
from torchforge.remote.errors import RemoteReadOnlyError
from torchforge.remote.messages import (
    COALESCE_GAP,
    CopyRequest,
    DeleteRequest,
    FetchRequest,
    HeadRequest,
    ListRequest,
    ObjectInfo,
    PutRequest,
    RangesRequest,
    ReadRequest,
    address,
    authkey,
    check_ranges,
)
from torchforge.remote.url import StoreSpec, store_spec

__all__ = ["FetcherClient", "connect"]

_START_TIMEOUT = 60.0


class FetcherClient:
    """A connection to the node's fetcher for ``cache_dir``; see :func:`connect`. Thread-safe; after a
    fork the child opens its own connection."""

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self.downloaded = False  # whether the last fetch() downloaded its object (else the cache had it)
        self.cache_dir = user_cache_dir() if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self.cache = ObjectCache(self.cache_dir)
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._pid = -1

    def _connect(self) -> Connection:
        root = self.cache.root
        where, key = address(root), authkey(root)
        try:
            return Client(where, family="AF_UNIX", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        with open(os.path.join(root, "fetcher.start"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                return Client(where, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            # its own session: a Ctrl-C at the terminal (SIGINT to the foreground process group) stops the
            # job, not the node's fetcher in the middle of the requests the job's cleanup waits for
            proc = subprocess.Popen([sys.executable, "-c", _SERVE, self.cache_dir],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
                                    close_fds=True, start_new_session=True)
            line = proc.stdout.readline() if proc.stdout else b""
            threading.Thread(target=proc.wait, daemon=True).start()  # reap it when it exits
            if line.strip() != b"ready":
                raise RuntimeError(f"the fetcher process for {self.cache_dir} did not start "
                                   f"(exit status {proc.poll()}); see its stderr above")
            deadline = time.monotonic() + _START_TIMEOUT
            while True:
                try:
                    return Client(where, family="AF_UNIX", authkey=key)
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)

    def _call(self, req: Any) -> Any:
        with self._lock:
            for attempt in range(2):
                if self._conn is None or self._pid != os.getpid():
                    self._conn, self._pid = self._connect(), os.getpid()
                try:
                    self._conn.send(req)
                    reply = self._conn.recv()
                    break
                except (EOFError, OSError):  # the fetcher went away: start another and ask again
                    self._conn = None
                    if attempt:
                        raise
                except BaseException:  # interrupted (Ctrl-C) between the request and its reply: that reply
                    self._drop()     # would be read as the next call's answer, so the connection goes
                    raise
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        """Close this process's connection (the fetcher exits once no process is connected)."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    def head(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> ObjectInfo:
        """The object's size and ETag.

        Raises:
            RemoteNotFoundError: no such object (at once, no retries).
            RemoteAccessError: access denied.
        """
        spec, key = store_spec(url, storage_options)
        return self._call(HeadRequest(url, spec, key))

    def get_ranges(self, url: str, ranges: Sequence[tuple[int, int]], *, etag: str | None = None,
                   gap: int = COALESCE_GAP, storage_options: Mapping[str, Any] | None = None) -> list[bytes]:
        """The bytes of each ``[start, end)`` range, read with concurrent requests; ranges at most ``gap``
        bytes apart are merged into one request (:func:`coalesce`).

        Args:
            etag: the pinned version; a changed object raises :class:`RemoteChangedError`.

        Raises:
            RemoteChangedError: the object's ETag is not ``etag``.
            RemoteCorruptError: a range reaches past the object's end (at once, not retried: a server clips
                such a range, which would otherwise pass for a truncated body).
            RemoteNotFoundError, RemoteAccessError, RemoteError: see :meth:`head`.
        """
        spec, key = store_spec(url, storage_options)
        return self._call(RangesRequest(url, spec, key, check_ranges(url, ranges), etag, int(gap)))

    def fetch(self, url: str, size: int, *, hashes: Mapping[str, str] | None = None, etag: str | None = None,
              cache_limit: int | str | None = None, policy: str = "belady", next_use: Sequence[str] = (),
              storage_options: Mapping[str, Any] | None = None) -> str:
        """The path of the whole object in the node-local cache, downloaded once per node on first need.

        Args:
            size: the object's size as the index records it.
            hashes: ``{algorithm: hex digest}`` as MDS records them (``sha1``, ``md5``, ``xxh64``, ...);
                algorithms not available are skipped.
            etag: the pinned version; the cache is keyed by it (else by the hash, else by a HEAD's ETag).
            cache_limit: the most bytes the cache may hold (``"50GB"``); None for no limit.
            policy: ``"belady"`` (evicts the object used furthest in the future) or ``"lru"``.
            next_use: the URLs the caller will read next, in order (Belady's view of the future).

        Raises:
            RemoteCorruptError: the size or hash disagrees with the index (nothing is cached).
            RemoteChangedError: the object's ETag is not ``etag``.
            CacheFullError: no room within ``cache_limit``.
        """
        _check_size(url, size)
        hit = self.cached(url, size, hashes=hashes, etag=etag)
        if hit is not None:
            self.downloaded = False
            return hit
        reply = self._call(self._fetch_request(url, size, hashes, etag, cache_limit, policy, next_use,
                                               storage_options))
        path, self.downloaded = reply if isinstance(reply, tuple) else (reply, True)  # (an older fetcher replies a path)
        return path

    def read(self, url: str, size: int, ranges: Sequence[tuple[int, int]], *, hashes: Mapping[str, str] | None = None,
             etag: str | None = None, cache_limit: int | str | None = None, policy: str = "belady",
             next_use: Sequence[str] = (), storage_options: Mapping[str, Any] | None = None
             ) -> tuple[list[bytes], str | None]:
        """The bytes of each ``[start, end)`` range of the object, read from its download into the node's
        cache: the download is started if none is in progress (one per node, as :meth:`fetch` makes, and the
        object ends up cached as :meth:`fetch` leaves it), the parts holding the ranges are fetched before
        any other, and this returns as soon as they are written. An object whose ``hashes`` can be checked
        is returned only once complete and verified. Takes :meth:`fetch`'s arguments.

        Returns:
            the ranges' bytes, and the object's path in the cache if it was complete by then (else None).

        Raises:
            what :meth:`fetch` raises.
        """
        _check_size(url, size)
        ranges = check_ranges(url, ranges)
        if any(e > size for _, e in ranges):
            raise ValueError(f"{url}: a range ends past the object's {size} bytes: {max(e for _, e in ranges)}")
        return self._call(ReadRequest(self._fetch_request(url, size, hashes, etag, cache_limit, policy, next_use,
                                                          storage_options), ranges))

    def _fetch_request(self, url: str, size: int, hashes: Mapping[str, str] | None, etag: str | None,
                       cache_limit: int | str | None, policy: str, next_use: Sequence[str],
                       storage_options: Mapping[str, Any] | None) -> FetchRequest:
        spec, key = store_spec(url, storage_options)
        limit = None if cache_limit is None else ObjectCache(self.cache_dir, limit=cache_limit).limit
        return FetchRequest(url, spec, key, size, tuple(sorted(dict(hashes or {}).items())), etag, limit, policy,
                            tuple(next_use))

    def cached(self, url: str, size: int, *, hashes: Mapping[str, str] | None = None,
               etag: str | None = None) -> str | None:
        """The path of the object in the node's cache if it is there now (no request), else None; the
        version is keyed as :meth:`fetch` keys it (None without an ETag or a hash)."""
        version = version_of(etag, hashes)
        return None if version is None else self.cache.lookup(url, version, size)

    def put(self, url: str, local_path: str | os.PathLike, *,
            storage_options: Mapping[str, Any] | None = None) -> ObjectInfo:
        """Upload the local file ``local_path`` to the object ``url`` (replacing it), with multipart uploads
        for large files and retries like reads; the object appears whole or not at all.

        Returns:
            the object's size and its new ETag (None where the store gives none).

        Raises:
            RemoteReadOnlyError: ``url`` is ``http(s)://`` (read-only).
            FileNotFoundError: no file at ``local_path``.
            RemoteAccessError: the server refused the write (credentials, permissions).
            RemoteNotFoundError: the bucket or container does not exist.
            RemoteError: the upload failed after retries, or the file changed during it.
        """
        spec, key = _writable(url, storage_options)
        path = os.path.abspath(os.fspath(local_path))
        size = os.path.getsize(path)
        return self._call(PutRequest(url, spec, key, path, size))

    def copy(self, source: str, url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        """Copy the object ``source`` to ``url`` (replacing it) on the server: both in one bucket or
        container; the object appears whole or not at all.

        Raises:
            ValueError: the two URLs are in different stores.
            RemoteReadOnlyError: ``url`` is ``http(s)://``.
            RemoteNotFoundError: ``source`` does not exist.
            RemoteAccessError, RemoteError: the store refused or failed (names ``url``).
        """
        spec, key = _writable(url, storage_options)
        from_spec, from_key = store_spec(source, storage_options)
        if from_spec != spec:
            raise ValueError(f"{source} and {url} are in different stores: a copy stays in one")
        self._call(CopyRequest(url, spec, from_key, key))

    def list_objects(self, url: str, *,
                     storage_options: Mapping[str, Any] | None = None) -> list[tuple[str, int]]:
        """Every object below the folder ``url`` (``s3://bucket/data``: the keys ``data/...``), as sorted
        ``(URL, size)`` pairs; an empty list where there is none.

        Raises:
            RemoteAccessError: listing was refused.
            RemoteNotFoundError: the bucket or container does not exist.
        """
        return [(u, size) for u, size, _ in self.list_versions(url, storage_options=storage_options)]

    def list_versions(self, url: str, *,
                      storage_options: Mapping[str, Any] | None = None) -> list[tuple[str, int, str | None]]:
        """Like :meth:`list_objects`, with each object's ETag (None where the store gives none):
        ``(URL, size, ETag)``, sorted."""
        spec, prefix = _folder(url, storage_options)
        root = url.rstrip("/")
        objects = self._call(ListRequest(url, spec, prefix))
        cut = len(prefix) + 1 if prefix else 0
        return [(f"{root}/{key[cut:]}", size, etag) for key, size, etag in objects]

    def delete(self, urls: Sequence[str], *, storage_options: Mapping[str, Any] | None = None) -> None:
        """Delete the objects ``urls`` (one request per store where it allows bulk deletes); an object
        that does not exist is no error.

        Raises:
            RemoteReadOnlyError: a URL is ``http(s)://``.
            RemoteAccessError, RemoteError: the store refused or failed (names the first URL).
        """
        groups: dict[StoreSpec, tuple[str, list[str]]] = {}
        for url in urls:
            spec, key = _writable(url, storage_options)
            groups.setdefault(spec, (url, []))[1].append(key)
        for spec, (first, keys) in groups.items():
            self._call(DeleteRequest(first, spec, tuple(keys)))

    def pinned(self, url: str) -> contextlib.AbstractContextManager[None]:
        """While the block runs, no process evicts ``url`` from the cache (take it before :meth:`fetch`)."""
        return self.cache.pinned(url)


def _check_size(url: str, size: Any) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"{url}: size={size!r} must be a non-negative int")


def _writable(url: str, storage_options: Mapping[str, Any] | None) -> tuple[StoreSpec, str]:
    spec, key = store_spec(url, storage_options)
    if spec.kind in ("http", "https"):
        raise RemoteReadOnlyError(f"{spec.kind}:// URLs are read-only: write to s3://, gs://, az:// or "
                                  "file://", url=url)
    return spec, key


def _folder(url: str, storage_options: Mapping[str, Any] | None) -> tuple[StoreSpec, str]:
    """The store of the folder ``url`` and its key prefix (no trailing ``/``; ``""`` for a bucket's root)."""
    spec, key = store_spec(url.rstrip("/") + "/_", storage_options)
    return spec, key[:-2]


_SERVE = "import sys; from torchforge.remote.fetcher import serve; serve(sys.argv[1])"  # a fresh interpreter
_clients: dict[str, FetcherClient] = {}
_clients_lock = threading.Lock()


def connect(cache_dir: str | os.PathLike | None = None) -> FetcherClient:
    """This process's client of the fetcher for ``cache_dir`` (default: the per-user cache folder)."""
    path = user_cache_dir() if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cache_dir={path!r} is a file, not a folder: name a folder (made if missing) for the "
                         "node-local cache")
    with _clients_lock:
        client = _clients.get(path)
        if client is None:
            client = _clients[path] = FetcherClient(path)
        return client


