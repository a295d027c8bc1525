"""All object-store I/O of a node happens in one fetcher process per cache folder; every other process
asks it over a Unix socket.

Why: obstore keeps a global async (tokio) runtime. A process that has used obstore and then forks (torch's
DataLoader forks its workers by default) leaves a child whose first obstore call hangs forever, even with a
new store object. A process that never touched obstore forks safely. So no caller ever imports obstore:
the main process, forked workers and spawned workers alike connect to the fetcher, a fresh interpreter
(``python -m torchforge.remote.fetcher``, the equivalent of multiprocessing's "spawn", started with
``subprocess`` because torch's workers are daemonic and multiprocessing forbids them children).

One fetcher serves the node: its address is derived from the cache folder, so every process naming that
folder (every rank and worker) finds the same one; whoever finds none starts it under a file lock. It
exits when no client has been connected and no download has been in progress for :data:`IDLE_EXIT`
seconds (a download a batch started goes on to the whole file after its readers left); a client whose
fetcher went away starts a new one and asks again.

Requests and replies are the dataclasses of :mod:`torchforge.remote.messages`; the client side is
:mod:`torchforge.remote.client`.

Failures: 5xx, 429, timeouts, connection resets and truncated bodies are retried with exponential backoff
and full jitter (:data:`BACKOFF_BASE` doubling up to :data:`BACKOFF_CAP` seconds),
:data:`~torchforge.remote.url.DEFAULT_RETRIES` times unless the dataset's ``storage_options`` set another
budget (``max_retries``, ``retry_timeout``: see :mod:`torchforge.remote.url`); every retried read is
verified again (range lengths; a whole object's size and hash). A missing
object or denied access is not retried: it raises at once, naming the URL. Uploads (``put``, multipart
above obstore's part size) retry the same way, each retry sending the whole file again; obstore's ``put``
is atomic, so an object is either absent or complete.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener
from typing import IO, Any

from torchforge._limits import ensure_open_files
from torchforge.remote.cache import ObjectCache, url_key, version_of
from torchforge.remote.errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteCorruptError,
    RemoteError,
    RemoteNotFoundError,
    RemoteReadOnlyError,
)
from torchforge.remote.messages import (
    CopyRequest,
    DeleteRequest,
    FetchRequest,
    HeadRequest,
    ListRequest,
    ObjectInfo,
    PutRequest,
    RangesRequest,
    ReadRequest,
    Reply,
    address,
    authkey,
    coalesce,
)
from torchforge.remote.parts import Download, PartScheduler
from torchforge.remote.url import StoreSpec

__all__ = ["BACKOFF_BASE", "BACKOFF_CAP", "IDLE_EXIT", "serve"]

IN_USE_WAIT = 60.0  # seconds a fetch waits for readers to let go of cached objects when they fill cache_limit
BACKOFF_BASE = 0.05
BACKOFF_CAP = 2.0
IDLE_EXIT = float(os.environ.get("TORCHFORGE_FETCHER_IDLE_EXIT", "15"))
_CHUNK = 1 << 20


# -- the server ----------------------------------------------------------------------------------------
class _Transient(Exception):
    """A failure worth retrying (5xx, 429, reset, truncated body)."""


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split("Debug source:")[0].split())
    return text[:400] + ("..." if len(text) > 400 else "")


def _classify(e: BaseException, url: str) -> BaseException:
    """The typed error for an obstore failure, or :class:`_Transient` for one worth retrying."""
    from obstore import exceptions as ox

    if isinstance(e, (RemoteError, _Transient)):
        return e
    if isinstance(e, (ox.NotFoundError, FileNotFoundError)):  # obstore raises the builtin for a 404
        return RemoteNotFoundError(f"no such object ({_short(e)})", url=url)
    if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)):
        return RemoteAccessError(f"access denied: check the credentials (storage_options or AWS_*/"
                                 f"GOOGLE_*/AZURE_* variables) ({_short(e)})", url=url)
    if isinstance(e, ox.PreconditionError):
        return RemoteChangedError("the object changed since the dataset was opened (its ETag differs from "
                                  "the pinned one): open the dataset again", url=url)
    text = str(e)
    if isinstance(e, ox.NotSupportedError) and "range" in text.lower():  # a server that answers 200 to a Range
        return RemoteError(f"the server does not serve byte ranges: an MDS dataset reads with mode='shards' "
                           f"(whole objects); JINX and safetensors datasets read their footers and headers by "
                           f"ranges when they open, and need a server that serves them ({_short(e)})", url=url)
    if isinstance(e, (ox.GenericError, ConnectionError, TimeoutError)):
        low = _URL.sub(" ", text.lower())  # a key such as logs/status404.json says nothing about the reply
        m = _STATUS.search(low)  # "status 403" and obstore's "non-2xx status code: 403 Forbidden"
        status = int(m.group(1) or m.group(2)) if m else None
        if any(code in low for code in _RETRY_CODES):  # S3's 400 RequestTimeout, 503 SlowDown, ...
            return _Transient(_short(e))
        if "nosuchbucket" in low or "containernotfound" in low or "bucket does not exist" in low:
            return RemoteNotFoundError(f"no such bucket or container: check the URL's bucket and the endpoint "
                                       f"({_short(e)})", url=url)
        if status == 404 or "nosuchkey" in low:
            return RemoteNotFoundError(f"no such object ({_short(e)})", url=url)
        if status in (401, 403) or any(code in low for code in _DENIED):
            return RemoteAccessError(f"access denied: check the credentials (storage_options or AWS_*/"
                                     f"GOOGLE_*/AZURE_* variables) ({_short(e)})", url=url)
        if status == 412 or "precondition" in low:
            return _classify(ox.PreconditionError(text), url)
        if status == 416 or "range not satisfiable" in low or "invalidrange" in low:
            return RemoteCorruptError(f"a range starts past the object's end: whatever points there (an index, "
                                      f"a footer) is wrong, or the object was cut short ({_short(e)})", url=url)
        if status not in _FINAL:
            return _Transient(_short(e))
    return RemoteError(f"{type(e).__name__}: {_short(e)}", url=url)


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
_STATUS = re.compile(r"non-2xx status code:?\s*(\d{3})\b|\bstatus\s+(\d{3})\b")
_FINAL = {400, 405, 411, 413, 414, 415, 422}  # client errors no retry can mend (others, as 409 or 410, are retried)
_RETRY_CODES = ("requesttimeout", "slowdown", "throttl", "operationaborted", "serverbusy", "toomanyrequests")
_DENIED = ("accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch", "expiredtoken", "invalidtoken",
           "authorizationfailure", "authenticationfailed")


def _past_end(url: str, start: int, end: int, size: int) -> RemoteCorruptError:
    return RemoteCorruptError(f"bytes [{start}, {end}) reach past the object's end ({size} bytes): whatever points "
                              "there (an index, a footer) is wrong, or the object was cut short", url=url, offset=size)


QUICK_TIMEOUT = 15.0  # seconds: requests that move no data (HEAD, LIST, DELETE)
DATA_TIMEOUT = 120.0  # seconds: requests that move data (GET of a part, PUT of a part)
TIMED_OUT_RETRIES = 2  # retries of attempts that ran into the request timeout (without retry_timeout)


def _backoff(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(attempt, 30)))


class _Budget:
    """The retries left to one operation: its store's ``max_retries`` and ``retry_timeout`` (counted from
    the operation's start)."""

    def __init__(self, spec: StoreSpec) -> None:
        self.retries, self.timeout = spec.max_retries, spec.retry_timeout
        self.start = time.monotonic()
        self.used = 0

    def pause(self) -> float | None:
        """The backoff before the next retry (counted as made), or None once the budget is spent."""
        if self.retries is not None and self.used >= self.retries:
            return None
        pause = _backoff(self.used)
        if self.timeout is not None:
            left = self.start + self.timeout - time.monotonic()
            if left <= 0:
                return None
            pause = min(pause, left)
        self.used += 1
        return pause

    def spent(self) -> str:
        return f"{self.used} retries in {time.monotonic() - self.start:.1f} s"


