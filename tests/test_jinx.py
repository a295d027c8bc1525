"""JINX: fixtures written by MLDataForge 0.6.10 read back equal; writer/reader round trips; lazy samples."""
from __future__ import annotations

import base64
import json
import os
import pickle
from collections.abc import Mapping

import numpy as np
import orjson
import pytest
import torch
from expected import rich, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchforge
from torchforge.datasets.base import open_dataset
from torchforge.datasets.jinx import JinxDataset
from torchforge.errors import FormatError, TorchforgeError
from torchforge.formats import jinx_reader
from torchforge.formats.jinx import JinxShard, JinxWriter
from torchforge.formats.jinx_codec import decode_text, encode_text
from torchforge.formats.values import ByteView
from torchforge.lazy import LazySample, materialize

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "interop")

with open(os.path.join(FIXTURES, "manifest.json")) as _f:
    MANIFEST = json.load(_f)
JINX_FIXTURES = sorted(k for k, v in MANIFEST.items() if v["format"] == "jinx")


# --- fixtures written by MLDataForge -------------------------------------------------------------------
@pytest.mark.parametrize("name", JINX_FIXTURES)
@pytest.mark.parametrize("lazy", [True, False])
def test_fixture_reads_back_equal(name, lazy):
    m = MANIFEST[name]
    ds = torchforge.JinxDataset(os.path.join(FIXTURES, name), lazy=lazy)
    expected = list(rich(m["n"], m["seed"], m["tensors"]))
    assert len(ds) == m["n"]
    for i, exp in enumerate(expected):
        assert same(exp, ds[i]) == "", (name, i)
    for exp, got in zip(expected, ds, strict=True):
        assert same(exp, got) == ""
    assert same(expected[-1], ds[-1]) == ""


def test_fixture_layout_facts():
    """What MLDataForge writes: raw uint64 index (not np.save), sidecar index past the threshold."""
    shard = JinxShard(os.path.join(FIXTURES, "jinx-b64-multishard", "shard-00003.jinx"))
    assert shard.split == "train" and shard.footer["shard_next"].endswith("shard-00004.jinx")
    assert shard.offsets[0] == 0 and len(shard.offsets) == shard.num_samples + 1
    inline = JinxShard(os.path.join(FIXTURES, "jinx-a85-zst-inline", "shard-00000.jinx"))
    assert inline.footer["index_compression"] == "zst" and inline.encoding == "a85"


def test_split_filter_and_open_dataset():
    folder = os.path.join(FIXTURES, "jinx-b64-multishard")
    assert len(JinxDataset(folder, split="train")) == 300
    test = JinxDataset(folder, split="test")
    assert len(test) == 0 and test.shard_files() == []  # key caches are per selection
    ds = open_dataset(folder)
    assert isinstance(ds, JinxDataset) and len(ds) == 300
    assert len(ds.shard_files()) == 28  # 14 shards + 14 sidecars


def test_fixture_sidecar_values_are_zero_copy_views():
    ds = JinxDataset(os.path.join(FIXTURES, "jinx-b64-zst-binx"))
    m = MANIFEST["jinx-b64-zst-binx"]
    for i, exp in enumerate(rich(m["n"], m["seed"])):
        img = ds[i]["image"]
        if len(exp["image"]) > 512 and isinstance(img, ByteView):
            assert not img.flags.writeable and img == exp["image"]
            assert img.base is not None  # a view into the sidecar's map, not a copy
            break
    else:  # pragma: no cover - the fixture has incompressible images over the threshold
        pytest.fail("no sidecar image found")


def test_sidecar_arrays_view_the_map_unless_the_shard_says_copies(tmp_path):
    """A remote dataset under a cache_limit sets zero_copy=False on its shards, so a sample's arrays do not
    keep the shard mapped (a batch drawn from many shards would hold them all against the limit)."""
    want = np.arange(4096, dtype=np.float32)
    with JinxWriter(tmp_path, compression=None, binary_threshold=64) as w:
        w.write({"a": want})
    (path,) = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n.endswith(".jinx")]
    for zero_copy in (True, False):
        shard = JinxShard(path)
        shard.zero_copy = zero_copy
        got = shard.sample(0, lazy=False)["a"]
        assert np.array_equal(got, want)
        assert got.flags.owndata is not zero_copy, zero_copy  # a view into the sidecar's map, or its own copy
        shard.close()


