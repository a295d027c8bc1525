"""Typed errors of remote reads and writes. Each names the URL: ``url`` is an attribute and appears in
``str()``."""
from __future__ import annotations

from torchforge.errors import TorchforgeError

__all__ = [
    "CacheFullError",
    "RemoteAccessError",
    "RemoteChangedError",
    "RemoteCorruptError",
    "RemoteError",
    "RemoteExistsError",
    "RemoteNotFoundError",
    "RemoteReadOnlyError",
]


class RemoteError(TorchforgeError):
    """A remote object could not be read or written. ``url`` is the object's URL (also shown as the error's
    path).

    Args:
        reason: what went wrong and, where there is one, the fix.
        url: the object's URL.
    """

    def __init__(self, reason: str, *, url: str, offset: int | None = None, path: str | None = None):
        self.url = url
        super().__init__(reason, path=url if path is None else path, offset=offset)


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The object (or its bucket) does not exist; also a FileNotFoundError. Raised without retries."""


class RemoteAccessError(RemoteError, PermissionError):
    """The server refused the request (403 / 401: wrong or missing credentials, or no permission on the
    bucket); also a PermissionError. Raised without retries."""


class RemoteChangedError(RemoteError):
    """The object's ETag (its Last-Modified time, for a server that sends no ETag) differs from the one
    pinned when the dataset was opened: it was overwritten at the same URL, and reading on would mix two
    versions into one epoch. Open the dataset again."""


class RemoteCorruptError(RemoteError):
    """The bytes received disagree with what the index records (size or hash), after retries."""


class CacheFullError(RemoteError):
    """``cache_limit`` leaves no room for the object even after evicting every cached object not in use."""


class RemoteReadOnlyError(RemoteError, PermissionError):
    """A write to a URL whose scheme is read-only (``http://``, ``https://``); also a PermissionError."""


class RemoteExistsError(RemoteError, FileExistsError):
    """The destination already holds objects and overwriting was not asked for; also a FileExistsError."""
