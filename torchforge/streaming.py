"""A one-line speed-up for MosaicML Streaming: torchforge's MDS reader inside ``StreamingDataset``.

>>> import torchforge.streaming
>>> torchforge.streaming.patch()  # doctest: +SKIP
>>> ds = streaming.StreamingDataset(local="data/train")  # now reads via one mmap per shard

:func:`patch` registers :class:`MDSStreamingReader` for format ``"mds"`` in Streaming's reader table
(``streaming.base.format._readers``). The table is mutated rather than ``reader_from_json`` rebound,
because Streaming's ``stream.py`` and ``local.py`` import that function by name. The reader subclasses
Streaming's own ``MDSReader``, so eviction, ``set_up_local``, sizes and ``validate`` behave exactly as
Streaming's; sample access goes through one memory map per shard instead of an ``open()`` per sample,
and per-sample compression (``"compression": "sample::zstd"``, MLDataForge's layout) becomes readable.
A process keeps at most :data:`MAX_OPEN_SHARDS` shards mapped (each holds two file descriptors), and
no more than a quarter of the descriptors the rest of the process leaves free (Streaming's own use grows
with every dataset alive on the machine): beyond that the map least recently opened and not used since
the last sweep is closed (a "clock"), and reopened on its next access, so datasets of many thousands of shards stay within the process's
file descriptor and memory-map limits.
:func:`unpatch` restores Streaming's reader. Importing this module does not import Streaming;
:func:`patch` does.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from typing import Any

from torchforge._limits import open_files_limit

# MDSStreamingReader is reachable as an attribute too (built on first use, see __getattr__).
__all__ = ["is_patched", "patch", "unpatch"]

_lock = threading.Lock()


# At most (two descriptors per map, half the limit left to the rest); within it, see _budget.
MAX_OPEN_SHARDS = max(2, min(4096, open_files_limit() // 4))
_opened: collections.deque[weakref.ref] = collections.deque()  # readers in the order they mapped
_opened_lock = threading.Lock()
_budget_now, _counted_maps, _admits_since = 2, 0, 0  # the budget last counted; the maps then; admits since


def _budget() -> int:
    """The maps this process may keep now: :data:`MAX_OPEN_SHARDS`, and no more than a quarter of the
    descriptors the rest of the process leaves free, at least 2. Streaming's own use grows with every
    dataset alive on the machine (two descriptors per shared-memory region of each, twelve a dataset):
    a budget fixed at import (16 maps at a limit of 64) ran the process out of descriptors."""
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # (less listdir's own)
    except OSError:  # no /proc (not Linux), or no descriptor left to list it with
        return max(2, min(MAX_OPEN_SHARDS, open_files_limit() // 8))
    free = open_files_limit() - (in_use - 2 * len(_opened))  # (an entry closed by eviction counts as open)
    return max(2, min(MAX_OPEN_SHARDS, free // 4))


def _admit(reader: Any) -> None:
    """Record that ``reader`` mapped its shard; close others' maps beyond the budget (:func:`_budget`).

    Each reader has at most one entry (``_admitted``); a reader closed by eviction keeps its entry, which
    counts again once it reopens, or is dropped when a sweep finds it closed. The chosen maps are closed
    after the budget's lock is released (closing takes the reader's own lock, which ``_open`` holds
    while it maps: one order of locks, no deadlock).
    """
    global _budget_now, _counted_maps, _admits_since
    victims = []
    with _opened_lock:
        if not reader._admitted:
            reader._admitted = True
            _opened.append(weakref.ref(reader))
        _admits_since += 1
        if len(_opened) > 2 and (len(_opened) > _counted_maps or _admits_since >= 64):
            # (counting descriptors costs: again when the maps outgrow those counted, or every 64th admit)
            _budget_now, _counted_maps, _admits_since = _budget(), len(_opened), 0
        budget = min(MAX_OPEN_SHARDS, _budget_now)
        sweeps = 2 * len(_opened)  # a sweep clears the used flags, so two rounds always find one
        while len(_opened) > budget and sweeps:
            sweeps -= 1
            r = _opened.popleft()()
            if r is None:
                continue
            if r._shard is None:  # closed since (evicted): its entry is dropped
                r._admitted = False
            elif r._used or r is reader:
                r._used = False
                _opened.append(weakref.ref(r))
            else:
                r._admitted = False
                victims.append(r)
    for r in victims:
        r.close()


_original: Any = None
_cls: Any = None


def _build_reader_class() -> type:
    from streaming.base.format.mds.reader import MDSReader

    from torchforge.errors import TorchforgeError
    from torchforge.formats.mds_reader import MDSShard, SampleDecoder, parse_shard_entry

    class MDSStreamingReader(MDSReader):
        """Streaming's ``MDSReader`` with mmap access and per-sample decompression.

        Constructed by Streaming from an index.json shard entry (``from_json``). A shard with a column whose
        encoding is not Streaming's own (one a user registered, or a stock one replaced, in Streaming's
        ``encodings._encodings`` table) gets Streaming's own reader, which decodes with that table.
        """

        @classmethod
        def from_json(cls, dirname: str, split: str | None, obj: dict[str, Any]) -> Any:
            encodings = obj.get("column_encodings") if isinstance(obj, dict) else None
            if isinstance(encodings, list) and any(_user_encoding(e) for e in encodings):
                return MDSReader.from_json(dirname, split, obj)
            return super().from_json(dirname, split, obj)

        def __init__(self, dirname: str, split: str | None, column_encodings: list[str], column_names: list[str],
                     column_sizes: list[int | None], compression: str | None, hashes: list[str], raw_data: Any,
                     samples: int, size_limit: int | str | None, zip_data: Any) -> None:
            entry = {"version": 2, "format": "mds", "column_encodings": column_encodings,
                     "column_names": column_names, "column_sizes": column_sizes, "compression": compression,
                     "hashes": hashes, "samples": samples, "size_limit": size_limit,
                     "raw_data": _info_dict(raw_data), "zip_data": _info_dict(zip_data)}
            where = self._where = os.path.join(dirname, split or "", raw_data.basename)  # (errors name it)
            self._meta = parse_shard_entry(entry, "shard", where)
            per_sample = self._meta.compression is not None and self._meta.compression.per_sample
            # Per-sample compression is invisible to Streaming's file handling: no zip files exist.
            super().__init__(dirname, split, column_encodings, column_names, column_sizes,
                             None if per_sample else compression, hashes, raw_data, samples, size_limit, zip_data)
            self.sample_compression = self._meta.compression.spec if per_sample else None
            self._shard: MDSShard | None = None
            self._fd = -1
            self._lock = threading.Lock()  # opening and closing the map (threads may share a reader)
            self._used = False  # accessed since the last sweep of the open-map budget
            self._admitted = False  # has an entry in the open-map budget
            # Streaming gates pkl columns in validate() (inherited, called by Stream); past that gate
            # its reader decodes them, and so does this one.
            self._decoder = SampleDecoder(self._meta, where, allow_unsafe_types=True)

        def _open(self) -> MDSShard:
            """The shard's map, reopened when the file was deleted (evicted) since it was mapped."""
            with self._lock:
                shard = self._shard
                if shard is not None and os.fstat(self._fd).st_nlink:
                    return shard
                self._close_locked()
                path = os.path.join(self.dirname, self.split, self.raw_data.basename)
                # FileNotFoundError propagates: StreamingDataset.get_item downloads the shard and retries.
                fd = os.open(path, os.O_RDONLY)
                try:
                    with self._named():
                        shard = MDSShard(path, self._meta, allow_unsafe_types=True)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd, self._shard = fd, shard
            _admit(self)
            return shard

        @property
        def is_open(self) -> bool:
            """Whether the shard's map and descriptor are open now (they are closed when evicted)."""
            return self._shard is not None

        def close(self) -> None:
            """Drop the map and descriptor (the next access reopens them)."""
            with self._lock:
                self._close_locked()

        def _close_locked(self) -> None:
            shard, self._shard = self._shard, None
            if shard is not None:
                shard.close()
                os.close(self._fd)
                self._fd = -1

        def get_sample_data(self, idx: int) -> bytes:
            shard = self._open()
            if not 0 <= idx < shard.samples:
                raise IndexError(f"Relative sample index {idx} is not present in the {self.raw_data.basename} file.")
            return self._read(shard, lambda s: bytes(s.raw(idx)))

        def decode_sample(self, data: bytes) -> dict[str, Any]:
            with self._named():
                return self._decoder.decode(data)

        @contextlib.contextmanager
        def _named(self) -> Any:
            """An error in a shard Streaming decompressed from its ``zip_data`` file (``.mds.zstd``) says
            so: that file is the one to replace (the decompressed one is Streaming's copy)."""
            try:
                yield
            except TorchforgeError as e:
                if self.zip_data is not None and self.compression and "Streaming decompressed this file" not in e.reason:
                    e.reason += (f" (Streaming decompressed this file from {self.zip_data.basename}: that is the "
                                 "file to replace)")
                    e.args = (str(e),)
                raise

        def get_item(self, idx: int) -> dict[str, Any]:
            with self._named():
                return self._get_item(idx)

        def _get_item(self, idx: int) -> dict[str, Any]:
            # One fstat per sample: a shard deleted behind our back (eviction by another worker, a user)
            # must raise FileNotFoundError as Streaming's reader does, so that Streaming fetches it again.
            shard = self._shard
            try:
                st = None if shard is None else os.fstat(self._fd)
                if st is None or not st.st_nlink:
                    shard = self._open()
                elif st.st_size < shard.size:  # rewritten in place while mapped: reading on would be SIGBUS
                    from torchforge.errors import CorruptShardError

                    raise CorruptShardError(f"the shard file shrank to {st.st_size} bytes while it was open (it "
                                            f"had {shard.size}): rewritten in place?", path=shard.path,
                                            offset=st.st_size)
                self._used = True
                if not 0 <= idx < shard.samples:
                    raise IndexError(f"Relative sample index {idx} is not present in the {self.raw_data.basename} file.")
                return shard.get(idx)
            except (ValueError, OSError):
                if shard is None or self._shard is shard:
                    raise  # this shard's own error (FormatError is a ValueError), or a missing file
            return self._read(self._open(), lambda s: s.get(idx))

        def _read(self, shard: MDSShard, read: Any) -> Any:
            """``read(shard)``; when another thread's open (the open-map budget) closes the map under
            it, reopen and read again, a few times if that goes on. Other errors are raised."""
            for attempt in range(8):
                self._used = True
                try:
                    return read(shard)
                except ValueError:
                    if self._shard is shard or attempt == 7:
                        raise
                shard = self._open()
            raise AssertionError("unreachable")

        def __getitem__(self, at: Any) -> Any:
            # Streaming's get_item calls reader[i] for every sample: take ints straight to get_item
            # (Array.__getitem__ also takes negative ints, slices, lists and arrays).
            if type(at) is int and at >= 0:
                return self.get_item(at)
            return super().__getitem__(at)

        def __del__(self) -> None:
            with contextlib.suppress(Exception):  # half-built reader, or interpreter shutdown
                self.close()

        def _evict_raw(self) -> int:
            self.close()
            return super()._evict_raw()

        def evict(self) -> int:
            self.close()
            return super().evict()

        def __getstate__(self) -> dict[str, Any]:
            state = self.__dict__.copy()
            state["_shard"], state["_used"], state["_admitted"] = None, False, False  # maps, descriptors and decoders (closures) are rebuilt on the other side
            state.pop("_fd", None)
            del state["_decoder"], state["_lock"]
            return state

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state)
            self._fd, self._lock = -1, threading.Lock()
            self._decoder = SampleDecoder(self._meta, self._where, allow_unsafe_types=True)

    MDSStreamingReader.__module__ = __name__
    MDSStreamingReader.__qualname__ = "MDSStreamingReader"
    return MDSStreamingReader


