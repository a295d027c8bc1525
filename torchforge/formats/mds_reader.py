"""Reading MDS: index.json parsing and one checked, memory-mapped shard reader.

:class:`MDSShard` maps a raw (uncompressed-at-shard-level) ``.mds`` file once and checks its header
against index.json and the file size before any offset is used: a truncated file, a lying count or
offset table, or a sample whose column sizes run past its end raises
:class:`~torchforge.errors.CorruptShardError` naming the file and byte offset. Per-sample compression
(``sample::zstd``) is undone sample by sample; a corrupt frame raises
:class:`~torchforge.errors.CodecError` with the sample's offset.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchforge.errors import CodecError, CorruptShardError, FormatError, NotFoundError, TorchforgeError
from torchforge.formats.mds import INDEX_BASENAME, Compression, parse_mds_compression
from torchforge.formats.mds_encodings import Encoding, get_encoding
from torchforge.formats.values import ByteView, byte_view

__all__ = ["LazySample", "MDSShard", "SampleDecoder", "ShardMeta", "parse_shard_entry", "read_index"]


@dataclass(frozen=True)
class ShardMeta:
    """One entry of index.json's ``shards`` list, checked."""

    samples: int
    raw_basename: str
    raw_bytes: int
    zip_basename: str | None
    zip_bytes: int | None
    compression: Compression | None
    column_names: tuple[str, ...]
    column_encodings: tuple[str, ...]
    column_sizes: tuple[int | None, ...]
    raw: dict  # the entry as read, for code that needs every field (Streaming's reader)


def _field(entry: Mapping, key: str, types: type | tuple[type, ...], where: str, path: str) -> Any:
    if key not in entry:
        raise FormatError(f"{where} has no {key!r}", path=path)
    value = entry[key]
    if not isinstance(value, types) or isinstance(value, bool):
        raise FormatError(f"{where}: {key!r} is {value!r}, not {getattr(types, '__name__', types)}", path=path)
    return value


def _file_info(entry: Mapping, key: str, where: str, path: str) -> tuple[str, int] | None:
    info = entry.get(key)
    if info is None:
        return None
    if not isinstance(info, Mapping):
        raise FormatError(f"{where}: {key!r} is not an object", path=path)
    name = _field(info, "basename", str, f"{where}.{key}", path)
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise FormatError(f"{where}.{key}: basename {name!r} leaves the dataset folder", path=path)
    size = _field(info, "bytes", int, f"{where}.{key}", path)
    if size < 0:
        raise FormatError(f"{where}.{key}: negative size {size}", path=path)
    hashes = info.get("hashes", {})
    if not isinstance(hashes, Mapping) or not all(isinstance(v, str) for v in hashes.values()):
        raise FormatError(f"{where}.{key}: 'hashes' is {hashes!r}, not an object of hex digests", path=path)
    return name, size


def parse_shard_entry(entry: Any, where: str, path: str) -> ShardMeta:
    """Check one shard entry of index.json (also used for Streaming's from_json objects)."""
    if not isinstance(entry, Mapping):
        raise FormatError(f"{where} is not an object", path=path)
    if entry.get("version") != 2:
        raise FormatError(f"{where}: version {entry.get('version')!r} is not 2", path=path)
    if entry.get("format") != "mds":
        raise FormatError(f"{where}: format {entry.get('format')!r} is not 'mds'", path=path)
    samples = _field(entry, "samples", int, where, path)
    if samples < 0:
        raise FormatError(f"{where}: negative sample count {samples}", path=path)
    raw = _file_info(entry, "raw_data", where, path)
    if raw is None:
        raise FormatError(f"{where} has no raw_data", path=path)
    if 4 * (samples + 2) > raw[1]:  # [count: u32][offsets: (samples + 1) * u32], before any sample
        raise FormatError(f"{where}: {samples} samples cannot fit in raw_data's {raw[1]} bytes (their offset "
                          "table alone would not)", path=path)
    zipped = _file_info(entry, "zip_data", where, path)
    try:
        comp = parse_mds_compression(entry.get("compression"))
    except CodecError as e:
        raise CodecError(f"{where}: {e.reason}", path=path) from None
    if zipped is not None and (comp is None or comp.per_sample):
        raise FormatError(f"{where}: zip_data without a shard-level compression", path=path)
    names = _field(entry, "column_names", list, where, path)
    encs = _field(entry, "column_encodings", list, where, path)
    sizes = _field(entry, "column_sizes", list, where, path)
    for key, values in (("column_names", names), ("column_encodings", encs)):
        odd = next((v for v in values if not isinstance(v, str)), None)
        if odd is not None:
            raise FormatError(f"{where}: {key!r} holds {odd!r}, not a string", path=path)
    if not len(names) == len(encs) == len(sizes) or len(set(names)) != len(names):
        raise FormatError(f"{where}: column_names, column_encodings and column_sizes disagree", path=path)
    for name, enc_name, size in zip(names, encs, sizes):
        try:
            enc = get_encoding(enc_name)
        except FormatError as e:
            raise FormatError(f"{where}: column {name!r}: {e.reason}", path=path) from None
        if size != enc.size:
            raise FormatError(f"{where}: column {name!r} ({enc_name}) has size {size!r}, the encoding's is "
                              f"{enc.size!r}", path=path)
    return ShardMeta(samples, raw[0], raw[1], zipped and zipped[0], zipped and zipped[1], comp, tuple(names),
                     tuple(encs), tuple(sizes), dict(entry))


