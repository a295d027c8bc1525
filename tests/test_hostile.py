"""Bounded decompression and decoding (issue 12 item 4): data whose metadata lies about its size raises
a typed error naming the file and offset before the lie is allocated. "Before allocating" is checked with
tracemalloc: zstandard's and Pillow's Python-level outputs are allocated through Python's allocator."""
from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest
import zstandard

from torchforge import codecs
from torchforge.datasets.mds import MDSDataset
from torchforge.errors import CodecError, FormatError, TorchforgeError
from torchforge.formats.mds import MDSWriter

MiB = 1 << 20


def _zstd_claiming(size: int, payload: bytes = b"a") -> bytes:
    """A zstd frame whose header claims ``size`` bytes of content and whose one RLE block holds 1 byte."""
    magic = struct.pack("<I", 0xFD2FB528)
    descriptor = bytes([0b11000000, 0x00])  # 8-byte content size, a window descriptor (1 KiB), no checksum
    block = bytes([0b1011, 0, 0]) + payload[:1]  # last block, RLE, 1 byte repeated once
    return magic + descriptor + struct.pack("<Q", size) + block


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except TorchforgeError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("claim", [1 << 40, 8 << 30, 64 * MiB])
def test_zstd_frame_claiming_a_huge_size_is_refused_before_allocating(claim):
    frame = _zstd_claiming(claim)
    with pytest.raises(CodecError, match=f"claims {claim} bytes") as e:
        codecs.decompress("zst", frame, path="/data/x.jinx", offset=77)
    assert e.value.path == "/data/x.jinx" and e.value.offset == 77
    assert _peak(lambda: codecs.decompress("zst", frame)) < MiB


def test_zstd_limit_bounds_frames_with_and_without_a_claimed_size():
    data = bytes(32 * MiB)  # zeros: compresses about 30000:1
    sized = zstandard.ZstdCompressor().compress(data)
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    for frame in (sized, streamed):
        assert codecs.unzstd(frame, limit=len(data)) == data
        with pytest.raises(CodecError, match="limit of 1000 bytes"):
            codecs.unzstd(frame, limit=1000, path="/s.zstd", offset=0)
        assert _peak(lambda f=frame: codecs.unzstd(f, limit=1000)) < MiB
    # concatenated frames are bounded as a whole
    two = zstandard.ZstdCompressor().compress(b"x" * 600) * 2
    assert codecs.unzstd(two) == b"x" * 1200
    with pytest.raises(CodecError):
        codecs.unzstd(two, limit=1000)


@pytest.mark.parametrize("name", ["gz", "bz2", "xz"])
def test_stdlib_codecs_stop_at_the_limit(name):
    data = bytes(64 * MiB)
    packed = codecs.compress(name, data)
    assert codecs.get_codec(name).decompress(packed, limit=len(data)) == data
    with pytest.raises(CodecError, match="more than 4096 bytes"):
        codecs.get_codec(name).decompress(packed, limit=4096, path="/p", offset=3)
    # the decompressor's own state (xz: a dictionary of several MiB) is not output
    assert _peak(lambda: codecs.get_codec(name).decompress(packed, limit=4096)) < 16 * MiB
    with pytest.raises(CodecError):  # truncated input is still an error under a limit
        codecs.get_codec(name).decompress(packed[: len(packed) // 2], limit=len(data))


def test_mds_shard_that_decompresses_past_its_index_size_is_refused_before_allocating(tmp_path):
    out = str(tmp_path / "d")
    with MDSWriter(out, {"id": "int", "blob": "bytes"}, compression="zstd") as w:
        for i in range(4):
            w.write({"id": i, "blob": bytes(8 * MiB)})  # zeros: the shard compresses to a few KiB
    index_path = os.path.join(out, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    shard = index["shards"][0]
    real = shard["raw_data"]["bytes"]
    assert MDSDataset(out)[3]["id"] == 3  # the honest dataset reads
    shard["raw_data"]["bytes"] = 4096  # the index now lies: the shard is 32 MiB decompressed
    with open(index_path, "w") as f:
        json.dump(index, f)
    zpath = os.path.join(out, shard["zip_data"]["basename"])
    with pytest.raises(CodecError, match="limit of 4096 bytes") as e:
        MDSDataset(out)[0]
    assert e.value.path == zpath and e.value.offset == 0
    assert real > 32 * MiB
    assert _peak(lambda: MDSDataset(out)[0]) < 4 * MiB


def _pil_value(width: int, height: int, mode: str, pixels: bytes) -> bytes:
    m = mode.encode()
    return struct.pack("<III", width, height, len(m)) + m + pixels


@pytest.mark.parametrize(("width", "height", "mode", "npix"), [
    (1 << 16, 1 << 16, "RGB", 12),  # claims 12 GiB of pixels, holds 12 bytes
    (4, 4, "RGB", 47),  # one byte short
    (4, 4, "L", 17),  # one byte too many
    (8, 2, "NOPE", 16),  # not a mode
])
def test_pil_column_whose_size_disagrees_with_its_bytes_is_a_format_error(tmp_path, width, height, mode, npix):
    pytest.importorskip("PIL")
    out = str(tmp_path / "d")
    with MDSWriter(out, {"id": "int", "img": "bytes"}) as w:  # the pil layout, written as plain bytes
        w.write({"id": 0, "img": _pil_value(width, height, mode, b"\x07" * npix)})
    shard = os.path.join(out, "shard.00000.mds")
    with open(shard, "rb") as f:
        data = f.read()
    assert data.count(b'"bytes"') == 1
    with open(shard, "wb") as f:  # the column now says pil: same length, still JSON
        f.write(data.replace(b'"bytes"', b'"pil"  '))
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    index["shards"][0]["column_encodings"] = ["int", "pil"]
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(FormatError) as e:
        MDSDataset(out)[0]["img"]
    assert e.value.path == shard and e.value.offset is not None
    if mode != "NOPE":
        assert "needs" in str(e.value)
    assert _peak(lambda: MDSDataset(out)[0]["img"]) < 4 * MiB


def test_pil_column_of_the_right_size_reads(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    out = str(tmp_path / "d")
    img = Image.new("RGB", (5, 3), (1, 2, 3))
    with MDSWriter(out, {"id": "int", "img": "pil"}) as w:
        w.write({"id": 0, "img": img})
    assert MDSDataset(out)[0]["img"].tobytes() == img.tobytes()
