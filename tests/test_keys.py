"""ShardDataset.keys(): reads only the key's field, caches beside the shards, invalidates on change."""
import logging
import os
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pytest

from torchforge.datasets.base import KEY_CACHE_PREFIX, ShardDataset
from torchforge.sampler import GlobalSampler

FIELDS = ("len", "name", "meta", "text")


class SidecarRead(RuntimeError):
    """Raised when a test dataset reads a field the key does not need."""


class Lazy(Mapping):
    """A lazy sample: each field is read from its file only when accessed; ``text`` always raises."""

    def __init__(self, ds, i, fields=FIELDS):
        self._ds, self._i, self._fields = ds, i, fields

    def __getitem__(self, field):
        if field not in self._fields:
            raise KeyError(field)
        self._ds.reads[field] += 1
        if field == "len":
            return int(self._ds.lengths()[self._i])
        if field == "name":
            return f"s{int(self._ds.lengths()[self._i]):03d}"
        if field == "meta":
            return Lazy(self._ds, self._i, fields=("len",))
        raise SidecarRead(f"sample {self._i}: the sidecar {field!r} was read")

    def __contains__(self, field):
        return field in self._fields

    def __iter__(self):
        return iter(self._fields)

    def __len__(self):
        return len(self._fields)


class SidecarDataset(ShardDataset):
    format_name = "test-sidecar"

    def __init__(self, folder):
        self.folder = str(folder)
        self.reads = Counter()
        self.gets = 0

    def lengths(self):
        return np.fromfile(os.path.join(self.folder, "shard-00000.len"), dtype="<i4")

    def __len__(self):
        return len(self.lengths())

    def _get(self, i):
        self.gets += 1
        return Lazy(self, i)

    def shard_files(self):
        return [os.path.join(self.folder, "shard-00000.len"), os.path.join(self.folder, "shard-00000.text")]


def write(folder, lengths):
    np.asarray(lengths, dtype="<i4").tofile(os.path.join(folder, "shard-00000.len"))
    with open(os.path.join(folder, "shard-00000.text"), "wb") as f:
        f.write(b"\xff" * 7)  # a sidecar nobody may read


@pytest.fixture(autouse=True)
def key_cache(tmp_path_factory, monkeypatch):
    """The per-user cache folder, private to each test."""
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("TORCHFORGE_CACHE_DIR", str(folder))
    return os.path.join(folder, "keys")


def caches(folder):
    if not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f.startswith(KEY_CACHE_PREFIX))


LENGTHS = [30, 10, 20, 10, 50, 40, 10]


@pytest.fixture
def ds(tmp_path):
    write(tmp_path, LENGTHS)
    return SidecarDataset(tmp_path)


def test_sorting_by_a_lazy_field_reads_no_other_field(ds):
    s = GlobalSampler(ds, sort_key="len")
    assert list(s) == [1, 3, 6, 2, 0, 5, 4]  # stable: ties in index order
    assert set(ds.reads) == {"len"}
    with pytest.raises(SidecarRead):  # the trap is armed
        ds[0]["text"]
    ds.reads.clear()
    assert list(GlobalSampler(ds, sort_key="meta.len", descending=True)) == [4, 5, 0, 2, 1, 3, 6]
    assert set(ds.reads) == {"meta", "len"}
    ds.reads.clear()
    assert list(GlobalSampler(ds, sort_key=lambda sample: -sample["len"])) == [4, 5, 0, 2, 1, 3, 6]
    assert set(ds.reads) == {"len"}


def test_bucketed_sort_by_field(ds):
    order = GlobalSampler(ds, sort_key="len", bucket_size=3, seed=4).global_indices(0, 7).tolist()
    buckets = Counter(frozenset(order[i:i + 3]) for i in (0, 3))
    assert buckets == Counter([frozenset({1, 3, 6}), frozenset({2, 0, 5})])
    assert order[6] == 4  # the partial bucket stays last
    assert set(ds.reads) == {"len"}


