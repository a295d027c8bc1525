"""The node-local cache of remote objects: one file per (URL, pinned version), shared by every process
of a node that names the same cache folder.

Layout under ``<cache_dir>/remote/``::

    objects/<u16><v16>-<name>                     a complete, verified object (u16: URL hash, v16: version hash)
    objects/<u16><v16>-<name>.tmp.<host>.<pid>.<r> a download in progress, preallocated to its full size
    locks/<u16><v16>.fetch                        held (flock, exclusive) by the one process downloading
    locks/<u16>.use                               held shared by processes using the URL; eviction skips it
    .accounting                                   held exclusive while space is reserved or freed

Promises:

- One download per object per node: a process takes the entry's ``.fetch`` lock, looks again, and only
  then downloads; others wait on the lock and find the file. No leader election, nothing that can race.
- A file appears under its final name only after its size (and, in the fetcher, its hash) checked out:
  it is written to a temporary name and renamed. A process killed mid-download leaves a ``.tmp`` file that
  no lookup ever uses; the next reservation on this host removes it once its pid is gone.
- ``limit`` is never exceeded: complete files and partial downloads (preallocated to their full size)
  are counted under the ``.accounting`` lock before a download starts. When room is needed the policy
  orders the candidates: ``"belady"`` (default) evicts the object whose next use lies furthest in the
  future (never-again first, then least recently used), ``"lru"`` the least recently used. An object
  whose URL is in use (a shared lock on its ``.use`` file) is never evicted.
- The cache removes only files it created: names matching its own patterns, in its own folders.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from torchforge._proc import host_name, pid_alive
from torchforge.cache import user_cache_dir
from torchforge.remote.errors import CacheFullError, RemoteCorruptError
from torchforge.sizes import parse_size

__all__ = ["POLICIES", "CachedObject", "ObjectCache", "url_key", "version_key", "version_of"]

_NAME = re.compile(r"^(?P<url>[0-9a-f]{16})(?P<ver>[0-9a-f]{16})-(?P<name>[A-Za-z0-9_-][A-Za-z0-9._-]{0,79})$")
_TMP = re.compile(r"^(?P<final>[0-9a-f]{32}-[A-Za-z0-9._-]+)\.tmp\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)"
                  r"\.[0-9a-f]{8}$")
_HOST = host_name()


def url_key(url: str) -> str:
    """The 16 hex digits naming ``url`` in the cache."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def version_key(version: str) -> str:
    """The 16 hex digits naming a pinned version (an ETag or the index's hash) in the cache."""
    return hashlib.sha256(version.encode()).hexdigest()[:16]


def version_of(etag: str | None, hashes: Mapping[str, str] | None) -> str | None:
    """The version an object is cached under: its pinned ETag, else the first of the hashes the index
    records (``"sha1:..."``), else None (the fetcher then asks the store for the ETag)."""
    return etag or next((f"{k}:{v}" for k, v in sorted(dict(hashes or {}).items())), None)


@dataclass(frozen=True)
class CachedObject:
    """One complete object in the cache, as eviction policies see it."""

    name: str
    path: str
    size: int
    url_key: str
    last_used: float


EvictionPolicy = Callable[[Sequence[CachedObject], Mapping[str, int]], Sequence[CachedObject]]


def belady(objects: Sequence[CachedObject], next_use: Mapping[str, int]) -> list[CachedObject]:
    """Furthest next use first (``next_use`` maps a URL key to its position in the coming accesses);
    objects not used again come first, least recently used first among equals."""
    never = 1 << 62
    return sorted(objects, key=lambda o: (-next_use.get(o.url_key, never), o.last_used))


def lru(objects: Sequence[CachedObject], next_use: Mapping[str, int]) -> list[CachedObject]:
    """Least recently used first; ``next_use`` is ignored."""
    return sorted(objects, key=lambda o: o.last_used)


POLICIES: dict[str, EvictionPolicy] = {"belady": belady, "lru": lru}


class _Busy(CacheFullError):
    """No room now: the objects that fill the cache are in use (or downloading)."""


