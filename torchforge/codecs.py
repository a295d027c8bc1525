"""Compression codecs in one table keyed by file/key extension.

``get_codec("zst")`` and ``get_codec("zstd:7")`` return a :class:`Codec`; ``None`` means pass-through.
Aliases: zst|zstd, gz|gzip, bz2, xz|lzma, lz4, snappy, br|brotli. Codecs whose package is not
installed raise :class:`~torchforge.errors.CodecError` naming the package to install.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zstandard  # a hard dependency

from torchforge.errors import CodecError

__all__ = ["CODECS", "Codec", "compress", "decompress", "get_codec", "parse_compression", "unzstd"]

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
    _decompress: Callable[[Buffer, int | None], bytes]  # (data, limit): output past limit may be cut off
    default_level: int | None = None

    def compress(self, data: Buffer, level: int | None = None) -> bytes:
        return self._compress(data, self.default_level if level is None else level)

    def decompress(self, data: Buffer, *, path: str | None = None, offset: int | None = None,
                   limit: int | None = None) -> bytes:
        """Decompress ``data``; failures raise CodecError naming ``path`` and ``offset``.

        With ``limit``, output longer than ``limit`` bytes raises CodecError; zstd checks a frame's
        claimed size before allocating, gz/bz2/xz/br stop decompressing one byte past the limit. Without
        one, gz/bz2/xz/br output is bounded as zstd's is, by what ``data`` could honestly hold (at least
        64 MiB): a tiny value that expands to gigabytes is a CodecError, not a MemoryError.
        """
        bomb = False
        if limit is None and self.name in _BOMB_BOUNDED:
            limit, bomb = max(memoryview(data).nbytes * _ZSTD_MAX_RATIO, _BOMB_FLOOR), True
        try:
            out = self._decompress(data, limit)
        except CodecError as e:
            if e.path is not None or path is None:
                raise
            raise CodecError(e.reason, path=path, offset=offset) from e
        except Exception as e:  # every library has its own error type
            raise CodecError(f"corrupt {self.name} data ({type(e).__name__}: {e})", path=path,
                             offset=offset) from e
        if limit is not None and len(out) > limit:
            if bomb:
                raise CodecError(f"{self.name} data of {memoryview(data).nbytes} bytes decompresses to more "
                                 f"than {limit} bytes: refused (a decompression bomb)", path=path, offset=offset)
            raise CodecError(f"{self.name} data decompresses to more than {limit} bytes", path=path, offset=offset)
        return out


# --- zstd: the one decompression path (JINX values, MDS samples and shards) ---------------------------
# One compressor/decompressor per thread (zstd contexts are not thread-safe). A forked child inherits a
# copy of its parent's thread's contexts, which is safe: the child's thread is the only user of the copy.
_tls = threading.local()
# zstd output per compressed byte, at most: a block yields <= 128 KiB and takes >= 4 bytes (an RLE block's
# 3-byte header and its byte). A frame that claims more than this for its length is lying.
_ZSTD_MAX_RATIO = (128 << 10) // 4
_SIZED_FAST = 1 << 15
# decompressed without a known size: bounded like zstd (see Codec.decompress); lz4 and snappy output is at
# most about 255 and 22 times their input
_BOMB_BOUNDED = ("gz", "bz2", "xz", "br")
_BOMB_FLOOR = 64 << 20
_UNKNOWN = zstandard.CONTENTSIZE_UNKNOWN  # frames with a content size at least this large go through one-shot decompress


def _zstd_compress(data: Buffer, level: int | None) -> bytes:
    level = 3 if level is None else level
    cache = getattr(_tls, "zstd_c", None)
    if cache is None:
        cache = _tls.zstd_c = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level)
    return cctx.compress(data)


def unzstd(data: Buffer, *, limit: int | None = None, path: str | None = None, offset: int | None = None) -> bytes:
    """Decompress zstd data: one frame or several concatenated, with or without a content size.

    Bounded: a frame whose claimed content size exceeds ``limit`` (when given) or what its length can
    possibly hold raises :class:`CodecError` before anything is allocated; output without a claimed
    size is cut off at ``limit``. Errors name ``path`` and ``offset``.
    """
    try:
        dctx = _tls.zstd_d
    except AttributeError:
        dctx = _tls.zstd_d = zstandard.ZstdDecompressor()
    try:
        size = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise CodecError(f"not a zstd frame ({e})", path=path, offset=offset) from None
    bound = len(data) * _ZSTD_MAX_RATIO if limit is None else min(limit, len(data) * _ZSTD_MAX_RATIO)
    if size != _UNKNOWN:
        if size > bound:
            why = f"the limit of {limit} bytes" if limit is not None and limit < size else (
                f"what {len(data)} compressed bytes can hold")
            raise CodecError(f"zstd frame claims {size} bytes decompressed, more than {why}", path=path,
                             offset=offset)
        if size >= _SIZED_FAST:
            try:
                return dctx.decompress(data, allow_extra_data=False)
            except zstandard.ZstdError as e:
                if "unused data" not in str(e):
                    raise CodecError(f"corrupt zst data ({e})", path=path, offset=offset) from None
                # more frames follow the first: the general path below goes through all of them
    try:
        if limit is None:  # fast path: one frame, bounded by its length (the ratio above)
            dobj = dctx.decompressobj()
            out = dobj.decompress(data)
            if dobj.eof and not dobj.unused_data:
                return out
        else:  # output without a claimed size is read only up to the limit, then decompressed for real
            probe = dctx.stream_reader(data, read_across_frames=True, closefd=False).read(limit + 1)
            if len(probe) > limit:
                raise CodecError(f"zstd data decompresses to more than the limit of {limit} bytes", path=path,
                                 offset=offset)
        return _unzstd_frames(dctx, data, bound, path, offset)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt zst data ({e})", path=path, offset=offset) from None


def _unzstd_frames(dctx: Any, data: Buffer, bound: int, path: str | None, offset: int | None) -> bytes:
    """Every frame of ``data``, each one's claimed size checked before it is decompressed, the total
    checked against ``bound`` after each frame (a frame without a claimed size can produce at most
    ``_ZSTD_MAX_RATIO`` times its length before the check)."""
    out = bytearray()
    view = memoryview(data)
    while len(view):
        try:
            size = zstandard.get_frame_parameters(view).content_size
        except zstandard.ZstdError as e:
            raise CodecError(f"not a zstd frame at byte {len(data) - len(view)} of the data ({e})", path=path,
                             offset=offset) from None
        if size != zstandard.CONTENTSIZE_UNKNOWN and len(out) + size > bound:
            raise CodecError(f"zstd frames claim more than {bound} bytes decompressed", path=path, offset=offset)
        dobj = dctx.decompressobj()
        out += dobj.decompress(view)
        if not dobj.eof:
            raise CodecError("truncated zstd frame", path=path, offset=offset)
        if len(out) > bound:
            raise CodecError(f"zstd data decompresses to more than {bound} bytes", path=path, offset=offset)
        view = view[len(view) - len(dobj.unused_data):]
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


def _gzip_decompress(data: Buffer, limit: int | None) -> bytes:
    """Every gzip member of ``data``, stopping one byte past ``limit``."""
    out = b""
    data = bytes(data)
    while True:
        d = zlib.decompressobj(wbits=31)
        try:
            got = d.decompress(data, 0 if limit is None else limit + 1 - len(out))
        except zlib.error as e:
            raise CodecError(f"corrupt gzip data ({e})") from e
        out += got
        if limit is not None and len(out) > limit:
            return out  # (the caller raises)
        if not d.eof:
            raise CodecError("truncated gzip data")
        data = d.unused_data
        if not data:
            return out


def _bounded(make: Callable[[], Any]) -> Callable[[Buffer, int | None], bytes]:
    """bz2/xz decompression of every stream of ``data``, stopping one byte past ``limit``."""
    def decompress(data: Buffer, limit: int | None) -> bytes:
        d = make()
        out = d.decompress(bytes(data), -1 if limit is None else limit + 1)
        if limit is not None and len(out) > limit:
            return out  # (the caller raises)
        if not d.eof:
            raise CodecError("truncated data")
        if d.unused_data:  # more streams follow (pbzip2, xz -T): the standard library reads them all too
            return out + decompress(d.unused_data, None if limit is None else limit - len(out))
        return out
    return decompress


def _brotli_decompress(data: Buffer, limit: int | None) -> bytes:
    """Brotli, stopping at least one byte past ``limit`` (brotli >= 1.2's ``output_buffer_limit``; an older
    brotli decompresses it all, and the caller's check comes after)."""
    brotli = _brotli()
    if limit is None:
        return brotli.decompress(bytes(data))
    d = brotli.Decompressor()
    try:
        out = d.process(bytes(data), output_buffer_limit=limit + 1)
    except TypeError:  # brotli < 1.2: no output limit
        return brotli.decompress(bytes(data))
    parts = [out]
    size = len(out)
    while size <= limit and not d.is_finished() and not d.can_accept_more_data():
        out = d.process(b"", output_buffer_limit=limit + 1 - size)
        parts.append(out)
        size += len(out)
    if size <= limit and not d.is_finished():
        raise CodecError("truncated br data")
    return b"".join(parts)


CODECS: dict[str, Codec] = {}
_ALIASES: dict[str, str] = {}


def _register(codec: Codec, *aliases: str) -> None:
    CODECS[codec.name] = codec
    for alias in (codec.name, *aliases):
        _ALIASES[alias] = codec.name


_register(Codec("zst", "zstandard", _zstd_compress, lambda d, limit: unzstd(d, limit=limit), 3), "zstd")
_register(Codec("gz", "", lambda d, lvl: gzip.compress(bytes(d), compresslevel=lvl, mtime=0),
                _gzip_decompress, 9), "gzip")
_register(Codec("bz2", "", lambda d, lvl: bz2.compress(bytes(d), lvl), _bounded(bz2.BZ2Decompressor), 9))
_register(Codec("xz", "", lambda d, lvl: lzma.compress(bytes(d), preset=lvl), _bounded(lzma.LZMADecompressor),
                None), "lzma")
_register(Codec("lz4", "lz4", lambda d, lvl: _lz4().compress(bytes(d), compression_level=lvl or 0),
                lambda d, limit: _lz4().decompress(bytes(d)), None))
_register(Codec("snappy", "python-snappy", lambda d, lvl: _snappy().compress(bytes(d)),
                lambda d, limit: _snappy().decompress(bytes(d)), None))
_register(Codec("br", "brotli", lambda d, lvl: _brotli().compress(bytes(d), quality=11 if lvl is None else lvl),
                _brotli_decompress, None), "brotli")


def is_codec(ext: str) -> bool:
    """Whether ``ext`` names a known compression (installed or not)."""
    return ext in _ALIASES


def parse_compression(spec: str | None, *, option: str = "compression") -> tuple[Codec, int | None] | None:
    """The one parser of compression specs: ``"algo"`` or ``"algo:level"``; ``None``, ``""`` and
    ``"none"`` mean no compression. Formats check their own allowed names and levels on the result
    (MDS: Streaming's five families and their level ranges).

    Raises:
        CodecError: not a string, an unknown algorithm, a level that is not an integer, or the codec's
            package is missing; the message names ``option``.

    >>> parse_compression("zstd:7")[1]
    7
    """
    if spec is None or spec == "" or spec == "none":
        return None
    if not isinstance(spec, str):
        raise CodecError(f"{option}={spec!r} must be a compression name such as 'zst' or 'zstd:7', or None")
    name, colon, level = spec.partition(":")
    try:
        codec = get_codec(name)
    except CodecError as e:
        raise CodecError(f"{option}={spec!r}: {e.reason}") from None
    if colon and not level.lstrip("-").isdigit():
        raise CodecError(f"{option}={spec!r}: the level after ':' must be an integer")
    return codec, int(level) if colon else None


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