# --- round trips ----------------------------------------------------------------------------------------
def _check_equal(samples, ds):
    assert len(ds) == len(samples)
    for i, exp in enumerate(samples):
        assert same(exp, ds[i]) == "", i
    for exp, got in zip(samples, ds, strict=True):
        assert same(exp, got) == ""


OPTIONS = [
    {},
    {"encoding": "b64", "binary_threshold": 512, "shard_size": 30_000, "split": "train"},
    {"encoding": "hex", "compression": None, "index_compression": None},
    {"encoding": "b64", "compression": "gzip", "index_compression": "bz2", "compress_threshold": 16},
    {"encoding": "a85", "compression": "xz", "binary_threshold": 0, "compress_ratio": 1.0},
    {"encoding": "b64", "compression": "zstd:9", "shard_size": None},
    {"encoding": "b64", "compression": "lz4", "binary_threshold": 64},
    {"encoding": "b64", "compression": "snappy"},
    {"encoding": "b64", "compression": "br", "ext_sep": ":"},
    # '_' begins 'index_compression', a footer field the reader took for a second index
    {"compression": "zstd", "index_compression": "zstd", "compress_threshold": 16, "ext_sep": "_"},
    {"binary_threshold": 64, "ext_sep": "_"},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_round_trip_rich(write_jinx, tmp_path, opts):
    samples = list(rich(60, 11, tensors=True))
    path = tmp_path / ("one.jinx" if opts.get("shard_size", 1) is None else "ds")
    w = write_jinx(path, samples, **opts)
    if opts.get("shard_size") == 30_000:
        assert len(w.files) > 1
    for lazy in (True, False):
        _check_equal(samples, JinxDataset(path, lazy=lazy, split=opts.get("split")))


def test_empty_dataset_and_empty_values(write_jinx, tmp_path):
    write_jinx(tmp_path / "empty", [])
    ds = JinxDataset(tmp_path / "empty")
    assert len(ds) == 0 and list(ds) == []
    with pytest.raises(IndexError):
        ds[0]
    samples = [{"b": b"", "s": "", "d": {}, "l": [], "a": np.zeros(0, np.int16), "n": None}]
    write_jinx(tmp_path / "e", samples, encoding="b64", compress_threshold=0, binary_threshold=0)
    _check_equal(samples, JinxDataset(tmp_path / "e"))


def test_thresholds_follow_mldataforge(write_jinx, tmp_path):
    """Strings under the limit stay plain; compression only where it pays; offload past the threshold."""
    long_text = "abc" * 200
    noise = os.urandom(3000)
    write_jinx(tmp_path / "t", [{"short": "x" * 127, "long": long_text, "noise": noise, "small": b"ab"}],
               encoding="b64", binary_threshold=2048)
    line = orjson.loads((tmp_path / "t" / "shard-00000.jinx").read_bytes().split(b"\n", 1)[0])
    assert line["short"] == "x" * 127
    assert "long.str.zst" in line  # compressible: zst, inline, b64 text
    assert line["noise.raw.bin"] == {"offset": 0, "length": 3000}  # incompressible: raw, to the sidecar
    assert base64.b64decode(line["small.raw"]) == b"ab"


def _values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                        st.floats(allow_nan=False, allow_infinity=False), st.text())
    leaves = st.one_of(
        scalars,
        st.binary(max_size=300),
        st.text(min_size=100, max_size=400),
        st.builds(lambda d, xs: np.asarray(xs, dtype=d),
                  st.sampled_from(["int8", "uint16", "int32", "int64", "float32", "float64", "bool"]),
                  st.lists(st.integers(0, 100), max_size=20)),
        st.builds(lambda d, x: np.dtype(d).type(x), st.sampled_from(["int8", "uint32", "int64", "float16",
                                                                     "float32", "float64", "bool"]),
                  st.integers(0, 100)),
        st.builds(lambda xs: torch.tensor(xs, dtype=torch.float32), st.lists(st.floats(-1e6, 1e6), max_size=8)),
    )
    keys = st.text(min_size=0, max_size=8).filter(lambda k: "." not in k)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.dictionaries(keys, inner, max_size=4),
                                st.lists(st.one_of(scalars, st.dictionaries(keys, inner, max_size=3)), max_size=4)),
        max_leaves=12,
    )


