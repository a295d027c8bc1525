"""MDS, the shard format of MosaicML Streaming: a writer whose output is byte-identical to Streaming's.

Layout (Streaming 0.13): a folder with ``index.json`` (``{"shards": [...], "version": 2}``) and shard
files ``shard.NNNNN.mds``, each ``[count: u32][offsets: (count + 1) * u32][config JSON][samples]``
where ``offsets`` are absolute and the last one is the file size. A sample is ``[size: u32 per
variable-size column][column bytes in column-name order]``. Shard-level compression writes
``shard.NNNNN.mds.<ext>`` instead; sample-level compression (``"sample::zstd"``, MLDataForge's
``MDSSampleWriter``) compresses each sample on its own and keeps the ``.mds`` name.

Example:
    >>> with MDSWriter("out", {"id": "int", "text": "str"}) as w:  # doctest: +SKIP
    ...     w.write({"id": 0, "text": "hello"})

The reader side lives in :mod:`torchforge.formats.mds_reader`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from torchforge.codecs import Codec, parse_compression
from torchforge.errors import CodecError, FormatError, TorchforgeError
from torchforge.formats.mds_encodings import Encoding, get_encoding
from torchforge.formats.safetensors import fsync_dir
from torchforge.formats.values import BYTES_LIKE, as_bytes
from torchforge.sizes import parse_size

__all__ = ["MAX_SHARD_BYTES", "Compression", "MDSWriter", "get_hash", "hash_names", "parse_mds_compression"]

MAX_SHARD_BYTES = 2**32 - 1  # offsets are uint32; the last offset is the shard's size
INDEX_BASENAME = "index.json"

# Streaming's compression families: extension -> (torchforge codec, default level, allowed levels).
_FAMILIES: dict[str, tuple[str, int | None, range | None]] = {
    "br": ("br", 11, range(12)),
    "bz2": ("bz2", 9, range(1, 10)),
    "gz": ("gz", 9, range(10)),
    "snappy": ("snappy", None, None),
    "zstd": ("zst", 3, range(1, 23)),
}
SAMPLE_PREFIX = "sample::"


@dataclass(frozen=True)
class Compression:
    """A parsed MDS compression setting.

    Attributes:
        spec: the string as written into index.json (``"zstd:7"``, ``"sample::zstd"``).
        extension: the file extension Streaming appends for shard-level compression (``"zstd"``).
        codec: the torchforge codec.
        level: the level to compress with (Streaming's default when the spec names none).
        per_sample: True for ``sample::`` compression (each sample compressed on its own).
    """

    spec: str
    extension: str
    codec: Codec
    level: int | None
    per_sample: bool

    def __reduce__(self) -> tuple[Any, ...]:
        return parse_mds_compression, (self.spec,)  # codecs hold functions: rebuild from the spec

    def compress(self, data: bytes) -> bytes:
        if self.extension == "gz":
            return _gzip_like_streaming(data, 9 if self.level is None else self.level)
        return self.codec.compress(data, self.level)


def _gzip_like_streaming(data: bytes, level: int) -> bytes:
    """``gzip.compress(data, level)`` as Streaming calls it (OS byte 255), but with mtime 0, not now."""
    xfl = 2 if level == 9 else 4 if level == 1 else 0
    header = struct.pack("<BBBBLBB", 0x1F, 0x8B, 8, 0, 0, xfl, 255)
    trailer = struct.pack("<LL", zlib.crc32(data), len(data) & 0xFFFFFFFF)
    return header + zlib.compress(data, level, wbits=-15) + trailer


def parse_mds_compression(spec: str | None) -> Compression | None:
    """Parse an MDS compression string: ``None``, ``"zstd"``, ``"gz:6"``, ``"sample::zstd"``, ...

    Raises:
        CodecError: not one of Streaming's compressions, a level out of range, or the codec's
            package is missing.
    """
    if not spec:
        return None
    if not isinstance(spec, str):
        raise CodecError(f"compression must be a string, got {type(spec).__name__}")
    per_sample = spec.startswith(SAMPLE_PREFIX)
    algo = spec[len(SAMPLE_PREFIX):] if per_sample else spec
    family = algo.partition(":")[0]
    if family not in _FAMILIES:  # Streaming's spellings only: they are written into index.json
        raise CodecError(f"compression={spec!r}: {family!r} is not one of {sorted(_FAMILIES)} (optionally "
                         "':level', or 'sample::' in front for per-sample compression)")
    parsed = parse_compression(algo, option="compression")
    assert parsed is not None  # family is one of _FAMILIES
    codec, level = parsed
    _, default, levels = _FAMILIES[family]
    if level is None:
        level = default
    elif levels is None or level not in levels:
        allowed = "no levels" if levels is None else f"levels {levels.start}..{levels.stop - 1}"
        raise CodecError(f"compression={spec!r}: {family} takes {allowed}")
    return Compression(spec, family, codec, level, per_sample)


# --- hashes: hashlib's constructors (no shake_*) and xxhash's when installed, as Streaming ---------
def _hash_table() -> dict[str, Callable[[bytes], Any]]:
    table: dict[str, Callable[[bytes], Any]] = {}
    for algo in hashlib.algorithms_available:
        if hasattr(hashlib, algo) and not algo.startswith("shake_"):
            table[algo] = getattr(hashlib, algo)
    try:
        import xxhash
    except ImportError:
        return table
    for algo in xxhash.algorithms_available:
        table[algo] = getattr(xxhash, algo)
    return table


_HASHES = _hash_table()


def hash_names() -> list[str]:
    """The hash algorithms available for ``hashes=`` (xxh* only when ``xxhash`` is installed)."""
    return sorted(_HASHES)


def get_hash(algo: str, data: bytes) -> str:
    """Hex digest of ``data`` under ``algo``."""
    func = _HASHES.get(algo)
    if func is None:
        raise FormatError(f"hash {algo!r} is not one of {hash_names()}")
    return func(data).hexdigest()


def _parse_size(size_limit: int | str | None) -> int | None:
    """``size_limit`` in bytes (:func:`torchforge.sizes.parse_size`); None or 0 means no limit."""
    if size_limit is None:
        return None
    value = parse_size(size_limit, option="size_limit", allow_zero=True)
    if value >= 2**32:
        raise FormatError(f"size_limit={size_limit!r} must be below 2**32 bytes: MDS stores sample offsets "
                          "as uint32")
    return value or None


# the names MDS writers give shards (Streaming's formats, its compressions' extensions) and the index
_DATASET_FILE = re.compile(r"shard\.\d{5,}\.(mds|csv|tsv|jsonl|xsv)(\.(zstd|zst|gz|bz2|br|snappy))?"
                           r"|\.?index\.json(\.tmp)?")


def _remove_dataset(folder: str) -> None:
    """Remove the MDS dataset in ``folder``: its index first (then no reader takes what is left for a
    dataset), then its shard files and a dead writer's temporary index."""
    index = os.path.join(folder, INDEX_BASENAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
        fsync_dir(folder)
    for name in os.listdir(folder):
        if _DATASET_FILE.fullmatch(name) and os.path.isfile(os.path.join(folder, name)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))


class MDSWriter:
    """Write an MDS dataset, byte-identical to MosaicML Streaming's ``MDSWriter`` for the same input.

    Args:
        out: the output folder (created; must be empty unless ``exist_ok``).
        columns: column name -> encoding (see :mod:`torchforge.formats.mds_encodings`).
        compression: ``None``; shard-level ``"zstd"``, ``"zstd:7"``, ``"gz"``, ``"bz2"``, ``"br"``,
            ``"snappy"``; or per-sample ``"sample::zstd"`` (MLDataForge's layout, which Streaming
            reads only after :func:`torchforge.streaming.patch`).
        hashes: sorted list of hash algorithms recorded for every shard file (see :func:`hash_names`).
        size_limit: start a new shard before one would exceed this many bytes: an int or a size string
            (:mod:`torchforge.sizes`: ``"64MiB"`` is 2**26, ``"64MB"`` 64*10**6; Streaming reads
            ``"64mb"`` as 2**26, torchforge as 64*10**6); must be below 2**32. ``None`` puts everything in one shard (still capped at 2**32 - 1).
        exist_ok: allow a non-empty ``out``: the MDS dataset there is removed first, its ``index.json``
            before its shards (the names MDS writers give, ``shard.NNNNN.mds[.zstd]`` and the like, the
            decompressed copies a reader leaves included), so a
            rewrite that dies leaves no index over a mix of old and new shards, and no stale shard is read
            for a new one; other files stay. (Streaming's writer removes all of the folder's contents.)

    Raises:
        FileExistsError: ``out`` holds files already.
        FormatError: a bad column encoding, size limit or hash name; a sample that does not match its
            columns; a shard that would pass 2**32 bytes.
        CodecError: an unknown compression.
    """

    format = "mds"

    def __init__(self, out: str | os.PathLike, columns: dict[str, str], compression: str | None = None,
                 hashes: list[str] | None = None, size_limit: int | str | None = 1 << 26, *,
                 exist_ok: bool = False) -> None:
        self.out = os.fspath(out)
        if not isinstance(columns, dict) or not columns:
            raise FormatError("columns must be a non-empty dict of column name -> MDS encoding")
        self.compression = compression or None
        self._comp = parse_mds_compression(self.compression)
        # (a string names one algorithm or several, comma-separated: "sha1,xxh64", as `convert -o hashes=` gives)
        self.hashes = [h.strip() for h in hashes.split(",") if h.strip()] if isinstance(hashes, str) else \
            list(hashes or [])
        if self.hashes != sorted(set(self.hashes)):
            raise FormatError(f"hashes={self.hashes!r} must be unique and sorted")
        for algo in self.hashes:
            if algo not in _HASHES:
                raise FormatError(f"hash {algo!r} is not one of {hash_names()}")
        self.size_limit = _parse_size(size_limit)
        self.column_names = sorted(columns)
        self._encodings: list[Encoding] = [get_encoding(columns[name]) for name in self.column_names]
        self.column_encodings = [columns[name] for name in self.column_names]
        self.column_sizes = [enc.size for enc in self._encodings]
        self._config = json.dumps(self._shard_config(), sort_keys=True).encode("utf-8")
        self._shard_overhead = 8 + len(self._config)  # count + first offset + config
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._shard_size = self._shard_overhead
        self._finished = False
        if os.path.isdir(self.out) and os.listdir(self.out) and not exist_ok:
            raise FileExistsError(f"{self.out}: output folder is not empty (pass exist_ok=True to write into it)")
        if os.path.isdir(self.out):
            _remove_dataset(self.out)
        os.makedirs(self.out, exist_ok=True)

    # --- encoding -----------------------------------------------------------------------------------
    def _shard_config(self) -> dict[str, Any]:
        return {"version": 2, "format": self.format, "compression": self.compression, "hashes": self.hashes,
                "size_limit": self.size_limit, "column_names": self.column_names,
                "column_encodings": self.column_encodings, "column_sizes": self.column_sizes}

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        """One sample's bytes: variable-column sizes, then the columns (compressed if per-sample)."""
        sizes = []
        parts = []
        for name, enc in zip(self.column_names, self._encodings):
            try:
                value = sample[name]
            except KeyError:
                raise FormatError(f"sample has no column {name!r} (columns: {self.column_names})") from None
            # Streaming stores bytes as they are, whatever the encoding (pre-encoded JPEG, ...).
            try:
                datum = as_bytes(value, "MDS") if isinstance(value, BYTES_LIKE) else enc.encode(value)
            except (TypeError, ValueError, OverflowError) as e:  # (UnicodeError is a ValueError)
                if isinstance(e, TorchforgeError):
                    raise
                raise FormatError(f"column {name!r} ({enc.name}) cannot hold this {type(value).__name__}: {e}",
                                  path=self.out) from e
            if enc.size is None:
                sizes.append(len(datum).to_bytes(4, "little"))
            elif len(datum) != enc.size:
                raise FormatError(f"column {name!r} ({enc.name}) must encode to {enc.size} bytes, got {len(datum)}")
            parts.append(datum)
        data = b"".join(sizes + parts)
        if self._comp is not None and self._comp.per_sample:
            data = self._comp.compress(data)
        return data

    # --- writing ------------------------------------------------------------------------------------
    def write(self, sample: dict[str, Any]) -> None:
        """Add a sample, first closing the current shard if the sample would push it past size_limit."""
        if self._finished:
            raise FormatError("write() after finish()", path=self.out)
        data = self.encode_sample(sample)
        grown = self._shard_size + len(data) + 4
        if self.size_limit and self.size_limit < grown:
            # Like Streaming, even when the shard is empty (a first sample above size_limit leaves an
            # empty shard 0): the output stays byte-identical.
            self._flush()
            grown = self._shard_size + len(data) + 4
        if grown > MAX_SHARD_BYTES:
            raise FormatError(f"shard {len(self.shards)} would reach {grown} bytes, past the MDS limit of 2**32 - 1 "
                              "(sample offsets are uint32): set a size_limit below 2**32 and keep every "
                              "sample below it", path=self.out)
        self._samples.append(data)
        self._shard_size = grown

    def _encode_shard(self) -> bytes:
        n = len(self._samples)
        head = 4 + 4 * (n + 1) + len(self._config)
        offsets = [head]
        for s in self._samples:
            offsets.append(offsets[-1] + len(s))
        return b"".join([n.to_bytes(4, "little"), b"".join(o.to_bytes(4, "little") for o in offsets),
                         self._config, *self._samples])

    def _file_info(self, data: bytes, basename: str) -> dict[str, Any]:
        return {"basename": basename, "bytes": len(data), "hashes": {a: get_hash(a, data) for a in self.hashes}}

    def _flush(self) -> None:
        raw_name = f"shard.{len(self.shards):05}.{self.format}"
        raw = self._encode_shard()
        raw_info = self._file_info(raw, raw_name)
        zip_info = None
        data, name = raw, raw_name
        if self._comp is not None and not self._comp.per_sample:
            name = f"{raw_name}.{self._comp.extension}"
            data = self._comp.compress(raw)
            zip_info = self._file_info(data, name)
        with open(os.path.join(self.out, name), "wb") as f:
            f.write(data)
        entry = {"samples": len(self._samples), "raw_data": raw_info, "zip_data": zip_info}
        entry.update(self._shard_config())
        self.shards.append(entry)
        self._samples = []
        self._shard_size = self._shard_overhead

    def finish(self) -> None:
        """Write the last shard and index.json (idempotent)."""
        if self._finished:
            return
        if self._samples:
            self._flush()
        tmp = os.path.join(self.out, f".{INDEX_BASENAME}.tmp")
        with open(tmp, "w") as f:
            json.dump({"version": 2, "shards": self.shards}, f, sort_keys=True)
        os.replace(tmp, os.path.join(self.out, INDEX_BASENAME))
        self._finished = True

    close = finish

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finish()
