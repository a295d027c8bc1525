"""JINX value codecs: text encodings of binary data, compressions, and the serialization extensions.

A JINX key carries its value's decoding chain as extensions, innermost first:
``name.<serialization>.<compression>.bin``. Decoding peels them outermost first: ``bin`` fetches the
bytes from the ``.binx`` sidecar (an inline value is text in the shard's encoding instead), a
compression extension decompresses, and the serialization (``str``, ``raw``, ``npy``, ``pt`` or a numpy
scalar dtype) turns bytes into the value. A chain without a serialization holds compressed JSON.

This module is shared by the reader and the writer; it has no state.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from torchforge.codecs import get_codec, is_codec, unzstd
from torchforge.errors import CodecError, FormatError

__all__ = [
    "ENCODINGS",
    "SCALAR_DTYPES",
    "SERIALIZATIONS",
    "compress_value",
    "decode_text",
    "decompress_value",
    "encode_text",
    "load_npy",
    "load_pt",
    "save_npy",
    "save_pt",
]

Buffer = bytes | bytearray | memoryview

ENCODINGS = ("a85", "b64", "hex")
# numpy scalar dtypes written as a JSON number with the dtype as extension. MLDataForge 0.6.10 reads the
# integer and float32/float64 ones; bool and float16 are torchforge additions.
SCALAR_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                           "float16", "float32", "float64", "bool"})
SERIALIZATIONS = frozenset({"str", "raw", "npy", "pt"}) | SCALAR_DTYPES
_SNAPPY_FRAME_MAGIC = b"\xff\x06\x00\x00sNaPpY"


# --- text encodings of binary data -------------------------------------------------------------------
def encode_text(data: Buffer, encoding: str) -> str:
    """Encode bytes as JSON-safe text: ``a85`` (Ascii85, no folding), ``b64`` or ``hex``."""
    if encoding == "b64":
        return binascii.b2a_base64(data, newline=False).decode("ascii")
    if encoding == "a85":
        return _a85encode(bytes(data))
    if encoding == "hex":
        return bytes(data).hex()
    raise FormatError(f"encoding={encoding!r} is not one of {list(ENCODINGS)}")


def decode_text(text: str, encoding: str) -> bytes:
    """Decode text written by :func:`encode_text`; raises ValueError (caller adds path and offset)."""
    if encoding == "b64":
        return binascii.a2b_base64(text, strict_mode=True)
    if encoding == "a85":
        return _a85decode(text)
    if encoding == "hex":
        return bytes.fromhex(text)
    raise ValueError(f"unknown encoding {encoding!r}: not one of {list(ENCODINGS)}")


def _a85encode(data: bytes) -> str:
    """``base64.a85encode(data)`` (no folding, ``z`` for zero groups), vectorized for long inputs."""
    if len(data) < 256:
        return base64.a85encode(data).decode("ascii")
    pad = -len(data) % 4
    words = np.frombuffer(data + b"\0" * pad, dtype=">u4").astype(np.uint64)
    digits = (words[:, None] // _POW85 % 85 + 33).astype(np.uint8)
    zero = words == 0
    if pad:
        zero[-1] = False  # the stdlib writes a padded last group in full, then cuts it
    keep = np.ones(digits.shape, dtype=bool)
    keep[zero, 1:] = False
    digits[zero, 0] = ord("z")
    out = digits[keep].tobytes()
    return (out[:len(out) - pad] if pad else out).decode("ascii")


_POW85 = np.array([85**4, 85**3, 85**2, 85, 1], dtype=np.uint64)


def _a85decode(text: str) -> bytes:
    """Ascii85 decoding as ``base64.a85decode(text, foldspaces=True)``, vectorized for the common case."""
    raw = text.encode("ascii")
    if len(raw) < 64 or b"z" in raw or b"y" in raw or raw.translate(None, _A85_DIGITS):
        return base64.a85decode(raw, foldspaces=True)  # short, or with 'z'/'y'/whitespace/bad characters
    n = len(raw)
    pad = -n % 5
    digits = np.frombuffer(raw + b"u" * pad, dtype=np.uint8).reshape(-1, 5).astype(np.uint64) - 33
    words = digits @ _POW85
    if int(words.max()) > 0xFFFFFFFF:
        raise ValueError("Ascii85 overflow in 5-tuple")
    out = words.astype(">u4").tobytes()
    return out[: len(out) - pad] if pad else out


_A85_DIGITS = bytes(range(33, 118))


# --- compression ---------------------------------------------------------------------------------------
def compress_value(data: Buffer, ext: str, level: int | None) -> bytes:
    """Compress with a canonical codec extension; snappy uses the framing format MLDataForge writes."""
    if ext == "snappy":
        import snappy

        comp = snappy.StreamCompressor()
        return comp.compress(bytes(data)) + comp.flush()
    return get_codec(ext).compress(data, level)


def decompress_value(data: Buffer, ext: str, *, path: str | None, offset: int | None) -> bytes:
    """Decompress one extension's worth; errors are CodecError naming ``path`` and ``offset``."""
    if ext == "zst":
        return unzstd(data, path=path, offset=offset)
    if not is_codec(ext):
        raise FormatError(f"unknown extension {ext!r}: not a serialization ({sorted(SERIALIZATIONS)}) "
                          "or a compression", path=path, offset=offset)
    if ext == "snappy" and bytes(data[:10]) == _SNAPPY_FRAME_MAGIC:
        try:
            import snappy

            return snappy.StreamDecompressor().decompress(bytes(data))
        except ImportError as e:
            raise CodecError("the snappy codec needs the 'python-snappy' package", path=path, offset=offset) from e
        except Exception as e:
            raise CodecError(f"corrupt snappy data ({type(e).__name__}: {e})", path=path, offset=offset) from e
    try:
        codec = get_codec(ext)
    except CodecError as e:
        raise CodecError(e.reason, path=path, offset=offset) from None
    return codec.decompress(data, path=path, offset=offset)