def read_index(folder: str) -> list[ShardMeta]:
    """Read and check ``folder/index.json``.

    Raises:
        FormatError: missing, not JSON, or not an MDS version-2 index.
    """
    path = os.path.join(folder, INDEX_BASENAME)
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError("no MDS index.json here", path=path) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise FormatError(f"index.json is not JSON ({e})", path=path, offset=getattr(e, "pos", None)) from None
    if not isinstance(obj, Mapping) or obj.get("version") != 2 or not isinstance(obj.get("shards"), list):
        raise FormatError("not an MDS index: expected {'version': 2, 'shards': [...]}", path=path)
    return [parse_shard_entry(e, f"shards[{k}]", path) for k, e in enumerate(obj["shards"])]


def _view(data: memoryview | bytes) -> ByteView:
    """A ``bytes`` column without a copy: a read-only view of the sample's buffer that pickles as bytes."""
    return byte_view(data)


class SampleDecoder:
    """Decodes one sample's bytes into a dict, checking every column size against the sample's length.

    Args:
        meta: the shard's index entry (columns and encodings).
        path: the shard file, for error messages.
        allow_unsafe_types: decode ``pkl`` columns (runs pickle: only for data you trust).
        columns: decode only these columns (None: all).
        zero_copy: ``bytes`` columns come back as :class:`~torchforge.formats.values.ByteView` views of the
            sample's buffer (the shard's map when it is not sample-compressed) instead of copies.
    """

    def __init__(self, meta: ShardMeta, path: str, *, allow_unsafe_types: bool = False,
                 columns: list[str] | None = None, zero_copy: bool = False) -> None:
        self.path = path
        self.meta = meta
        self.per_sample = meta.compression is not None and meta.compression.per_sample
        want = set(meta.column_names if columns is None else columns)
        missing = want - set(meta.column_names)
        if missing:
            raise FormatError(f"no columns {sorted(missing)} (columns: {list(meta.column_names)})", path=path)
        self.encodings: dict[str, Encoding] = {}
        plan = []  # (name, decode or None to skip, fixed size or None)
        for name, enc_name, size in zip(meta.column_names, meta.column_encodings, meta.column_sizes):
            enc = get_encoding(enc_name)
            self.encodings[name] = enc
            if name in want and not enc.safe and not allow_unsafe_types:
                raise FormatError(f"column {name!r} is {enc_name!r}, which runs pickle when read: pass "
                                  "allow_unsafe_types=True only for data you trust", path=path)
            dec = _view if zero_copy and enc.name == "bytes" else enc.decode
            plan.append((name, dec if name in want else None, size))
        self.plan = plan
        self.nvar = sum(size is None for size in meta.column_sizes)
        self.sizes_struct = struct.Struct(f"<{self.nvar}I")
        # For lazy lookups: name -> (fixed bytes before it, variable columns before it, size, decode).
        self.spec: dict[str, tuple[int, int, int | None, Any]] = {}
        fixed = var = 0
        for name, dec, size in plan:
            if dec is not None:
                self.spec[name] = (fixed, var, size, dec)
            if size is None:
                var += 1
            else:
                fixed += size

    def decode(self, data: memoryview | bytes, where: int = 0) -> dict[str, Any]:
        """Decode one sample's bytes; ``where`` is its file offset, for error messages."""
        n = len(data)
        pos = 4 * self.nvar
        if pos > n:
            raise CorruptShardError(f"sample of {n} bytes is too short for {self.nvar} column sizes",
                                    path=self.path, offset=where)
        sizes = iter(self.sizes_struct.unpack_from(data, 0))
        out = {}
        for name, dec, size in self.plan:
            end = pos + (next(sizes) if size is None else size)
            if dec is not None:
                if end > n:
                    self.overrun(name, pos, end, n, where)
                try:
                    out[name] = dec(data[pos:end])
                except TorchforgeError:
                    raise
                except Exception as e:  # noqa: BLE001 - any decoder failure means corrupt bytes
                    self.undecodable(name, e, where, pos)
            pos = end
        if pos != n:
            self.overrun(None, pos, pos, n, where)
        return out

    def undecodable(self, name: str, e: Exception, where: int, pos: int) -> None:
        enc = self.encodings[name].name
        raise CorruptShardError(f"column {name!r} ({enc}) does not decode: {type(e).__name__}: {e}", path=self.path,
                                offset=where if self.per_sample else where + pos) from None

    def overrun(self, name: str | None, pos: int, end: int, n: int, where: int) -> None:
        what = f"column {name!r} spans bytes {pos}..{end}" if name else f"columns end at byte {pos}"
        raise CorruptShardError(f"{what} of a {n}-byte sample (lying column sizes or offsets)",
                                path=self.path, offset=where if self.per_sample else where + pos)


