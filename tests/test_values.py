"""Values that travel (issue 12 item 1): what a torchforge dataset returns pickles and collates in torch's
own DataLoader with workers, zero-copy bytes included (ByteView), and every writer takes any bytes-like
value, so MDS -> MDS and JINX -> MDS conversions carry bytes, arrays and tensors."""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchforge.convert import convert
from torchforge.datasets.jinx import JinxDataset
from torchforge.datasets.mds import MDSDataset
from torchforge.datasets.safetensors import SafetensorsShardWriter
from torchforge.formats.jinx import JinxWriter
from torchforge.formats.mds import MDSWriter
from torchforge.formats.values import ByteView, byte_view
from torchforge.loader import DataLoader as ForgeLoader


def _blob(i: int) -> bytes:
    return bytes([i % 251]) * (50 + 37 * i)


@pytest.fixture(scope="module")
def mds_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("values") / "mds")
    with MDSWriter(out, {"id": "int", "blob": "bytes", "vec": "ndarray:float32:3"}) as w:
        for i in range(12):
            w.write({"id": i, "blob": _blob(i), "vec": np.arange(3, dtype=np.float32) + i})
    return out


@pytest.fixture(scope="module")
def jinx_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("values") / "jinx"
    with JinxWriter(out, binary_threshold=16, compression=None) as w:  # blobs go to the sidecar, raw
        for i in range(12):
            w.write({"id": i, "blob": _blob(i)})
    return str(out)


def test_byteview_behaves_as_bytes():
    raw = b"hello torchforge"
    v = byte_view(memoryview(raw))[6:]
    assert isinstance(v, ByteView) and v == b"torchforge" and b"torchforge" == v and v != b"other"
    assert hash(v) == hash(b"torchforge") and {v: 1}[b"torchforge"] == 1
    assert bytes(v) == b"torchforge" and v.decode() == "torchforge" and len(v) == 10
    assert io.BytesIO(v).read() == b"torchforge" and bytes(memoryview(v)) == b"torchforge"
    assert "torchforge" in repr(v)
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[0] = 1
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(v, protocol=protocol))
        assert type(back) is bytes and back == b"torchforge"
    assert torch.utils.data.default_collate([v, byte_view(b"xy")]) == [b"torchforge", b"xy"]


@pytest.mark.parametrize("kind", ["mds", "jinx"])
def test_zero_copy_bytes_travel_through_torchs_own_loader_with_workers(kind, mds_folder, jinx_folder):
    ds = MDSDataset(mds_folder) if kind == "mds" else JinxDataset(jinx_folder)
    assert isinstance(ds[3]["blob"], ByteView)  # still zero-copy in the main process
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    got = [b for batch in loader for b in batch["blob"]]
    assert [type(b) for b in got] == [bytes] * 12
    assert got == [_blob(i) for i in range(12)]


def test_zero_copy_bytes_travel_through_torchforges_loader(mds_folder):
    got = [b for batch in ForgeLoader(MDSDataset(mds_folder), batch_size=5, num_workers=2) for b in batch["blob"]]
    assert got == [_blob(i) for i in range(12)]


