"""Checksums of checkpoint files, and their verification.

Every file is cut into ``BLOCK``-byte blocks (64 MiB); a block's digest is BLAKE2b-128 over the 64-bit
sums (mod 2**64, little-endian words, last page zero-padded) of its 4 KiB pages and its length. numpy
sums pages at memory speed with the GIL released (zlib's CRC-32 is several times slower), so
checksumming is not what limits a save; per-block digests let threads hash disjoint parts of one file
in parallel and let ``verify`` say where a file is damaged. Any change inside one page that does not
leave its word sum unchanged is detected - every flipped bit or byte, a zeroed, torn, stale, moved or
swapped page, truncation - and BLAKE2b makes a different page-sum list collide with probability
2**-128. Not detected: changes that cancel out inside one page (two 8-byte words swapped within a page).
It guards against accidental damage, not tampering.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from torchforge.errors import CheckpointError

__all__ = ["BLOCK", "PAGE", "BlockDigest", "PageSums", "verify_files"]

BLOCK = 64 << 20  # checksum granularity (the writer cuts its parallel writes on the same boundaries)
PAGE = 4096


class _Pages:
    """Cuts a stream of bytes into whole 4 KiB pages and hands each run of whole pages to ``_pages``; the
    bytes of a page not yet complete wait in ``_tail``."""

    def __init__(self) -> None:
        self._tail = bytearray()  # bytes of a page not yet complete
        self._n = 0

    def update(self, v: memoryview) -> None:
        self._n += len(v)
        pos = 0
        if self._tail:
            pos = min(PAGE - len(self._tail), len(v))
            self._tail += v[:pos]
            if len(self._tail) < PAGE:
                return
            self._pages(self._tail)
            self._tail = bytearray()
        full = (len(v) - pos) // PAGE * PAGE
        if full:
            self._pages(v[pos: pos + full])
        self._tail += v[pos + full:]

    @property
    def nbytes(self) -> int:
        """Bytes seen so far."""
        return self._n

    def _pages(self, buf: Any) -> None:
        raise NotImplementedError

    def _padded_tail(self) -> bytes:
        """The incomplete last page, zero-padded to a whole page."""
        return bytes(self._tail) + bytes(-len(self._tail) % PAGE)


class BlockDigest(_Pages):
    """Streaming digest of one block: BLAKE2b-128 of the 64-bit word sums of its 4 KiB pages."""

    def __init__(self) -> None:
        super().__init__()
        self._h = hashlib.blake2b(digest_size=16)

    def _pages(self, buf: Any) -> None:
        self._h.update(_page_sums(np.frombuffer(buf, dtype=np.uint8)).astype("<u8", copy=False).tobytes())

    def hexdigest(self) -> str:
        if self._tail:
            self._pages(self._padded_tail())
            self._tail = bytearray()
        self._h.update(self._n.to_bytes(8, "little"))  # zero padding must not hide a length change
        return self._h.hexdigest()


class PageSums(_Pages):
    """:class:`BlockDigest`'s page sums, kept rather than hashed, for a file whose first bytes (a header)
    are known only at the end: :meth:`hexdigest` puts them first and gives the digest of the whole."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: list[np.ndarray] = []

    def _pages(self, buf: Any) -> None:
        self.sums.append(_page_sums(np.frombuffer(buf, dtype=np.uint8)))

    def mark(self) -> tuple[int, bytes, int]:
        """The state to go back to with :meth:`rollback` (the bytes seen so far)."""
        return len(self.sums), bytes(self._tail), self._n

    def rollback(self, mark: tuple[int, bytes, int]) -> None:
        """Forget the bytes seen since :meth:`mark` returned ``mark``."""
        del self.sums[mark[0]:]
        self._tail, self._n = bytearray(mark[1]), mark[2]

    def hexdigest(self, head: bytes) -> str:
        """The digest of ``head`` (whole pages) followed by the bytes seen."""
        sums = [_page_sums(np.frombuffer(head, np.uint8)), *self.sums]
        if self._tail:
            sums.append(_page_sums(np.frombuffer(self._padded_tail(), np.uint8)))
        return _digest_of_sums(sums, len(head) + self._n)


def _page_sums(a: np.ndarray) -> np.ndarray:
    """The 64-bit word sums (mod 2**64) of each 4 KiB page of ``a`` (uint8, a whole number of pages)."""
    return a.view("<u8").reshape(-1, PAGE // 8).sum(axis=1, dtype=np.uint64)


def _digest_of_sums(sums: Sequence[np.ndarray], size: int) -> str:
    """The :class:`BlockDigest` of a block from its pages' sums (in order) and its length."""
    h = hashlib.blake2b(digest_size=16)
    for a in sums:
        h.update(a.astype("<u8", copy=False).tobytes())
    h.update(size.to_bytes(8, "little"))
    return h.hexdigest()


def verify_files(folder: str, entries: Mapping[str, Mapping[str, Any]], *, checksums: bool = True,
                 pool: ThreadPoolExecutor | None = None) -> None:
    """Check every manifest entry's size (and, with ``checksums``, its block digests).

    Raises:
        CheckpointError: naming the missing, resized or damaged file and the offset of the bad block.
    """
    for name, e in entries.items():
        p = os.path.join(folder, name)
        try:
            size = os.path.getsize(p)
        except OSError as ex:
            raise CheckpointError(f"file listed in the manifest is missing ({ex.strerror})", path=p) from None
        if size != e["size"]:
            raise CheckpointError(f"file has {size} bytes, the manifest says {e['size']}", path=p,
                                  offset=min(size, e["size"]))
        blocks = -(-size // BLOCK)
        if len(e["digests"]) not in (blocks, max(blocks, 1)):  # (an empty file: one digest of nothing, or none)
            raise CheckpointError(f"the manifest lists {len(e['digests'])} block digests for {size} bytes, which "
                                  f"take {blocks}: it is damaged", path=p)
    if not checksums:
        return
    work = [(name, b) for name, e in entries.items() for b in range(len(e["digests"]))]
    run: Callable = pool.map if pool is not None else map
    for (name, b), got in zip(work, run(lambda nb: _digest_block(os.path.join(folder, nb[0]), nb[1]), work)):
        want = entries[name]["digests"][b]
        if got != want:
            end = min((b + 1) * BLOCK, entries[name]["size"])
            raise CheckpointError(f"checksum mismatch in bytes {b * BLOCK}..{end} (digest {got}, "
                                  f"manifest {want}): the file is damaged", path=os.path.join(folder, name),
                                  offset=b * BLOCK)


def _digest_block(path: str, b: int) -> str:
    with open(path, "rb", buffering=0) as f:
        f.seek(b * BLOCK)
        buf = bytearray(max(0, min(BLOCK, os.fstat(f.fileno()).st_size - b * BLOCK)))
        n = f.readinto(buf)
        d = BlockDigest()
        d.update(memoryview(buf)[:n])
        return d.hexdigest()

