"""JINX: JSON lines with typed key extensions, an offset index in the footer, and a binary sidecar.

The layout is exactly the one MLDataForge 0.6.x writes and reads (see :mod:`.jinx_reader` for the
reader and its validation, :mod:`.jinx_codec` for the value extensions). :class:`JinxWriter` writes a
folder of ``shard-NNNNN.jinx`` files (+ ``shard-NNNNN.binx`` sidecars) that MLDataForge's
``JinxDatasetReader`` reads, with the same options and the same thresholds as its ``JinxDatasetWriter``.

Values: str, bytes-like (``raw``), int/float/bool/None (plain JSON), numpy arrays (``npy``, no pickle),
numpy scalars (their dtype as extension: float16 and bool ones as MLDataForge's writer stores them, which
its reader, 0.6.10, refuses; torchforge reads them), torch tensors (``pt``), dicts and lists of these. What the
format cannot hold is refused with a :class:`~torchforge.errors.FormatError` instead of being written
wrong (MLDataForge writes some of it silently corrupted): keys containing the extension separator;
bytes, arrays, tensors or numpy scalars directly inside a list (only dict keys carry extensions: wrap
them in a dict); non-finite Python floats (JSON has none); integers beyond 64 bits. Strings inside
lists are always stored plain.

>>> with JinxWriter("out", compression="zst", encoding="b64", binary_threshold=1024) as w:  # doctest: +SKIP
...     w.write({"id": 0, "text": "hello", "image": b"...", "arr": np.zeros(3, np.float32)})
"""
from __future__ import annotations

import glob
import math
import os
import sys
from typing import Any, BinaryIO, Self

import numpy as np
import orjson

from torchforge.codecs import parse_compression
from torchforge.errors import FormatError
from torchforge.formats.jinx_codec import (
    ENCODINGS,
    SCALAR_DTYPES,
    compress_value,
    encode_text,
    save_npy,
    save_pt,
)
from torchforge.formats.jinx_reader import JinxShard, sidecar_path
from torchforge.formats.values import BYTES_LIKE, as_bytes
from torchforge.lazy import LazySample
from torchforge.sizes import parse_size

__all__ = ["SHARD_TEMPLATE", "JinxShard", "JinxWriter"]

SHARD_TEMPLATE = "shard-{:05d}.jinx"
_INF = float("inf")
_PLAIN_SCALARS = (bool, int, float, type(None))


def _parse_codec(option: str, spec: str | None) -> tuple[str | None, int | None]:
    """``"zstd:3"`` -> ``("zst", 3)``: the canonical extension (MLDataForge's names) and a level."""
    parsed = parse_compression(spec, option=option)
    return (None, None) if parsed is None else (parsed[0].name, parsed[1])


