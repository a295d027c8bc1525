"""Remote datasets: URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``), one fetcher
process per node that does all object-store I/O (fork-safe callers), and the node-local object cache.

Needs the ``remote`` extra (``pip install torchforge[remote]``, which installs obstore) in the fetcher;
importing this package does not import obstore.
"""
from __future__ import annotations

from torchforge.remote.cache import ObjectCache
from torchforge.remote.client import FetcherClient, connect
from torchforge.remote.errors import (
    CacheFullError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteCorruptError,
    RemoteError,
    RemoteNotFoundError,
)
from torchforge.remote.messages import COALESCE_GAP, ObjectInfo, coalesce
from torchforge.remote.url import is_remote, store_spec

__all__ = [
    "COALESCE_GAP",
    "CacheFullError",
    "FetcherClient",
    "ObjectCache",
    "ObjectInfo",
    "RemoteAccessError",
    "RemoteChangedError",
    "RemoteCorruptError",
    "RemoteError",
    "RemoteNotFoundError",
    "coalesce",
    "connect",
    "is_remote",
    "store_spec",
]
