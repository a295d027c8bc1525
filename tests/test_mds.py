"""MDS: writer layout (byte-identical to Streaming / MLDataForge), readers, round trips, bad input."""
from __future__ import annotations

import gc
import gzip
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import types
from decimal import Decimal

import numpy as np
import pytest
from expected import MDS_COLUMNS, mds_rows, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchforge
from torchforge.datasets import base
from torchforge.datasets.mds import MDSDataset, detect
from torchforge.errors import CodecError, CorruptShardError, FormatError, NotFoundError, TorchforgeError
from torchforge.formats import mds as mds_mod
from torchforge.formats.mds import MDSWriter, hash_names
from torchforge.formats.values import ByteView

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "interop")


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _save(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _json(path):
    return json.loads(_read(path))


MANIFEST = _json(os.path.join(FIXTURES, "manifest.json"))
MDS_FIXTURES = ["mds-streaming-none", "mds-sample-zstd"]


def _files(folder):
    return {f: _read(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


def _assert_rows(ds, rows):
    assert len(ds) == len(rows)
    for i, r in enumerate(rows):
        assert same(r, ds[i]) == "", i
    got = list(ds)
    assert len(got) == len(rows)
    for r, g in zip(rows, got):
        assert same(r, g) == ""


# --- interop fixtures written by Streaming 0.13 and MLDataForge 0.6.10 ---------------------------------
@pytest.mark.parametrize("name", MDS_FIXTURES)
def test_fixture_reads_equal_to_generator(name):
    m = MANIFEST[name]
    ds = MDSDataset(os.path.join(FIXTURES, name))
    _assert_rows(ds, list(mds_rows(m["n"], m["seed"])))
    assert ds[-1]["id"] == m["n"] - 1
    # registered for open_dataset, which finds it through detect
    assert base.formats()["mds"] is MDSDataset
    assert type(base.open_dataset(os.path.join(FIXTURES, name))) is MDSDataset
    assert detect(os.path.join(FIXTURES, name)) and not detect(os.path.join(FIXTURES, "jinx-b64-multishard"))


@pytest.mark.parametrize("name", MDS_FIXTURES)
def test_bytes_columns_zero_copy_or_copied(name):
    m = MANIFEST[name]
    rows = list(mds_rows(m["n"], m["seed"]))
    views = MDSDataset(os.path.join(FIXTURES, name))  # zero_copy=True by default
    copies = MDSDataset(os.path.join(FIXTURES, name), zero_copy=False)
    held = []
    for i in (0, 7, len(rows) - 1):
        v, c = views[i]["image"], copies[i]["image"]
        assert type(v) is ByteView and not v.flags.writeable and v.base is not None and type(c) is bytes
        assert bytes(v) == c == rows[i]["image"]
        held.append(v)
    views.close()  # views still held: the map stays alive until they go, nothing breaks
    assert [bytes(v) for v in held] == [rows[i]["image"] for i in (0, 7, len(rows) - 1)]


@pytest.mark.parametrize("name", MDS_FIXTURES)
def test_writer_reproduces_fixture_bytes(write_mds, tmp_path, name):
    """Our writer, fed the generator's rows, writes the very bytes Streaming / MLDataForge wrote."""
    m = MANIFEST[name]
    src = os.path.join(FIXTURES, name)
    entry = _json(os.path.join(src, "index.json"))["shards"][0]
    out = write_mds(str(tmp_path / "out"), mds_rows(m["n"], m["seed"]), m["columns"],
                    compression=m["compression"], size_limit=entry["size_limit"])
    assert _files(out) == {f: b for f, b in _files(src).items() if not f.startswith(".")}


# --- byte identity against Streaming's MDSWriter, in the same test ------------------------------------
def _all_columns_rows(n, seed):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        img = Image.fromarray(rng.integers(0, 255, (4 + i % 3, 5, 3), dtype=np.uint8), "RGB")
        jpg = io.BytesIO()
        img.save(jpg, format="JPEG")
        rows.append({
            "b": rng.bytes(int(rng.integers(0, 50))), "s": "héllo" * int(rng.integers(0, 5)), "i": int(rng.integers(-2**62, 2**62)),
            "i8": np.int8(rng.integers(-128, 127)), "u16": np.uint16(rng.integers(0, 65535)), "u64": np.uint64(2**63 + i),
            "f16": np.float16(rng.random()), "f32": np.float32(rng.random()), "f64": float(rng.random()),
            "i16": np.int16(-i), "i32": np.int32(i * 1000), "i64": np.int64(-i * 10**12), "u8": np.uint8(i % 256),
            "u32": np.uint32(i), "si": -(10**30) - i, "sf": float(rng.random()) * 1e10, "sd": Decimal("3.14159") + i,
            "nd": rng.standard_normal((1 + i % 3, 2)).astype(np.float64), "ndd": rng.integers(0, 9, 300 + i, dtype=np.int16),
            "nds": rng.standard_normal((2, 3)).astype(np.float32), "j": {"k": [i, "v", None, True, 1.5]},
            "pil": img, "png": img, "jpeg": img, "lpng": [img, img], "lpil": [img], "ljpeg": [img],
            "ja": [jpg.getvalue()] * (1 + i % 2),
        })
    return rows


ALL_COLUMNS = {"b": "bytes", "s": "str", "i": "int", "i8": "int8", "u16": "uint16", "u64": "uint64", "f16": "float16",
               "f32": "float32", "f64": "float64", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
               "u32": "uint32", "si": "str_int", "sf": "str_float", "sd": "str_decimal", "nd": "ndarray",
               "ndd": "ndarray:int16", "nds": "ndarray:float32:2,3", "j": "json", "pil": "pil", "png": "png",
               "jpeg": "jpeg", "lpng": "list[png]", "lpil": "list[pil]", "ljpeg": "list[jpeg]", "ja": "jpeg_array"}


@pytest.mark.parametrize("compression,hashes", [
    (None, []), (None, ["md5", "sha1"]), ("zstd", ["sha1"]), ("zstd:9", []), ("gz", ["md5"]), ("bz2:3", []),
    ("br:5", []), ("snappy", []), ("sample::zstd", ["sha256"]),
])
def test_byte_identical_to_streaming_mdswriter(write_mds, tmp_path, monkeypatch, compression, hashes):
    streaming = pytest.importorskip("streaming", reason="MosaicML Streaming is not installed")
    if "xxh64" in hash_names() and compression is None and hashes:
        hashes = sorted(hashes + ["xxh64"])
    rows = _all_columns_rows(40, 7)
    # gzip stamps the current time into its header; pin it so that both writers agree (ours writes 0).
    monkeypatch.setattr(gzip, "time", types.SimpleNamespace(time=lambda: 0))
    ref = str(tmp_path / "ref")
    if compression and compression.startswith("sample::"):
        # Streaming cannot write per-sample compression; MLDataForge's MDSSampleWriter is Streaming's
        # writer with each encoded sample compressed by Streaming's own compress(): emulate that.
        from streaming.base.compression import compress

        class SampleWriter(streaming.MDSWriter):
            def encode_sample(self, sample):
                return compress(compression.removeprefix("sample::"), super().encode_sample(sample))

            def get_config(self):
                return {**super().get_config(), "compression": compression}

        writer = SampleWriter(out=ref, columns=ALL_COLUMNS, hashes=hashes, size_limit=1 << 14)
    else:
        writer = streaming.MDSWriter(out=ref, columns=ALL_COLUMNS, compression=compression, hashes=hashes,
                                     size_limit=1 << 14)
    with writer:
        for r in rows:
            writer.write(r)
    ours = write_mds(str(tmp_path / "ours"), rows, ALL_COLUMNS, compression=compression, hashes=hashes,
                     size_limit=1 << 14)
    want = _files(ref)
    assert len(want) > 3  # several shards
    assert _files(ours) == want
    ds = MDSDataset(ours)
    assert len(ds) == len(rows)
    for i in (0, 17, 39):
        got, r = ds[i], rows[i]
        assert got["b"] == r["b"] and got["s"] == r["s"] and got["i"] == r["i"] and got["sd"] == r["sd"]
        assert got["u64"] == r["u64"] and got["u64"].dtype == np.uint64 and got["si"] == r["si"]
        assert np.array_equal(got["nd"], r["nd"]) and np.array_equal(got["nds"], r["nds"])
        assert np.array_equal(np.asarray(got["pil"]), np.asarray(r["pil"]))
        assert np.array_equal(np.asarray(got["png"]), np.asarray(r["png"]))
        assert [bytes(x.tobytes()) for x in got["lpil"]] == [r["pil"].tobytes()]
        assert got["j"] == r["j"] and got["jpeg"].size == r["jpeg"].size and len(got["ja"]) == len(r["ja"])


def test_writer_defaults_and_public_name(write_mds, tmp_path):
    assert torchforge.MDSWriter is MDSWriter and torchforge.MDSDataset is MDSDataset
    out = write_mds(str(tmp_path / "d"), [{"x": 1}], {"x": "int"})
    idx = _json(os.path.join(out, "index.json"))
    (shard,) = idx["shards"]
    assert shard["size_limit"] == 1 << 26 and shard["compression"] is None and shard["hashes"] == []
    assert shard["column_sizes"] == [8] and shard["zip_data"] is None


# --- round trips ---------------------------------------------------------------------------------------
_value = {
    "bytes": st.binary(max_size=300), "str": st.text(max_size=40), "int": st.integers(-2**63, 2**63 - 1),
    "json": st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                         max_leaves=8),
    "float64": st.floats(allow_nan=False), "uint8": st.integers(0, 255).map(np.uint8),
    "str_int": st.integers(), "ndarray": st.integers(1, 5).flatmap(
        lambda n: st.lists(st.floats(-1e6, 1e6, width=32), min_size=n, max_size=n).map(
            lambda v: np.array(v, np.float32))),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cols=st.lists(st.sampled_from(sorted(_value)), min_size=1, max_size=5, unique=True).flatmap(
    lambda names: st.tuples(st.just(names), st.lists(st.tuples(*[_value[n] for n in names]), max_size=25))),
    compression=st.sampled_from([None, "zstd", "gz:1", "sample::zstd", "sample::br:1", "snappy"]),
    size_limit=st.sampled_from([None, 200, 1 << 12]))
def test_round_trip_property(write_mds, tmp_path_factory, cols, compression, size_limit):
    names, values = cols
    columns = {f"c_{n}": n for n in names}
    rows = [{f"c_{n}": v for n, v in zip(names, vals)} for vals in values]
    out = write_mds(str(tmp_path_factory.mktemp("rt") / "d"), rows, columns, compression=compression,
                    size_limit=size_limit)
    ds = MDSDataset(out)
    expect = [{k: (np.float64(v) if columns[k] == "float64" else v) for k, v in r.items()} for r in rows]
    _assert_rows(ds, expect)
    if "c_int" in columns and rows:
        assert ds.keys("c_int", cache=False).tolist() == [r["c_int"] for r in rows]
    lazy = MDSDataset(out, lazy=True)
    for i, r in enumerate(expect):
        assert same(r, dict(lazy[i])) == ""


def test_keys_vectorised_behind_variable_columns(write_mds, tmp_path):
    rows = list(mds_rows(60, 3))
    out = write_mds(str(tmp_path / "d"), rows, size_limit=1 << 14)
    ds = MDSDataset(out)
    assert len(ds.metas) > 2
    # "label" comes after variable-size "image" in column order: positions depend on each sample.
    assert ds.keys("label").tolist() == [int(r["label"]) for r in rows]
    assert ds.keys("score").tolist() == [float(r["score"]) for r in rows]
    assert ds.keys(lambda s: len(s["messages"][0]["content"])).tolist() == [
        len(r["messages"][0]["content"]) for r in rows]
    assert ds.keys("text", cache=False).tolist() == [r["text"] for r in rows]


def test_columns_subset_and_lazy(write_mds, tmp_path):
    rows = list(mds_rows(10, 4))
    out = write_mds(str(tmp_path / "d"), rows)
    ds = MDSDataset(out, columns=["id", "text"])
    assert ds[3] == {"id": 3, "text": rows[3]["text"]}
    assert [s["id"] for s in ds] == list(range(10))
    lazy = MDSDataset(out, lazy=True)[5]
    assert lazy["text"] == rows[5]["text"] and len(lazy) == 7 and sorted(lazy) == sorted(MDS_COLUMNS)
    with pytest.raises(KeyError):
        lazy["nope"]
    with pytest.raises(FormatError, match="no columns"):
        MDSDataset(out, columns=["nope"])[0]


def test_indexing_contract(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), mds_rows(5, 1))
    ds = MDSDataset(out)
    assert ds[-5]["id"] == 0 and ds[np.int64(2)]["id"] == 2
    for bad in (5, -6):
        with pytest.raises(IndexError):
            ds[bad]
    with pytest.raises(TypeError):
        ds[1.5]


def test_split_and_index_path(write_mds, tmp_path):
    write_mds(str(tmp_path / "d" / "train"), mds_rows(4, 2))
    assert len(MDSDataset(str(tmp_path / "d"), split="train")) == 4
    assert len(MDSDataset(str(tmp_path / "d" / "train" / "index.json"))) == 4


def test_shard_compressed_cache_is_cleaned_and_pickling(write_mds, tmp_path):
    rows = list(mds_rows(30, 5))
    out = write_mds(str(tmp_path / "d"), rows, compression="zstd", size_limit=1 << 14)
    assert not any(f.endswith(".mds") for f in os.listdir(out))
    ds = MDSDataset(out)
    cache = ds.cache_dir
    assert cache is not None  # made at construction: DataLoader workers share it
    _assert_rows(ds, rows)
    assert sorted(os.listdir(cache)) and all(f.endswith(".mds") for f in os.listdir(cache))
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets: shares the cache
    assert same(rows[29], clone[29]) == ""
    del clone
    gc.collect()
    assert os.path.isdir(cache)  # a copy does not remove the owner's cache
    ds.close()
    del ds
    gc.collect()
    assert not os.path.exists(cache)
    assert not any(f.endswith(".mds") for f in os.listdir(out))  # the dataset folder is untouched


def test_cache_dir_argument_is_kept(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), mds_rows(5, 5), compression="gz")
    cache = tmp_path / "cache"
    cache.mkdir()
    ds = MDSDataset(out, cache_dir=str(cache))
    assert ds[4]["id"] == 4
    assert pickle.loads(pickle.dumps(ds))[3]["id"] == 3
    del ds
    gc.collect()
    assert len(os.listdir(cache)) == 1


