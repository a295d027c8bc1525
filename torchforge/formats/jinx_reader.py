"""Reading one JINX shard: the footer, the index, the lines, and the decoding of values.

Layout (as MLDataForge 0.6.x writes it): one JSON object per line; then a footer JSON line holding the
index (``index.npy[.<compression>]`` inline as encoded text, or ``index.npy.bin`` in the sidecar; raw
little-endian uint64 offsets, ``num_samples + 1`` of them, starting at 0) and the writer's settings; then
a last line with the footer's byte offset. Binary values over the writer's threshold live in the
``.binx`` sidecar beside the shard, referenced as ``{"offset": o, "length": n}``.

The shard and its sidecar are memory-mapped once; the footer and every offset are checked against the
file sizes before use, and every failure is a :class:`~torchforge.errors.FormatError` subclass naming the
file and the byte offset. Lines are parsed by msgspec when it is installed (faster, and straight from the
map), else by orjson; each stored key gets a decoder, made once per shard, for its chain of extensions.
"""
from __future__ import annotations

import math
import mmap
import os
from binascii import a2b_base64
from collections.abc import Callable, Iterator
from sys import getrefcount
from typing import Any

import numpy as np
import orjson

from torchforge.codecs import is_codec, unzstd
from torchforge.errors import CodecError, CorruptShardError, FormatError, TorchforgeError
from torchforge.formats.jinx_codec import (
    ENCODINGS,
    SCALAR_DTYPES,
    SERIALIZATIONS,
    decode_text,
    decompress_value,
    load_npy,
    load_pt,
)
from torchforge.formats.safetensors import open_regular
from torchforge.formats.values import ByteView, byte_view
from torchforge.formats.values import _getitem as _slice
from torchforge.lazy import Decoder, LazySample, lazy_sample

__all__ = ["LINE_ERRORS", "LINE_PARSER", "JinxShard", "sidecar_path"]

_MAX_FOOTER_DIGITS = 20
_JSONDecodeError = orjson.JSONDecodeError


def _line_parser() -> tuple[Callable[[Any], Any], bool]:
    """The fastest parser of a whole JSON line at hand, and whether it reads views (else bytes)."""
    try:
        from msgspec.json import Decoder as JSONDecoder
    except ImportError:  # orjson parses bytes faster than a view
        return orjson.loads, False
    return JSONDecoder().decode, True  # 4/5 of orjson's time per line, and no copy out of the map


LINE_PARSER = _line_parser()  # a shard takes the one set here when it opens
# What a line parser raises on a bad line: malformed JSON, invalid UTF-8, a number out of range, nesting
# deeper than the recursion limit.
LINE_ERRORS = (ValueError, RecursionError)


def sidecar_path(path: str) -> str:
    """The ``.binx`` sidecar of a shard (the shard's suffix replaced, as MLDataForge does)."""
    return os.path.splitext(path)[0] + ".binx"


def _mmap_file(path: str) -> tuple[Any, memoryview]:
    with open_regular(path, FormatError) as f:  # (open() blocks for ever on a FIFO)
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None, memoryview(b"")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, memoryview(mm)