class MDSShard:
    """A raw ``.mds`` shard file, memory-mapped once and checked against its index entry.

    Args:
        path: the raw shard file (shard-level compression already undone).
        meta: its index.json entry.
        allow_unsafe_types: decode ``pkl`` columns (runs pickle: only for data you trust).
        columns: decode only these columns (None: all).
        label: the path errors name (default ``path``): a copy decompressed elsewhere names its stored file.

    Raises:
        FileNotFoundError: the file is missing (Streaming relies on this to fetch it).
        CorruptShardError: the file contradicts its index entry or its own header.
        FormatError: a ``pkl`` column without ``allow_unsafe_types``.
    """

    def __init__(self, path: str, meta: ShardMeta, *, allow_unsafe_types: bool = False,
                 columns: list[str] | None = None, zero_copy: bool = False, label: str | None = None) -> None:
        self.path = path
        self.label = label or path  # what errors name (a decompressed copy names the stored file)
        self.meta = meta
        self.samples = meta.samples
        self._sample_codec = meta.compression if meta.compression and meta.compression.per_sample else None
        self.decoder = SampleDecoder(meta, self.label, allow_unsafe_types=allow_unsafe_types, columns=columns,
                                     zero_copy=zero_copy)
        self.encodings = self.decoder.encodings
        self.decode = self.decoder.decode
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != meta.raw_bytes:
                raise CorruptShardError(f"shard is {size} bytes, index.json says {meta.raw_bytes}"
                                        f" ({'truncated' if size < meta.raw_bytes else 'extra bytes'})",
                                        path=self.label, offset=min(size, meta.raw_bytes))
            self.size = size
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        self.offsets = self._check_header()
        self._offsets_list = self.offsets.tolist()

    def _check_header(self) -> np.ndarray:
        size, n = self.size, self.samples
        if size < 4:
            raise CorruptShardError(f"shard is {size} bytes, too short for its sample count", path=self.label,
                                    offset=size)
        (count,) = struct.unpack_from("<I", self._view, 0)
        if count != n:
            raise CorruptShardError(f"shard says it holds {count} samples, index.json says {n}", path=self.label,
                                    offset=0)
        head = 4 + 4 * (n + 1)
        if size < head:
            raise CorruptShardError(f"offset table of {n + 1} entries runs past the end ({size} bytes)",
                                    path=self.label, offset=size)
        offsets = np.frombuffer(self._view, "<u4", n + 1, 4).astype(np.int64)
        if not head <= offsets[0] <= size:
            raise CorruptShardError(f"first sample offset {offsets[0]} is outside {head}..{size}", path=self.label,
                                    offset=4)
        bad = np.flatnonzero(np.diff(offsets) < 0)
        if len(bad):
            k = int(bad[0]) + 1
            raise CorruptShardError(f"sample offset {k} ({offsets[k]}) is below the previous one ({offsets[k - 1]})",
                                    path=self.label, offset=4 + 4 * k)
        if offsets[-1] != size:
            raise CorruptShardError(f"last sample offset {offsets[-1]} is not the shard size {size}",
                                    path=self.label, offset=4 + 4 * n)
        try:
            config = json.loads(bytes(self._view[head:offsets[0]]))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptShardError(f"shard config is not JSON ({e})", path=self.label, offset=head) from None
        if not isinstance(config, Mapping) or (
                list(config.get("column_names", ())), list(config.get("column_encodings", ()))) != (
                list(self.meta.column_names), list(self.meta.column_encodings)):
            raise CorruptShardError("shard's column config disagrees with index.json", path=self.label, offset=head)
        return offsets

    # --- samples ------------------------------------------------------------------------------------
    def raw(self, i: int) -> memoryview | bytes:
        """Sample ``i``'s bytes, per-sample compression undone (a view into the map when uncompressed)."""
        begin, end = self._offsets_list[i], self._offsets_list[i + 1]
        data = self._view[begin:end]
        if self._sample_codec is not None:
            return self._sample_codec.codec.decompress(data, path=self.label, offset=begin)
        return data

    def get(self, i: int) -> dict[str, Any]:
        """Sample ``i`` decoded (0 <= i < samples; callers check bounds)."""
        return self.decode(self.raw(i), self._offsets_list[i])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Sequential pass: the kernel reads ahead, samples are decoded in file order."""
        if self._mm is not None:
            try:
                self._mm.madvise(mmap.MADV_WILLNEED)  # not SEQUENTIAL: that drops pages behind the reader
            except (AttributeError, OSError):  # pragma: no cover - not on every platform
                pass
        offs = self._offsets_list
        view = self._view
        decode = self.decode
        if self._sample_codec is None:
            for i in range(self.samples):
                yield decode(view[offs[i]:offs[i + 1]], offs[i])
        else:
            dec = self._sample_codec.codec.decompress
            for i in range(self.samples):
                yield decode(dec(view[offs[i]:offs[i + 1]], path=self.label, offset=offs[i]), offs[i])

    def lazy(self, i: int) -> LazySample:
        """Sample ``i`` as a mapping that decodes a column only when it is looked up."""
        return LazySample(self, i)

    def column_array(self, name: str) -> np.ndarray | None:
        """Every sample's value of a fixed-size numeric column, read in one vectorised pass.

        Returns None when the column cannot be gathered that way (variable size, per-sample
        compression).
        """
        enc = self.encodings[name]
        if enc.numpy_dtype is None or self._sample_codec is not None:
            return None
        if self.samples == 0:
            return np.zeros(0, enc.numpy_dtype)
        begins = self.offsets[:-1]
        buf = np.frombuffer(self._view, np.uint8)
        pos = begins + 4 * self.decoder.nvar
        var_k = 0
        for col, _, size in self.decoder.plan:
            if col == name:
                break
            if size is None:
                idx = (begins + 4 * var_k)[:, None] + np.arange(4)
                self._check_within(idx[:, -1] + 1, begins)
                pos = pos + buf[idx].copy().view("<u4").ravel().astype(np.int64)
                var_k += 1
            else:
                pos = pos + size
        end = pos + enc.size
        self._check_within(end, begins)
        return buf[pos[:, None] + np.arange(enc.size)].copy().view(enc.numpy_dtype).ravel()

    def _check_within(self, end: np.ndarray, begins: np.ndarray) -> None:
        bad = np.flatnonzero(end > self.offsets[1:])
        if len(bad):
            k = int(bad[0])
            raise CorruptShardError(f"sample {k}'s column sizes run past its end (lying column sizes or offsets)",
                                    path=self.label, offset=int(begins[k]))

    # --- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the file (views handed out earlier must be gone)."""
        self._view.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the map goes with the last reference
                pass
            self._mm = None