def _retrying(url: str, fn: Callable[[], Any], spec: StoreSpec, quick: bool = False) -> Any:
    """``fn()``, its transient failures retried within ``spec``'s budget. Attempts that ran into the request
    timeout (an endpoint that takes connections and never answers: a wedged proxy, a firewall) are retried
    at most :data:`TIMED_OUT_RETRIES` times unless ``retry_timeout`` asks to wait out an outage: the error
    comes in about a minute, not after the whole budget of timeouts (7 x 120 s)."""
    budget = _Budget(spec)
    limit, timed_out = 0.9 * _timeouts(spec, quick), 0
    while True:
        t = time.monotonic()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            err = _classify(e, url)
            if not isinstance(err, _Transient):
                raise err from None
            if time.monotonic() - t >= limit:
                timed_out += 1
                if timed_out > TIMED_OUT_RETRIES and spec.retry_timeout is None:
                    raise RemoteError(f"no reply within the request timeout ({limit / 0.9:g} s) in "
                                      f"{timed_out} attempts: is the endpoint right and answering? ({err})",
                                      url=url) from None
            pause = budget.pause()
            if pause is None:
                raise RemoteError(f"failed after {budget.spent()}: {err}", url=url) from None
            time.sleep(pause)


def _mismatch(fd: int, size: int, hashes: dict[str, str]) -> tuple[str, str] | None:
    """The first ``(algorithm, digest)`` of the file's ``size`` bytes that differs from ``hashes``, or None."""
    if not hashes:
        return None
    hashers = {k: _hasher(k) for k in hashes}
    for at in range(0, size, _CHUNK * 8):
        chunk = os.pread(fd, min(_CHUNK * 8, size - at), at)
        for h in hashers.values():
            h.update(chunk)
    return next(((k, h.hexdigest()) for k, h in hashers.items() if h.hexdigest() != str(hashes[k]).lower()), None)