# --- serializations --------------------------------------------------------------------------------------
def save_npy(arr: np.ndarray) -> bytes:
    if arr.dtype.hasobject:
        raise FormatError(f"numpy arrays of dtype {arr.dtype} cannot be stored (no pickle): use a numeric, "
                          "bool, bytes or unicode dtype")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def load_npy(data: Buffer, *, zero_copy: bool) -> np.ndarray:
    """Load ``.npy`` bytes without pickle; with ``zero_copy`` the array is a read-only view of ``data``.

    Raises ValueError on a malformed header or a size mismatch.
    """
    view = memoryview(data)
    head = io.BytesIO(bytes(view[:min(len(view), 1 << 16)]))
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    else:  # format 3.0 (utf-8 field names): rare, let numpy parse it
        return np.load(io.BytesIO(bytes(view)), allow_pickle=False)
    if dtype.hasobject:
        raise ValueError(f"object dtype {dtype} needs pickle, refused")
    count = 1
    for dim in shape:
        count *= dim
    start = head.tell()
    if len(view) - start != count * dtype.itemsize:
        raise ValueError(f"npy payload is {len(view) - start} bytes, header says {count} x {dtype.itemsize}")
    arr = np.frombuffer(view, dtype=dtype, count=count, offset=start)
    arr = arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)
    return arr if zero_copy else arr.copy()


def save_pt(tensor: Any) -> bytes:
    """``torch.save`` bytes of ``tensor``. torch.save writes a view's whole storage: a view of a larger
    tensor (one row of a column, a slice) is saved as a compact copy of its own values instead."""
    import torch

    if tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_quantized \
            and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        tensor = tensor.detach().clone(memory_format=torch.contiguous_format).requires_grad_(tensor.requires_grad)
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def load_pt(data: Buffer) -> Any:
    import torch

    return torch.load(io.BytesIO(bytes(data)), weights_only=True)