# --- writer arguments -----------------------------------------------------------------------------------
def test_writer_rejects_bad_arguments(tmp_path):
    cols = {"x": "int"}
    with pytest.raises(FormatError, match="2\\*\\*32"):
        MDSWriter(str(tmp_path / "a"), cols, size_limit=2**32)
    with pytest.raises(FormatError, match="2\\*\\*32"):
        MDSWriter(str(tmp_path / "a"), cols, size_limit="5gb")
    with pytest.raises(CodecError, match="not one of"):
        MDSWriter(str(tmp_path / "a"), cols, compression="zip")
    with pytest.raises(CodecError, match="levels"):
        MDSWriter(str(tmp_path / "a"), cols, compression="zstd:99")
    with pytest.raises(FormatError, match="sorted"):
        MDSWriter(str(tmp_path / "a"), cols, hashes=["sha1", "md5"])
    with pytest.raises(FormatError, match="not one of"):
        MDSWriter(str(tmp_path / "a"), cols, hashes=["crc7"])
    with pytest.raises(FormatError, match="unknown MDS encoding"):
        MDSWriter(str(tmp_path / "a"), {"x": "int128"})
    with pytest.raises(FormatError, match="dtype"):
        MDSWriter(str(tmp_path / "a"), {"x": "ndarray:bool"})
    w = MDSWriter(str(tmp_path / "b"), {"x": "int", "y": "ndarray:uint8:2"})
    with pytest.raises(FormatError, match="no column"):
        w.write({"x": 1})
    with pytest.raises(FormatError, match="must encode to 2 bytes"):
        w.write({"x": 1, "y": b"abc"})
    with pytest.raises(ValueError, match="shape"):
        w.write({"x": 1, "y": np.zeros(3, np.uint8)})
    # a value its column's encoding cannot hold: a FormatError naming the column (was the encoder's own
    # TypeError, OverflowError, UnicodeEncodeError)
    for bad, says in (("1", "takes int"), (2**63, "int")):
        with pytest.raises(FormatError, match=f"column 'x' \\(int\\).*{says}"):
            w.write({"x": bad, "y": np.zeros(2, np.uint8)})
    s = MDSWriter(str(tmp_path / "c"), {"n": "str_int", "t": "str"})
    for row in ({"n": True, "t": "a"}, {"n": 1, "t": "\ud800"}):  # "True" would not read back; a lone surrogate
        with pytest.raises(FormatError, match="column"):
            s.write(row)
    s.finish()
    w.finish()
    with pytest.raises(FileExistsError):
        MDSWriter(str(tmp_path / "b"), {"x": "int"})
    assert MDSWriter(str(tmp_path / "b"), {"x": "int"}, size_limit="64KiB", exist_ok=True).size_limit == 65536
    assert MDSWriter(str(tmp_path / "b"), {"x": "int"}, size_limit="64kb", exist_ok=True).size_limit == 64000