class _ShardWriter:
    """Writes one shard: lines, the sidecar (opened on first offload), the footer."""

    def __init__(self, path: str, opts: JinxWriter) -> None:
        self.path = path
        self.o = opts
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - open for the writer's life, closed in close()
        self.bin: BinaryIO | None = None
        self.offsets = [0]
        self.pos = 0

    # --- values --------------------------------------------------------------------------------------
    def prepare(self, value: dict) -> dict:
        o = self.o
        sep = o.ext_sep
        out = {}
        for key, val in value.items():
            if type(key) is not str:
                raise FormatError(f"sample keys must be strings, got {type(key).__name__} {key!r}")
            if sep in key:
                raise FormatError(f"key {key!r} contains the extension separator {sep!r}: JINX reads everything "
                                  "after it as type extensions; rename the key")
            try:
                v, ext = self.prepare_value(val)
            except FormatError as e:
                if not e.reason.startswith("field "):  # (the innermost key names it)
                    e.reason = f"field {key!r}: {e.reason}"
                    e.args = (str(e),)
                raise
            out[f"{key}{sep}{ext}" if ext else key] = v
        return out

    def prepare_list(self, items: Any) -> list:
        out = []
        for x in items:
            if isinstance(x, (dict, LazySample)):
                out.append(self.prepare(x))
            elif isinstance(x, (list, tuple)):
                out.append(self.prepare_list(x))
            elif isinstance(x, (str, *_PLAIN_SCALARS)) and not isinstance(x, np.generic):
                if type(x) is float and not math.isfinite(x):
                    raise FormatError(f"float {x!r} in a list: JSON has no NaN or infinity")
                out.append(x)  # strings in lists stay plain: a list element has no key to carry extensions
            else:
                raise FormatError(f"a {type(x).__name__} directly inside a list cannot be stored in JINX (only "
                                  "dict keys carry type extensions): wrap it in a dict, e.g. [{'value': x}]")
        return out

    def prepare_value(self, value: Any) -> tuple[Any, str | None]:
        o = self.o
        if isinstance(value, str):
            if len(value) < o.short_limit:
                return str(value), None
            try:
                data = value.encode("utf-8")
            except UnicodeEncodeError as e:  # (a short one is refused where the line is encoded)
                raise FormatError(f"a string is not valid UTF-8 ({e.reason} at character {e.start}): "
                                  "JSON cannot hold it") from None
            return self.store_bytes(data, "str")
        if isinstance(value, np.generic):
            if isinstance(value, (np.bytes_, np.str_)):
                return self.prepare_value(value.item())
            name = str(value.dtype)
            if name not in SCALAR_DTYPES:
                raise FormatError(f"numpy scalars of dtype {name} cannot be stored: not one of "
                                  f"{sorted(SCALAR_DTYPES)}; use a 0-d array instead")
            item = value.item()
            if type(item) is float and not math.isfinite(item) and not math.isnan(item):
                raise FormatError(f"{value!r}: JSON has no infinity; store it in a numpy array instead")
            return item, name
        if isinstance(value, _PLAIN_SCALARS):
            if type(value) is int and not -(2**63) <= value < 2**64:
                raise FormatError(f"integer {value} does not fit in 64 bits (JSON numbers in JINX are int64/uint64)")
            if type(value) is float and not math.isfinite(value):
                raise FormatError(f"float {value!r}: JSON has no NaN or infinity (it would read back as None); "
                                  "store it as a numpy scalar or array instead")
            return value, None
        if isinstance(value, (dict, LazySample)):
            return self.prepare(value), None
        if isinstance(value, (list, tuple)):
            return self.prepare_list(value), None
        if isinstance(value, BYTES_LIKE):  # before ndarray: a ByteView is one
            return self.store_bytes(as_bytes(value, "JINX raw value"), "raw")
        if isinstance(value, np.ndarray):
            return self.store_bytes(save_npy(value), "npy")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            return self.store_bytes(save_pt(value), "pt")
        raise FormatError(f"cannot store a value of type {type(value).__name__} in JINX: use str, bytes, numbers, "
                          "bool, None, dicts, lists, numpy arrays or scalars, or torch tensors")

    def store_bytes(self, data: Any, ext: str) -> tuple[Any, str | None]:
        """MLDataForge's rules: compress if long enough and it pays; offload if over the sidecar threshold."""
        o = self.o
        exts = [ext]
        if o.compression is not None and len(data) >= o.compress_threshold:
            packed = compress_value(data, o.compression, o.level)
            if len(packed) <= o.compress_ratio * len(data):
                data = packed
                exts.append(o.compression)
        if o.binary_threshold is not None and len(data) > o.binary_threshold:
            return self.offload(data), o.ext_sep.join([*exts, "bin"])
        if exts == ["str"]:
            return bytes(data).decode("utf-8"), None
        return encode_text(data, o.encoding), o.ext_sep.join(exts)

    def offload(self, data: Any) -> dict[str, int]:
        if self.bin is None:
            self.bin = open(sidecar_path(self.path), "wb")  # noqa: SIM115 - closed in close()
        offset = self.bin.tell()
        self.bin.write(data)
        return {"offset": offset, "length": len(data)}

    # --- lines and footer ------------------------------------------------------------------------------
    def write(self, sample: Any) -> None:
        if not isinstance(sample, (dict, LazySample)):
            raise FormatError(f"a JINX sample is a dict, got {type(sample).__name__}")
        try:
            line = orjson.dumps(self.prepare(sample))
        except orjson.JSONEncodeError as e:
            raise FormatError(f"sample cannot be written as JSON ({e})") from None
        self.file.write(line)
        self.file.write(b"\n")
        self.pos += len(line) + 1
        self.offsets.append(self.pos)

    def close(self, shard_id: int, shard_prev: str | None, shard_next: str | None) -> None:
        o = self.o
        data = np.asarray(self.offsets, dtype="<u8").tobytes()
        if o.binary_threshold is not None and len(data) > o.binary_threshold:
            key, index = "index.npy.bin", self.offload(data)
        else:
            key = "index.npy"
            if o.index_compression is not None and len(data) >= o.compress_threshold:
                packed = compress_value(data, o.index_compression, o.index_level)
                if len(packed) <= o.compress_ratio * len(data):
                    data, key = packed, f"index.npy.{o.index_compression}"
            index = encode_text(data, o.encoding)
        key = key.replace(".", o.ext_sep)
        footer: dict[str, Any] = {
            key: index,
            "num_samples": len(self.offsets) - 1,
            "shard_id": shard_id,
            "version": "1.0",
            "encoding": o.encoding,
            "binary_threshold": o.binary_threshold,
            "compression": o.compression,
            "index_compression": o.index_compression,
            "compress_threshold": o.compress_threshold,
            "compress_ratio": o.compress_ratio,
            "ext_sep": o.ext_sep,
        }
        for name, value in (("shard_prev", shard_prev), ("shard_next", shard_next), ("split", o.split)):
            if value:
                footer[name] = value
        self.file.write(orjson.dumps(footer))
        self.file.write(f"\n{self.pos}\n".encode())
        self.file.close()
        if self.bin is not None:
            self.bin.close()


