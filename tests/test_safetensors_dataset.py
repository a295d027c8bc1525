"""SafetensorsDataset / SafetensorsShardWriter: round trips (fixed and ragged), detection, bad shards."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch as st
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from torchforge.datasets.base import open_dataset
from torchforge.datasets.safetensors import SafetensorsDataset, SafetensorsShardWriter, detect, shard_order
from torchforge.errors import CorruptShardError, FormatError, TorchforgeError
from torchforge.formats.safetensors import save_safetensors


def _samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(0, 6, (1,), generator=g))
        out.append({"ids": torch.randint(0, 1000, (k,), generator=g),          # ragged 1-D
                    "emb": torch.randn(k, 3, generator=g).to(torch.bfloat16),  # ragged 2-D
                    "img": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),  # fixed
                    "label": i % 5,                                              # python int -> 0-dim
                    "w": np.float32(i) / 2})                                     # numpy scalar
    return out


def _check(ds, samples):
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        got = ds[i]
        assert set(got) == set(s)
        for k, v in s.items():
            v = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), (i, k)


def test_round_trip_fixed_and_ragged_across_shards(tmp_path):
    samples = _samples(53)
    with SafetensorsShardWriter(tmp_path / "d", samples_per_shard=10) as w:
        for s in samples:
            w.write(s)
    assert len(w.files) == 6 and w.samples == 53
    ds = SafetensorsDataset(tmp_path / "d")
    _check(ds, samples)
    assert ds[-1]["label"].item() == 52 % 5 and ds.columns == ["emb", "ids", "img", "label", "w"]
    with pytest.raises(IndexError):
        ds[53]
    # the shards are plain safetensors files: ragged columns as flat + offsets
    first = st.load_file(w.files[0])
    assert first["ids.offsets"].tolist()[0] == 0 and first["ids.offsets"].shape == (11,)
    assert first["img"].shape == (10, 2, 2) and "img.offsets" not in first
    assert np.array_equal(ds.keys("label"), np.array([i % 5 for i in range(53)]))


def test_views_are_zero_copy(tmp_path):
    with SafetensorsShardWriter(tmp_path, samples_per_shard=100) as w:
        for s in _samples(20):
            w.write(s)
    ds = SafetensorsDataset(tmp_path, zero_copy=True)
    a, b = ds[3], ds[4]
    assert a["img"].untyped_storage().data_ptr() == b["img"].untyped_storage().data_ptr()
    assert b["img"].data_ptr() - a["img"].data_ptr() == 4
    assert a["ids"].untyped_storage().data_ptr() == b["ids"].untyped_storage().data_ptr()


def test_open_dataset_detects_folder_and_file(tmp_path):
    with SafetensorsShardWriter(tmp_path / "d", max_shard_size=200) as w:
        for s in _samples(12, 3):
            w.write(s)
    assert len(w.files) > 1 and detect(str(tmp_path / "d")) and detect(w.files[0])
    ds = open_dataset(tmp_path / "d")
    assert isinstance(ds, SafetensorsDataset)
    _check(ds, _samples(12, 3))
    assert isinstance(open_dataset(w.files[0]), SafetensorsDataset)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "ck" / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert not detect(str(tmp_path / "ck")) and not detect(str(tmp_path / "nothing"))


def test_reads_files_written_by_the_official_library(tmp_path):
    st.save_file({"x": torch.arange(12.0).reshape(6, 2), "t": torch.arange(9), "t.offsets": torch.tensor(
        [0, 2, 2, 5, 6, 8, 9])}, tmp_path / "a.safetensors")
    ds = SafetensorsDataset(tmp_path)
    assert len(ds) == 6 and ds[2]["t"].tolist() == [2, 3, 4] and ds[1]["t"].numel() == 0
    assert ds[5]["x"].tolist() == [10.0, 11.0]
    assert list(SafetensorsDataset(tmp_path, columns=["x"])[0]) == ["x"]


@pytest.mark.parametrize("tensors,match", [
    ({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, "samples"),
    ({"a": torch.zeros(())}, "0-dim"),
    ({"a": torch.zeros(5), "a.offsets": torch.tensor([0, 2, 5], dtype=torch.int32)}, "int64"),
])
def test_inconsistent_headers_refused(tmp_path, tensors, match):
    save_safetensors(tensors, tmp_path / "x.safetensors")
    with pytest.raises(CorruptShardError, match=match) as ei:
        SafetensorsDataset(tmp_path)
    assert ei.value.path == str(tmp_path / "x.safetensors")


@pytest.mark.parametrize("offsets", [[0, 3, 2, 5], [1, 2, 3, 5], [0, 2, 3, 4], [0, 2, 3, 9]])
def test_lying_offsets_refused_with_byte_offset(tmp_path, offsets):
    save_safetensors({"a": torch.arange(5), "a.offsets": torch.tensor(offsets)}, tmp_path / "x.safetensors")
    ds = SafetensorsDataset(tmp_path)
    with pytest.raises(CorruptShardError, match="offsets") as ei:
        ds[0]
    assert ei.value.offset is not None and isinstance(ei.value, TorchforgeError)


def test_damaged_shard_file_is_a_typed_error(tmp_path):
    with SafetensorsShardWriter(tmp_path, samples_per_shard=5) as w:
        for s in _samples(5):
            w.write(s)
    raw = Path(w.files[0]).read_bytes()
    Path(w.files[0]).write_bytes(raw[:-2])
    with pytest.raises(TorchforgeError):
        SafetensorsDataset(tmp_path)


def test_writer_refuses_bad_input(tmp_path):
    w = SafetensorsShardWriter(tmp_path / "w")
    w.write({"a": torch.zeros(2)})
    with pytest.raises(FormatError):
        w.write({"a": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(FormatError):
        w.write({"a.offsets": torch.zeros(2)})
    w2 = SafetensorsShardWriter(tmp_path / "w2")
    w2.write({"a": torch.zeros(())})
    w2.write({"a": torch.zeros(2)})
    with pytest.raises(FormatError, match="ragged"):
        w2.close()
    w.close()
    with pytest.raises(FormatError, match="already"):
        SafetensorsShardWriter(tmp_path / "w")


@settings(max_examples=25, deadline=None)
@given(hs.lists(hs.lists(hs.integers(-2**31, 2**31 - 1), max_size=6), min_size=1, max_size=30), hs.integers(1, 7))
def test_ragged_round_trip_property(tmp_path_factory, rows, per_shard):
    out = tmp_path_factory.mktemp("p")
    with SafetensorsShardWriter(out, samples_per_shard=per_shard, ragged=["v"]) as w:
        for r in rows:
            w.write({"v": torch.tensor(r, dtype=torch.int32)})
    ds = SafetensorsDataset(out)
    assert [ds[i]["v"].tolist() for i in range(len(ds))] == rows


def test_pickles_by_path_for_worker_processes(tmp_path):
    import pickle

    with SafetensorsShardWriter(tmp_path, samples_per_shard=4) as w:
        for s in _samples(9):
            w.write(s)
    ds = SafetensorsDataset(tmp_path)
    ds[0], ds[8]  # maps two shards
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000  # no tensor data travels, only paths and the index
    _check(pickle.loads(blob), _samples(9))


def _raw_shard(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file with exactly this header (no writer's checks)."""
    import json
    import struct

    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_columns_a_dataset_cannot_index_by_row_are_refused_when_it_opens(tmp_path):
    """Found by a hostile-file review: an F6 column (no torch dtype: its rows came back as single bytes, row
    j being byte j, silently), a column of 2**63 empty rows (len() raised a bare OverflowError), and a
    column whose dtype differs between shards (read without error, then a bare RuntimeError in collate)
    are each a typed error naming the shard."""
    f6 = tmp_path / "f6"
    f6.mkdir()
    _raw_shard(f6 / "shard-00000.safetensors", {"y": {"dtype": "F6_E2M3", "shape": [7, 4], "data_offsets": [0, 21]}},
               bytes(range(100, 121)))
    with pytest.raises(FormatError, match="F6_E2M3") as e:
        SafetensorsDataset(str(f6))
    assert e.value.path.endswith("shard-00000.safetensors")
    huge = tmp_path / "huge"
    huge.mkdir()
    _raw_shard(huge / "shard-00000.safetensors", {"y": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}},
               b"")
    with pytest.raises(CorruptShardError, match="9223372036854775808 rows"):
        SafetensorsDataset(str(huge))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_safetensors({"y": torch.zeros(7)}, str(mixed / "shard-00000.safetensors"))
    save_safetensors({"y": torch.zeros(7, 3, dtype=torch.int64)}, str(mixed / "shard-00001.safetensors"))
    with pytest.raises(CorruptShardError, match="column 'y' is I64, the first shard's is F32") as e:
        SafetensorsDataset(str(mixed))
    assert e.value.path.endswith("shard-00001.safetensors")


