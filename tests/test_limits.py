"""Datasets of many shards keep one map (one descriptor) per shard file: the soft fd limit is raised."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource", reason="POSIX only")

from torchforge import _limits

SCRIPT = textwrap.dedent(r'''
    import resource, sys
    import numpy as np
    from torchforge import JinxDataset, JinxWriter, MDSDataset, MDSWriter
    root = sys.argv[1]
    with JinxWriter(root + "/jinx", shard_size=600, binary_threshold=64) as w:
        for i in range(400):
            w.write({"id": i, "blob": bytes([i % 251]) * 100})
    with MDSWriter(root + "/mds", {"id": "int", "blob": "bytes"}, size_limit=700) as w:
        for i in range(400):
            w.write({"id": i, "blob": bytes([i % 251]) * 100})
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))  # far fewer than the shard files
    order = np.random.default_rng(0).permutation(400).tolist()
    for ds in (JinxDataset(root + "/jinx"), MDSDataset(root + "/mds")):
        assert len(ds) == 400
        for i in order:
            s = ds[i]
            assert s["id"] == i and bytes(s["blob"]) == bytes([i % 251]) * 100, i
    print(len(ds.shard_files()), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
''')


def test_datasets_of_more_shards_than_the_soft_fd_limit_read(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, check=False,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shards, soft = map(int, out.stdout.split())
    assert shards > 64 and soft > 64


class _FakeResource:
    RLIMIT_NOFILE, RLIM_INFINITY = 7, -1

    def __init__(self, soft: int, hard: int):
        self.limits = (soft, hard)

    def getrlimit(self, which: int) -> tuple[int, int]:
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        if limits[0] > limits[1]:
            raise ValueError("not allowed to raise maximum limit")
        self.limits = limits


def test_soft_limit_is_raised_only_as_needed_and_a_low_hard_limit_is_reported(monkeypatch, caplog):
    fake = _FakeResource(1024, 8192)
    monkeypatch.setattr(_limits, "resource", fake)
    with caplog.at_level(logging.INFO, logger="torchforge._limits"):
        _limits.ensure_open_files(100)
    assert fake.limits == (1024, 8192) and not caplog.records  # enough room already: nothing changed or said
    with caplog.at_level(logging.INFO, logger="torchforge._limits"):
        _limits.ensure_open_files(5000, "JinxDataset")
    soft = fake.limits[0]
    assert 5000 < soft < 8192 and fake.limits[1] == 8192  # the count asked for, plus room for the rest
    assert f"from 1024 to {soft}" in caplog.text and "JinxDataset may hold 5000" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchforge._limits"):
        _limits.ensure_open_files(10000, "MDSDataset")
    assert fake.limits == (8192, 8192)
    assert "MDSDataset may hold 10000 open files" in caplog.text


def test_a_map_refused_for_lack_of_memory_or_maps_says_how_many_maps_and_the_limit(tmp_path):
    # ENOMEM is what mmap gives past vm.max_map_count; an address-space limit gives the same errno
    code = textwrap.dedent(r'''
        import mmap, resource, sys
        from torchforge import _vmem
        path = sys.argv[1]
        with open(path, "wb") as f:
            f.truncate(1 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (1 << 34, 1 << 34))  # 16 GiB of addresses: a 32 GiB map fails
        with open(path, "rb") as f:
            try:
                _vmem.map_at(None, 1 << 35, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), path)
            except OSError as e:
                print(e.errno, e.strerror)
    ''')
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("12 ") and str(tmp_path / "f") in out, out
    assert "maps; vm.max_map_count is" in out, out