_samples = st.lists(st.dictionaries(st.text(max_size=8).filter(lambda k: "." not in k), _values(), max_size=6),
                    max_size=6)
_options = st.fixed_dictionaries({}, optional={
    "compression": st.sampled_from([None, "zst", "gz", "bz2", "xz", "lz4", "snappy", "br"]),
    "index_compression": st.sampled_from([None, "zst", "gz"]),
    "compress_threshold": st.integers(0, 300),
    "compress_ratio": st.sampled_from([0.1, 0.67, 1.0, 2.0]),
    "encoding": st.sampled_from(["a85", "b64", "hex"]),
    "binary_threshold": st.one_of(st.none(), st.integers(0, 600)),
    "shard_size": st.sampled_from([None, 0, 200, 2000, 2**26]),
    "split": st.sampled_from([None, "train"]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(samples=_samples, opts=_options)
def test_round_trip_property(write_jinx, tmp_path_factory, samples, opts):
    path = tmp_path_factory.mktemp("rt") / ("x.jinx" if opts.get("shard_size", 1) is None else "ds")
    write_jinx(path, samples, **opts)
    for lazy in (True, False):
        ds = JinxDataset(path, lazy=lazy, split=opts.get("split"))
        _check_equal(samples, ds)
        if lazy and samples:
            assert same(samples[0], materialize(ds[0])) == ""


@settings(max_examples=80, deadline=None)
@given(data=st.one_of(st.binary(max_size=600), st.builds(lambda a, b: a + bytes(b), st.binary(max_size=300),
                                                        st.integers(0, 300))),
       encoding=st.sampled_from(["a85", "b64", "hex"]))
def test_text_encodings_round_trip(data, encoding):
    assert decode_text(encode_text(data, encoding), encoding) == data
    if encoding == "a85":  # the vectorized coder agrees with the standard library
        assert encode_text(data, encoding) == base64.a85encode(data).decode()
        assert decode_text(base64.a85encode(data).decode(), encoding) == data


# --- lazy samples ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lazy_ds(write_jinx, tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy") / "ds"
    samples = list(rich(20, 5, tensors=True))
    write_jinx(path, samples, encoding="b64", binary_threshold=256)
    return JinxDataset(path), samples


def test_lazy_sample_is_a_read_only_mapping(lazy_ds):
    ds, samples = lazy_ds
    s = ds[3]
    assert isinstance(s, LazySample) and isinstance(s, Mapping)
    assert set(s) == set(samples[3]) and len(s) == len(samples[3])
    assert "image" in s and "image.raw.bin" not in s and "nope" not in s
    with pytest.raises(KeyError):
        s["image.raw"]
    with pytest.raises(KeyError):
        s["nope"]
    assert s.get("nope", 7) == 7
    assert isinstance(s["meta"], LazySample) and isinstance(s["messages"][0], LazySample)
    assert s["meta"] is s["meta"]  # decoded once, then cached
    with pytest.raises(TypeError):
        s["id"] = 1  # type: ignore[index]
    assert "image" in repr(s)


def test_lazy_sample_decodes_only_what_is_read(lazy_ds, monkeypatch):
    ds, _ = lazy_ds
    shard = ds.shards[0]
    calls = []
    real = shard.decoder

    def counting(raw_key, offset):  # every decode goes through a decoder the shard hands out
        dec = real(raw_key, offset)
        return lambda src, v, o: calls.append(raw_key) or dec(src, v, o)

    monkeypatch.setattr(shard, "plans", {})
    monkeypatch.setattr(shard, "_decoders", {})
    monkeypatch.setattr(shard, "decoder", counting)
    s = ds[1]
    _ = s["id"], s["text"], s["tokens"]
    assert calls == []
    _ = s["arr"], s["arr"]
    assert calls == ["arr.npy"]


def test_lazy_sample_pickles_as_plain_dict(lazy_ds):
    ds, samples = lazy_ds
    s = ds[2]
    _ = s["meta"]  # partly decoded
    back = pickle.loads(pickle.dumps(s))
    assert type(back) is dict and type(back["meta"]) is dict and type(back["messages"][0]) is dict
    assert same(samples[2], back) == ""
    plain = s.materialize()
    assert type(plain["image"]) is bytes and same(samples[2], plain) == ""


def test_eager_mode_returns_plain_values(lazy_ds):
    ds, samples = lazy_ds
    eager = JinxDataset(ds.shards[0].path, lazy=False)
    s = eager[4]
    assert type(s) is dict and type(s["image"]) is bytes and type(s["meta"]) is dict
    assert isinstance(s["emb"], torch.Tensor) and isinstance(s["score"], np.float32)
    assert same(samples[4], s) == ""


def test_dataset_pickles_without_maps(lazy_ds):
    ds, samples = lazy_ds
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # paths and counts: no maps, no index (the shard holds ~80 KB)
    clone = pickle.loads(blob)
    assert same(samples[7], clone[7]) == "" and len(clone) == len(ds)


def test_keys_pass_over_a_text_field(lazy_ds):
    ds, samples = lazy_ds
    keys = ds.keys("meta.source", cache=False)
    assert list(keys) == [s["meta"]["source"] for s in samples]


def test_key_pass_samples_stay_valid_when_the_key_function_keeps_them(lazy_ds):
    ds, samples = lazy_ds
    kept = {}

    def key(s):  # keeps every third sample, and a bound method of every fifth
        if s["id"] % 3 == 0:
            kept[s["id"]] = s
        if s["id"] % 5 == 0:
            kept[-1 - s["id"]] = s.get
        return s["meta"]["source"]

    assert ds.key_values(key) == [s["meta"]["source"] for s in samples]
    assert len(kept) == len(range(0, len(samples), 3)) + len(range(0, len(samples), 5))
    for i, s in kept.items():
        if i >= 0:
            assert same(samples[i], s) == "", i
        else:
            assert s("id") == -1 - i
    assert ds.key_values(lambda s: s) is not None  # the samples themselves as keys
    assert [same(exp, got) for exp, got in zip(samples, ds.key_values(lambda s: s))] == [""] * len(samples)


def test_orjson_line_parser_reads_the_same(lazy_ds, monkeypatch):
    """Without msgspec, lines are parsed by orjson (from bytes): same samples, same key pass."""
    ds, samples = lazy_ds
    monkeypatch.setattr(jinx_reader, "LINE_PARSER", (orjson.loads, False))
    other = JinxDataset([shard.path for shard in ds.shards])
    assert all(shard.parse is orjson.loads and type(shard.lines) is not memoryview for shard in other.shards)
    _check_equal(samples, other)
    assert other.key_values(lambda s: s["meta"]["source"]) == [s["meta"]["source"] for s in samples]


def test_writer_accepts_lazy_samples(write_jinx, tmp_path, lazy_ds):
    ds, samples = lazy_ds
    write_jinx(tmp_path / "copy", list(ds), encoding="hex", binary_threshold=100)
    _check_equal(samples, JinxDataset(tmp_path / "copy"))


# --- writer input checks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sample, match", [
    ({"a.b": 1}, "separator"),
    ({1: 1}, "keys must be strings"),
    ({"x": [b"bytes in a list"]}, "inside a list"),
    ({"x": [np.float32(1)]}, "inside a list"),
    ({"x": {1, 2}}, "cannot store"),
    ({"x": float("nan")}, "NaN"),
    ({"x": np.float32("inf")}, "infinity"),
    ({"x": 2**70}, "64 bits"),
    ({"x": np.array([object()])}, "pickle"),
    ({"x": np.complex64(1)}, "dtype complex64"),
])
def test_writer_refuses_what_jinx_cannot_hold(tmp_path, sample, match):
    with JinxWriter(tmp_path / "w") as w:
        with pytest.raises(FormatError, match=match):
            w.write(sample)
        w.write({"ok": 1})
    assert [dict(s) for s in JinxDataset(tmp_path / "w")] == [{"ok": 1}]


@pytest.mark.parametrize("opts", [{"encoding": "b85"}, {"compression": "rar"}, {"shard_size": -1},
                                  {"compress_ratio": 0}, {"binary_threshold": "1k"}, {"compression": "zst:x"}])
def test_writer_checks_options(tmp_path, opts):
    with pytest.raises(TorchforgeError):
        JinxWriter(tmp_path / "w", **opts)


def test_dataset_checks_arguments(tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        JinxDataset(os.path.join(FIXTURES, "jinx-a85-zst-inline"), on_error="ignore")
    with pytest.raises(FileNotFoundError, match="no such") as e:
        JinxDataset(tmp_path / "missing")
    assert isinstance(e.value, TorchforgeError) and e.value.path == str(tmp_path / "missing")
    with pytest.raises(FormatError, match="given"):
        JinxDataset([])
    os.makedirs(tmp_path / "nothing")
    with pytest.raises(FormatError, match="no shard"):
        JinxDataset(tmp_path / "nothing")


def test_many_paths_concatenate(write_jinx, tmp_path):
    a, b = list(rich(5, 1)), list(rich(7, 2))
    write_jinx(tmp_path / "a", a)
    write_jinx(tmp_path / "b.jinx", b, shard_size=None)
    ds = JinxDataset([tmp_path / "a", str(tmp_path / "b.jinx")])
    _check_equal(a + b, ds)
    assert ds.locate(6) == (1, 1)


def test_writer_refuses_a_folder_with_shards(write_jinx, tmp_path):
    write_jinx(tmp_path / "d", list(rich(30, 1)), shard_size=20_000, binary_threshold=256)
    assert len(os.listdir(tmp_path / "d")) > 2
    with pytest.raises(FormatError, match="overwrite=True"):
        JinxWriter(tmp_path / "d")
    write_jinx(tmp_path / "d", [{"id": 1}], overwrite=True)
    assert sorted(os.listdir(tmp_path / "d")) == ["shard-00000.jinx"]
    assert [dict(s) for s in JinxDataset(tmp_path / "d")] == [{"id": 1}]


@pytest.mark.parametrize("shard_size", [20_000, None])
def test_a_with_block_that_raises_leaves_no_dataset_that_reads_as_complete(tmp_path, shard_size):
    path = tmp_path / ("d" if shard_size else "one.jinx")
    with pytest.raises(RuntimeError, match="job died"), \
            JinxWriter(path, shard_size=shard_size, binary_threshold=256) as w:
        for s in rich(40, 2):  # several finished shards, then the failure
            w.write(s)
        raise RuntimeError("job died")
    assert not (os.path.exists(path) and os.path.isfile(path))
    assert not shard_size or os.listdir(path) == []  # every shard and sidecar it wrote is gone
    with pytest.raises(TorchforgeError):
        open_dataset(path)
    with JinxWriter(tmp_path / "ok", shard_size=20_000) as w:  # without an error: finished as before
        w.write({"id": 1})
    assert [dict(s) for s in JinxDataset(tmp_path / "ok")] == [{"id": 1}]


def test_plans_stay_bounded_over_records_keyed_by_ids(write_jinx, tmp_path, monkeypatch):
    from torchforge import lazy

    monkeypatch.setattr(lazy, "MAX_PLANS", 8)
    # bytes values are stored under keys with extensions ("user3.raw.b64", say), which get plans
    samples = [{"blob": bytes([i]), "by_user": {f"user{i}": bytes([i, i])}} for i in range(30)]
    write_jinx(tmp_path / "ds", samples)
    ds = JinxDataset(tmp_path / "ds")
    got = [(bytes(s["blob"]), bytes(s["by_user"][f"user{i}"])) for i, s in enumerate(ds)]
    assert got == [(bytes([i]), bytes([i, i])) for i in range(30)]  # keys past the bound are still found
    plans = ds.shards[0].plans
    assert len(plans) == 8 and "blob" in plans  # a key seen before the bound keeps its plan


@pytest.mark.parametrize("sep", ["n", "1", "a."])
def test_a_separator_with_a_letter_or_digit_is_refused_it_would_split_extension_names(tmp_path, sep):
    with pytest.raises(FormatError, match="letter or digit"):
        JinxWriter(tmp_path / "ds", ext_sep=sep)
    assert not (tmp_path / "ds").exists()


def test_stored_keys_with_extensions_are_not_keys_whatever_the_separator(write_jinx, tmp_path):
    for sep in (".", "|"):
        write_jinx(tmp_path / f"ds{ord(sep)}", [{"a": np.int32(5), "b": 7}], ext_sep=sep)
        ds = JinxDataset(tmp_path / f"ds{ord(sep)}")
        s = ds[0]
        raw_key = f"a{sep}int32"
        with open(ds.shards[0].path, "rb") as f:
            line = orjson.loads(f.readline())
        assert line == {raw_key: 5, "b": 7}  # stored under its extension, as a plain JSON number
        assert s["a"] == 5 and s["b"] == 7
        assert raw_key not in s
        with pytest.raises(KeyError):
            s[raw_key]  # the stored key, extension included, is not a key of the sample


def test_a_nested_record_of_plain_values_is_a_plain_dict_fresh_for_every_read(write_jinx, tmp_path):
    samples = [{"id": 0, "turns": [{"role": "user", "content": "hi"}, {"role": "bot", "blob": b"\x00" * 300}],
                "meta": {"lang": "en", "n": 2}}]
    write_jinx(tmp_path / "ds", samples, encoding="b64", binary_threshold=256)
    ds = JinxDataset(tmp_path / "ds")
    s = ds[0]
    assert type(s["turns"][0]) is dict and type(s["meta"]) is dict  # nothing in them to decode
    assert isinstance(s["turns"][1], LazySample) and s["turns"][1]["blob"] == b"\x00" * 300
    s["turns"][0]["content"] = "changed"
    s["meta"]["n"] = 3
    again = ds[0]
    assert again["turns"][0] == {"role": "user", "content": "hi"} and again["meta"] == {"lang": "en", "n": 2}


def test_a_tensor_view_is_stored_with_its_own_values_not_its_whole_storage(tmp_path):
    """torch.save writes a view's whole storage: one row of a million-element column would cost 4 MB."""
    big = torch.arange(1_000_000, dtype=torch.float32)
    col = big.view(1000, 1000)
    samples = [{"x": big[i]} for i in range(5)] + [{"x": col[:, 7]}, {"x": col[3:5].t()}, {"x": torch.ones(3)}]
    with JinxWriter(str(tmp_path / "j"), compression=None) as w:
        for s in samples:
            w.write(s)
    assert sum(f.stat().st_size for f in (tmp_path / "j").iterdir()) < 60_000
    for s, got in zip(samples, JinxDataset(str(tmp_path / "j"), lazy=False)):
        assert torch.equal(got["x"], s["x"]) and got["x"].dtype == s["x"].dtype
        assert got["x"].untyped_storage().nbytes() == s["x"].numel() * 4


def test_a_long_string_that_is_not_utf8_is_a_format_error_naming_its_field(tmp_path):
    """A string past the short limit was encoded by itself: a lone surrogate raised a bare UnicodeEncodeError
    naming no field (a short one was a FormatError)."""
    from torchforge.errors import FormatError
    from torchforge.formats.jinx import JinxWriter

    for n in (1, 500):
        want = "not valid UTF-8" if n == 1 else "field 'text': .*not valid UTF-8"
        with pytest.raises(FormatError, match=want), JinxWriter(str(tmp_path / f"o{n}")) as w:
            w.write({"id": 1, "meta": {"text": "\ud800" * n}})