class JinxShard:
    """One ``.jinx`` file and its optional ``.binx`` sidecar, validated and memory-mapped.

    Args:
        path: the ``.jinx`` file.
        bin_path: its ``.binx`` sidecar (default: beside it, as MLDataForge names it).

    Attributes:
        num_samples: samples in the shard (as the footer says, checked against the index).
        footer: the footer's JSON object (the index excluded).
        split: the footer's split name, or None.
        zero_copy: whether ``.npy`` values of the uncompressed sidecar view its map (the default), or are
            copies that do not keep the shard mapped.
    """

    zero_copy = True

    def __init__(self, path: str | os.PathLike, bin_path: str | os.PathLike | None = None) -> None:
        self.path = os.fspath(path)
        self.bin_path = sidecar_path(self.path) if bin_path is None else os.fspath(bin_path)
        self.plans: dict[str, tuple[tuple[str, Decoder], ...]] = {}  # logical key -> raw keys, decoders
        self._decoders: dict[str, Decoder] = {}
        try:
            self._mm, self._mv = _mmap_file(self.path)
        except OSError as e:
            raise FormatError(f"cannot open JINX shard ({e.strerror or e})", path=self.path) from e
        self._bin_mv: memoryview | None = None
        self._bin_bv: ByteView | None = None  # the same bytes, as the ByteView raw values are sliced from
        self._bin_mm: Any = None
        self._bin_size = -1  # until the sidecar is opened
        self._read_footer()
        self.parse, views = LINE_PARSER  # parse(lines[start:end]) -> the line's JSON value
        self.lines: Any = self._mv if views else self._mm

    # --- footer and index ----------------------------------------------------------------------------
    def _fail(self, reason: str, offset: int | None, path: str | None = None) -> CorruptShardError:
        return CorruptShardError(reason, path=path or self.path, offset=offset)

    def _read_footer(self) -> None:
        mv = self._mv
        size = len(mv)
        if size < 2 or mv[size - 1] != 0x0A:
            raise self._fail(f"file of {size} bytes does not end with the footer-offset line "
                             "(truncated or not a JINX shard)", size)
        nl = (self._mm.rfind(b"\n", max(0, size - 2 - _MAX_FOOTER_DIGITS), size - 1)
              if self._mm is not None else -1)
        digits = bytes(mv[nl + 1:size - 1])
        if nl < 0 or not digits.isdigit():
            raise self._fail(f"last line {digits[-_MAX_FOOTER_DIGITS:]!r} is not the footer's byte offset "
                             "(truncated or not a JINX shard)", max(nl + 1, 0))
        foot = int(digits)
        if foot >= nl or (foot > 0 and mv[foot - 1] != 0x0A):
            raise self._fail(f"footer offset {foot} is not the start of a line before the last one "
                             f"(footer line ends at byte {nl})", nl + 1)
        try:
            footer = orjson.loads(mv[foot:nl])
        except _JSONDecodeError as e:
            raise self._fail(f"footer is not valid JSON ({e})", foot) from None
        if type(footer) is not dict:
            raise self._fail(f"footer is a JSON {type(footer).__name__}, expected an object", foot)
        self._load_footer(footer, foot, size)

    def _load_footer(self, footer: dict, foot: int, size: int) -> None:
        """Check the footer (the JSON object at byte ``foot`` of a file of ``size`` bytes) and decode its
        index: the shard's settings, sample count and offsets."""
        self._footer_offset = foot
        self.ext_sep = footer.get("ext_sep", ".")
        self.encoding = footer.get("encoding", "a85")
        self._b64 = self.encoding == "b64"
        n = footer.get("num_samples")
        if type(n) is not int or n < 0:
            raise self._fail(f"footer num_samples={n!r} is not a non-negative integer", foot)
        if type(self.ext_sep) is not str or not self.ext_sep:
            raise self._fail(f"footer ext_sep={self.ext_sep!r} is not a non-empty string", foot)
        if self.encoding not in ENCODINGS:
            raise self._fail(f"footer encoding={self.encoding!r} is not one of {list(ENCODINGS)}", foot)
        # the index key is 'index.npy[.<codec>|.bin]' (MLDataForge's writer joins it with '.' whatever the
        # ext_sep; one with ext_sep is read too); 'index_compression' is a footer field, not the index
        keys = [k for k in footer if k.startswith(("index.npy", f"index{self.ext_sep}npy"))]
        if len(keys) != 1:
            raise self._fail(f"footer has {len(keys)} index entries ({keys}), expected one 'index.npy...'", foot)
        index_value = footer.pop(keys[0])
        offsets = self._decode_index(keys[0], index_value, foot)
        if len(offsets) != n + 1:
            raise self._fail(f"index has {len(offsets)} offsets, footer num_samples={n} needs {n + 1}", foot)
        if offsets[0] != 0:
            raise self._fail(f"index starts at {int(offsets[0])}, expected 0", foot)
        if n and not bool(np.all(offsets[1:] > offsets[:-1])):
            bad = int(np.argmax(offsets[1:] <= offsets[:-1]))
            start = int(offsets[bad])
            raise self._fail(f"index offsets out of order: sample {bad} spans {start}..{int(offsets[bad + 1])}",
                             start if start < size else foot)
        if int(offsets[-1]) != foot:
            raise self._fail(f"index ends at {int(offsets[-1])} but the footer starts at {foot}",
                             min(int(offsets[-1]), size))
        self.num_samples = n
        self.footer = footer
        self.split = footer.get("split")
        self.offsets = offsets
        self._offs = memoryview(np.ascontiguousarray(offsets, dtype=np.uint64)).cast("B").cast("Q")

    def _decode_index(self, key: str, value: Any, foot: int) -> np.ndarray:
        exts = key[len("index") + 1:].split(key[len("index")])
        if exts[-1] == "bin":
            exts.pop()
            data: Any = self.sidecar(value, foot)
        else:
            data = self._text_bytes(key, value, foot)
        if not exts or exts[0] != "npy":
            raise self._fail(f"index key {key!r} does not start with the npy serialization", foot)
        for ext in reversed(exts[1:]):
            data = decompress_value(data, ext, path=self.path, offset=foot)
        if bytes(data[:6]) == b"\x93NUMPY":  # a real .npy file (MLDataForge itself writes raw uint64)
            try:
                arr = load_npy(data, zero_copy=True)
            except ValueError as e:
                raise self._fail(f"index is not a valid .npy array ({e})", foot) from None
            if arr.ndim != 1 or arr.dtype.kind not in "ui":
                raise self._fail(f"index array is {arr.dtype}{arr.shape}, expected 1-d integers", foot)
            return arr.astype(np.uint64)
        if len(data) % 8:
            raise self._fail(f"index of {len(data)} bytes is not a whole number of uint64 offsets", foot)
        return np.frombuffer(data, dtype="<u8")

    # --- sidecar -----------------------------------------------------------------------------------
    def sidecar(self, loc: Any, offset: int) -> memoryview:
        """The bytes ``{"offset": o, "length": n}`` points at in the sidecar, as a zero-copy view.

        Args:
            loc: the location object from the shard.
            offset: byte offset in the shard of the line that holds ``loc`` (for errors).
        """
        bmv = self._bin_mv
        o, n = self._reference(loc, offset, len(bmv) if bmv is not None else -1)
        if bmv is None:
            bmv = self._open_sidecar(offset)
            self._reference(loc, offset, len(bmv))
        return bmv[o:o + n]

    def _reference(self, loc: Any, offset: int, size: int) -> tuple[int, int]:
        """A sidecar reference's (offset, length), checked: integers, not negative, and (when the sidecar's
        ``size`` is known, not -1) inside it. ``offset``: the line's, for errors."""
        if type(loc) is not dict:
            raise self._fail(f"sidecar reference is a {type(loc).__name__}, expected "
                             "{'offset': int, 'length': int}", offset)
        o, n = loc.get("offset"), loc.get("length")
        if type(o) is not int or type(n) is not int or o < 0 or n < 0:
            raise self._fail(f"sidecar reference {loc!r} needs non-negative integer offset and length", offset)
        if size >= 0 and o + n > size:
            raise self._fail(f"value at sidecar bytes {o}..{o + n} is past its end ({size} bytes): "
                             "truncated or wrong sidecar", o, self.bin_path)
        return o, n

    def _open_sidecar(self, offset: int) -> memoryview:
        try:
            self._bin_mm, self._bin_mv = _mmap_file(self.bin_path)
        except FileNotFoundError:
            raise self._fail(f"sample needs the sidecar {os.path.basename(self.bin_path)}, which is missing",
                             offset) from None
        except OSError as e:
            raise self._fail(f"cannot open the sidecar ({e.strerror or e})", None, self.bin_path) from e
        self._bin_size = len(self._bin_mv)
        self._bin_bv = byte_view(self._bin_mv)
        return self._bin_mv

    # --- lines -----------------------------------------------------------------------------------------
    def sample(self, j: int, lazy: bool = True) -> Any:
        """Sample ``j`` (0 <= j < num_samples, not checked here): a LazySample or a plain dict."""
        obj, start = self.line(j)
        return lazy_sample(obj, self, start) if lazy else self.eager(obj, start)

    def line(self, j: int) -> tuple[dict, int]:
        """Sample ``j``'s line parsed (its values not decoded) and the byte offset where it starts."""
        offs = self._offs
        start = offs[j]
        try:
            obj = self.parse(self.lines[start:offs[j + 1]])
        except LINE_ERRORS as e:
            raise self._fail(f"sample {j} is not a JSON line ({e})", start) from None
        if type(obj) is not dict:
            raise self._fail(f"sample {j} is a JSON {type(obj).__name__}, expected an object", start)
        return obj, start

    def iter_samples(self, lazy: bool = True, start: int = 0,
                     on_error: Callable[[TorchforgeError], None] | None = None) -> Iterator[Any]:
        """Samples ``start..num_samples-1`` in order; ``on_error`` (if given) takes a bad line's error."""
        offs, lines, parse, n = self._offs, self.lines, self.parse, self.num_samples
        prev = offs[start] if start < n else 0
        for end in offs[start + 1:n + 1]:
            try:
                obj = parse(lines[prev:end])
            except LINE_ERRORS as e:
                err = self._fail(f"sample {self._index_at(prev)} is not a JSON line ({e})", prev)
                if on_error is None:
                    raise err from None
                on_error(err)
                prev = end
                continue
            if lazy and type(obj) is dict:  # lazy_sample(obj, self, prev), inlined
                out = LazySample()
                out._raw = obj
                out._src = self
                out._off = prev
                out._done = None
            else:
                try:
                    if type(obj) is not dict:
                        raise self._fail(f"sample {self._index_at(prev)} is a JSON {type(obj).__name__}, "
                                         "expected an object", prev)
                    out = self.eager(obj, prev)
                except TorchforgeError as e:
                    if on_error is None:
                        raise
                    on_error(e)
                    prev = end
                    continue
            prev = end
            yield out

    def key_values(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(sample)`` of every (lazy) sample in order: the sequential key pass, in one frame."""
        offs, lines, parse = self._offs, self.lines, self.parse
        out: list[Any] = []
        prev = 0
        # One LazySample serves line after line as long as fn keeps no reference to it: its reference
        # count is then the same as when it was new (only this frame holds it).
        s: LazySample | None = None
        unshared = 0
        for end in offs[1:]:
            try:
                obj = parse(lines[prev:end])
            except LINE_ERRORS:
                obj = None
            if type(obj) is not dict:
                self.sample(self._index_at(prev))  # raises, naming the problem
            if s is None or getrefcount(s) != unshared:  # fn kept the last one: a new one
                s = LazySample()  # lazy_sample(obj, self, prev), inlined
                s._src = self
                unshared = getrefcount(s)  # measured, not assumed: interpreters count differently
            s._raw = obj
            s._off = prev
            s._done = None
            out.append(fn(s))
            prev = end
        return out

    def _index_at(self, offset: int) -> int:
        """The sample whose line starts at byte ``offset`` (for error messages)."""
        return int(np.searchsorted(self.offsets, offset))

    # --- values ------------------------------------------------------------------------------------
    def decode(self, raw_key: str, value: Any, offset: int) -> Any:
        """Decode ``value`` stored under ``raw_key`` (extensions included) in the line at ``offset``."""
        dec = self._decoders.get(raw_key)
        if dec is None:
            dec = self.decoder(raw_key, offset)
        return dec(self, value, offset)

    def decoder(self, raw_key: str, offset: int) -> Decoder:
        """The decoder of values stored under ``raw_key``: ``decoder(shard, value, offset)``, cached.

        Raises FormatError for a key with unknown or misplaced extensions (``offset``: the line's).
        """
        dec = self._decoders.get(raw_key)
        if dec is not None:
            return dec
        plan = self._plan(raw_key, offset)
        scalar, from_bin, codecs, ser = plan
        if scalar is not None:
            def dec(shard: JinxShard, value: Any, offset: int) -> Any:
                return shard._scalar(raw_key, scalar, value, offset)
        elif from_bin and not codecs and ser == "raw":
            dec = _raw_sidecar_view
        elif not from_bin and self._b64 and codecs == ("zst",) and ser == "str":
            def dec(shard: JinxShard, value: Any, offset: int) -> Any:  # inline compressed text
                if type(value) is str:
                    try:
                        return str(unzstd(a2b_base64(value, strict_mode=True), path=shard.path, offset=offset), "utf-8")
                    except ValueError:  # bad base64 or UTF-8: the general path names the problem
                        pass
                return shard._decode_with(raw_key, plan, value, offset)
        else:
            def dec(shard: JinxShard, value: Any, offset: int) -> Any:
                return shard._decode_with(raw_key, plan, value, offset)
        if len(self._decoders) < 4096:
            self._decoders[raw_key] = dec
        return dec

    def _decode_with(self, raw_key: str, plan: tuple[Any, ...], value: Any, offset: int) -> Any:
        """Decode ``value`` with the :meth:`_plan` of its key (the general path, and every error)."""
        scalar, from_bin, codecs, ser = plan
        if scalar is not None:
            return self._scalar(raw_key, scalar, value, offset)
        path, at, whose = self.path, offset, f"value of {raw_key!r}"
        if from_bin:  # errors in the value's bytes name the sidecar and where in it the value starts
            data = self.sidecar(value, offset)
            path, at = self.bin_path, value["offset"]
            whose += f" (referenced from {os.path.basename(self.path)} byte {offset})"
        elif self._b64 and type(value) is str:  # the common case, inline
            try:
                data = a2b_base64(value, strict_mode=True)
            except ValueError:
                data = self._text_bytes(raw_key, value, offset)  # raises, naming the problem
        else:
            data = self._text_bytes(raw_key, value, offset)
        try:
            for ext in codecs:
                data = (unzstd(data, path=path, offset=at) if ext == "zst" else
                        decompress_value(data, ext, path=path, offset=at))
        except CodecError as e:
            if not from_bin:
                raise
            raise CodecError(f"{whose}: {e.reason}", path=path, offset=at) from None
        if ser == "str":
            try:
                return str(data, "utf-8")
            except UnicodeDecodeError as e:
                raise self._fail(f"{whose} is not valid UTF-8 ({e})", at, path) from None
        if ser == "raw":
            return data if type(data) is bytes else byte_view(data)
        if ser is None:
            try:
                return orjson.loads(data)
            except _JSONDecodeError as e:
                raise self._fail(f"{whose} is not valid JSON ({e})", at, path) from None
        return self._deserialize(whose, ser, data, from_bin and not codecs and self.zero_copy, at, path)

    def _text_bytes(self, raw_key: str, value: Any, offset: int) -> bytes:
        """The bytes an inline value encodes in the shard's text encoding."""
        if type(value) is not str:
            raise self._fail(f"value of {raw_key!r} is a JSON {type(value).__name__}, expected "
                             f"{self.encoding} text", offset)
        try:
            return a2b_base64(value, strict_mode=True) if self._b64 else decode_text(value, self.encoding)
        except (ValueError, TypeError) as e:
            raise self._fail(f"value of {raw_key!r} is not valid {self.encoding} text ({e})", offset) from None

    def _plan(self, raw_key: str, offset: int) -> tuple[str | None, bool, tuple[str, ...], str | None]:
        """How to decode a key: (numpy scalar dtype, from sidecar, codecs outermost first,
        serialization or None for JSON)."""
        exts = raw_key.split(self.ext_sep)[1:]
        if len(exts) == 1 and exts[0] in SCALAR_DTYPES:
            plan: tuple[Any, ...] = (exts[0], False, (), None)
        else:
            from_bin = exts[-1] == "bin"
            if from_bin:
                exts.pop()
            ser = exts[0] if exts and exts[0] in SERIALIZATIONS else None
            codecs = exts[1:] if ser is not None else exts
            for ext in codecs:
                if not is_codec(ext):
                    what = "a serialization that must be innermost" if ext in SERIALIZATIONS else "unknown"
                    raise FormatError(f"key {raw_key!r}: extension {ext!r} is {what} (serializations: "
                                      f"{sorted(SERIALIZATIONS)}; or a compression)", path=self.path, offset=offset)
            if ser in SCALAR_DTYPES:
                raise FormatError(f"key {raw_key!r}: numpy scalar extension {ser!r} on binary data",
                                  path=self.path, offset=offset)
            plan = (None, from_bin, tuple(reversed(codecs)), ser)
        return plan  # type: ignore[return-value]

    def _deserialize(self, whose: str, ext: str, data: Any, zero_copy: bool, offset: int, path: str) -> Any:
        try:
            if ext == "npy":
                return load_npy(data, zero_copy=zero_copy)
            return load_pt(data)
        except (CodecError, FormatError):
            raise
        except Exception as e:  # noqa: BLE001 - numpy's and torch's own errors, re-raised typed
            raise self._fail(f"{whose} is not valid {ext} data ({type(e).__name__}: {e})", offset, path) from None

    def _scalar(self, raw_key: str, dtype: str, value: Any, offset: int) -> Any:
        """A numpy scalar from its JSON value, which must be what the writer stores for the dtype (a bool;
        a float, an int or null, NaN, for floats; an integer, an integral float too, for integers): a
        value the dtype would change (1.5 as int64, 1e300 as float32, true as int32) is a FormatError."""
        t = type(value)
        if dtype == "bool":
            ok = t is bool
        elif dtype.startswith("float"):
            ok = t is int or t is float or value is None
        else:
            ok = t is int or (t is float and value.is_integer())
            value = int(value) if ok else value
        if not ok:
            what = "null" if value is None else f"{t.__name__} {value!r}"
            raise self._fail(f"value of {raw_key!r} is a JSON {what}, which is not of dtype {dtype}", offset)
        try:
            with np.errstate(over="ignore"):  # (an overflow to inf is refused below, not warned about)
                out = np.dtype(dtype).type(np.nan if value is None else value)
        except (OverflowError, ValueError) as e:
            raise self._fail(f"value of {raw_key!r} does not fit {dtype} ({e})", offset) from None
        if value is not None and dtype.startswith("float") and np.isinf(out) and math.isfinite(value):
            raise self._fail(f"value of {raw_key!r} ({value!r}) does not fit {dtype}: it overflows to inf", offset)
        return out

    def eager(self, obj: Any, offset: int) -> Any:
        """Decode a parsed line (or part of it) completely into plain dicts and lists."""
        t = type(obj)
        if t is dict:
            out = {}
            sep = self.ext_sep
            for k, v in obj.items():
                if sep in k:
                    name = k.partition(sep)[0]
                    v = self.decode(k, v, offset)
                    if type(v) is ByteView or type(v) is memoryview:
                        v = v.tobytes()
                elif type(v) is dict or type(v) is list:
                    name, v = k, self.eager(v, offset)
                else:
                    name = k
                if name in out:
                    raise self._fail(f"key {name!r} appears twice (with different extensions)", offset)
                out[name] = v
            return out
        if t is list:
            return [self.eager(x, offset) for x in obj]
        return obj

    def close(self) -> None:
        """Drop the memory maps (they close once no view into them is alive)."""
        self._mv = self._bin_mv = self._bin_bv = self.lines = None  # type: ignore[assignment]
        self._mm = self._bin_mm = None
        self._bin_size = -1


def _raw_sidecar_view(shard: JinxShard, loc: Any, offset: int) -> ByteView:
    """Decoder of an uncompressed sidecar value (``name.raw.bin``): a zero-copy view into the map.

    The hot path of images; anything unusual (sidecar not open yet, a bad reference) goes through
    :meth:`JinxShard.sidecar`, which opens the sidecar or raises naming the problem.
    """
    if type(loc) is dict:
        o = loc.get("offset")
        n = loc.get("length")
        if type(o) is int and type(n) is int and 0 <= o <= o + n <= shard._bin_size:
            return _slice(shard._bin_bv, slice(o, o + n))  # type: ignore[arg-type]
    return byte_view(shard.sidecar(loc, offset))
