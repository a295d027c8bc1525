"""Remote datasets: URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``), one fetcher
process per node that does all object-store I/O (fork-safe callers), the node-local object cache, and
uploads of finished datasets (:func:`upload`: data first, the index last).

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
    RemoteExistsError,
    RemoteNotFoundError,
    RemoteReadOnlyError,
)
from torchforge.remote.messages import COALESCE_GAP, ObjectInfo, coalesce
from torchforge.remote.upload import publish_phases, upload
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
    "RemoteExistsError",
    "RemoteNotFoundError",
    "RemoteReadOnlyError",
    "coalesce",
    "connect",
    "is_remote",
    "publish_phases",
    "store_spec",
    "upload",
]