def test_shard_size_limit_of_2_32_is_a_clear_error(tmp_path, monkeypatch):
    # A 4 GiB shard is too big for a unit test: lower the ceiling the writer enforces.
    monkeypatch.setattr(mds_mod, "MAX_SHARD_BYTES", 1000)
    w = MDSWriter(str(tmp_path / "d"), {"b": "bytes"}, size_limit=None)
    w.write({"b": b"x" * 500})
    with pytest.raises(FormatError, match="2\\*\\*32") as e:
        w.write({"b": b"x" * 500})
    assert e.value.path == str(tmp_path / "d")


def test_first_sample_above_size_limit_matches_streaming(write_mds, tmp_path):
    """Streaming flushes an empty shard 0 when the first sample alone passes size_limit; so do we."""
    out = write_mds(str(tmp_path / "d"), [{"b": b"x" * 300}, {"b": b"y"}], {"b": "bytes"}, size_limit=200)
    ds = MDSDataset(out)
    assert [m.samples for m in ds.metas][:2] == [0, 1] and [s["b"] for s in ds] == [b"x" * 300, b"y"]


def test_pkl_refused_unless_allowed(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), [{"p": {"a": 1}, "x": 2}], {"p": "pkl", "x": "int"})
    with pytest.raises(FormatError, match="allow_unsafe_types"):
        MDSDataset(out)
    assert MDSDataset(out, columns=["x"])[0] == {"x": 2}
    assert MDSDataset(out, allow_unsafe_types=True)[0] == {"p": {"a": 1}, "x": 2}


