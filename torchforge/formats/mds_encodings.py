"""MDS column encodings: value <-> bytes, laid out exactly as MosaicML Streaming lays them out.

Every encoding Streaming 0.13 knows is here: ``bytes``, ``str``, ``int``, the fixed-width scalars
(``int8`` .. ``uint64``, ``float16/32/64``), ``str_int``, ``str_float``, ``str_decimal``,
``ndarray[:dtype[:shape]]``, ``json``, the image encodings ``pil``, ``jpeg``, ``png`` (with Pillow),
their ``list[...]`` variants, ``jpeg_array`` and the unsafe ``pkl``. Decoders take a ``bytes`` or a
``memoryview`` and never read outside it; a value that does not fit raises ``ValueError`` (callers
turn it into a :class:`~torchforge.errors.CorruptShardError` naming file and offset).
"""
from __future__ import annotations

import io
import json
import math
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from torchforge.errors import FormatError
from torchforge.formats.values import as_bytes

__all__ = ["Encoding", "encoding_names", "get_encoding", "is_safe"]

Buffer = bytes | bytearray | memoryview

try:  # orjson parses faster; json stays the reference (NaN, huge ints) and the writer
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

# ndarray: the dtype byte and the shape-dtype bits of the header (Streaming's numbering).
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_VALUE_CODES = {v: k for k, v in _VALUE_DTYPES.items()}
_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")

# MDS is little-endian; like Streaming, torchforge assumes a little-endian host for scalars.
_SCALARS = {name: np.dtype(name) for name in
            ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
             "float16", "float32", "float64")}
_SCALAR_TYPES = {name: getattr(np, name) for name in _SCALARS}


@dataclass(frozen=True)
class Encoding:
    """One column encoding.

    Attributes:
        name: the encoding string as written into index.json.
        size: fixed encoded size in bytes, or None for variable size.
        encode: value -> bytes.
        decode: bytes/memoryview -> value.
        safe: False for encodings whose decoding can run code (``pkl``).
        numpy_dtype: for fixed-size numeric scalars, the little-endian dtype (vectorised key reads).
    """

    name: str
    size: int | None
    encode: Callable[[Any], bytes]
    decode: Callable[[Buffer], Any]
    safe: bool = True
    numpy_dtype: np.dtype | None = None


def _need(obj: Any, types: type | tuple[type, ...], name: str) -> None:
    if not isinstance(obj, types):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise TypeError(f"encoding {name!r} takes {want}, got {type(obj).__name__}")