def test_mds_to_mds_and_jinx_to_mds_conversions_carry_bytes_and_arrays(tmp_path, mds_folder, jinx_folder):
    convert(mds_folder, tmp_path / "again", "mds")
    again = MDSDataset(str(tmp_path / "again"))
    for i in (0, 7, 11):
        assert again[i]["blob"] == _blob(i)
        assert np.array_equal(again[i]["vec"], np.arange(3, dtype=np.float32) + i)
    convert(jinx_folder, tmp_path / "from-jinx", "mds")
    assert MDSDataset(str(tmp_path / "from-jinx"))[5]["blob"] == _blob(5)
    # and through the CLI, as a user runs it
    r = subprocess.run([sys.executable, "-m", "torchforge.cli", "convert", mds_folder, str(tmp_path / "cli"),
                        "--to", "mds", "-q"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert MDSDataset(str(tmp_path / "cli"))[2]["blob"] == _blob(2)


def test_safetensors_tensors_convert_to_mds_and_jinx(tmp_path):
    with SafetensorsShardWriter(tmp_path / "st") as w:
        for i in range(5):
            w.write({"x": torch.arange(3) + i, "y": torch.tensor(float(i))})
    convert(tmp_path / "st", tmp_path / "mds", "mds")
    got = MDSDataset(str(tmp_path / "mds"))[4]
    assert got["x"].tolist() == [4, 5, 6] and float(got["y"]) == 4.0
    convert(tmp_path / "st", tmp_path / "jinx", "jinx")
    assert JinxDataset(str(tmp_path / "jinx"))[2]["x"].tolist() == [2, 3, 4]


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview, lambda b: byte_view(b),
                                  lambda b: memoryview(np.frombuffer(b, np.uint8).view(np.int16)) if len(b) % 2 == 0
                                  else memoryview(b)])
def test_every_writer_takes_any_bytes_like(tmp_path, make):
    value = b"0123456789abcdef"
    with MDSWriter(str(tmp_path / "m"), {"blob": "bytes", "img": "jpeg"}) as w:
        w.write({"blob": make(value), "img": make(value)})  # bytes-like for an image column: stored as is
    got = MDSDataset(str(tmp_path / "m"), columns=["blob"])[0]["blob"]
    assert got == value
    with JinxWriter(tmp_path / "j", binary_threshold=4) as w:
        w.write({"blob": make(value)})
    assert JinxDataset(str(tmp_path / "j"))[0]["blob"] == value


def test_mds_ndarray_and_scalar_columns_take_tensors(tmp_path):
    with MDSWriter(str(tmp_path / "m"), {"v": "ndarray:int64:3", "s": "float32"}) as w:
        w.write({"v": torch.tensor([1, 2, 3]), "s": torch.tensor(2.5)})
    got = MDSDataset(str(tmp_path / "m"))[0]
    assert got["v"].tolist() == [1, 2, 3] and float(got["s"]) == 2.5


def test_jinx_raw_value_of_a_wide_memoryview_keeps_all_its_bytes(tmp_path):
    arr = np.arange(4, dtype=np.int32)
    with JinxWriter(tmp_path / "j", binary_threshold=None, compression=None) as w:
        w.write({"raw": memoryview(arr)})
    assert JinxDataset(str(tmp_path / "j"))[0]["raw"] == arr.tobytes()  # 16 bytes, not 4 items


def test_values_survive_the_readers_close(tmp_path, mds_folder):
    ds = MDSDataset(mds_folder)
    held = pickle.loads(pickle.dumps(ds[4]["blob"]))
    del ds
    assert held == _blob(4) and os.path.isdir(mds_folder)


def test_byteview_indexes_and_iterates_as_bytes():
    v = byte_view(b"\x01\x02\xff")
    assert v[-1] == 255 and type(v[-1]) is int and len(v) + v[-1] == 258  # no uint8 wrap-around
    assert list(v) == [1, 2, 255] and isinstance(v[1:], ByteView) and v[1:] == b"\x02\xff"


@pytest.mark.parametrize("raw", [b"", b"\x00", b"\x89PNG\r\n\x00\x00", bytes(range(256))])
def test_byteview_truth_and_membership_are_bytes(raw):
    """bool() raised numpy's 'truth value of an array is ambiguous' (and was False for b"\\x00"); `in`
    compared elements, so b"PNG" in v was False for bytes that hold it."""
    v = byte_view(raw)
    assert bool(v) is bool(raw)
    for item in (b"", b"PNG", b"\x89", b"\x00\x00", raw, raw + b"x", 0, 0x89, 255):
        assert (item in v) is (item in raw), item
    with pytest.raises((TypeError, ValueError)):
        _ = 256 in v  # as bytes: a byte must be in range(256)