# --- bad input -----------------------------------------------------------------------------------------
@pytest.fixture
def small(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), mds_rows(12, 9), size_limit=1 << 14)
    return out


def _shard0(folder):
    return os.path.join(folder, "shard.00000.mds")


def _set_index_bytes(folder, k, size):
    path = os.path.join(folder, "index.json")
    idx = _json(path)
    idx["shards"][k]["raw_data"]["bytes"] = size
    _save(path, json.dumps(idx).encode())


def _read_all(folder, **kw):
    ds = MDSDataset(folder, **kw)
    for i in range(len(ds)):
        ds[i]
    return list(ds)


def test_index_json_nested_too_deep_is_a_format_error_naming_it(small):
    path = os.path.join(small, "index.json")
    _save(path, b"[" * 100_000 + b"]" * 100_000)  # valid JSON, deeper than the parser recurses
    with pytest.raises(FormatError, match="not JSON") as e:
        MDSDataset(small)
    assert e.value.path == path


def test_truncated_shard(small):
    path = _shard0(small)
    data = _read(path)
    _save(path, data[:-10])
    with pytest.raises(FormatError) as e:
        _read_all(small)
    assert e.value.path == path and e.value.offset == len(data) - 10
    _set_index_bytes(small, 0, len(data) - 10)  # now the index agrees: the header catches it
    with pytest.raises(CorruptShardError, match="last sample offset") as e:
        _read_all(small)
    assert e.value.path == path and e.value.offset is not None