def test_key_cache_is_written_reused_and_invalidated(ds, tmp_path, key_cache):
    before = sorted(os.listdir(tmp_path))
    a = ds.keys("len")
    assert a.tolist() == LENGTHS and len(caches(key_cache)) == 1
    assert sorted(os.listdir(tmp_path)) == before  # nothing written into the data folder
    gets = ds.gets
    b = ds.keys("len")
    assert ds.gets == gets and b.tolist() == LENGTHS  # served from the cache: no sample read
    assert ds.keys("name").tolist() == [f"s{x:03d}" for x in LENGTHS]
    assert len(caches(key_cache)) == 2  # one file per field
    write(tmp_path, [5, 4, 3, 2, 1, 0])  # the shards change: size and mtime differ
    assert ds.keys("len").tolist() == [5, 4, 3, 2, 1, 0]
    assert list(GlobalSampler(ds, sort_key="len")) == [5, 4, 3, 2, 1, 0]


def test_same_size_rewrite_invalidates_by_mtime(ds, tmp_path):
    ds.keys("len")
    path = os.path.join(tmp_path, "shard-00000.len")
    write(tmp_path, [1, 2, 3, 4, 5, 6, 7])  # same size
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ds.keys("len").tolist() == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickle", "scalar", "wrong_length", "2d"])
def test_a_damaged_cache_is_recomputed(ds, damage, caplog, key_cache):
    ds.keys("len")
    (name,) = caches(key_cache)
    path = os.path.join(key_cache, name)
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 3)
    elif damage == "garbage":
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY\x01\x00garbage")
    elif damage == "pickle":
        np.save(path, np.array([{"a": 1}] * 7, dtype=object), allow_pickle=True)
    elif damage == "scalar":
        np.save(path, np.array(3))
    elif damage == "wrong_length":
        np.save(path, np.arange(3))
    else:
        np.save(path, np.zeros((7, 2)))
    gets = ds.gets
    with caplog.at_level(logging.WARNING, logger="torchforge.datasets.base"):
        assert ds.keys("len").tolist() == LENGTHS
    assert ds.gets > gets  # recomputed from the samples
    assert "key cache" in caplog.text
    assert ds.keys("len").tolist() == LENGTHS and np.load(path).tolist() == LENGTHS  # and rewritten


def test_no_cache_and_callables_are_not_cached(ds, key_cache):
    assert ds.keys("len", cache=False).tolist() == LENGTHS
    assert ds.keys(lambda s: s["len"] * 2).tolist() == [2 * x for x in LENGTHS]
    assert caches(key_cache) == []


def test_read_only_dataset_folder_gets_a_reused_cache_in_the_user_folder(tmp_path, key_cache):
    data = tmp_path / "ro"
    data.mkdir()
    write(data, LENGTHS)
    os.chmod(data, 0o555)  # read-only (root writes anyway: the listing check below holds for everyone)
    try:
        ds = SidecarDataset(data)
        before = sorted(os.listdir(data))
        assert ds.keys("len").tolist() == LENGTHS
        assert sorted(os.listdir(data)) == before
        assert len(caches(key_cache)) == 1
        again = SidecarDataset(data)  # another dataset object (another process) over the same files
        assert again.keys("len").tolist() == LENGTHS and again.gets == 0  # served from the user cache
    finally:
        os.chmod(data, 0o755)


def test_same_files_at_another_path_are_another_dataset(tmp_path, key_cache):
    for name, lengths in (("a", LENGTHS), ("b", LENGTHS[::-1])):
        (tmp_path / name).mkdir()
        write(tmp_path / name, lengths)
    b = tmp_path / "b"
    st = os.stat(tmp_path / "a" / "shard-00000.len")
    for f in ("shard-00000.len", "shard-00000.text"):  # same names, sizes and mtimes: only the path differs
        os.utime(b / f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert SidecarDataset(tmp_path / "a").keys("len").tolist() == LENGTHS
    assert SidecarDataset(b).keys("len").tolist() == LENGTHS[::-1]
    assert len(caches(key_cache)) == 2


def test_cache_folder_location(monkeypatch, tmp_path):
    from torchforge.cache import user_cache_dir

    monkeypatch.delenv("TORCHFORGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir("keys") == str(tmp_path / "xdg" / "torchforge" / "keys")
    assert os.stat(tmp_path / "xdg" / "torchforge").st_mode & 0o777 == 0o700
    monkeypatch.setenv("TORCHFORGE_CACHE_DIR", str(tmp_path / "mine"))
    assert user_cache_dir() == str(tmp_path / "mine")


def test_missing_field_and_bad_argument(ds):
    with pytest.raises(KeyError, match="nope"):
        ds.keys("nope")
    with pytest.raises(KeyError, match="meta.nope"):
        ds.keys("meta.nope")
    with pytest.raises(TypeError, match="field name or a callable"):
        ds.keys(3)
