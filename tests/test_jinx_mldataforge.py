"""JINX interop with MLDataForge 0.6.10 itself, run in its Python 3.12 venv.

Folders written by torchforge's JinxWriter (every compression and encoding, sidecars, several shards,
a split, tensors, an empty dataset) read back equal in MLDataForge's JinxDatasetReader (lazy+mmap,
eager, iteration); and folders MLDataForge writes with options the shipped fixtures do not cover read
back equal in JinxDataset. The venv is built by tests/interop/setup_mldataforge.sh (MLDataForge needs
Python >= 3.12 and torch); without it these tests skip.
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
from canon import canon
from expected import rich, same

from torchforge.datasets.jinx import JinxDataset
from torchforge.formats.jinx import JinxWriter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INTEROP = os.path.join(HERE, "interop")

VENV = os.environ.get("TORCHFORGE_MLDF_VENV", os.path.join(ROOT, ".venv-mldf"))
PY = os.path.join(VENV, "bin", "python")


@pytest.fixture(scope="module")
def mldf_python():
    if not os.path.exists(PY):
        pytest.skip(f"MLDataForge venv {VENV} is absent: build it with tests/interop/setup_mldataforge.sh "
                    "(needs python3.12 and PyPI access)")
    # probed even after the setup script checked it: the venv links .venv's CUDA libraries, which a rebuilt or
    # removed .venv takes away
    probe = subprocess.run([PY, "-c", "import mldataforge.jinx"], capture_output=True, text=True, check=False, timeout=300)
    if probe.returncode:
        pytest.skip(f"MLDataForge does not import in {VENV}: {probe.stderr.strip()[-300:]}")
    return PY


WRITES = {  # torchforge writer options -> folder name
    "defaults": {},
    "b64-binx-multi": {"encoding": "b64", "binary_threshold": 512, "shard_size": 30_000, "split": "train"},
    "b64-gz": {"encoding": "b64", "compression": "gz", "index_compression": "gz", "compress_threshold": 32},
    "hex-sidecar-index": {"encoding": "hex", "binary_threshold": 64, "compression": "bz2"},
    "a85-xz-ratio1": {"encoding": "a85", "compression": "xz", "compress_ratio": 1.0},
    "b64-lz4": {"encoding": "b64", "compression": "lz4", "binary_threshold": 2048},
    "b64-snappy": {"encoding": "b64", "compression": "snappy"},
    "b64-br-none-index": {"encoding": "b64", "compression": "br", "index_compression": None},
    "plain": {"encoding": "b64", "compression": None, "index_compression": None},
}


def test_mldataforge_reads_what_torchforge_writes(mldf_python, tmp_path):
    samples = list(rich(40, 21, tensors=True))
    folders = []
    for name, opts in WRITES.items():
        with JinxWriter(tmp_path / name, **opts) as w:
            for s in samples:
                w.write(s)
        folders.append(str(tmp_path / name))
    with JinxWriter(tmp_path / "empty", encoding="b64") as w:
        pass
    folders.append(str(tmp_path / "empty"))
    proc = subprocess.run([mldf_python, os.path.join(INTEROP, "mldf_read.py"), *folders],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {os.path.basename(d["path"]): d for d in map(json.loads, proc.stdout.splitlines())}
    assert set(results) == {os.path.basename(f) for f in folders}
    want = json.loads(json.dumps([canon(s) for s in samples]))
    for name, got in results.items():
        assert "error" not in got, (name, got.get("error"))
        exp = [] if name == "empty" else want
        for mode in ("lazy", "eager", "iter"):
            assert got[mode] == exp, (name, mode)


MLDF_WRITES = {  # MLDataForge writer options not covered by the shipped fixtures
    "mdf-hex-gz": {"shard_size": 2**26, "encoding": "hex", "compression": "gz", "index_compression": None,
                   "binary_threshold": 64},
    "mdf-b64-lz4-tensors": {"shard_size": 20_000, "encoding": "b64", "compression": "lz4",
                            "index_compression": "lz4", "binary_threshold": 256},
    "mdf-a85-snappy": {"shard_size": 2**26, "encoding": "a85", "compression": "snappy", "index_compression": "br"},
    "mdf-b64-xz-bz2": {"shard_size": 2**26, "encoding": "b64", "compression": "xz", "index_compression": "bz2",
                       "compress_threshold": 16, "compress_ratio": 1.0},
    "mdf-b64-plain-single": {"shard_size": None, "encoding": "b64", "compression": None, "index_compression": None},
}


def test_torchforge_reads_what_mldataforge_writes(mldf_python, tmp_path):
    jobs = []
    for name, opts in sorted(MLDF_WRITES.items()):
        target = tmp_path / (name + ".jinx" if opts["shard_size"] is None else name)
        jobs.append([str(target), 30, 5, "tensors" in name, opts])
    proc = subprocess.run([mldf_python, os.path.join(INTEROP, "mldf_write.py"), json.dumps(jobs)],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for target, n, seed, tensors, _ in jobs:
        expected = list(rich(n, seed, tensors))
        for lazy in (True, False):
            ds = JinxDataset(target, lazy=lazy)
            assert len(ds) == n
            assert [same(e, g) for e, g in zip(expected, ds)] == [""] * n, target
            assert [same(e, ds[i]) for i, e in enumerate(expected)] == [""] * n, target


_MLDF_SCALARS = """
import sys, numpy as np
from mldataforge.jinx.dataset_writer import JinxDatasetWriter
with JinxDatasetWriter(sys.argv[1], shard_size=1 << 20) as w:
    w.write({"h": np.float16(1.5), "b": np.bool_(True), "f": np.float32(0.25)})
"""


def test_numpy_float16_and_bool_scalars_are_stored_as_mldataforge_stores_them(mldf_python, tmp_path):
    """MLDataForge 0.6.10's writer stores np.float16/np.bool_ scalars under the extensions 'float16'/'bool',
    which its own reader refuses ('Unsupported extension'); torchforge writes the same line and reads both
    folders back with their numpy types."""
    proc = subprocess.run([mldf_python, "-c", _MLDF_SCALARS, str(tmp_path / "mldf")], capture_output=True,
                          text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with JinxWriter(tmp_path / "tf", compression=None, index_compression=None) as w:
        w.write({"h": np.float16(1.5), "b": np.bool_(True), "f": np.float32(0.25)})
    lines = [min((tmp_path / d).glob("*.jinx")).read_bytes().split(b"\n")[0] + b"\n" for d in ("mldf", "tf")]
    assert lines[0] == lines[1] == b'{"h.float16":1.5,"b.bool":true,"f.float32":0.25}\n'
    for d in ("mldf", "tf"):
        got = JinxDataset(tmp_path / d, lazy=False)[0]
        assert {k: (type(v), v) for k, v in got.items()} == {
            "h": (np.float16, 1.5), "b": (np.bool_, True), "f": (np.float32, 0.25)}