def test_lying_count(small):
    path = _shard0(small)
    data = bytearray(_read(path))
    data[0:4] = struct.pack("<I", 10**6)
    _save(path, data)
    with pytest.raises(CorruptShardError, match="holds 1000000 samples") as e:
        _read_all(small)
    assert (e.value.path, e.value.offset) == (path, 0)


def test_lying_offsets(small):
    path = _shard0(small)
    orig = _read(path)
    (n,) = struct.unpack_from("<I", orig)
    offs = list(struct.unpack_from(f"<{n + 1}I", orig, 4))
    cases = [(2, offs[1] - 1, "below the previous"), (0, 2, "first sample offset"),
             (n, offs[n] + 5, "not the shard size")]
    for k, value, msg in cases:
        data = bytearray(orig)
        struct.pack_into("<I", data, 4 + 4 * k, value)
        _save(path, data)
        with pytest.raises(CorruptShardError, match=msg) as e:
            _read_all(small)
        assert e.value.path == path and e.value.offset == (4 + 4 * k if k else 4)
    # Monotonic but shifted: the sample boundaries move, so column sizes no longer fit the sample.
    data = bytearray(orig)
    struct.pack_into("<I", data, 4 + 4 * 2, offs[2] + 7)
    _save(path, data)
    with pytest.raises(CorruptShardError, match="lying column sizes or offsets") as e:
        _read_all(small)
    assert e.value.path == path and offs[1] <= e.value.offset <= offs[3]


