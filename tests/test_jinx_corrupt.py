"""JINX bad input: truncated, bit-flipped and lying files give a TorchforgeError naming file and offset."""
from __future__ import annotations

import base64
import logging
import os
import random
import shutil
import zlib

import numpy as np
import orjson
import pytest
import zstandard
from expected import rich, same

from torchforge.datasets.jinx import JinxDataset
from torchforge.errors import CodecError, CorruptShardError, FormatError, TorchforgeError
from torchforge.formats import jinx_reader
from torchforge.formats.jinx import JinxWriter
from torchforge.lazy import materialize

HERE = os.path.dirname(os.path.abspath(__file__))


def craft(path, lines, *, index=None, **footer):
    """Write a JINX shard by hand: raw JSON lines, a b64 inline index, the footer, its offset."""
    body = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    if index is None:
        index, pos = [0], 0
        for x in lines:
            pos += len(orjson.dumps(x)) + 1
            index.append(pos)
    head = {"index.npy": base64.b64encode(np.asarray(index, "<u8").tobytes()).decode(), "num_samples": len(lines),
            "shard_id": 0, "version": "1.0", "encoding": "b64", "binary_threshold": None, "compression": None,
            "index_compression": None, "compress_threshold": 128, "compress_ratio": 0.67, "ext_sep": "."}
    head.update(footer)
    with open(path, "wb") as f:
        f.write(body + orjson.dumps(head) + f"\n{len(body)}\n".encode())
    return path


def read_all(path, **kw):
    """Open and decode everything (lazy values included)."""
    ds = JinxDataset(path, **kw)
    return [materialize(s) for s in ds]