def _validator(meta: Any) -> str | None:
    """What pins an object's version, from obstore's metadata of a HEAD, GET or listing: its ETag; else,
    for a server that sends none (a plain web server may not), ``"lm:"`` and its Last-Modified time in
    whole seconds (the header's precision); else None (obstore gives the epoch where the header is missing,
    and then nothing tells two versions of the same size apart)."""
    return str(meta["e_tag"]) if meta.get("e_tag") else _modified(meta)


def _modified(meta: Any) -> str | None:
    """``"lm:"`` and the Last-Modified time in whole seconds, or None where the server sent none."""
    modified = meta.get("last_modified")
    stamp = int(modified.timestamp()) if modified is not None else 0
    return f"lm:{stamp}" if stamp > 0 else None


def _bare(validator: str) -> str:
    return validator.removeprefix("W/").strip('"')  # a listing may give an ETag without the quotes a header has


def _pin(opts: dict[str, Any], pinned: str | None) -> dict[str, Any]:
    """``opts`` asking the server for the pinned version: ``If-Match`` with an ETag (a Last-Modified time
    is checked on the reply instead, by :func:`_check_pinned`: servers that send no ETag often ignore the
    conditional headers too)."""
    if pinned and not pinned.startswith("lm:"):
        opts["if_match"] = pinned
    return opts


def _check_pinned(meta: Any, pinned: str | None, url: str) -> None:
    """RemoteChangedError where a reply's own validator is not the pinned one, before its body is read: the
    only check where the pin is a Last-Modified time, and a second one where a server ignores If-Match."""
    if not pinned:
        return
    now = _modified(meta) if pinned.startswith("lm:") else meta.get("e_tag")
    if now and _bare(now) != _bare(pinned):
        what = "Last-Modified" if pinned.startswith("lm:") else "ETag"
        raise RemoteChangedError(f"the object changed since the dataset was opened (its {what} is {now}, "
                                 f"{pinned} when pinned): open the dataset again", url=url)


class _Source:
    """Where a download's parts come from: the store, the key, and the version (:func:`_validator`) they
    are pinned to."""

    def __init__(self, store: Any, key: str, etag: str | None, spec: StoreSpec) -> None:
        self.store = store
        self.key = key
        self.etag = etag
        self.spec = spec  # (its retry budget)
        self.whole: bytes | None = None  # the whole object, where the server serves no byte ranges
        self.lock = threading.Lock()  # one whole GET, however many parts find ranges refused