def _as_array(obj: Any) -> Any:
    """A torch tensor as the numpy array of its data (copied to the CPU if needed); anything else as is."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    return obj


def _text(data: Buffer) -> str:
    return str(data, "utf-8") if not isinstance(data, memoryview) else bytes(data).decode("utf-8")


# --- simple encodings -------------------------------------------------------------------------------
def _bytes_enc(obj: Any) -> bytes:
    return as_bytes(obj, "encoding 'bytes'")


def _str_enc(obj: Any) -> bytes:
    _need(obj, str, "str")
    return obj.encode("utf-8")


_INT64 = struct.Struct("<q")


def _int_enc(obj: Any) -> bytes:
    _need(obj, int, "int")
    try:
        return _INT64.pack(obj)
    except struct.error:
        raise OverflowError(f"encoding 'int' stores int64; {obj} is out of range") from None


def _int_dec(data: Buffer) -> int:
    if len(data) != 8:
        raise ValueError(f"int column holds {len(data)} bytes, not 8")
    return _INT64.unpack(data)[0]


def _scalar(name: str) -> Encoding:
    dtype = _SCALARS[name]
    typ = _SCALAR_TYPES[name]
    size = dtype.itemsize

    # a value the type cannot hold is an error, not a wrapped integer or an infinity (a float's rounding
    # to the type's precision is the type's and stays; a Python int out of range numpy refuses itself)
    limit = float(np.finfo(dtype).max) if dtype.kind == "f" else None

    def enc(obj: Any) -> bytes:
        value = _as_array(obj)
        if limit is not None:
            if type(value) is not float and np.ndim(value):
                return typ(value).tobytes()  # (an array: numpy's own conversion, as Streaming's)
            v = float(value)
            if limit < abs(v) < math.inf:
                raise OverflowError(f"encoding {name!r}: {obj!r} is beyond its range (it would be stored as inf)")
            return typ(value).tobytes()
        out = typ(value)
        if type(value) is not int and isinstance(value, (np.integer, np.ndarray)) and np.ndim(value) == 0 \
                and np.asarray(value).dtype.kind in "iu" and int(out) != int(value):
            raise OverflowError(f"encoding {name!r}: {obj!r} is out of its range")
        return out.tobytes()

    def dec(data: Buffer) -> Any:
        if len(data) != size:
            raise ValueError(f"{name} column holds {len(data)} bytes, not {size}")
        return np.frombuffer(data, dtype)[0]  # a numpy scalar, as Streaming returns

    return Encoding(name, size, enc, dec, numpy_dtype=dtype)


def _str_number(name: str, typ: type, parse: Callable[[str], Any]) -> Encoding:
    def enc(obj: Any) -> bytes:
        _need(obj, typ, name)
        if isinstance(obj, bool):  # str(True) is "True", which no reader parses back as a number
            raise TypeError(f"encoding {name!r} takes {typ.__name__}, got bool")
        return str(obj).encode("utf-8")

    return Encoding(name, None, enc, lambda data: parse(_text(data)))


def _json_enc(obj: Any) -> bytes:
    if isinstance(obj, np.ndarray):
        obj = obj.tolist()
    return json.dumps(obj).encode("utf-8")


_NOT_DIGITS = bytes(c for c in range(256) if not 48 <= c <= 57)
_LONG_RUN = re.compile(rb"[0-9]{19}")


def _json_dec(data: Buffer) -> Any:
    if _orjson is not None:
        raw = data if type(data) is bytes else bytes(data)
        # orjson reads an integer beyond 64 bits as a float, silently: where 19 digits in a row could
        # make one (counting the digits first is cheap), json.loads reads it exactly
        if len(raw.translate(None, _NOT_DIGITS)) < 19 or not _LONG_RUN.search(raw):
            try:
                return _orjson.loads(raw)
            except _orjson.JSONDecodeError:
                pass  # NaN/Infinity: json.loads accepts what json.dumps wrote
    return json.loads(_text(data))


def _pkl_enc(obj: Any) -> bytes:
    import pickle  # writing only; reading is refused unless the caller opts in (see mds_reader)

    return pickle.dumps(obj)


def _pkl_dec(data: Buffer) -> Any:
    import pickle

    return pickle.loads(data)  # only reached with allow_unsafe_types=True


# --- ndarray ----------------------------------------------------------------------------------------
def _ndarray(name: str, config: str) -> Encoding:
    args = config.split(":") if config else []
    if len(args) > 2:
        raise FormatError(f"encoding {name!r}: expected ndarray[:dtype[:shape]]")
    dtype = args[0] if args else None
    if dtype is not None and dtype not in _VALUE_CODES:
        raise FormatError(f"encoding {name!r}: dtype {dtype!r} is not one of {sorted(_VALUE_CODES)}")
    shape: tuple[int, ...] | None = None
    if len(args) == 2:
        try:
            shape = tuple(int(d) for d in args[1].split(","))
        except ValueError:
            raise FormatError(f"encoding {name!r}: shape {args[1]!r} is not comma-separated integers") from None
        if any(d < 1 for d in shape):
            raise FormatError(f"encoding {name!r}: every dimension must be >= 1")
    np_dtype = None if dtype is None else np.dtype(dtype).newbyteorder("<")
    size = None
    if np_dtype is not None and shape is not None:
        size = int(np.prod(shape)) * np_dtype.itemsize

    def enc(arr: Any) -> bytes:
        arr = _as_array(arr)
        _need(arr, np.ndarray, name)
        code = _VALUE_CODES.get(arr.dtype.name)
        if code is None:
            raise ValueError(f"encoding {name!r}: array dtype {arr.dtype.name} is not one of "
                             f"{sorted(_VALUE_CODES)}")
        parts = []
        if dtype is None:
            parts.append(bytes([code]))
        elif arr.dtype.name != dtype:
            raise ValueError(f"encoding {name!r}: expected dtype {dtype}, got {arr.dtype.name}")
        if arr.size == 0:
            raise ValueError(f"encoding {name!r} cannot store an empty array")
        if shape is None:
            if arr.ndim == 0:
                raise ValueError(f"encoding {name!r} cannot store a 0-d array; use a scalar encoding")
            if arr.ndim >= 64:
                raise ValueError(f"encoding {name!r}: at most 63 axes, got {arr.ndim}")
            biggest = max(arr.shape)
            bits = 0 if biggest < 1 << 8 else 1 if biggest < 1 << 16 else 2 if biggest < 1 << 32 else 3
            parts.append(bytes([(arr.ndim << 2) | bits]))
            parts.append(np.asarray(arr.shape, _SHAPE_DTYPES[bits]).tobytes())
        elif arr.shape != shape:
            raise ValueError(f"encoding {name!r}: expected shape {shape}, got {arr.shape}")
        parts.append(np.ascontiguousarray(arr, arr.dtype.newbyteorder("<")).tobytes())
        return b"".join(parts)

    def dec(data: Buffer) -> np.ndarray:
        pos = 0
        if np_dtype is None:
            if len(data) < 1 or data[0] not in _VALUE_DTYPES:
                raise ValueError(f"ndarray dtype code {data[0] if len(data) else None} is unknown")
            vdtype = np.dtype(_VALUE_DTYPES[data[0]]).newbyteorder("<")
            pos = 1
        else:
            vdtype = np_dtype
        if shape is None:
            if len(data) < pos + 1:
                raise ValueError("ndarray header is truncated")
            byte = data[pos]
            ndim, bits = byte >> 2, byte & 3
            pos += 1
            end = pos + ndim * (1 << bits)
            if len(data) < end:
                raise ValueError("ndarray shape is truncated")
            dims = tuple(int(d) for d in np.frombuffer(data[pos:end], _SHAPE_DTYPES[bits]))
            pos = end
        else:
            dims = shape
        count = int(np.prod(dims, dtype=np.uint64)) if dims else 1
        if count * vdtype.itemsize != len(data) - pos:
            raise ValueError(f"ndarray of shape {dims} and dtype {vdtype.name} needs {count * vdtype.itemsize} "
                             f"bytes, the column holds {len(data) - pos}")
        return np.frombuffer(data, vdtype, count, pos).astype(vdtype.newbyteorder("="), copy=True).reshape(dims)

    return Encoding(name, size, enc, dec)


# --- images (Pillow is optional) --------------------------------------------------------------------
def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow ships with the test environment
        raise FormatError("image encodings (pil, jpeg, png) need Pillow: pip install pillow") from e
    return Image


_U32 = struct.Struct("<I")


def _pil_enc(obj: Any) -> bytes:
    _need(obj, _pil().Image, "pil")
    mode = obj.mode.encode("utf-8")
    width, height = obj.size
    return struct.pack("<III", width, height, len(mode)) + mode + obj.tobytes()


def _pil_dec(data: Buffer) -> Any:
    if len(data) < 12:
        raise ValueError("pil header is truncated")
    width, height, mode_len = struct.unpack_from("<III", data)
    if 12 + mode_len > len(data):
        raise ValueError("pil mode is truncated")
    mode = _text(data[12:12 + mode_len])
    pixels = len(data) - 12 - mode_len
    need = (width * _pil_bits(mode) + 7) // 8 * height  # checked before Pillow allocates width x height
    if pixels != need:
        raise ValueError(f"pil image of {width}x{height} in mode {mode!r} needs {need} bytes of pixels, "
                         f"the value holds {pixels}")
    return _pil().frombytes(mode, (width, height), bytes(data[12 + mode_len:]))


_PIL_BITS: dict[str, int] = {}


def _pil_bits(mode: str) -> int:
    """Bits per pixel of ``mode`` in ``Image.tobytes()`` (8 pixels of it, in bytes)."""
    bits = _PIL_BITS.get(mode)
    if bits is None:
        try:
            bits = len(_pil().new(mode, (8, 1)).tobytes())
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"pil mode {mode!r} is not an image mode Pillow knows ({e})") from None
        _PIL_BITS[mode] = bits
    return bits


def _saved(fmt: str) -> Callable[[Any], bytes]:
    def enc(obj: Any) -> bytes:
        Image = _pil()
        _need(obj, Image.Image, fmt.lower())
        if fmt == "JPEG":
            from PIL.JpegImagePlugin import JpegImageFile

            if isinstance(obj, JpegImageFile) and getattr(obj, "filename", None):
                try:  # keep the original JPEG bytes rather than re-encoding (Streaming does too)
                    with open(obj.filename, "rb") as f:
                        return f.read()
                except FileNotFoundError:
                    pass
        out = io.BytesIO()
        obj.save(out, format=fmt)
        return out.getvalue()

    return enc


def _image_dec(data: Buffer) -> Any:
    return _pil().open(io.BytesIO(bytes(data)))


def _list_of(inner: Encoding, name: str) -> Encoding:
    """``[0: u32][n: u32][sizes: n * u32][elements]`` (Streaming's List encoding)."""

    def enc(obj: Any) -> bytes:
        _need(obj, list, name)
        items = [inner.encode(x) for x in obj]
        sizes = np.asarray([len(x) for x in items], "<u4").tobytes()
        return b"".join([_U32.pack(0), _U32.pack(len(items)), sizes, *items])

    def dec(data: Buffer) -> list:
        return [inner.decode(part) for part in _split_sized(data, 4)]

    return Encoding(name, None, enc, dec)


def _split_sized(data: Buffer, head: int) -> list[Buffer]:
    """Split ``[head bytes][n: u32][sizes: n * u32][parts]`` into its parts, checking every size."""
    if len(data) < head + 4:
        raise ValueError("list header is truncated")
    (n,) = _U32.unpack_from(data, head)
    pos = head + 4 + 4 * n
    if pos > len(data):
        raise ValueError(f"list of {n} elements: sizes run past the column's {len(data)} bytes")
    sizes = np.frombuffer(data, "<u4", n, head + 4)
    if int(sizes.sum(dtype=np.uint64)) + pos > len(data):
        raise ValueError("list elements run past the end of the column")
    parts = []
    for size in sizes.tolist():
        parts.append(data[pos:pos + size])
        pos += size
    return parts


def _jpeg_array_enc(obj: Any) -> bytes:
    items = [bytes(x) for x in obj]
    sizes = np.asarray([len(x) for x in items], "<u4").tobytes()
    return b"".join([_U32.pack(len(items)), sizes, *items])


def _jpeg_array_dec(data: Buffer) -> list:
    return [_image_dec(part) for part in _split_sized(data, 0)]


# --- registry ---------------------------------------------------------------------------------------
def _build() -> dict[str, Encoding]:
    table = {
        "bytes": Encoding("bytes", None, _bytes_enc, bytes),
        "str": Encoding("str", None, _str_enc, _text),
        "int": Encoding("int", 8, _int_enc, _int_dec, numpy_dtype=np.dtype("<i8")),
        "str_int": _str_number("str_int", int, int),
        "str_float": _str_number("str_float", float, float),
        "str_decimal": _str_number("str_decimal", Decimal, Decimal),
        "json": Encoding("json", None, _json_enc, _json_dec),
        "pil": Encoding("pil", None, _pil_enc, _pil_dec),
        "jpeg": Encoding("jpeg", None, _saved("JPEG"), _image_dec),
        "png": Encoding("png", None, _saved("PNG"), _image_dec),
        "jpeg_array": Encoding("jpeg_array", None, _jpeg_array_enc, _jpeg_array_dec),
        "jpegarray": Encoding("jpegarray", None, _jpeg_array_enc, _jpeg_array_dec),
        "pkl": Encoding("pkl", None, _pkl_enc, _pkl_dec, safe=False),
        "ndarray": _ndarray("ndarray", ""),
    }
    for name in _SCALARS:
        table[name] = _scalar(name)
    for inner in ("pil", "jpeg", "png"):
        table[f"list[{inner}]"] = _list_of(table[inner], f"list[{inner}]")
    return table


_TABLE = _build()
_cache: dict[str, Encoding] = {}


def encoding_names() -> list[str]:
    """The encoding names (``ndarray`` also takes ``:dtype`` and ``:dtype:shape``)."""
    return sorted(_TABLE)


def get_encoding(name: str) -> Encoding:
    """Look up an encoding by its index.json string (``"int"``, ``"ndarray:float32:3,4"``, ...).

    Raises:
        FormatError: the name is not an MDS encoding.
    """
    enc = _cache.get(name)
    if enc is not None:
        return enc
    if not isinstance(name, str):
        raise FormatError(f"column encoding must be a string, got {type(name).__name__}")
    base, colon, config = name.partition(":")
    if colon and base == "ndarray":
        enc = _ndarray(name, config)
    elif colon or base not in _TABLE:
        raise FormatError(f"unknown MDS encoding {name!r}: not one of {encoding_names()} "
                          "(ndarray also takes ':dtype' and ':dtype:shape')")
    else:
        enc = _TABLE[base]
    _cache[name] = enc
    return enc


def is_safe(name: str) -> bool:
    """Whether decoding ``name`` cannot run code (everything but ``pkl``)."""
    return get_encoding(name).safe