def _user_encoding(encoding: Any) -> bool:
    """Whether Streaming's encoding table maps ``encoding`` (``"str"``, ``"ndarray:int32:3"``) to a class
    that is not Streaming's own: a user's, which torchforge's decoders do not know."""
    from streaming.base.format.mds import encodings as stock

    if not isinstance(encoding, str):
        return False
    cls = stock._encodings.get(encoding.split(":", 1)[0])
    return cls is not None and not (getattr(cls, "__module__", None) == stock.__name__
                                    and getattr(stock, getattr(cls, "__name__", ""), None) is cls)


def _info_dict(info: Any) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"basename": info.basename, "bytes": info.bytes, "hashes": info.hashes}


def _reader_class() -> type:
    global _cls
    with _lock:
        if _cls is None:
            _cls = _build_reader_class()
        return _cls


def __getattr__(name: str) -> Any:
    # The class is built on first use so that importing this module never imports Streaming;
    # pickle finds it here by name (DataLoader workers unpickling a patched StreamingDataset).
    if name == "MDSStreamingReader":
        return _reader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def patch() -> None:
    """Make Streaming read format ``"mds"`` with torchforge's reader (idempotent).

    Raises:
        ImportError: MosaicML Streaming is not installed (``pip install mosaicml-streaming``).
    """
    global _original
    cls = _reader_class()
    from streaming.base import format as fmt

    with _lock:
        current = fmt._readers["mds"]
        if current is not cls:
            _original = current
            fmt._readers["mds"] = cls


def unpatch() -> None:
    """Restore Streaming's own ``"mds"`` reader (a no-op when not patched)."""
    global _original
    with _lock:
        if _original is None:
            return
        from streaming.base import format as fmt

        if fmt._readers.get("mds") is _cls:
            fmt._readers["mds"] = _original
        _original = None


def is_patched() -> bool:
    """Whether Streaming currently reads MDS through torchforge."""
    import sys

    fmt = sys.modules.get("streaming.base.format")
    return fmt is not None and _cls is not None and fmt._readers.get("mds") is _cls