def _write(folder, samples, **opts) -> list[str]:
    with SafetensorsShardWriter(folder, **opts) as w:
        for s in samples:
            w.write(s)
    return w.files


@pytest.mark.parametrize("n", [20, 23])  # 20: the last write fills the last shard exactly
def test_the_last_shard_says_how_many_shards_there_are(tmp_path, n):
    from safetensors import safe_open

    files = _write(tmp_path / "d", _samples(n), samples_per_shard=5)
    assert len(files) == -(-n // 5)
    metas = []
    for f in files:
        with safe_open(f, "pt") as h:  # the official reader sees the marker
            metas.append(h.metadata())
    assert [m.get("shards") for m in metas] == [None] * (len(files) - 1) + [str(len(files))]
    assert all(m["version"] == "2" and m["format"] == "torchforge-columns" for m in metas)
    _check(SafetensorsDataset(tmp_path / "d"), _samples(n))


def test_a_folder_missing_shards_is_refused_not_read_short(tmp_path):
    import shutil

    files = _write(tmp_path / "d", _samples(23), samples_per_shard=5)  # 5 shards
    cut = tmp_path / "cut"  # an upload or copy that stopped before the last shard (written last)
    cut.mkdir()
    for f in files[:-1]:
        shutil.copy(f, cut)
    with pytest.raises(CorruptShardError, match="the dataset is incomplete: none of its 4 shards is the last") as e:
        SafetensorsDataset(cut)  # before: it opened with 20 of 23 samples
    assert e.value.path == str(cut)
    with pytest.raises(CorruptShardError, match="incomplete"):
        open_dataset(str(cut))
    hole = tmp_path / "hole"  # a shard lost in the middle
    hole.mkdir()
    for f in files[:2] + files[3:]:
        shutil.copy(f, hole)
    with pytest.raises(CorruptShardError, match="says the dataset has 5 shards, the folder holds 4") as e:
        SafetensorsDataset(hole)
    assert e.value.path == str(hole / Path(files[-1]).name)
    other = _write(tmp_path / "other", _samples(3), samples_per_shard=5)  # another dataset's shard mixed in
    shutil.copy(other[0], tmp_path / "d" / "shard-00099.safetensors")
    with pytest.raises(CorruptShardError, match="2 shards say they are the last one"):
        SafetensorsDataset(tmp_path / "d")
    # one shard file on its own still reads, as before
    assert len(SafetensorsDataset(files[1])) == 5


def test_shards_past_99999_read_in_the_order_they_were_written(tmp_path):
    """The writer names shards shard-%05d: shard-100000 sorted between shard-10000 and shard-10001, and the
    dataset read its samples out of order (ds[10001] was sample 100000). Digits now sort by value."""
    files = _write(tmp_path / "d", _samples(3), samples_per_shard=1)
    for f, k in zip(files, (99999, 100000, 100001)):  # the names the writer gives shards 99999 to 100001
        os.rename(f, tmp_path / "d" / f"shard-{k:05d}.safetensors")
    _check(SafetensorsDataset(tmp_path / "d"), _samples(3))
    assert shard_order(["b10", "a", "b9", "b9x", "b09y"]) == ["a", "b9", "b9x", "b09y", "b10"]
    os.rename(tmp_path / "d" / "shard-100001.safetensors", tmp_path / "d" / "shard-09999.safetensors")
    with pytest.raises(CorruptShardError, match="marked last is not the last in name order"):
        SafetensorsDataset(tmp_path / "d")  # the marker's shard must come last


def test_shards_without_the_marker_still_read(tmp_path):
    """Version 1 shards (torchforge before the marker) and other tools' shards make no claim to check."""
    old = tmp_path / "v1"
    old.mkdir()
    for k in range(3):
        save_safetensors({"x": torch.arange(4) + 4 * k}, str(old / f"shard-{k:05d}.safetensors"),
                         {"format": "torchforge-columns", "version": "1", "samples": "4"})
    (old / "shard-00002.safetensors").unlink()  # nothing says it was there
    assert SafetensorsDataset(old)[7]["x"].item() == 7 and len(SafetensorsDataset(old)) == 8
    plain = tmp_path / "plain"
    plain.mkdir()
    st.save_file({"x": torch.arange(3)}, str(plain / "a.safetensors"))
    assert len(SafetensorsDataset(plain)) == 3


def test_writer_takes_arrays_of_any_byte_order_and_strides_and_names_a_value_it_cannot_hold(tmp_path):

    w = SafetensorsShardWriter(str(tmp_path / "a"))
    for bad in ("text", None, {"k": 1}, np.array(["a"])):
        with pytest.raises(FormatError, match="column 'x' of sample 0"):
            w.write({"x": bad})
    rows = [{"x": np.arange(4, dtype=">i4") + i, "y": np.arange(6.0)[::-1] * i} for i in range(3)]
    w2 = SafetensorsShardWriter(str(tmp_path / "b"))
    for r in rows:
        w2.write(r)
    w2.close()
    for r, got in zip(rows, SafetensorsDataset(str(tmp_path / "b"))):
        assert got["x"].tolist() == r["x"].tolist() and got["y"].tolist() == r["y"].tolist()


def test_an_in_place_change_to_a_sample_is_not_seen_by_the_next_read(tmp_path):
    """Samples were views into the shard's private map: a transform's x.sub_(1) stayed there, and every
    epoch saw it applied once more ([-1, 0, 1, 2], then [-2, -1, 0, 1], ...). They are copies now; with
    zero_copy=True views, as documented."""
    with SafetensorsShardWriter(tmp_path / "st") as w:
        for i in range(4):
            w.write({"x": torch.full((3,), float(i)), "r": torch.arange(i + 1)})
    ds = SafetensorsDataset(tmp_path / "st")
    for _ in range(3):
        got = []
        for i in range(4):
            s = ds[i]
            got.append(float(s["x"].sub_(1)[0]))
            s["r"].add_(10)
        assert got == [-1.0, 0.0, 1.0, 2.0]
    assert ds[3]["r"].tolist() == [0, 1, 2, 3]
    views = SafetensorsDataset(tmp_path / "st", zero_copy=True)
    views[0]["x"].add_(5)
    assert views[0]["x"].tolist() == [5.0, 5.0, 5.0]  # (the documented cost of views)
    assert SafetensorsDataset(tmp_path / "st")[0]["x"].tolist() == [0.0, 0.0, 0.0]  # the file is never written


def test_a_shard_rewritten_after_the_dataset_opened_is_an_error_not_the_other_versions_rows(tmp_path):
    """Read with the row counts of its old header, a replaced shard gave rows of the other version silently,
    then an untyped IndexError (JINX said 'shard changed since the dataset was opened')."""
    import os

    from torchforge.errors import FormatError

    for name, per in (("a", 4), ("b", 2)):
        with SafetensorsShardWriter(tmp_path / name, samples_per_shard=per) as w:
            for i in range(8 if name == "a" else 4):
                w.write({"x": torch.tensor([i + (100 if name == "b" else 0)])})
    ds = SafetensorsDataset(tmp_path / "a")
    assert ds[0]["x"].item() == 0  # shard 0 mapped; shard 1 not yet
    os.replace(tmp_path / "b" / "shard-00001.safetensors", tmp_path / "a" / "shard-00001.safetensors")
    with pytest.raises(FormatError, match="shard changed since the dataset was opened: it held 4 rows, now 2") as e:
        ds[4]
    assert e.value.path.endswith("shard-00001.safetensors")


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling link"])
def test_a_fifo_folder_or_dangling_link_named_like_a_shard_is_a_typed_error_naming_it(tmp_path, kind):
    """A FIFO named *.safetensors blocked SafetensorsDataset() in open() for ever; a folder or a link to
    nothing was a raw OSError."""
    import os

    from torchforge.errors import TorchforgeError

    with SafetensorsShardWriter(tmp_path / "ds") as w:
        w.write({"x": torch.tensor([1])})
    odd = tmp_path / "ds" / "zz.safetensors"
    {"fifo": os.mkfifo, "folder": os.mkdir, "dangling link": lambda p: os.symlink(tmp_path / "nothing", p)}[kind](odd)
    with pytest.raises(TorchforgeError) as e:
        SafetensorsDataset(tmp_path / "ds")
    assert e.value.path == str(odd)


def test_an_empty_column_of_enormous_dimensions_reads_as_the_official_reader_reads_it(tmp_path):
    """shape [1, 0, 2**62, 2**62] holds no element; torch.empty of it overflows its strides: a RuntimeError
    traceback from the dataset, inspect and verify (the official reader gives a view of that shape)."""
    import json
    import struct

    head = json.dumps({"x": {"dtype": "F32", "shape": [1, 0, 2**62, 2**62], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "ds").mkdir()
    path = tmp_path / "ds" / "shard-00000.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head)
    want = st.load_file(str(path))["x"]
    ds = SafetensorsDataset(tmp_path / "ds")
    assert len(ds) == 1 and ds[0]["x"].shape == want.shape[1:]


def test_a_column_of_single_f4_values_is_refused_as_rows_cannot_split_a_byte(tmp_path):
    """A 1-D F4 column (the official writer's float4_e2m1fn_x2 packs two values a byte) said len 8 of 16
    values, and ds[4] was an IndexError."""
    from torchforge.errors import FormatError

    (tmp_path / "ds").mkdir()
    st.save_file({"x": torch.zeros(8, dtype=torch.float4_e2m1fn_x2)}, str(tmp_path / "ds" / "shard-00000.safetensors"))
    with pytest.raises(FormatError, match="F4 column 'x' of shape \\[16\\] has no rows of whole bytes"):
        SafetensorsDataset(tmp_path / "ds")


def test_a_shard_never_passes_max_shard_size_when_a_sample_fits_in_the_next(tmp_path):
    """A shard was completed only after its data had passed the limit: 40-byte samples under a 100-byte
    limit made shards of 120 bytes."""
    from torchforge.formats.safetensors import read_header

    with SafetensorsShardWriter(tmp_path / "ds", max_shard_size=100) as w:
        for _ in range(9):
            w.write({"x": torch.zeros(10, dtype=torch.float32)})
        w.write({"x": torch.zeros(30, dtype=torch.float32)})  # alone larger than the limit: a shard of its own
    sizes = [sum(i.end - i.start for i in read_header(f)[1].values()) for f in w.files]
    assert sizes == [80, 80, 80, 80, 40, 120] and len(SafetensorsDataset(tmp_path / "ds")) == 10
