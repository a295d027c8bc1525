"""One size parser and one compression-spec parser for every option (issue 12 items 6 and 7)."""
from __future__ import annotations

import pytest
import zstandard

from torchforge import codecs
from torchforge.checkpoint import Checkpointer
from torchforge.datasets.safetensors import SafetensorsShardWriter
from torchforge.errors import CodecError, FormatError
from torchforge.formats import jinx_codec
from torchforge.formats.jinx import JinxWriter
from torchforge.formats.mds import MDSWriter, parse_mds_compression
from torchforge.sizes import parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("64MB", 64 * 10**6), ("64mb", 64 * 10**6), ("64 MB", 64 * 10**6), ("64MiB", 64 * 2**20),
    ("64mib", 64 * 2**20), ("1.5GB", 1_500_000_000), ("2GiB", 2 * 2**30), ("512", 512), ("512b", 512),
    ("100kb", 100_000), ("100KiB", 102_400), (".5MiB", 2**19), (4096, 4096),
])
def test_one_meaning_of_every_unit(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2XB", "GB", "-1", "1e6", "64 M B", "", "MiB1"])
def test_bad_sizes_name_the_option(bad):
    with pytest.raises(ValueError, match=r"shard_size=.* units: b, kb"):
        parse_size(bad, option="shard_size")


def test_zero_negative_and_non_sizes():
    with pytest.raises(ValueError, match="positive"):
        parse_size(0, option="max_shard_size")
    assert parse_size(0, allow_zero=True) == 0
    with pytest.raises(ValueError, match="non-negative"):
        parse_size(-5, allow_zero=True)
    for bad in (True, 1.5, None, b"64MB"):
        with pytest.raises(TypeError, match="not a size"):
            parse_size(bad)


@pytest.mark.parametrize("text", ["64mb", "64MB", "8MiB", "1.5MB"])
def test_every_writer_reads_a_size_string_the_same_way(tmp_path, text):
    want = parse_size(text)
    assert MDSWriter(str(tmp_path / "mds"), {"x": "int"}, size_limit=text, exist_ok=True).size_limit == want
    assert SafetensorsShardWriter(tmp_path / f"st-{text}", max_shard_size=text).max_bytes == want
    assert Checkpointer(tmp_path / "ck", max_shard_size=text).max_shard_size == want
    w = JinxWriter(tmp_path / f"jinx-{text}", shard_size=text, overwrite=True)
    assert w.shard_size == want
    w.close()


def test_writers_refuse_bad_sizes_with_the_option_named(tmp_path):
    with pytest.raises(FormatError, match="shard_size='64 parsecs'"):
        JinxWriter(tmp_path / "j", shard_size="64 parsecs")
    with pytest.raises(ValueError, match="size_limit='lots'"):
        MDSWriter(str(tmp_path / "m"), {"x": "int"}, size_limit="lots")
    with pytest.raises(ValueError, match="max_shard_size='2XB'"):
        Checkpointer(tmp_path / "c", max_shard_size="2XB")


# --- compression specs --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["zstd:x", "zstd:", "gz:1.5"])
def test_one_compression_parser_one_message(tmp_path, spec):
    with pytest.raises(CodecError, match="level after ':' must be an integer"):
        codecs.parse_compression(spec)
    with pytest.raises(CodecError, match="level after ':' must be an integer"):
        JinxWriter(tmp_path / "j", compression=spec)
    with pytest.raises(CodecError, match="level after ':' must be an integer"):
        parse_mds_compression(spec)


def test_compression_names_resolve_through_the_one_table(tmp_path):
    for spec, name, level in (("zstd:7", "zst", 7), ("zst", "zst", None), ("gzip:5", "gz", 5), ("lzma", "xz", None)):
        codec, lvl = codecs.parse_compression(spec)
        assert (codec.name, lvl) == (name, level)
        w = JinxWriter(tmp_path / f"j-{spec}", compression=spec, overwrite=True)
        assert (w.compression, w.level) == (name, level)
        w.close()
    mds = parse_mds_compression("sample::zstd:7")
    assert (mds.codec.name, mds.level, mds.per_sample) == ("zst", 7, True)
    with pytest.raises(CodecError, match="not one of"):
        parse_mds_compression("lzma")  # a torchforge codec, but not one of Streaming's families
    with pytest.raises(CodecError, match="must be a compression name"):
        codecs.parse_compression(3)


def test_jinx_values_go_through_the_one_bounded_zstd_path():
    assert getattr(jinx_codec, "unzstd", codecs.unzstd) is codecs.unzstd  # no second zstd path
    frame = b"\x28\xb5\x2f\xfd" + bytes([0b11000000, 0]) + (1 << 40).to_bytes(8, "little") + bytes([0b1011, 0, 0, 97])
    with pytest.raises(CodecError, match="claims 1099511627776 bytes") as e:
        jinx_codec.decompress_value(frame, "zst", path="/d/shard-00000.jinx", offset=12)
    assert (e.value.path, e.value.offset) == ("/d/shard-00000.jinx", 12)
    data = b"torchforge " * 50
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert jinx_codec.decompress_value(streamed + streamed, "zst", path=None, offset=None) == data + data