def test_index_names_missing_shard_or_wrong_size(small):
    os.rename(_shard0(small), _shard0(small) + ".gone")
    with pytest.raises(FormatError, match="missing") as e:
        MDSDataset(small)
    assert e.value.path == os.path.join(small, "index.json")
    os.rename(_shard0(small) + ".gone", _shard0(small))
    _set_index_bytes(small, 0, os.path.getsize(_shard0(small)) + 3)
    with pytest.raises(FormatError, match="index.json says") as e:
        MDSDataset(small)
    assert e.value.path == _shard0(small) and e.value.offset == os.path.getsize(_shard0(small))


def test_bad_index_json(tmp_path, small):
    path = os.path.join(small, "index.json")
    good = _read(path).decode()
    for text, msg in [("{not json", "not JSON"), ('{"version": 3, "shards": []}', "not an MDS index"),
                      (good.replace('"samples": ', '"samples": -', 1), "negative"),
                      (good.replace('"shard.00000.mds"', '"../x.mds"', 1), "leaves the dataset folder"),
                      (good.replace('"bytes"', '"ndarray:int"', 1), "dtype 'int' is not one of"),
                      (good.replace('"bytes"', '"blob"', 1), "unknown MDS encoding"),
                      (good.replace('"compression": null', '"compression": "lzw"', 1), "not one of"),
                      (re.sub(r'"column_names": \["(\w+)"', r'"column_names": [["\1"]', good, count=1),
                       "'column_names' holds"),
                      (re.sub(r'"column_encodings": \["', r'"column_encodings": [7, "', good, count=1)
                       .replace('"column_names": [', '"column_names": ["extra", ', 1)
                       .replace('"column_sizes": [', '"column_sizes": [8, ', 1), "'column_encodings' holds 7")]:
        _save(path, text.encode())
        with pytest.raises(TorchforgeError, match=msg) as e:
            MDSDataset(small)
        assert e.value.path == path
    with pytest.raises(FileNotFoundError, match="no MDS index.json") as e:
        MDSDataset(str(tmp_path))
    assert isinstance(e.value, TorchforgeError)


