"""Values readers hand out without copying.

:class:`ByteView` is what JINX (``name.raw.bin``) and MDS (``bytes``) binary values come back as when a
reader is zero-copy: a read-only view into the shard's map that behaves as ``bytes`` where values
travel, and costs no copy where they do not:

- it pickles as its ``bytes`` (the copy happens when it leaves the process, into a DataLoader worker's
  batch or a queue), so the other side receives plain ``bytes``;
- torch's ``default_collate`` collates a batch of them as it does ``bytes``: a list (the type is added
  to ``torch.utils.data._utils.collate.default_collate_fn_map``, the extension point torch documents);
- ``==``, ``hash``, ``len``, truth, ``in`` (a byte or a substring), ``v[i]`` and iteration (ints),
  ``bytes(v)``, ``v.decode()`` and the buffer protocol (``memoryview(v)``, ``io.BytesIO(v)``, ``np.frombuffer(v)``, ``PIL.Image.open(io.BytesIO(v))``) work as on ``bytes``.

It is a one-dimensional ``uint8`` numpy array underneath (the one type in Python 3.11 that offers
the buffer protocol over someone else's memory and can be subclassed), so arithmetic is numpy's;
call ``bytes(v)`` for the other ``bytes`` methods. Every torchforge writer takes it, and any other
bytes-like value, wherever it takes ``bytes``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BYTES_LIKE", "ByteView", "as_bytes", "byte_view"]


class ByteView(np.ndarray):
    """A read-only ``uint8`` view that behaves as ``bytes`` when compared, hashed, pickled or collated."""

    def __reduce__(self) -> tuple[Any, ...]:
        return bytes, (self.tobytes(),)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:  # numpy's own sends array buffers (protocol 5)
        return bytes, (self.tobytes(),)

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        """An int for an index (as ``bytes``), a ByteView for a slice."""
        item = _getitem(self, key)
        return int(item) if isinstance(item, np.integer) else item

    def __iter__(self) -> Any:
        return iter(self.tobytes())  # ints, as bytes

    def __bytes__(self) -> bytes:
        return self.tobytes()

    def __bool__(self) -> bool:  # numpy's: ambiguous beyond one element, and False for b"\x00"
        return len(self) > 0

    def __contains__(self, item: object) -> bool:  # numpy's compares elements: b"PNG" in v was False
        return item in self.tobytes()

    def __eq__(self, other: object) -> bool:  # type: ignore[override]
        if isinstance(other, BYTES_LIKE):
            return self.tobytes() == (other.tobytes() if isinstance(other, ByteView) else bytes(other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:  # type: ignore[override]
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(self.tobytes())

    def __repr__(self) -> str:
        data = self[:64].tobytes()
        return f"ByteView({data!r}{'...' if len(self) > 64 else ''}, {len(self)} bytes)"

    __str__ = __repr__

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.tobytes().decode(encoding, errors)


BYTES_LIKE = (bytes, bytearray, memoryview, ByteView)
_getitem = np.ndarray.__getitem__  # readers slice with it directly (no Python-level call per value)


def byte_view(buffer: Any) -> ByteView:
    """A read-only :class:`ByteView` over ``buffer`` (no copy); slice it for sub-views."""
    view = np.frombuffer(buffer, dtype=np.uint8).view(ByteView)
    if view.flags.writeable:
        view.flags.writeable = False
    return view


def as_bytes(value: Any, what: str) -> bytes:
    """``bytes`` of any bytes-like value (bytes, bytearray, memoryview, ByteView); TypeError otherwise."""
    if type(value) is bytes:
        return value
    if isinstance(value, ByteView):
        return value.tobytes()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} takes bytes-like values (bytes, bytearray, memoryview, ByteView), "
                    f"got {type(value).__name__}")


def _register_with_torch_collate() -> None:
    try:
        from torch.utils.data._utils.collate import collate_str_fn, default_collate_fn_map
    except ImportError:  # torch is optional for the format layer
        return
    default_collate_fn_map.setdefault(ByteView, collate_str_fn)


_register_with_torch_collate()
