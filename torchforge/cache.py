"""The per-user cache folder: key arrays for ``sort_key`` today, remote shards and ranges later.

Never the data folder: dataset folders are often read-only, shared between users, or on a network
filesystem that other jobs read at the same time.

Location, first that applies: ``$TORCHFORGE_CACHE_DIR``; ``$XDG_CACHE_HOME/torchforge``;
``~/.cache/torchforge``; and, where that cannot be created (a read-only home), a folder named for the
user under the system's temporary folder. Folders are created with mode 0700.
"""
from __future__ import annotations

import logging
import os
import tempfile

__all__ = ["user_cache_dir"]

log = logging.getLogger(__name__)


def _base() -> str:
    env = os.environ.get("TORCHFORGE_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "torchforge")


def user_cache_dir(*parts: str) -> str:
    """The per-user cache folder (or ``parts`` below it), created if missing.

    >>> user_cache_dir("keys")  # doctest: +SKIP
    '/home/me/.cache/torchforge/keys'
    """
    base = _base()
    path = os.path.join(base, *parts)
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)  # the mode applies to the last folder made only
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    except OSError as e:
        uid = os.getuid() if hasattr(os, "getuid") else os.getlogin()
        fallback = os.path.join(tempfile.gettempdir(), f"torchforge-cache-{uid}", *parts)
        log.warning("cache folder %s cannot be created (%s); using %s", path, e, fallback)
        os.makedirs(fallback, mode=0o700, exist_ok=True)
        return fallback