def test_corrupt_compressed_sample(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), mds_rows(8, 6), compression="sample::zstd")
    path = _shard0(out)
    data = bytearray(_read(path))
    (n,) = struct.unpack_from("<I", data)
    offs = struct.unpack_from(f"<{n + 1}I", data, 4)
    data[offs[3] + 6: offs[3] + 14] = b"\xff" * 8  # inside sample 3's zstd frame
    _save(path, data)
    ds = MDSDataset(out)
    assert ds[2]["id"] == 2
    with pytest.raises(TorchforgeError) as e:
        ds[3]
    assert e.value.path == path and e.value.offset == offs[3]
    assert isinstance(e.value, (CodecError, CorruptShardError))


def test_corrupt_shard_level_zstd(write_mds, tmp_path):
    out = write_mds(str(tmp_path / "d"), mds_rows(8, 6), compression="zstd", hashes=["sha1"])
    path = _shard0(out) + ".zstd"
    orig = _read(path)
    data = bytearray(orig)
    data[4:10] = b"\xff" * 6  # the frame header
    _save(path, data)
    with pytest.raises(CodecError) as e:
        MDSDataset(out)[0]
    assert e.value.path == path and e.value.offset == 0
    # Random image bytes sit in raw zstd blocks, which carry no checksum: the sha1 in index.json catches it.
    data = bytearray(orig)
    data[len(data) // 2: len(data) // 2 + 16] = bytes(16)
    _save(path, data)
    with pytest.raises(CorruptShardError, match="sha1") as e:
        MDSDataset(out)[0]
    assert e.value.path == path and e.value.offset == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
       compression=st.sampled_from([None, "sample::zstd"]))
def test_bit_flips_never_escape_as_untyped_errors(write_mds, tmp_path_factory, flips, compression):
    out = write_mds(str(tmp_path_factory.mktemp("flip") / "d"), mds_rows(6, 8), compression=compression)
    path = _shard0(out)
    data = bytearray(_read(path))
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    _save(path, data)
    try:
        _read_all(out)
    except TorchforgeError as e:
        assert e.path == path and e.offset is not None and 0 <= e.offset <= len(data)


def test_json_column_keeps_nan_and_big_ints(write_mds, tmp_path):
    rows = [{"j": [float("nan"), 2**70, "x"]}]
    ds = MDSDataset(write_mds(str(tmp_path / "d"), rows, {"j": "json"}))
    got = ds[0]["j"]
    assert np.isnan(got[0]) and got[1:] == [2**70, "x"]


