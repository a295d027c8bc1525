"""Room for open files: datasets keep one memory map per shard file, and each map holds a descriptor.

Python's ``mmap`` duplicates the descriptor it maps, so a dataset that has touched ``n`` shard files
holds ``n`` descriptors (JINX: shard and sidecar). The usual soft limit of 1024 would stop a random
pass over a thousand shards with ``EMFILE``. Before opening many files, :func:`ensure_open_files`
raises the process's soft limit toward the hard limit (as ``ulimit -n`` would), once, logs that it did
(INFO, logger ``torchforge._limits``), and warns when even the hard limit is too low.
"""
from __future__ import annotations

import logging
import threading

try:
    import resource
except ImportError:  # pragma: no cover - not on POSIX
    resource = None  # type: ignore[assignment]

__all__ = ["ensure_open_files", "open_files_limit"]

log = logging.getLogger(__name__)
_MARGIN = 256  # descriptors left for everything else (sockets, pipes, workers, logs)
_lock = threading.Lock()


def open_files_limit(unlimited: int = 1 << 16, unknown: int = 1024) -> int:
    """The process's soft limit on open descriptors (``unlimited`` if it has none, ``unknown`` where the
    platform does not say)."""
    if resource is None:
        return unknown
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):  # pragma: no cover - not on every platform
        return unknown
    return unlimited if soft == resource.RLIM_INFINITY else soft


def ensure_open_files(count: int, what: str = "dataset") -> None:
    """Make room for ``count`` more open descriptors, raising the soft limit if needed.

    Args:
        count: descriptors the caller may hold at once (e.g. one per shard file).
        what: named in the warning when the hard limit is too low.
    """
    if resource is None or count <= 0:
        return
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        want = count + _MARGIN
        if want <= soft:
            return
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (OSError, ValueError):
            new = soft
        if new > soft:
            log.info("raised this process's open-file soft limit from %d to %d (hard limit %s): %s may hold "
                     "%d open files", soft, new, hard, what, count)
        if new < want:
            log.warning("%s may hold %d open files but the open-file limit is %d (hard limit %s): "
                        "raise it (ulimit -n) or expect 'Too many open files'", what, count, new, hard)
