"""What the fetcher and its clients say to each other: requests and replies with named fields, range
coalescing, and where a node's fetcher listens (an address and key derived from the cache folder)."""
from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchforge.remote.url import StoreSpec

__all__ = ["COALESCE_GAP", "MAX_MERGED", "CopyRequest", "DeleteRequest", "FetchRequest", "HeadRequest", "ListRequest",
           "ObjectInfo", "PutRequest", "RangesRequest", "ReadRequest", "Reply", "address", "authkey", "check_ranges",
           "coalesce"]

#: for the KB-sized samples of a batch) while still merging neighbours of one shard.
COALESCE_GAP = 64 * 1024
#: A merged request grows no larger than this (a range larger than this by itself stays whole).
MAX_MERGED = 32 * 1024 * 1024

# -- messages ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObjectInfo:
    """An object's size in bytes and ETag (None where the server gives none)."""

    size: int
    etag: str | None


@dataclass(frozen=True)
class HeadRequest:
    url: str
    store: StoreSpec
    key: str


@dataclass(frozen=True)
class RangesRequest:
    url: str
    store: StoreSpec
    key: str
    ranges: tuple[tuple[int, int], ...]
    etag: str | None
    gap: int


@dataclass(frozen=True)
class FetchRequest:
    url: str
    store: StoreSpec
    key: str
    size: int
    hashes: tuple[tuple[str, str], ...]
    etag: str | None
    cache_limit: int | None
    policy: str
    next_use: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class ReadRequest:
    """Ranges of the object ``fetch`` names, read from its download into the cache (see
    :mod:`torchforge.remote.parts`)."""

    fetch: FetchRequest
    ranges: tuple[tuple[int, int], ...]

    @property
    def url(self) -> str:
        return self.fetch.url


@dataclass(frozen=True)
class PutRequest:
    """Upload the local file ``path`` (``size`` bytes when the request was made) to ``key``."""

    url: str
    store: StoreSpec
    key: str
    path: str
    size: int


@dataclass(frozen=True)
class ListRequest:
    """Every object below the folder ``prefix`` (a key without its trailing ``/``; ``""`` for the root)."""

    url: str
    store: StoreSpec
    prefix: str


@dataclass(frozen=True)
class CopyRequest:
    """Copy the object ``source`` to ``key`` in the same store, on the server (no bytes through here)."""

    url: str
    store: StoreSpec
    source: str
    key: str


@dataclass(frozen=True)
class DeleteRequest:
    """Delete the objects ``keys`` (missing ones are no error)."""

    url: str
    store: StoreSpec
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: BaseException | None = None


# -- coalescing ----------------------------------------------------------------------------------------
def coalesce(ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP,
             max_merged: int = MAX_MERGED) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` ranges whose distance is at most ``gap`` bytes (overlaps always merge) into
    the requests to make, sorted; a merge never grows a request past ``max_merged`` bytes.

    >>> coalesce([(0, 10), (12, 20), (100, 110)], gap=5)
    [(0, 20), (100, 110)]
    """
    out: list[list[int]] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and s <= out[-1][1] + gap and (s <= out[-1][1] or max(e, out[-1][1]) - out[-1][0] <= max_merged):
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def check_ranges(url: str, ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out = []
    for r in ranges:
        try:
            s, e = (int(r[0]), int(r[1]))
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"{url}: range {r!r} is not a (start, end) pair of ints") from None
        if not 0 <= s <= e:
            raise ValueError(f"{url}: range {r!r} must have 0 <= start <= end")
        out.append((s, e))
    return tuple(out)


def address(root: str) -> str:
    digest = hashlib.sha256(f"{os.path.realpath(root)}\0{os.getuid()}".encode()).hexdigest()[:20]
    if sys.platform.startswith("linux"):
        return f"\0torchforge-fetcher-{digest}"
    return os.path.join(root, "fetcher.sock")


def authkey(root: str) -> bytes:
    path = os.path.join(root, "fetcher.key")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32).hex().encode())
    for _ in range(100):
        with open(path, "rb") as f:
            key = f.read()
        if len(key) == 64:
            return key
        time.sleep(0.01)  # another process is writing it
    raise RuntimeError(f"{path} holds no fetcher key: remove it")


