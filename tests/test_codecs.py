import pickle

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