@contextlib.contextmanager
def _flock(path: str, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _remove_if_stale(entry: os.DirEntry) -> bool:
    """Remove ``entry`` if it is a partial download of a process of this host that is gone; whether it was."""
    tmp = _TMP.match(entry.name)
    if tmp is None or tmp["host"] != _HOST or pid_alive(int(tmp["pid"])):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(entry.path)
    return True


class ObjectCache:
    """The node-local object cache in ``cache_dir`` (default: the per-user cache folder).

    Args:
        cache_dir: the folder; ``remote/`` below it holds the cache. Never the data folder.
        limit: the most bytes the cache holds, partial downloads included (an int or ``"50GB"``);
            None for no limit.
        policy: ``"belady"``, ``"lru"`` or a callable ``(objects, next_use) -> objects in eviction order``.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, limit: int | str | None = None,
                 policy: str | EvictionPolicy = "belady") -> None:
        base = user_cache_dir() if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self.root = os.path.join(base, "remote")
        self.objects = os.path.join(self.root, "objects")
        self.locks = os.path.join(self.root, "locks")
        for d in (self.root, self.objects, self.locks):
            os.makedirs(d, mode=0o700, exist_ok=True)
        self.limit = None if limit is None else parse_size(limit, option="cache_limit")
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is not one of {sorted(POLICIES)} or a callable")
        self.policy: EvictionPolicy = POLICIES[policy] if isinstance(policy, str) else policy

    # -- names ------------------------------------------------------------------------------------
    def path(self, url: str, version: str) -> str:
        """Where the object ``url`` at ``version`` lives once cached."""
        name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:].lstrip(".") or "object"
        return os.path.join(self.objects, f"{url_key(url)}{version_key(version)}-{name}")

    def lookup(self, url: str, version: str, size: int | None = None) -> str | None:
        """The cached file of ``url`` at ``version`` (of ``size`` bytes, when given), or None; marks it used."""
        path = self.path(url, version)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if size is not None and st.st_size != size:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return path

    @contextlib.contextmanager
    def pinned(self, url: str) -> Iterator[None]:
        """Mark ``url`` in use while the block runs (any process): eviction never removes it."""
        fd = self.hold(url)
        try:
            yield
        finally:
            os.close(fd)

    def hold(self, url: str) -> int:
        """Mark ``url`` in use until the returned descriptor is closed (by this process and every child
        that inherited it): eviction never removes it meanwhile. A reader takes this before it looks for
        the file, so the file it then finds stays until it lets go."""
        fd = os.open(os.path.join(self.locks, f"{url_key(url)}.use"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- filling ----------------------------------------------------------------------------------
    def fill(self, url: str, version: str, size: int, download: Callable[[IO[bytes]], None], *,
             next_use: Mapping[str, int] | None = None, wait: float = 0.0) -> str:
        """The cached file of ``url`` at ``version``, downloading it with ``download(file)`` if missing.

        ``download`` writes exactly ``size`` bytes to the file (opened at offset 0) and raises if the bytes
        are wrong; this checks the size again, then renames the file into place. One process per node
        downloads; the others wait and find the file. When the objects in use leave no room, it waits up
        to ``wait`` seconds for their readers to let go (see :meth:`hold`).

        Raises:
            CacheFullError: no room within ``limit`` even after evicting every object not in use (and
                waiting ``wait`` seconds for more to come out of use).
            RemoteCorruptError: ``download`` wrote a number of bytes other than ``size``.
        """
        if size < 0:
            raise ValueError(f"size={size} must be >= 0")
        path = self.lookup(url, version, size)
        if path is not None:
            return path
        final = self.path(url, version)
        lock = os.path.join(self.locks, f"{os.path.basename(final)[:32]}.fetch")
        with _flock(lock, fcntl.LOCK_EX):
            path = self.lookup(url, version, size)
            if path is not None:
                return path
            deadline = time.monotonic() + wait
            while True:
                try:
                    tmp = self._reserve(final, size, url, next_use or {})
                    break
                except _Busy:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
            try:
                with open(tmp, "r+b") as f:
                    download(f)
                    f.flush()
                    written = f.tell()
                    if written != size:
                        raise RemoteCorruptError(f"received {written} bytes, the index records {size}", url=url)
                    f.truncate(size)
                    os.fsync(f.fileno())
                # under the accounting lock: a folder listed while a file is renamed may show it under
                # neither name, and a reservation that missed it would overfill the cache
                with _flock(os.path.join(self.root, ".accounting"), fcntl.LOCK_EX):
                    os.rename(tmp, final)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return final

    def _scan(self) -> tuple[list[CachedObject], int]:
        """Complete objects and the bytes held (partial downloads included); removes stale downloads of
        this host (their process is gone)."""
        objects, used = [], 0
        with os.scandir(self.objects) as it:
            for e in it:
                if _TMP.match(e.name) is not None:
                    if _remove_if_stale(e):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        used += e.stat().st_size
                    continue
                m = _NAME.match(e.name)
                if m is None:
                    continue  # not ours: never counted, never removed
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                used += st.st_size
                objects.append(CachedObject(e.name, e.path, st.st_size, m["url"], st.st_mtime))
        return objects, used

    def _sweep(self) -> None:
        """Remove the partial downloads of this host's dead processes (each one holds its whole size:
        the reservation preallocates it), as :meth:`_scan` does under a limit."""
        with os.scandir(self.objects) as it:
            for e in it:
                _remove_if_stale(e)

    def _reserve(self, final: str, size: int, url: str, next_use: Mapping[str, int]) -> str:
        tmp = f"{final}.tmp.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"
        with _flock(os.path.join(self.root, ".accounting"), fcntl.LOCK_EX):
            if self.limit is None:  # (with a limit, _scan below removes them)
                self._sweep()
            else:
                if size > self.limit:
                    raise CacheFullError(f"the object's {size} bytes exceed cache_limit={self.limit}", url=url)
                objects, used = self._scan()
                for victim in self.policy(objects, next_use):
                    if used + size <= self.limit:
                        break
                    used -= self._evict(victim)
                if used + size > self.limit:
                    raise _Busy(f"cache_limit={self.limit} bytes: {used} are held by objects in use (mapped by "
                                f"readers: lazy samples or zero-copy values still alive keep theirs) or "
                                f"downloading, no room for {size} more; raise cache_limit, use fewer DataLoader "
                                f"workers, or read with mode='ranges'", url=url)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if size:
                    try:
                        os.posix_fallocate(fd, 0, size)  # the reservation is the file's size
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                        os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
        return tmp

    def _evict(self, victim: CachedObject) -> int:
        """Remove ``victim`` unless its URL is in use; the bytes freed."""
        fd = os.open(os.path.join(self.locks, f"{victim.url_key}.use"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            try:
                os.unlink(victim.path)
            except FileNotFoundError:
                return 0
            return victim.size
        finally:
            os.close(fd)

    def usage(self) -> int:
        """Bytes the cache holds now, partial downloads included."""
        return self._scan()[1]
