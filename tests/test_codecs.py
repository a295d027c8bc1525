import os
import pickle
import tracemalloc

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge import codecs
from torchforge.errors import CodecError, TorchforgeError


@pytest.mark.parametrize("name", ["zst", "zstd", "gz", "gzip", "bz2", "xz", "lzma", "lz4", "snappy", "br"])
@settings(max_examples=20, deadline=None)
@given(data=st.binary(max_size=5000))
def test_round_trip(name, data):
    assert codecs.decompress(name, codecs.compress(name, data)) == data


def test_levels_and_passthrough():
    data = b"abc" * 1000
    assert codecs.decompress("zstd", codecs.compress("zstd:19", data)) == data
    assert codecs.compress(None, data) == data
    assert codecs.parse_compression("gz:5")[1] == 5
    with pytest.raises(CodecError, match="must be an integer"):
        codecs.parse_compression("gz:high")


def test_zstd_frame_without_content_size():
    data = bytes(range(256)) * 500
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    framed = cctx.compressobj().compress(data) + cctx.compressobj().flush()
    chunks = cctx.compressobj()
    streamed = chunks.compress(data) + chunks.flush()
    assert zstandard.get_frame_parameters(streamed).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert codecs.decompress("zst", streamed) == data
    # two concatenated streamed frames
    assert codecs.decompress("zst", streamed + streamed) == data + data
    del framed
    # concatenated frames that do carry a content size
    sized = zstandard.ZstdCompressor().compress(b"a" * 100) + zstandard.ZstdCompressor().compress(b"b" * 50)
    assert codecs.decompress("zst", sized) == b"a" * 100 + b"b" * 50


def test_unknown_codec_lists_choices():
    with pytest.raises(CodecError, match="unknown compression 'rar'.*zst"):
        codecs.get_codec("rar")


@pytest.mark.parametrize("name", ["zst", "gz", "bz2", "xz", "lz4", "br", "snappy"])
def test_corrupt_input_names_file_and_offset(name):
    good = codecs.compress(name, b"x" * 1000 + bytes(range(256)))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    bad = bytes(bad[: len(bad) - 3])
    with pytest.raises(CodecError) as ei:
        codecs.decompress(name, bad, path="/data/a.jinx", offset=1234)
    assert ei.value.path == "/data/a.jinx" and ei.value.offset == 1234
    assert "/data/a.jinx: byte 1234:" in str(ei.value)
    assert isinstance(ei.value, TorchforgeError)


def test_missing_package_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("lz4"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(CodecError, match="pip install lz4"):
        codecs.get_codec("lz4")


def test_errors_pickle_with_path_and_offset():
    e = CodecError("boom", path="/x", offset=7)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is CodecError and e2.path == "/x" and e2.offset == 7 and str(e2) == str(e)


def test_a_tiny_value_that_expands_to_gigabytes_is_refused_not_a_memory_error():
    """bz2 had no bound without a limit (zstd's frames bound themselves; gzip cannot exceed about 1032x):
    785 bytes of bz2 became 1 GiB of zeros, and a little more was a MemoryError. Output is now bounded as
    zstd's is, by what the data could honestly hold, and never below 64 MiB."""
    name = "bz2"
    bomb = codecs.compress(name, bytes(80 << 20))  # 80 MiB of zeros: more than 64 MiB and the ratio bound
    assert len(bomb) * codecs._ZSTD_MAX_RATIO < (80 << 20)
    with pytest.raises(CodecError, match="decompression bomb") as ei:
        codecs.decompress(name, bomb, path="/data/a.binx", offset=77)
    assert ei.value.path == "/data/a.binx" and ei.value.offset == 77
    assert codecs.decompress(name, codecs.compress(name, bytes(1 << 20))) == bytes(1 << 20)
    for name in ("gz", "xz"):  # their formats cannot reach the bound: 80 MiB of zeros decode whole
        assert codecs.decompress(name, codecs.compress(name, bytes(80 << 20))) == bytes(80 << 20)


def test_a_brotli_bomb_is_refused_before_it_is_decompressed_whole():
    """Brotli had no bound: 3.2 KB of br (a JINX value, an MDS ``sample::br`` sample) became 2 GiB in
    memory before any check. Its output now stops one byte past the bound, as gz/bz2/xz's does."""
    brotli = pytest.importorskip("brotli")
    c = brotli.Compressor(quality=5)
    bomb = b"".join([c.process(bytes(64 << 20)) for _ in range(8)] + [c.finish()])  # 512 MiB of zeros
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="decompression bomb") as ei:
            codecs.decompress("br", bomb, path="/data/a.jinx", offset=9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ei.value.path == "/data/a.jinx" and ei.value.offset == 9
    assert peak < 2 * codecs._BOMB_FLOOR, peak  # was 512 MiB: the whole output, then the check
    br = codecs.get_codec("br")
    with pytest.raises(CodecError, match="more than 100 bytes"):
        br.decompress(br.compress(bytes(101)), limit=100)
    assert br.decompress(br.compress(bytes(100)), limit=100) == bytes(100)
    with pytest.raises(CodecError, match="truncated br"):
        br.decompress(br.compress(os.urandom(5000))[:-10], limit=10_000)


@pytest.mark.parametrize("name", ["gz", "bz2", "xz"])
def test_concatenated_streams_are_read_whole_with_and_without_a_limit(name):
    """pbzip2, pigz and xz -T write several streams; with a limit the bounded path read only the first."""
    two = codecs.compress(name, b"a" * 1000) + codecs.compress(name, b"b" * 500)
    want = b"a" * 1000 + b"b" * 500
    codec = codecs.get_codec(name)
    assert codecs.decompress(name, two) == want
    assert codec.decompress(two, limit=1500) == want
    with pytest.raises(CodecError, match="more than 1499 bytes"):
        codec.decompress(two, limit=1499)
    with pytest.raises(CodecError):
        codec.decompress(two[:-5], limit=1500)
