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
from torchforge.errors import CodecError, CorruptShardError, FormatError, TorchforgeError
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


# --- index.json entries that lie (found by fuzzing every byte of small datasets) ---------------------------
def _mds(out: str, n: int = 6, **kw) -> str:
    with MDSWriter(out, {"id": "int", "blob": "bytes"}, size_limit=kw.pop("size_limit", 400), **kw) as w:
        for i in range(n):
            w.write({"id": i, "blob": bytes([i]) * 60})
    return out


def _edit_index(out: str, fn) -> None:
    path = os.path.join(out, "index.json")
    with open(path) as f:
        index = json.load(f)
    fn(index)
    with open(path, "w") as f:
        json.dump(index, f)


def test_verify_finds_a_shard_whose_index_entry_says_0_samples_or_is_gone(tmp_path):
    """A shard whose entry says 0 samples is never opened by decoding every sample, and a shard whose entry
    was deleted is not seen at all: both lost every sample of the shard while verify said '0 problems'."""
    from torchforge.cli import verify_dataset

    out = _mds(str(tmp_path / "zero"))
    assert verify_dataset(out) == (6, []) and MDSDataset(out).metas[0].samples > 0
    _edit_index(out, lambda ix: ix["shards"][0].update(samples=0))
    _, problems = verify_dataset(out)
    assert len(problems) == 1 and "shard.00000.mds: byte 0: shard says it holds" in problems[0], problems
    assert "index.json says 0" in problems[0]

    out = _mds(str(tmp_path / "gone"))
    _edit_index(out, lambda ix: ix["shards"].pop(1))
    _, problems = verify_dataset(out)
    assert len(problems) == 1 and "shard.00001.mds:" in problems[0] and "does not list" in problems[0], problems


@pytest.mark.parametrize(("field", "value", "match"), [
    ("samples", 2**63, "cannot fit in raw_data"),  # was accepted, then len() raised a raw OverflowError
    ("samples", 10**6, "cannot fit in raw_data"),
    ("hashes", "x", "not an object of hex digests"),  # was a raw AttributeError at the first read
    ("hashes", {"sha1": 5}, "not an object of hex digests"),
])
def test_an_index_entry_with_impossible_counts_or_hashes_is_a_format_error_naming_index_json(
        tmp_path, field, value, match):
    out = _mds(str(tmp_path / "d"), compression="zstd", hashes=["sha1"])

    def lie(ix):
        if field == "samples":
            ix["shards"][0]["samples"] = value
        else:
            ix["shards"][0]["raw_data"]["hashes"] = value

    _edit_index(out, lie)
    with pytest.raises(FormatError, match=match) as e:
        MDSDataset(out)
    assert e.value.path == os.path.join(out, "index.json")


def test_errors_in_a_decompressed_mds_shard_name_the_stored_file_not_the_private_copy(tmp_path):
    out = _mds(str(tmp_path / "d"), compression="zstd", size_limit=None)
    _edit_index(out, lambda ix: ix["shards"][0].update(samples=5))
    with pytest.raises(CorruptShardError, match="holds 6 samples, index.json says 5") as e:
        MDSDataset(out)[0]
    assert e.value.path == os.path.join(out, "shard.00000.mds.zstd") + " (decompressed)", e.value.path


def test_a_damaged_sidecar_value_names_the_binx_file_and_the_values_offset(tmp_path):
    """Damage inside a .binx value was reported against the .jinx line that refers to it."""
    from torchforge import JinxWriter, open_dataset

    folder = str(tmp_path / "j")
    with JinxWriter(folder, encoding="b64", binary_threshold=16, compression="zst") as w:
        for i in range(3):
            w.write({"id": i, "text": "x" * 200 + str(i)})
    binx = os.path.join(folder, "shard-00000.binx")
    ds = open_dataset(folder)
    assert ds[2]["text"] == "x" * 200 + "2"
    where = ds[1].raw_keys()
    del ds
    with open(binx, "r+b") as f:
        data = bytearray(f.read())
        second = data.find(b"\x28\xb5\x2f\xfd", 1)  # the second value's zstd frame
        data[second:second + 4] = b"JUNK"
        f.seek(0)
        f.write(data)
    with pytest.raises(CodecError, match=r"value of 'text.str.zst.bin' \(referenced from shard-00000.jinx byte") as e:
        open_dataset(folder)[1]["text"]
    assert e.value.path == binx and e.value.offset == second, (e.value, where)