def _hasher(name: str) -> Any | None:
    name = name.lower()
    if name.startswith("xxh"):
        try:
            import xxhash
        except ImportError:
            return None
        ctor = getattr(xxhash, {"xxh3": "xxh3_64"}.get(name, name), None)
        return ctor() if callable(ctor) else None
    try:
        return hashlib.new(name)
    except (ValueError, TypeError):
        return None


class _Server:
    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.stores: dict[tuple[StoreSpec, bool], Any] = {}
        self.lock = threading.Lock()
        self.clients = 0
        self.last_seen = time.monotonic()
        self.parts = PartScheduler(self._fetch_part)
        self.cache = ObjectCache(cache_dir)  # lookups (a fill makes its own, with the request's limit)

    def store(self, spec: StoreSpec, quick: bool = False) -> Any:
        """The store of ``spec``; ``quick``: the one for requests with no body to move (HEAD, LIST,
        DELETE), whose replies come at once or not at all (see :func:`_timeouts`)."""
        key = (spec, quick)
        with self.lock:
            if key not in self.stores:
                self.stores[key] = _open_store(spec, quick)
            return self.stores[key]

    def handle(self, req: Any) -> Any:
        method = _HANDLERS.get(type(req))
        if method is None:
            raise TypeError(f"unknown request {type(req).__name__}")
        return getattr(self, method)(req)

    def head(self, req: HeadRequest) -> ObjectInfo:
        import obstore

        store = self.store(req.store, True)
        try:
            meta = _retrying(req.url, lambda: obstore.head(store, req.key), req.store, quick=True)
        except RemoteNotFoundError:
            if not req.url.startswith(("http://", "https://")):
                raise
            # a web server may refuse HEAD (405), which reads as not found: a GET of its first byte says
            # whether the object is there, and its size and validator (Content-Range, ETag) if so
            def first_byte() -> Any:
                return obstore.get(store, req.key, options={"range": (0, 1)}).meta

            meta = _retrying(req.url, first_byte, req.store, quick=True)
        return ObjectInfo(int(meta["size"]), _validator(meta))

    def ranges(self, req: RangesRequest) -> list[bytes]:
        import obstore

        store = self.store(req.store)
        merged = coalesce(req.ranges, req.gap)
        got: dict[tuple[int, int], Any] = {}

        async def one(s: int, e: int) -> Any:
            res = await obstore.get_async(store, req.key, options=_pin({"range": (s, e)}, req.etag))
            _check_pinned(res.meta, req.etag, req.url)
            total = int(res.meta["size"])
            if e > total:  # a server clips such a range: the short body is no transient fault
                raise _past_end(req.url, s, e, total)
            data = await res.bytes_async()
            if len(data) != e - s:
                raise _Transient(f"truncated body: {len(data)} of {e - s} bytes for range [{s}, {e})")
            return data

        async def batch(todo: list[tuple[int, int]]) -> list[Any]:
            return await asyncio.gather(*(one(s, e) for s, e in todo), return_exceptions=True)

        todo = merged
        budget = _Budget(req.store)
        while True:
            results = asyncio.run(batch(todo))
            failed, last = [], None
            for r, res in zip(todo, results):
                if isinstance(res, BaseException):
                    err = _classify(res, req.url)
                    if not isinstance(err, _Transient):
                        raise err
                    failed.append(r)
                    last = last or err
                else:
                    got[r] = res
            if not failed:
                break
            pause = budget.pause()
            if pause is None:  # the first range that still failed, and why
                raise RemoteError(f"range reads failed after {budget.spent()}: bytes [{failed[0][0]}, "
                                  f"{failed[0][1]}): {last}", url=req.url, offset=failed[0][0])
            todo = failed
            time.sleep(pause)
        starts = sorted(got)
        out = []
        import bisect

        for s, e in req.ranges:
            if s == e:
                out.append(b"")
                continue
            ms, me = starts[bisect.bisect_right(starts, (s, float("inf"))) - 1]
            out.append(bytes(memoryview(got[(ms, me)])[s - ms:e - ms]))
        return out

    def fetch(self, req: FetchRequest) -> tuple[str, bool]:
        """The object's path in the cache, and whether this request downloaded it (the first request to
        ask for a download in progress counts as its owner)."""
        d = self._download(req)
        path = self.parts.wait(d)
        with self.parts.cond:
            mine = d.ran and not d.claimed
            d.claimed = d.claimed or mine
        return path, mine

    def read(self, req: ReadRequest) -> tuple[list[bytes], str | None]:
        """Ranges of an object read from its download into the cache (started if none is in progress), as
        soon as the parts that hold them are there; and the object's cache file if it is complete."""
        try:
            return self.parts.read(self._download(req.fetch, req.ranges), req.ranges)
        except FileNotFoundError:  # the cached file was evicted before it was read: download it again
            return self.parts.read(self._download(req.fetch, req.ranges), req.ranges)

    def _download(self, req: FetchRequest, first: Sequence[tuple[int, int]] = ()) -> Download:
        """The download of ``req``'s object: the one in progress, else a new one (a thread fills the cache
        through :class:`PartScheduler`, the blocks of ``first`` before any other), or a finished one when
        the cache has the object."""
        hashes = dict(req.hashes)
        etag = req.etag
        version = version_of(etag, hashes)
        if version is None:
            with self.parts.cond:  # an unpinned object being downloaded: join that download, no HEAD
                d = next((d for d in self.parts.active.values() if d.url == req.url and d.size == req.size), None)
            if d is not None:
                return d
            info = self.head(HeadRequest(req.url, req.store, req.key))
            etag = info.etag
            version = etag or f"size:{info.size}"
        key = (req.url, version)
        checked = {k: v for k, v in hashes.items() if _hasher(k) is not None}
        source = _Source(self.store(req.store), req.key, etag, req.store)
        with self.parts.cond:
            d = self.parts.active.get(key)
            if d is not None:
                return d
            d = Download(key, req.url, req.size, source, verified_only=bool(checked))
            path = self.cache.lookup(req.url, version, req.size)
            if path is not None:
                d.path, d.ended = path, True
                return d
            self.parts.want(d, first)
            self.parts.active[key] = d
        try:
            threading.Thread(target=self._fill, args=(d, req, version, checked), daemon=True,
                             name="torchforge-fill").start()
        except BaseException as e:  # (no thread to end it): its readers must not wait forever
            self.parts.end(d, error=e)
            raise
        return d

    def _fill(self, d: Download, req: FetchRequest, version: str, hashes: dict[str, str]) -> None:
        """Fill the cache with ``d``'s object; whatever happens, ``d`` ends (its readers never wait forever)."""
        try:
            path = self._filled(d, req, version, hashes)
        except BaseException as e:  # noqa: BLE001 - every reader of the download raises it
            self.parts.end(d, error=e)
        else:
            self.parts.end(d, path=path)
        finally:
            d.context.whole = None  # (a server without ranges: the object's bytes are in the file now)

    def _filled(self, d: Download, req: FetchRequest, version: str, hashes: dict[str, str]) -> str:
        cache = ObjectCache(self.cache_dir, limit=req.cache_limit, policy=req.policy)
        next_use: dict[str, int] = {}
        for pos, u in enumerate(req.next_use):
            next_use.setdefault(url_key(u), pos)
        src: _Source = d.context
        if src.etag is None:  # pin the version before parts go out in parallel (they must not mix versions)
            info = self.head(HeadRequest(req.url, req.store, req.key))
            if info.size != req.size:
                raise RemoteCorruptError(f"the object has {info.size} bytes, the index records {req.size}",
                                         url=req.url)
            src.etag = info.etag

        def download(f: IO[bytes]) -> None:
            for full_try in range(2):  # a hash mismatch is downloaded once more before it is an error
                self.parts.run(d, f.fileno())
                bad = _mismatch(f.fileno(), req.size, hashes)
                if bad is None:
                    break
                if full_try == 1:
                    raise RemoteCorruptError(f"{bad[0]} of the bytes received is {bad[1]}, the index records "
                                             f"{hashes[bad[0]]}", url=req.url)
            f.seek(req.size)

        return cache.fill(req.url, version, req.size, download, next_use=next_use, wait=IN_USE_WAIT)

    def _fetch_part(self, d: Download, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of ``d``'s object: one GET (a range GET unless that is the whole object),
        pinned to the ETag (the one the object had when the download began, else the first reply's),
        retried; length and object size checked. A server that serves no byte ranges gets one plain GET
        of the whole object, kept in memory until the download ends, and every part is cut from it."""
        import obstore
        from obstore.exceptions import NotSupportedError

        src: _Source = d.context

        def get(s: int, e: int) -> Any:
            whole = s == 0 and e == d.size  # a plain GET: servers without range support serve it too
            res = obstore.get(src.store, src.key, options=_pin({} if whole else {"range": (s, e)}, src.etag) or None)
            _check_pinned(res.meta, src.etag, d.url)
            total = int(res.meta["size"])
            if total != d.size:
                raise RemoteCorruptError(f"the object has {total} bytes, the index records {d.size}", url=d.url)
            src.etag = src.etag or _validator(res.meta)
            data = res.bytes()
            if len(data) != e - s:
                raise _Transient(f"truncated body: {len(data)} of {e - s} bytes for range [{s}, {e})")
            return data

        def once() -> Any:
            if d.error is not None or d.ended:  # another part failed: this one is not needed any more
                raise RemoteError(f"the download stopped: {d.error}", url=d.url)
            if src.whole is None:
                try:
                    return get(start, end)
                except NotSupportedError as e:  # the server answered a Range with the whole object (200)
                    if "range" not in str(e).lower():
                        raise
                    with src.lock:  # one plain GET of the whole object, kept while the download lasts
                        if src.whole is None:
                            src.whole = bytes(get(0, d.size))
            return memoryview(src.whole)[start:end]

        return _retrying(d.url, once, src.spec)

    def put(self, req: PutRequest) -> ObjectInfo:
        """Upload a local file (multipart above obstore's part size); each retry starts the upload over."""
        import obstore

        if req.store.kind in ("http", "https"):
            raise RemoteReadOnlyError(f"{req.store.kind}:// URLs are read-only", url=req.url)
        store = self.store(req.store)

        def once() -> Any:
            try:
                size = os.path.getsize(req.path)
            except OSError as e:
                raise RemoteError(f"cannot read the local file {req.path}: {e}", url=req.url) from None
            if size != req.size:
                raise RemoteError(f"the local file {req.path} changed during the upload ({size} bytes, "
                                  f"{req.size} when it started)", url=req.url)
            with open(req.path, "rb") as f:
                return obstore.put(store, req.key, f)

        res = _retrying(req.url, once, req.store)
        return ObjectInfo(req.size, res.get("e_tag"))

    def copy(self, req: CopyRequest) -> None:
        """Copy an object within its store on the server (S3 CopyObject, GCS rewrite, Azure copy)."""
        import obstore

        if req.store.kind in ("http", "https"):
            raise RemoteReadOnlyError(f"{req.store.kind}:// URLs are read-only", url=req.url)
        store = self.store(req.store)
        _retrying(req.url, lambda: obstore.copy(store, req.source, req.key), req.store)

    def list(self, req: ListRequest) -> list[tuple[str, int, str | None]]:
        import obstore

        store = self.store(req.store, True)
        prefix = req.prefix.strip("/") or None
        metas = _retrying(req.url, lambda: obstore.list(store, prefix=prefix).collect(), req.store, quick=True)
        return sorted((str(m["path"]), int(m["size"]), _validator(m)) for m in metas)

    def delete(self, req: DeleteRequest) -> None:
        import obstore

        if req.store.kind in ("http", "https"):
            raise RemoteReadOnlyError(f"{req.store.kind}:// URLs are read-only", url=req.url)
        store = self.store(req.store, True)
        if not req.keys:
            return
        try:
            _retrying(req.url, lambda: obstore.delete(store, list(req.keys)), req.store, quick=True)
        except RemoteNotFoundError:  # a store without bulk delete stops at the first missing key
            for key in req.keys:
                try:
                    _retrying(req.url, lambda key=key: obstore.delete(store, key), req.store)
                except RemoteNotFoundError:
                    pass


# request type -> the _Server method that serves it
_HANDLERS = {HeadRequest: "head", RangesRequest: "ranges", FetchRequest: "fetch", ReadRequest: "read",
             PutRequest: "put", CopyRequest: "copy", ListRequest: "list", DeleteRequest: "delete"}


def _timeouts(spec: StoreSpec, quick: bool) -> float:
    """The request timeout (seconds) of ``spec``'s store: ``client_options["timeout"]`` when given, else
    120 s for requests that move data (a 16 MiB part over a slow, shared link) and 15 s for those that
    move none (HEAD, LIST, DELETE: an endpoint that has not answered one in 15 s is not answering)."""
    given = dict(spec.client).get("timeout")
    if given is None:
        return QUICK_TIMEOUT if quick else DATA_TIMEOUT
    if isinstance(given, (int, float)):
        return float(given)
    m = re.fullmatch(r"\s*([\d.]+)\s*(ms|s|sec|seconds?|m|min|minutes?)?\s*", str(given))
    if not m:
        return DATA_TIMEOUT  # a form obstore reads and this does not: attempts count as timed out from 108 s
    n = float(m.group(1))
    return n / 1000 if m.group(2) == "ms" else n * 60 if (m.group(2) or "s").startswith("m") else n


def _open_store(spec: StoreSpec, quick: bool = False) -> Any:
    from obstore.store import AzureStore, GCSStore, HTTPStore, LocalStore, S3Store

    config = dict(spec.config)
    client = {"connect_timeout": "5s", "timeout": f"{_timeouts(spec, quick):g}s", **dict(spec.client)}
    retry = {"max_retries": 0}  # retries are ours: counted, jittered and re-verified
    if spec.kind == "s3":
        return S3Store(spec.root, config=config, client_options=client, retry_config=retry)
    if spec.kind == "gs":
        return GCSStore(spec.root, config=config, client_options=client, retry_config=retry)
    if spec.kind == "az":
        return AzureStore(spec.root, config=config, client_options=client, retry_config=retry)
    if spec.kind in ("http", "https"):
        return HTTPStore.from_url(spec.root, client_options=client, retry_config=retry)
    if spec.kind == "file":
        return LocalStore("/")
    raise ValueError(f"unknown store kind {spec.kind!r}")


def _serve_connection(server: _Server, conn: Connection) -> None:
    with server.lock:
        server.clients += 1
    try:
        while True:
            try:
                req = conn.recv()
            except (EOFError, OSError):
                return
            try:
                reply = Reply(value=server.handle(req))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                reply = Reply(error=e)
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                return
            except Exception as e:  # noqa: BLE001 - an unpicklable error
                conn.send(Reply(error=RemoteError(f"{type(reply.error).__name__}: {reply.error}",
                                                  url=getattr(req, "url", "?"))))
                del e
    finally:
        conn.close()
        with server.lock:
            server.clients -= 1
            server.last_seen = time.monotonic()


def serve(cache_dir: str) -> None:
    """Run the fetcher for ``cache_dir`` until idle (the body of ``python -m torchforge.remote.fetcher``)."""
    root = ObjectCache(cache_dir).root
    ensure_open_files(4096, "the remote fetcher")  # every download in progress holds a few descriptors
    listener = Listener(address(root), family="AF_UNIX", authkey=authkey(root))
    server = _Server(cache_dir)

    def watchdog() -> None:
        while True:
            time.sleep(min(1.0, IDLE_EXIT / 4))
            with server.parts.cond:
                downloading = bool(server.parts.active)
            with server.lock:
                if downloading:  # the idle time counts from the last download's end
                    server.last_seen = time.monotonic()
                idle = server.clients == 0 and time.monotonic() - server.last_seen > IDLE_EXIT
            if idle:
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    print("ready", flush=True)
    while True:
        try:
            conn = listener.accept()
        except Exception:  # noqa: BLE001, S112 - a client that failed the handshake
            continue
        threading.Thread(target=_serve_connection, args=(server, conn), daemon=True).start()


if __name__ == "__main__":
    # Run the imported module's serve, not this __main__ copy: requests and replies must be the classes
    # clients pickle (torchforge.remote.fetcher.*), not __main__.*.
    from torchforge.remote.fetcher import serve as _serve

    _serve(sys.argv[1])