class JinxWriter:
    """Write samples (dicts) into a folder of JINX shards that MLDataForge 0.6.x reads.

    Args:
        path: the output folder (created), or with ``shard_size=None`` the single shard file.
        shard_size: start a new shard before a sample once the shard holds more than this many bytes of
            lines plus index (MLDataForge's rule): an int or a size string (``"64MiB"``; see
            :mod:`torchforge.sizes`). None writes one file at ``path``.
        compression: value compression (``zst``, ``gz``, ``bz2``, ``xz``, ``lz4``, ``snappy``, ``br``,
            aliases and ``"name:level"`` accepted), or None.
        index_compression: compression of the inline index, or None.
        compress_threshold: values of at least this many bytes are compressed (strings of at least this
            many characters are stored as bytes first).
        compress_ratio: keep a compressed value only if it is at most this fraction of the original.
        encoding: text encoding of inline binary data: ``a85``, ``b64`` or ``hex`` (MLDataForge 0.6.10
            reads hex values but not a hex inline index).
        binary_threshold: values over this many bytes go to the ``.binx`` sidecar; None keeps all inline.
        split: a split name written into every footer (readers can filter on it).
        ext_sep: the key-extension separator.
        overwrite: delete the ``shard-*.jinx`` (and ``.binx``) files already in the folder; without it a
            folder that holds shards is refused (the new shards would be mixed with stale ones).

    Use it as a context manager, or call :meth:`close`. When the ``with`` block raises, the writer
    calls :meth:`abort` instead: the shards it wrote are deleted, none is left looking complete.

    >>> with JinxWriter("data/train", encoding="b64") as w:  # doctest: +SKIP
    ...     for s in samples:
    ...         w.write(s)
    """

    def __init__(self, path: str | os.PathLike, *, shard_size: int | str | None = 2**26, compression: str | None = "zst",
                 index_compression: str | None = "zst", compress_threshold: int = 128, compress_ratio: float = 0.67,
                 encoding: str = "a85", binary_threshold: int | None = None, split: str | None = None,
                 ext_sep: str = ".", overwrite: bool = False) -> None:
        self.path = os.fspath(path)
        self.compression, self.level = _parse_codec("compression", compression)
        self.index_compression, self.index_level = _parse_codec("index_compression", index_compression)
        if encoding not in ENCODINGS:
            raise FormatError(f"encoding={encoding!r} is not one of {list(ENCODINGS)}")
        sizes = {}
        for name, val, allow_none in (("shard_size", shard_size, True), ("compress_threshold", compress_threshold, False),
                                      ("binary_threshold", binary_threshold, True)):
            if val is None and not allow_none:
                raise FormatError(f"{name}=None: give a size in bytes")
            try:
                sizes[name] = None if val is None else parse_size(val, option=name, allow_zero=True)
            except (TypeError, ValueError) as e:
                raise FormatError(str(e)) from None
        shard_size, compress_threshold, binary_threshold = (
            sizes["shard_size"], sizes["compress_threshold"], sizes["binary_threshold"])
        if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, (int, float)) or compress_ratio <= 0:
            raise FormatError(f"compress_ratio={compress_ratio!r} must be a positive number")
        if not isinstance(ext_sep, str) or not ext_sep:
            raise FormatError(f"ext_sep={ext_sep!r} must be a non-empty string")
        if any(c.isalnum() for c in ext_sep):  # it would split extension names ('npy', 'zst', 'int64')
            raise FormatError(f"ext_sep={ext_sep!r} holds a letter or digit, which extension names are made of: "
                              "choose punctuation ('.', '_', '|')")
        if split is not None and not isinstance(split, str):
            raise FormatError(f"split={split!r} must be a string or None")
        self.shard_size = shard_size
        self.compress_threshold = compress_threshold
        self.compress_ratio = compress_ratio
        self.encoding = encoding
        self.binary_threshold = binary_threshold
        self.split = split
        self.ext_sep = ext_sep
        self.short_limit = min(compress_threshold if self.compression is not None else _INF,
                               binary_threshold if binary_threshold is not None else _INF)
        self.shard_id = 0
        self.num_samples = 0
        self.files: list[str] = []
        if shard_size is not None:
            os.makedirs(self.path, exist_ok=True)
            old = sorted(glob.glob(os.path.join(glob.escape(self.path), "shard-*.jinx")))
            if old and not overwrite:
                raise FormatError(f"folder already holds {len(old)} JINX shard(s), which a reader would mix with "
                                  "the new ones: pick an empty folder or pass overwrite=True", path=self.path)
            for f in old:
                for g in (f, sidecar_path(f)):
                    if os.path.exists(g):
                        os.unlink(g)
        self._prev: str | None = None
        self._shard: _ShardWriter | None = _ShardWriter(self._shard_path(0), self)
        self.files.append(self._shard.path)

    def _shard_path(self, shard_id: int) -> str:
        return self.path if self.shard_size is None else os.path.join(self.path, SHARD_TEMPLATE.format(shard_id))

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample (a dict with string keys; see the module docs for the value types)."""
        shard = self._shard
        if shard is None:
            raise FormatError("JinxWriter is closed", path=self.path)
        if self.shard_size is not None and shard.pos + (len(shard.offsets) - 1) * 8 > self.shard_size:
            nxt = self._shard_path(self.shard_id + 1)
            shard.close(self.shard_id, self._prev, nxt)
            self._prev = shard.path
            self.shard_id += 1
            shard = self._shard = _ShardWriter(nxt, self)
            self.files.append(nxt)
        shard.write(sample)
        self.num_samples += 1

    def close(self) -> None:
        """Finish the last shard (its footer and index). Idempotent."""
        if self._shard is not None:
            self._shard.close(self.shard_id, self._prev, None)
            self._shard = None

    def abort(self) -> None:
        """Stop without finishing: close the files and delete every shard (and sidecar) this writer
        wrote, finished ones included, so that no part of an unfinished dataset reads as complete."""
        shard, self._shard = self._shard, None
        if shard is not None:
            shard.file.close()
            if shard.bin is not None:
                shard.bin.close()
        for f in self.files:
            for g in (f, sidecar_path(f)):
                if os.path.exists(g):
                    os.unlink(g)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # the with block raised: a footer now would make a truncated dataset look whole