class LazySample(Mapping):
    """A sample whose columns are decoded on first lookup (for keys, filters, column subsets)."""

    __slots__ = ("_cache", "_i", "_shard")

    def __init__(self, shard: MDSShard, i: int) -> None:
        self._shard = shard
        self._i = i
        self._cache: dict[str, Any] | None = None

    def __getitem__(self, name: str) -> Any:
        cache = self._cache
        if cache is not None and name in cache:
            return cache[name]
        shard = self._shard
        dec = shard.decoder
        spec = dec.spec.get(name)
        if spec is None:
            raise KeyError(name)
        if cache is None:
            cache = self._cache = {}
        begin, end = shard._offsets_list[self._i], shard._offsets_list[self._i + 1]
        if dec.per_sample:  # one decompression: decode every column at once
            cache.update(shard.get(self._i))
            return cache[name]
        fixed, var, size, decode = spec
        n = end - begin
        pos = 4 * dec.nvar
        if pos > n:
            dec.overrun(None, pos, pos, n, begin)
        if var or size is None:
            sizes = dec.sizes_struct.unpack_from(shard._view, begin)
            pos += fixed + sum(sizes[:var])
            if size is None:
                size = sizes[var]
        else:
            pos += fixed
        if pos + size > n:
            dec.overrun(name, pos, pos + size, n, begin)
        try:
            value = cache[name] = decode(shard._view[begin + pos:begin + pos + size])
        except TorchforgeError:
            raise
        except Exception as e:  # noqa: BLE001 - any decoder failure means corrupt bytes
            dec.undecodable(name, e, begin, pos)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._shard.decoder.spec)

    def __len__(self) -> int:
        return len(self._shard.decoder.spec)

    def __repr__(self) -> str:
        return f"LazySample({self._shard.path!r}, {self._i})"