def test_image_column_decodes_to_pil(write_mds, tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")

    img = Image.new("L", (3, 2), 7)
    ds = MDSDataset(write_mds(str(tmp_path / "d"), [{"p": img, "q": io.BytesIO(b"raw").getvalue()}],
                              {"p": "png", "q": "bytes"}))
    assert np.array_equal(np.asarray(ds[0]["p"]), np.asarray(img)) and ds[0]["q"] == b"raw"
    shutil.rmtree(str(tmp_path / "d"))


def test_dataloader_spawn_workers_share_the_decompressed_cache(write_mds, tmp_path):
    """Workers get a pickled dataset (no maps): they reopen shards and reuse the owner's cache folder."""
    import torch.utils.data

    rows = list(mds_rows(24, 10))
    out = write_mds(str(tmp_path / "d"), rows, compression="zstd", size_limit=1 << 14)
    ds = MDSDataset(out, columns=["id", "label"])
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = sorted(int(s["id"]) for s in loader)
    assert got == list(range(24))
    assert sorted(os.listdir(ds.cache_dir)) == sorted(f"{k:05}-{m.raw_basename}" for k, m in enumerate(ds.metas))


def test_importing_torchforge_never_imports_streaming():
    """Streaming is an optional extra: even torchforge.streaming imports it only in patch()."""
    code = ("import sys, torchforge, torchforge.streaming, torchforge.datasets.mds, torchforge.formats.mds_reader\n"
            "torchforge.MDSDataset, torchforge.MDSWriter, torchforge.streaming.is_patched()\n"
            "assert not [m for m in sys.modules if m == 'streaming' or m.startswith('streaming.')], 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_json_columns_keep_integers_beyond_64_bits_exact(tmp_path):
    """orjson reads an integer beyond 64 bits as a float: such values are read by json.loads, exactly,
    as Streaming reads them (and as they were written)."""
    values = [{"id": 2**64}, {"id": -2**63 - 1}, {"n": [12345678901234567890123, 1.5, "9" * 30]},
              {"ok": 2**64 - 1}, {"f": 0.1234567890123456789}, {"text": "plain"}]
    with MDSWriter(out=str(tmp_path / "m"), columns={"j": "json"}) as w:
        for v in values:
            w.write({"j": v})
    got = [s["j"] for s in MDSDataset(str(tmp_path / "m"))]
    assert got == values and all(type(a) is type(b) for g, v in zip(got, values) for a, b in zip(g.values(), v.values()))
    assert type(got[2]["n"][0]) is int and type(got[4]["f"]) is float


def test_scalar_encodings_refuse_values_out_of_their_range_instead_of_wrapping_or_overflowing_to_inf():
    from torchforge.formats.mds_encodings import get_encoding

    for name, value in (("int16", np.int64(70000)), ("uint8", np.int64(-1)), ("float16", 70000), ("float32", 1e40)):
        with pytest.raises(OverflowError, match=name):
            get_encoding(name).encode(value)
    for name, value in (("float32", 0.1), ("float32", float("inf")), ("float64", 2**53 + 1), ("int64", True)):
        get_encoding(name).encode(value)  # rounding to the type's precision, and infinities, are the type's


def test_a_rewrite_with_exist_ok_replaces_the_dataset_and_a_dead_one_leaves_no_index(tmp_path):
    """MDSWriter(exist_ok=True) left the old dataset's files: a stale decompressed shard of the new shard's
    size (one a reader leaves beside shard.00000.mds.gz) was read for the new data, and a rewrite that
    died kept the old index over partly new shards (read as a mix). Streaming's writer empties the folder."""
    out = tmp_path / "ds"
    with MDSWriter(str(out), {"x": "int"}) as w:  # uncompressed: shard.00000.mds, as a decompressed copy
        for i in range(10):
            w.write({"x": i})
    (out / "README").write_text("kept")
    (out / "shard.20240101.log").write_text("kept: not a name MDS writers give")
    with MDSWriter(str(out), {"x": "int"}, compression="gz", exist_ok=True) as w:
        for i in range(10):
            w.write({"x": 100 + i})
    assert sorted(os.listdir(out)) == ["README", "index.json", "shard.00000.mds.gz", "shard.20240101.log"]
    assert [int(s["x"]) for s in MDSDataset(str(out))] == list(range(100, 110))
    with pytest.raises(RuntimeError, match="died"), MDSWriter(str(out), {"x": "int"}, size_limit=64,
                                                               exist_ok=True) as w:
        for i in range(20):
            w.write({"x": 1000 + i})
        raise RuntimeError("died")
    assert "index.json" not in os.listdir(out) and len(os.listdir(out)) > 2  # shards flushed, no index
    with pytest.raises(NotFoundError):
        MDSDataset(str(out))