def assert_named(err, path):
    assert isinstance(err, TorchforgeError)
    assert err.path is not None and os.path.basename(err.path).startswith(os.path.basename(path)[:5])
    assert err.offset is not None and err.offset >= 0
    assert err.path in str(err) and f"byte {err.offset}" in str(err)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A small single-shard dataset with a sidecar; returns (folder, samples)."""
    folder = tmp_path_factory.mktemp("good") / "ds"
    samples = list(rich(12, 3))
    with JinxWriter(folder, encoding="b64", binary_threshold=300) as w:
        for s in samples:
            w.write(s)
    return folder, samples


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst / "shard-00000.jinx"


# --- truncation and bit flips ------------------------------------------------------------------------------
def test_every_truncation_is_refused_at_open(shard, tmp_path):
    folder, _ = shard
    data = (folder / "shard-00000.jinx").read_bytes()
    target = tmp_path / "shard-00000.jinx"
    cuts = sorted(set(range(0, len(data), max(1, len(data) // 150))) | set(range(len(data) - 40, len(data))))
    for cut in cuts:
        target.write_bytes(data[:cut])
        with pytest.raises(TorchforgeError) as e:
            JinxDataset(target)
        assert_named(e.value, target)


def _flipped(shard, tmp_path, positions):
    """Yield (position, path) with the shard copied to tmp_path and byte ``position`` XOR 0x80, which is
    never valid UTF-8 inside JSON and never a digit in the offset line."""
    folder, _ = shard
    data = (folder / "shard-00000.jinx").read_bytes()
    foot = int(data.rstrip(b"\n").rsplit(b"\n", 1)[1])
    target = tmp_path / "shard-00000.jinx"
    shutil.copy(folder / "shard-00000.binx", tmp_path / "shard-00000.binx")
    for pos in positions(foot, len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x80
        target.write_bytes(bytes(bad))
        yield pos, target


def test_flips_in_footer_and_offset_line_are_detected(shard, tmp_path):
    for _, target in _flipped(shard, tmp_path, lambda foot, size: range(foot, size)):
        with pytest.raises(TorchforgeError) as e:
            read_all(target)
        assert_named(e.value, target)


def test_flips_in_the_body_are_detected_on_read(shard, tmp_path):
    for pos, target in _flipped(shard, tmp_path, lambda foot, size: random.Random(0).sample(range(foot), 60)):
        ds = JinxDataset(target)  # the footer is intact
        with pytest.raises(CorruptShardError) as e:
            [materialize(s) for s in ds]
        assert_named(e.value, target)
        assert e.value.offset <= pos


@pytest.mark.parametrize("name", ["shard-00000.jinx", "shard-00000.binx"])
def test_random_flips_anywhere_raise_typed_errors_or_read(shard, tmp_path, name):
    """Any byte, any flip: a TorchforgeError naming file and offset, or a clean read; nothing else."""
    folder, samples = shard
    rng = random.Random(zlib.crc32(name.encode()))  # the same flips every run
    work = tmp_path / "ds"
    shutil.copytree(folder, work)
    data = (folder / name).read_bytes()
    outcomes = set()
    for _ in range(120):
        pos = rng.randrange(len(data))
        bad = bytearray(data)
        bad[pos] ^= rng.randrange(1, 256)
        (work / name).write_bytes(bytes(bad))
        try:
            got = read_all(work)
        except TorchforgeError as e:
            assert_named(e, work / name)
            outcomes.add("error")
        else:
            assert len(got) == len(samples)
            outcomes.add("read")
    assert "error" in outcomes or name.endswith(".binx")


def test_index_in_sidecar_checked(tmp_path):
    """binary_threshold small enough puts the index itself in the sidecar; lying offsets there too."""
    folder = tmp_path / "ds"
    with JinxWriter(folder, encoding="b64", binary_threshold=16) as w:
        for s in rich(6, 1):
            w.write(s)
    jinx = folder / "shard-00000.jinx"
    data = jinx.read_bytes()
    foot = int(data.rstrip(b"\n").rsplit(b"\n", 1)[1])
    head = orjson.loads(data[foot:].split(b"\n", 1)[0])
    loc = head["index.npy.bin"]
    binx = folder / "shard-00000.binx"
    side = bytearray(binx.read_bytes())
    idx = np.frombuffer(bytes(side[loc["offset"]:loc["offset"] + loc["length"]]), "<u8").copy()
    idx[2], idx[3] = idx[3], idx[2]
    side[loc["offset"]:loc["offset"] + loc["length"]] = idx.tobytes()
    binx.write_bytes(bytes(side))
    with pytest.raises(CorruptShardError, match="out of order") as e:
        JinxDataset(folder)
    assert_named(e.value, jinx)
    binx.write_bytes(bytes(side[:loc["offset"] + 8]))  # short sidecar: the index is cut
    with pytest.raises(CorruptShardError, match="past its end") as e:
        JinxDataset(folder)
    assert e.value.path.endswith(".binx")


# --- lying footers and indexes -----------------------------------------------------------------------------
LINES = [{"id": i, "t": "x" * i} for i in range(5)]


def test_handcrafted_shard_reads(tmp_path):
    assert read_all(craft(tmp_path / "a.jinx", LINES)) == LINES


@pytest.mark.parametrize("how, match", [
    ({"num_samples": 7}, "num_samples=7"),
    ({"num_samples": -1}, "num_samples"),
    ({"num_samples": "5"}, "num_samples"),
    ({"encoding": "b32"}, "encoding"),
    ({"ext_sep": ""}, "ext_sep"),
    ({"index": [0, 20, 10, 30, 40, 50]}, "out of order"),
    ({"index": [0, 13, 27, 42, 58, 10**9]}, "index ends at"),
    ({"index": [5, 13, 27, 42, 58, 75]}, "starts at 5"),
    ({"index": [0, 13]}, "offsets"),
    ({"index.npy": "not base64!"}, "b64"),
    ({"index.npy": "QUJD"}, "whole number"),
    ({"index.npy.zst": base64.b64encode(b"\x28\xb5\x2f\xfd garbage").decode()}, "index entries"),
])
def test_lying_footer(tmp_path, how, match):
    how = dict(how)
    index = how.pop("index", None)
    path = craft(tmp_path / "a.jinx", LINES, index=index, **how)
    with pytest.raises(TorchforgeError, match=match) as e:
        JinxDataset(path)
    assert_named(e.value, path)


def test_corrupt_zstd_index(tmp_path):
    path = tmp_path / "a.jinx"
    craft(path, LINES)
    data = path.read_bytes()
    foot = int(data.rstrip(b"\n").rsplit(b"\n", 1)[1])
    head = orjson.loads(data[foot:].split(b"\n", 1)[0])
    raw = base64.b64decode(head.pop("index.npy"))
    head["index.npy.zst"] = base64.b64encode(zstandard.compress(raw)[:-4]).decode()
    path.write_bytes(data[:foot] + orjson.dumps(head) + f"\n{foot}\n".encode())
    with pytest.raises(CodecError) as e:
        JinxDataset(path)
    assert_named(e.value, path)


@pytest.mark.parametrize("tail", [b"\n99999999\n", b"\n-3\n", b"\nabc\n", b"\n12", b"", b"\n0\n"])
def test_footer_offset_line(tmp_path, tail):
    path = craft(tmp_path / "a.jinx", LINES)
    data = path.read_bytes()
    path.write_bytes(data.rstrip(b"\n").rsplit(b"\n", 1)[0] + tail)
    with pytest.raises(CorruptShardError) as e:
        JinxDataset(path)
    assert_named(e.value, path)


def test_empty_and_foreign_files(tmp_path):
    for name, content in (("e.jinx", b""), ("r.jinx", os.urandom(3000)), ("n.jinx", b"\n"), ("j.jinx", b"{}\n0\n")):
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(TorchforgeError) as e:
            JinxDataset(p)
        assert_named(e.value, p)


# --- bad values ---------------------------------------------------------------------------------------------
ZSTD_GARBAGE = base64.b64encode(b"\x28\xb5\x2f\xfd" + bytes(range(40))).decode()


@pytest.mark.parametrize("key, value, error", [
    ("x.foo", "QUJD", FormatError),  # unknown extension
    ("x.raw.foo", "QUJD", FormatError),
    ("x.zst.raw", "QUJD", FormatError),  # serialization not innermost
    ("x.raw", "!!not base64!!", CorruptShardError),
    ("x.raw", "QUJ", CorruptShardError),  # bad padding
    ("x.raw", 12, CorruptShardError),
    ("x.raw.zst", ZSTD_GARBAGE, CodecError),
    ("x.raw.zst", base64.b64encode(zstandard.compress(b"abc" * 50)[:-5]).decode(), CodecError),
    ("x.raw.gz", "QUJD", CodecError),
    ("x.npy", "QUJD", CorruptShardError),
    ("x.npy", base64.b64encode(b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, "
                               b"'shape': (1,), }" + b" " * 60 + b"\n" + b"\0" * 8).decode(), CorruptShardError),
    ("x.pt", "QUJD", CorruptShardError),
    ("x.str", base64.b64encode(b"\xff\xfe").decode(), CorruptShardError),
    ("x.zst", base64.b64encode(zstandard.compress(b"{not json")).decode(), CorruptShardError),
    ("x.int8", 300, CorruptShardError),
    ("x.float32", "1.5", CorruptShardError),
    ("x.uint8", -1, CorruptShardError),
    # values the dtype would change were read changed: 1.5 as 1, true as 1, 1e300 and 70000 as inf
    ("x.int64", 1.5, CorruptShardError),
    ("x.uint64", -0.5, CorruptShardError),
    ("x.int32", True, CorruptShardError),
    ("x.bool", 1, CorruptShardError),
    ("x.float32", 1e300, CorruptShardError),
    ("x.float16", 70000, CorruptShardError),
    ("x.float32", False, CorruptShardError),
    ("x.raw.bin", {"offset": -1, "length": 3}, CorruptShardError),
    ("x.raw.bin", {"offset": "0", "length": 3}, CorruptShardError),
    ("x.raw.bin", [0, 3], CorruptShardError),
    ("x.raw.bin", {"offset": 0, "length": 3}, CorruptShardError),  # no sidecar
])
def test_bad_value_raises_on_access(tmp_path, key, value, error):
    path = craft(tmp_path / "a.jinx", [{"id": 0}, {"id": 1, "y": {"z": [{key: value}]}}])
    ds = JinxDataset(path)
    assert ds[0]["id"] == 0 and ds[1]["id"] == 1  # other values still read
    with pytest.raises(error) as e:
        ds[1]["y"]["z"][0]["x"]
    assert_named(e.value, path)
    assert e.value.offset == len(orjson.dumps({"id": 0})) + 1  # the line of the bad value
    with pytest.raises(error):
        JinxDataset(path, lazy=False)[1]


def test_short_and_missing_sidecar(shard, tmp_path):
    folder, _ = shard
    jinx = _copy(folder, tmp_path / "ds")
    binx = jinx.with_suffix(".binx")
    size = binx.stat().st_size
    binx.write_bytes(binx.read_bytes()[: size // 2])
    with pytest.raises(CorruptShardError, match="past its end") as e:
        read_all(jinx)
    assert e.value.path == str(binx) and e.value.offset < size
    binx.unlink()
    with pytest.raises(CorruptShardError, match="missing") as e:
        read_all(jinx)
    assert_named(e.value, jinx)


def test_duplicate_logical_key_in_eager_mode(tmp_path):
    path = craft(tmp_path / "a.jinx", [{"x": "plain", "x.raw": "QUJD"}])
    with pytest.raises(CorruptShardError, match="twice"):
        JinxDataset(path, lazy=False)[0]


# --- on_error="skip" --------------------------------------------------------------------------------------
def test_skip_mode_skips_counts_and_logs(shard, tmp_path, caplog):
    folder, samples = shard
    jinx = _copy(folder, tmp_path / "ds")
    data = bytearray(jinx.read_bytes())
    ds = JinxDataset(jinx)
    bad_lines = [2, 7]
    for j in bad_lines:
        data[ds.shards[0].offsets[j] + 1] ^= 0x80  # break line j's JSON
    jinx.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError):
        list(JinxDataset(jinx))
    for lazy in (True, False):
        ds = JinxDataset(jinx, on_error="skip", lazy=lazy)
        with caplog.at_level(logging.WARNING, logger="torchforge.datasets.jinx"):
            got = list(ds)
        assert ds.skipped == 2 and len(got) == len(samples) - 2
        want = [s for i, s in enumerate(samples) if i not in bad_lines]
        assert all(same(a, b) == "" for a, b in zip(want, got))
        assert sum("skipping malformed" in r.message for r in caplog.records) >= 2
        caplog.clear()
        with pytest.raises(CorruptShardError):
            ds[2]  # random access still raises


def test_skip_mode_eager_skips_bad_values(tmp_path):
    path = craft(tmp_path / "a.jinx", [{"id": 0}, {"id": 1, "x.raw": "!!"}, {"id": 2}])
    ds = JinxDataset(path, lazy=False, on_error="skip")
    assert [s["id"] for s in ds] == [0, 2] and ds.skipped == 1


# --- bad lines, under either line parser ------------------------------------------------------------------
BAD_LINES = {
    1: b'{"id":1,"t":"\xff"}',  # invalid UTF-8
    2: b'{"id":2,"x":' + b"[" * 5000 + b"]" * 5000 + b"}",  # nested deeper than a parser goes
    3: b'{"id":3,"x":1e400}',  # a number out of range
    4: b'{"id":4,"x":NaN}',
    5: b"[1,2]",  # not an object
    6: b'{"id":6} trailing',
    7: b'{"id":7,"t":"\x01"}',  # a control character in a string
}


@pytest.fixture(params=["msgspec", "orjson"])
def line_parser(request, monkeypatch):
    """Shards opened in the test parse lines with msgspec (when installed) or with orjson."""
    if request.param == "orjson":
        monkeypatch.setattr(jinx_reader, "LINE_PARSER", (orjson.loads, False))
    else:
        pytest.importorskip("msgspec")
    return request.param


def test_bad_lines_raise_named_errors_or_are_skipped(tmp_path, line_parser):
    lines = [BAD_LINES.get(i, orjson.dumps({"id": i, "t": "ok"})) for i in range(10)]
    body = b"".join(x + b"\n" for x in lines)
    index = np.cumsum([0] + [len(x) + 1 for x in lines])
    path = craft(tmp_path / "a.jinx", [], index=index.tolist(), num_samples=len(lines))
    data = path.read_bytes()
    path.write_bytes(body + data[:-2] + str(len(body)).encode() + b"\n")  # footer offset moved by the body
    ds = JinxDataset(path)
    assert (ds.shards[0].parse is orjson.loads) == (line_parser == "orjson")
    good = [i for i in range(len(lines)) if i not in BAD_LINES]
    for i in range(len(lines)):
        if i in BAD_LINES:
            with pytest.raises(CorruptShardError, match=f"sample {i} ") as e:
                ds[i]
            assert_named(e.value, path)
            assert e.value.offset == index[i]
        else:
            assert ds[i]["id"] == i and ds[i]["t"] == "ok"
    with pytest.raises(CorruptShardError, match="sample 1 "):
        list(ds)
    with pytest.raises(CorruptShardError, match="sample 1 "):
        ds.key_values(lambda s: s["id"])
    for lazy in (True, False):
        skipping = JinxDataset(path, lazy=lazy, on_error="skip")
        assert [s["id"] for s in skipping] == good and skipping.skipped == len(BAD_LINES)


def test_a_folder_missing_the_shard_that_ends_the_chain_is_refused_not_read_short(tmp_path):
    """Each shard's footer names the next one; the last names none. A writer killed between two shards, or
    a partial copy, leaves a folder whose last shard still names a next one: refused (as remotely), while a
    folder holding the whole chain, and one shard opened as a file, still read."""
    src = os.path.join(HERE, "fixtures", "interop", "jinx-b64-multishard")
    names = sorted(n for n in os.listdir(src) if n.endswith(".jinx"))
    whole = JinxDataset(src)
    part = tmp_path / "part"
    part.mkdir()
    for n in names[:5]:  # the first five shards and their sidecars, as a copy stopped there
        for ext in (".jinx", ".binx"):
            if os.path.exists(os.path.join(src, n[:-5] + ext)):
                shutil.copy(os.path.join(src, n[:-5] + ext), part / (n[:-5] + ext))
    with pytest.raises(CorruptShardError, match="the dataset is incomplete") as e:
        JinxDataset(str(part))
    assert e.value.path == str(part / names[4]) and names[5] in str(e.value)
    one = JinxDataset(str(part / names[4]))  # a file on its own: what it holds
    assert len(one) == one.shards[0].num_samples
    assert len(JinxDataset(src)) == len(whole)
