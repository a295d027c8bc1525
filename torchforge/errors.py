"""Typed errors. Every error that concerns a file carries its path and byte offset.

All errors derive from :class:`TorchforgeError`; ``path`` and ``offset`` are attributes and appear in
``str()``, so a log line names the file and where in it the problem is.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = [
    "CheckpointError",
    "CodecError",
    "CorruptShardError",
    "FormatError",
    "NotFoundError",
    "SafetensorsError",
    "TorchforgeError",
    "WorkerError",
]


class TorchforgeError(Exception):
    """Base class of every error torchforge raises on purpose.

    Args:
        reason: what went wrong and, where there is one, the fix.
        path: the file concerned, if any.
        offset: the byte offset in ``path`` where the problem was found, if known.
    """

    def __init__(self, reason: str, *, path: str | os.PathLike | None = None, offset: int | None = None):
        self.reason = reason
        self.path = None if path is None else os.fspath(path)
        self.offset = offset
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(self.path)
        if self.offset is not None:
            where.append(f"byte {self.offset}")
        return f"{': '.join(where)}: {self.reason}" if where else self.reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep path and offset across pickling (worker processes re-raise in the main process).
        return (_rebuild, (type(self), self.reason, self.path, self.offset, self.__dict__))


def _rebuild(cls: type, reason: str, path: str | None, offset: int | None, state: dict) -> TorchforgeError:
    err = cls.__new__(cls)
    TorchforgeError.__init__(err, reason, path=path, offset=offset)
    err.__dict__.update(state)
    return err


class NotFoundError(TorchforgeError, FileNotFoundError):
    """A path the caller named (a dataset, a shard, an index) does not exist: both a TorchforgeError and
    a FileNotFoundError, so either ``except`` catches it."""


class FormatError(TorchforgeError, ValueError):
    """A file is not laid out as its format requires (bad header, footer, index or value)."""


class CorruptShardError(FormatError):
    """A shard's bytes contradict its own metadata: offsets out of range, truncation, bad checksum."""


class CodecError(TorchforgeError):
    """A compression codec is unknown, not installed, or failed to decompress its input."""


class SafetensorsError(FormatError):
    """A safetensors file violates the format (header, dtype, offsets, sizes)."""


class CheckpointError(TorchforgeError):
    """A checkpoint is missing, incomplete, or fails verification."""


class WorkerError(TorchforgeError, RuntimeError):
    """A data-loader worker died more often than ``max_retries`` allows (a RuntimeError, as torch's
    "DataLoader worker ... is killed by signal" is)."""
