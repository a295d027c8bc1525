"""Compression codecs in one table keyed by file/key extension.

``get_codec("zst")`` and ``get_codec("zstd:7")`` return a :class:`Codec`; ``None`` means pass-through.
Aliases: zst|zstd, gz|gzip, bz2, xz|lzma, lz4, snappy, br|brotli. Codecs whose package is not
installed raise :class:`~torchforge.errors.CodecError` naming the package to install.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from torchforge.errors import CodecError

__all__ = ["CODECS", "Codec", "compress", "decompress", "get_codec", "parse_compression"]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Codec:
    """A named compression algorithm.

    Attributes:
        name: canonical extension (``zst``, ``gz``, ...).
        package: the PyPI package that provides it ('' for the standard library).
    """

    name: str
    package: str
    _compress: Callable[[Buffer, int | None], bytes]
    _decompress: Callable[[Buffer], bytes]
    default_level: int | None = None

    def compress(self, data: Buffer, level: int | None = None) -> bytes:
        return self._compress(data, self.default_level if level is None else level)

    def decompress(self, data: Buffer, *, path: str | None = None, offset: int | None = None) -> bytes:
        """Decompress ``data``; failures raise CodecError naming ``path`` and ``offset``."""
        try:
            return self._decompress(data)
        except CodecError as e:
            if e.path is not None or path is None:
                raise
            raise CodecError(e.reason, path=path, offset=offset) from e
        except Exception as e:  # every library has its own error type
            raise CodecError(f"corrupt {self.name} data ({type(e).__name__}: {e})", path=path,
                             offset=offset) from e


# --- zstd: one compressor/decompressor per thread and process (contexts are not thread-safe) ----------
_tls = threading.local()


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # pragma: no cover - zstandard is a hard dependency
        raise CodecError("zstd needs the 'zstandard' package: pip install zstandard") from e
    return zstandard


def _zstd_ctx(kind: str, level: int | None = None):
    key = (kind, level, os.getpid())
    cache = getattr(_tls, "zstd", None)
    if cache is None:
        cache = _tls.zstd = {}
    ctx = cache.get(key)
    if ctx is None:
        zstandard = _zstd()
        ctx = zstandard.ZstdDecompressor() if kind == "d" else zstandard.ZstdCompressor(level=level)
        cache[key] = ctx
    return ctx


def _zstd_compress(data: Buffer, level: int | None) -> bytes:
    return _zstd_ctx("c", 3 if level is None else level).compress(data)


def _zstd_decompress(data: Buffer) -> bytes:
    dctx = _zstd_ctx("d")
    zstandard = _zstd()
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise CodecError(f"not a zstd frame ({e})") from e
    if params.content_size and params.content_size != zstandard.CONTENTSIZE_UNKNOWN:
        try:
            return dctx.decompress(data, allow_extra_data=False)
        except zstandard.ZstdError as e:
            if "unused data" not in str(e):
                raise
        # more frames follow the first: the incremental path below goes through all of them
    # Streamed frames carry no content size (MLDataForge writes them): decompress incrementally, and
    # go on through concatenated frames.
    out = bytearray()
    view = memoryview(data)
    while len(view):
        dobj = dctx.decompressobj()
        out += dobj.decompress(view)
        if not dobj.eof:
            raise CodecError("truncated zstd frame")
        used = len(view) - len(dobj.unused_data)
        view = view[used:]
    return bytes(out)


def _lz4():
    try:
        import lz4.frame
    except ImportError as e:
        raise CodecError("the lz4 codec needs the 'lz4' package: pip install lz4 (or torchforge[codecs])") from e
    return lz4.frame


def _snappy():
    try:
        import snappy
    except ImportError as e:
        raise CodecError("the snappy codec needs the 'python-snappy' package: pip install python-snappy "
                         "(or torchforge[codecs])") from e
    return snappy


def _brotli():
    try:
        import brotli
    except ImportError as e:
        raise CodecError("the br codec needs the 'brotli' package: pip install brotli (or torchforge[codecs])") from e
    return brotli


def _gzip_decompress(data: Buffer) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise CodecError(f"corrupt gzip data ({e})") from e


CODECS: dict[str, Codec] = {}
_ALIASES: dict[str, str] = {}


def _register(codec: Codec, *aliases: str) -> None:
    CODECS[codec.name] = codec
    for alias in (codec.name, *aliases):
        _ALIASES[alias] = codec.name


_register(Codec("zst", "zstandard", _zstd_compress, _zstd_decompress, 3), "zstd")
_register(Codec("gz", "", lambda d, lvl: gzip.compress(bytes(d), compresslevel=lvl, mtime=0),
                _gzip_decompress, 9), "gzip")
_register(Codec("bz2", "", lambda d, lvl: bz2.compress(bytes(d), lvl), bz2.decompress, 9))
_register(Codec("xz", "", lambda d, lvl: lzma.compress(bytes(d), preset=lvl),
                lambda d: lzma.decompress(bytes(d)), None), "lzma")
_register(Codec("lz4", "lz4", lambda d, lvl: _lz4().compress(bytes(d), compression_level=lvl or 0),
                lambda d: _lz4().decompress(bytes(d)), None))
_register(Codec("snappy", "python-snappy", lambda d, lvl: _snappy().compress(bytes(d)),
                lambda d: _snappy().decompress(bytes(d)), None))
_register(Codec("br", "brotli", lambda d, lvl: _brotli().compress(bytes(d), quality=11 if lvl is None else lvl),
                lambda d: _brotli().decompress(bytes(d)), None), "brotli")


def is_codec(ext: str) -> bool:
    """Whether ``ext`` names a known compression (installed or not)."""
    return ext in _ALIASES


def parse_compression(spec: str | None) -> tuple[Codec, int | None] | None:
    """Parse ``"algo"`` or ``"algo:level"``; ``None`` means no compression.

    >>> parse_compression("zstd:7")[1]
    7
    """
    if spec is None or spec == "" or spec == "none":
        return None
    name, _, level = spec.partition(":")
    codec = get_codec(name)
    if level:
        try:
            lvl = int(level)
        except ValueError:
            raise CodecError(f"compression level in {spec!r} is not an integer") from None
        return codec, lvl
    return codec, None


def get_codec(name: str) -> Codec:
    """Look up a codec by extension or alias, checking that its package is importable."""
    canon = _ALIASES.get(name)
    if canon is None:
        raise CodecError(f"unknown compression {name!r}: not one of {sorted(_ALIASES)}")
    codec = CODECS[canon]
    {"lz4": _lz4, "snappy": _snappy, "br": _brotli}.get(canon, lambda: None)()
    return codec


def compress(name: str | None, data: Buffer) -> bytes:
    """Compress with a codec spec such as ``"zst"`` or ``"zstd:7"``; ``None`` returns the bytes as is."""
    parsed = parse_compression(name)
    if parsed is None:
        return bytes(data)
    codec, level = parsed
    return codec.compress(data, level)


def decompress(name: str | None, data: Buffer, *, path: str | None = None, offset: int | None = None) -> bytes:
    """Decompress with a codec name; errors name ``path`` and ``offset``."""
    if name is None:
        return bytes(data)
    try:
        codec = get_codec(name.partition(":")[0])
    except CodecError as e:
        raise CodecError(e.reason, path=path, offset=offset) from None
    return codec.decompress(data, path=path, offset=offset)
