"""FeatureStore: concurrent ranks, crash safety, versions, round trips, hostile files, workers, join, CLI."""
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from typing import ClassVar

import numpy as np
import pytest
import safetensors.numpy
import torch
import torch.distributed as dist
from _forkserver import start_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchforge import DataLoader, GlobalSampler
from torchforge.errors import CorruptShardError, FormatError, NotFoundError, TorchforgeError
from torchforge.features import FeatureStore, MissingIdsError
from torchforge.features.layout import stale_temp_files
from torchforge.loader import collate

SCHEMA = {"emb": ((4,), torch.float16), "loss": ((), torch.float32)}


def _rows(ids, salt=0.0):
    ids = np.asarray(ids, dtype=np.int64)
    emb = torch.from_numpy(np.stack([ids + k + salt for k in range(4)], 1).astype(np.float32))
    return {"emb": emb, "loss": torch.from_numpy((ids * 0.5 + salt).astype(np.float32))}


def _expect(store, ids, salt=0.0):
    got = store.get(ids)
    want = _rows(ids, salt)
    assert torch.equal(got["emb"], want["emb"].half()), (got["emb"], want["emb"])
    assert torch.equal(got["loss"], want["loss"])


@pytest.fixture
def store(tmp_path):
    return FeatureStore(tmp_path / "fs", SCHEMA, create=True)


# --- concurrent ranks ----------------------------------------------------------------------------
def _rank_main(rank, world, path, rendezvous):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        store = FeatureStore(path)
        w = store.writer(shard_size=4096)  # several shards per rank
        ids = np.arange(rank, 3000, world, dtype=np.int64) * 7 + 5  # interleaved, sparse, unordered below
        ids = np.random.default_rng(rank).permutation(ids)
        dist.barrier()  # every rank writes at the same time
        for k in range(0, len(ids), 100):
            w.write(torch.from_numpy(ids[k:k + 100]), **_rows(ids[k:k + 100]))
        dist.barrier()  # ... and commits at the same time: not a collective, no lock
        v = w.commit()
        with open(os.path.join(os.path.dirname(rendezvous), f"rank{rank}.json"), "w") as f:
            json.dump({"version": v, "ids": ids.tolist()}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_three_gloo_ranks_write_concurrently_then_each_commits_a_version(tmp_path):
    path = str(tmp_path / "fs")
    FeatureStore(path, SCHEMA, create=True)
    ctx = start_ranks(_rank_main, args=(3, path, str(tmp_path / "rdv")), nprocs=3, join=False)
    while not ctx.join():
        pass
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert sorted(r["version"] for r in results) == [1, 2, 3]  # each commit its own version, none lost
    store = FeatureStore(path)
    assert store.version == 3 and len(store) == 3000
    every = np.concatenate([r["ids"] for r in results])
    _expect(store, every)
    assert np.array_equal(store.ids(), np.sort(every))
    by_version = {r["version"]: r["ids"] for r in sorted(results, key=lambda r: r["version"])}
    seen = []
    for v in (1, 2, 3):  # version v holds exactly the rows of the commits up to v
        seen += by_version[v]
        old = store.at(v)
        assert len(old) == len(seen)
        _expect(old, seen)


# --- crashes -------------------------------------------------------------------------------------
_KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    from torchforge.features import FeatureStore
    w = FeatureStore(sys.argv[1]).writer(shard_size=1 << 16)
    i = 0
    while True:
        ids = np.arange(i, i + 512) + 10_000
        w.write(ids, emb=torch.zeros(512, 4), loss=torch.full((512,), -1.0))
        i += 512
        if i == 512 * 8:
            print("writing", flush=True)
""")


def test_writer_sigkilled_mid_write_leaves_last_version_intact(store, tmp_path):
    with store.writer() as w:
        w.write(np.arange(100), **_rows(np.arange(100)))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, store.path], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"writing"  # it has flushed shards and keeps writing
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    left = os.listdir(os.path.join(store.path, "shards"))
    assert len(left) > 1  # its shards (and maybe a partial temp file) are there, named by nothing
    reopened = FeatureStore(store.path)
    assert reopened.version == 1 and len(reopened) == 100
    _expect(reopened, np.arange(100))
    with pytest.raises(MissingIdsError):
        reopened.get([10_000])
    stale = stale_temp_files(store.path)
    assert all(f"-{proc.pid}-" in os.path.basename(p) for p in stale)
    # every file the killed writer left is a temporary file of its pid: none leaks under a final name
    committed = {os.path.basename(e.file) for e in reopened._snap.manifest.shards}
    assert sorted(os.path.join(store.path, "shards", n) for n in left if n not in committed) == sorted(
        p for p in stale if os.path.dirname(p).endswith("shards"))
    w = reopened.writer()  # the next writer cleans up after the dead one and commits as if nothing happened
    assert stale and not any(os.path.exists(p) for p in stale)
    assert sorted(os.listdir(os.path.join(store.path, "shards"))) == sorted(committed)
    w.write([100], **_rows([100]))
    assert w.commit() == 2
    _expect(reopened, np.arange(101))


_KILLED_IN_COMMIT = textwrap.dedent("""
    import os, sys, numpy as np, torch
    import torchforge.features.writer as fw
    from torchforge.features import FeatureStore
    w = FeatureStore(sys.argv[1]).writer(shard_size=1 << 12)
    ids = np.arange(5000, 5600)
    w.write(ids, emb=torch.ones(600, 4), loss=torch.full((600,), 7.0))
    fw.claim_version = lambda *a, **k: os._exit(9)  # killed after naming its shards and index, before the claim
    w.commit()
""")


def test_a_writer_killed_inside_commit_leaves_files_the_next_writer_deletes(store):
    """A writer killed after naming its shards and id index but before claiming its version left them under
    final names forever: nothing listed or deleted them, and every such crash leaked its rows' bytes."""
    with store.writer() as w:
        w.write(np.arange(100), **_rows(np.arange(100)))

    def files(sub):
        return sorted(os.listdir(os.path.join(store.path, sub)))

    before = {sub: files(sub) for sub in ("shards", "index")}
    proc = subprocess.run([sys.executable, "-c", _KILLED_IN_COMMIT, store.path], check=False, timeout=120)
    assert proc.returncode == 9
    left = {sub: [n for n in files(sub) if n not in before[sub]] for sub in ("shards", "index")}
    assert len(left["shards"]) >= 1 and len(left["index"]) == 1, left
    reopened = FeatureStore(store.path)
    assert reopened.version == 1  # nothing of it is visible
    _expect(reopened, np.arange(100))
    w = reopened.writer()
    assert {sub: files(sub) for sub in ("shards", "index")} == before  # its files are gone, the committed kept
    w.write([100], **_rows([100]))
    assert w.commit() == 2
    _expect(FeatureStore(store.path), np.arange(101))
    assert FeatureStore(store.path).at(1).get(np.arange(100))["loss"].shape == (100,)


def test_uncommitted_writer_leaves_nothing_visible_and_abort_removes_its_shards(store):
    w = store.writer(shard_size=64)
    w.write(np.arange(10), **_rows(np.arange(10)))
    w.flush()
    assert FeatureStore(store.path).version == 0
    w.close()
    assert os.listdir(os.path.join(store.path, "shards")) == []
    with pytest.raises(TorchforgeError, match="closed"):
        w.write([1], **_rows([1]))


# --- versions ------------------------------------------------------------------------------------
def test_overwrite_last_commit_wins_and_at_reads_older_versions(store):
    a = store.writer()
    a.write(np.arange(10), **_rows(np.arange(10)))
    assert a.commit() == 1
    b = store.writer()
    b.write(np.arange(5, 15), **_rows(np.arange(5, 15), salt=100))
    b.write([14], **_rows([14], salt=200))  # within one commit the last write wins too
    assert b.commit() == 2
    assert store.version == 2 and len(store) == 15
    _expect(store, np.arange(5), 0)
    _expect(store, np.arange(5, 14), 100)
    _expect(store, [14], 200)
    v1 = store.at(1)
    assert v1.version == 1 and len(v1) == 10
    _expect(v1, np.arange(10))
    with pytest.raises(MissingIdsError):
        v1.get([12])
    assert len(store.at(0)) == 0
    with pytest.raises(NotFoundError, match="version 7"):
        store.at(7)
    c = store.writer()  # a later commit overwrites every row of the first: its shard is dropped
    c.write(np.arange(10), **_rows(np.arange(10), salt=300))
    assert c.commit() == 3
    assert len(store._snap.manifest.shards) == 2
    _expect(store, np.arange(10), 300)
    _expect(store.at(1), np.arange(10))  # the old version still reads its own shard


def test_a_handle_opened_at_a_version_stays_there_through_its_own_writers_commits(store):
    with store.writer() as w:
        w.write(np.arange(4), **_rows(np.arange(4)))
    v1 = store.at(1)
    with v1.writer() as w:  # a commit through the pinned handle: a new version, the handle stays
        w.write(np.arange(4), **_rows(np.arange(4), salt=9))
    assert store.latest_version == 2
    assert v1.version == 1
    _expect(v1, np.arange(4))
    assert FeatureStore(store.path, version=1).writer().commit() == 3 and store.latest_version == 3
    assert v1.refresh() == 3 and v1.version == 3  # refresh() lets it follow again
    with v1.writer() as w:
        w.write([9], **_rows([9]))
    assert v1.version == 4
    store.refresh()
    assert store.writer().commit() == 5 and store.version == 5  # an unpinned handle follows its commits


def test_get_keeps_order_and_repeats_and_fills_missing(store):
    ids = np.array([2**40, -5, 3, 2**62], dtype=np.int64)
    with store.writer() as w:
        w.write(torch.from_numpy(ids), **_rows(ids))
    _expect(store, [3, -5, 3, 2**62, 2**40])
    with pytest.raises(MissingIdsError) as e:
        store.get([3, 4, 7])
    assert e.value.ids == [4, 7] and isinstance(e.value, KeyError) and "[4, 7]" in str(e.value)
    got = store.get([4, 3], missing={"emb": 0, "loss": -1})
    assert got["loss"].tolist() == [-1.0, 1.5] and got["emb"][0].tolist() == [0, 0, 0, 0]
    assert store.get([9], ["loss"], missing=float("nan"))["loss"].isnan().all()
    assert list(store.get([3], ["loss"])) == ["loss"]
    assert list(store.get([3], "loss")) == ["loss"]  # one name is one column, not its letters
    assert list(store.join([{"id": 3}], columns="emb")[0]) == ["id", "emb"]
    with pytest.raises(ValueError, match="not in the store"):
        store.get([3], ["nope"])
    assert 3 in store and 4 not in store


def test_get_takes_id_tensors_of_any_layout_and_leaves_them_as_they_were(written):
    """A batch's contiguous int64 CPU ids are read in place (no copy); strided, int32 and 0-d tensors
    are converted; none of them is changed by the get."""
    want = written.get(np.array([7, 3, 3, 40]))["emb"]
    base = torch.tensor([7, 0, 3, 0, 3, 0, 40, 0])
    for ids in (base[::2], base[::2].clone(), base[::2].to(torch.int32), base[::2].numpy()):
        before = torch.as_tensor(ids).clone()
        assert torch.equal(written.get(ids)["emb"], want)
        assert torch.equal(torch.as_tensor(ids), before)
    assert torch.equal(written.get(torch.tensor(40))["emb"], want[3:])
    with pytest.raises(TypeError, match="1-D sequence of integers"):
        written.get(torch.tensor([[7, 3]]))
    with pytest.raises(TypeError, match="1-D sequence of integers"):
        written.get(torch.tensor([7.0]))


def test_schema_is_required_to_create_and_checked_on_open(tmp_path):
    with pytest.raises(ValueError, match="needs a schema"):
        FeatureStore(tmp_path / "a", create=True)
    with pytest.raises(NotFoundError):
        FeatureStore(tmp_path / "nothing")
    FeatureStore(tmp_path / "a", SCHEMA, create=True)
    assert FeatureStore(tmp_path / "a").schema["emb"].shape == (4,)
    with pytest.raises(FormatError, match="differs"):  # (a FormatError is a ValueError too)
        FeatureStore(tmp_path / "a", {"emb": ((5,), torch.float16)})
    with pytest.raises(FormatError):
        FeatureStore(tmp_path / "a", {"emb": ((5,), torch.float16)}, create=True)
    with pytest.raises(ValueError, match="dtype"):
        FeatureStore(tmp_path / "b", {"x": ((1,), "float")}, create=True)
    w = FeatureStore(tmp_path / "a").writer()
    with pytest.raises(ValueError, match="every column"):
        w.write([1], emb=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="shape"):
        w.write([1, 2], emb=torch.zeros(1, 4), loss=torch.zeros(1))


# --- round trips ---------------------------------------------------------------------------------
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64]


def _random(shape, dtype, rng):
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    t = torch.from_numpy(rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)).view(dtype).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.nan_to_num(t)
    return (t != 0) if dtype == torch.bool else t


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(columns=st.dictionaries(st.sampled_from(["a", "b", "c"]),
                               st.tuples(st.lists(st.integers(0, 3), max_size=3), st.sampled_from(DTYPES)),
                               min_size=1, max_size=3),
       batches=st.lists(st.lists(st.integers(-2**63, 2**63 - 1), max_size=20), min_size=1, max_size=3),
       shard_size=st.sampled_from([1, 256, 1 << 20]), seed=st.integers(0, 2**32 - 1))
def test_round_trip_over_dtypes_and_shapes(columns, batches, shard_size, seed):
    rng = np.random.default_rng(seed)
    schema = {k: (tuple(shape), dt) for k, (shape, dt) in columns.items()}
    with tempfile.TemporaryDirectory() as d:
        store = FeatureStore(d, schema, create=True)
        want: dict[int, dict] = {}
        for commit, ids in enumerate(batches):
            w = store.writer(shard_size=shard_size)
            rows = {k: _random((len(ids), *shape), dt, rng) for k, (shape, dt) in schema.items()}
            w.write(ids, **rows)
            for j, i in enumerate(ids):
                want[i] = {k: v[j] for k, v in rows.items()}
            assert w.commit() == commit + 1
        keys = list(want)
        rng.shuffle(keys)
        got = store.get(keys)
        assert len(store) == len(want)
        for k, (shape, dt) in schema.items():
            assert got[k].dtype == dt and tuple(got[k].shape) == (len(keys), *shape)
            for j, i in enumerate(keys):
                assert _bytes(got[k][j]) == _bytes(want[i][k])


def test_every_file_opens_with_the_official_safetensors_reader(store):
    w = store.writer(shard_size=100)
    for k in range(3):
        w.write(np.arange(k * 10, k * 10 + 10), **_rows(np.arange(k * 10, k * 10 + 10)))
    w.commit()
    m = store._snap.manifest
    for entry in (*m.shards, m.index):
        tensors = safetensors.numpy.load_file(os.path.join(store.path, entry.file))
        assert len(tensors["id"]) == entry.rows
    shard = safetensors.numpy.load_file(os.path.join(store.path, m.shards[0].file))
    assert shard["emb"].dtype == np.float16 and shard["emb"].shape == (len(shard["id"]), 4)


WIDE = {"emb": ((64,), torch.float16), "loss": ((), torch.float32), "tag": ((3,), torch.int8)}


def _wide(ids, salt=0):
    ids = np.asarray(ids, dtype=np.int64)
    emb = ((ids[:, None] % 1009) + np.arange(64)[None, :] + salt).astype(np.float16)
    return {"emb": emb, "loss": (ids * 0.25 + salt).astype(np.float32),
            "tag": np.stack([ids % 100, ids % 7, ids % 3], 1).astype(np.int8)}


def _expect_wide(store, ids):
    got = store.get(ids)
    for k, v in _wide(ids).items():
        assert np.array_equal(got[k].numpy(), v), k


def test_wide_column_streams_to_its_shard_from_any_input_and_the_files_stay_plain_safetensors(tmp_path):
    from torchforge.features.inspect import verify_store
    from torchforge.features.writer import file_digest

    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    w = store.writer(shard_size=300 * 143)  # a shard every ~300 rows, mid write() call
    assert w._stream == "emb"
    ids = np.random.default_rng(0).permutation(1000).astype(np.int64) * 3 - 500
    a, b, c, d = ids[:250], ids[250:500], ids[500:900], ids[900:]
    buf = torch.from_numpy(_wide(a)["emb"]).clone()
    w.write(a, emb=buf, loss=_wide(a)["loss"], tag=_wide(a)["tag"])  # the stream column from caller memory
    buf.fill_(-1)  # ... which the caller may reuse at once
    w.write(b, emb=torch.from_numpy(_wide(b)["emb"]).float().numpy(), loss=_wide(b)["loss"],
            tag=_wide(b)["tag"])  # float32 rows converted
    t = torch.from_numpy(np.ascontiguousarray(_wide(c)["emb"].T)).T  # not contiguous
    assert not t.is_contiguous()
    w.write(c, emb=t, loss=torch.from_numpy(_wide(c)["loss"]), tag=torch.from_numpy(_wide(c)["tag"]))
    w.write(d[:0], emb=np.zeros((0, 64), np.float16), loss=np.zeros(0, np.float32), tag=np.zeros((0, 3), np.int8))
    w.write(d, **_wide(d))
    assert w.commit() == 1
    m = store._snap.manifest
    assert len(m.shards) >= 3 and sum(e.rows for e in m.shards) == 1000
    for e in m.shards:
        path = os.path.join(store.path, e.file)
        assert e.digest == file_digest(path) and e.bytes == os.path.getsize(path)
        tensors = safetensors.numpy.load_file(path)
        for k, v in _wide(tensors["id"]).items():
            assert np.array_equal(tensors[k], v)
        with open(path, "rb") as f:  # the stream column starts on a page boundary, right after the header
            n = int.from_bytes(f.read(8), "little")
            assert (8 + n) % 4096 == 0 and json.loads(f.read(n))["emb"]["data_offsets"][0] == 0
    assert verify_store(store.path) == (1000, [])
    q = np.concatenate([ids[::-1], ids[:7]])
    _expect_wide(store, q)


def test_the_stream_column_is_written_in_pieces_that_end_on_2_mib_file_offsets(tmp_path, monkeypatch):
    # a page-cache folio is as large as the write that fills it: whole 2 MiB pieces become huge pages,
    # which a reader's random rows reach through one TLB entry
    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    w = store.writer(shard_size="1GiB")
    writes, real = [], os.pwritev

    def pwritev(fd, views, offset):
        name = os.readlink(f"/proc/self/fd/{fd}")
        n = real(fd, views, offset)
        writes.append((name, offset, n))
        return n

    monkeypatch.setattr(os, "pwritev", pwritev)
    ids = np.random.default_rng(1).permutation(70_000).astype(np.int64)
    for k in range(0, len(ids), 7_000):  # 7,000 rows of 128 bytes: no call ends on a boundary
        rows = _wide(ids[k:k + 7_000])
        w.write(ids[k:k + 7_000], **rows)
        rows["emb"].fill(0)  # the caller reuses its buffer: held bytes were copied
    streamed = [(o, n) for name, o, n in writes if "/shards/" in name]
    w.commit()
    assert len(streamed) >= 4
    for o, n in streamed:
        assert (o + n) % (2 << 20) == 0 and n <= 4 << 20, (o, n)
    q = np.random.default_rng(2).choice(ids, 5_000)
    _expect_wide(store, q)


def test_a_write_that_fails_midway_leaves_the_shard_as_it_was_and_the_writer_can_go_on(tmp_path, monkeypatch):
    import errno

    from torchforge.features.inspect import verify_store

    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    w = store.writer(shard_size="1GiB")
    real, calls = os.pwritev, {"n": 0, "fail": {2}}

    def pwritev(fd, views, offset):
        calls["n"] += 1
        if calls["n"] in calls["fail"]:
            real(fd, views[:1], offset)  # part of it reached the file, then the disk filled up
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    a, b, c = np.arange(0, 20_000), np.arange(20_000, 60_000), np.arange(60_000, 70_000)
    w.write(a, **_wide(a))  # 2.5 MiB of 128-byte rows: one piece written, the rest held
    with pytest.raises(OSError, match="injected") as failed:
        w.write(b, **_wide(b))  # 5 MiB more: its second piece fails after the first went out
    w.write(b, **_wide(b))  # the same rows again, while the error (and its traceback) is still alive
    del failed
    w.write(c, **_wide(c))
    assert w.commit() == 1
    assert verify_store(store.path) == (70_000, [])
    q = np.random.default_rng(3).permutation(70_000)
    _expect_wide(store, q)


def _fail_shard_writes(monkeypatch, name, fail):
    """Make calls of ``os.<name>`` on a shard file fail with ENOSPC while ``fail["on"]`` (for pwritev, after
    part of the bytes reached the file)."""
    import errno

    real = getattr(os, name)

    def call(fd, *args):
        if fail["on"] and "/shards/" in os.readlink(f"/proc/self/fd/{fd}"):
            fail["hits"] += 1
            if name == "pwritev":
                real(fd, args[0][:1], args[1])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(fd, *args)

    monkeypatch.setattr(os, name, call)


def test_a_commit_whose_shard_cannot_be_completed_keeps_its_rows_for_the_next_try(store, monkeypatch):
    from torchforge.features.inspect import verify_store

    fail = {"on": False, "hits": 0}
    _fail_shard_writes(monkeypatch, "pwritev", fail)
    w = store.writer(shard_size="1GiB")
    ids = np.random.default_rng(4).permutation(3_000).astype(np.int64)
    for k in range(0, 3_000, 500):
        w.write(ids[k:k + 500], **_rows(ids[k:k + 500]))
    fail["on"] = True  # the shard's buffered columns and header cannot be written
    with pytest.raises(OSError, match="injected"):
        w.commit()
    with pytest.raises(OSError, match="injected"):
        w.flush()  # and again: the same rows, the same shard
    assert fail["hits"] >= 2 and store.latest_version == 0
    fail["on"] = False
    assert w.commit() == 1
    assert verify_store(store.path) == (3_000, [])
    _expect(FeatureStore(store.path), np.random.default_rng(5).permutation(ids))


def test_a_write_that_cannot_complete_the_full_shard_keeps_none_of_its_rows(store, monkeypatch):
    from torchforge.features.inspect import verify_store

    fail = {"on": False, "hits": 0}
    _fail_shard_writes(monkeypatch, "pwritev", fail)
    w = store.writer(shard_size=100 * 26)  # 100 rows of 18 bytes + id
    a, b, lost = np.arange(0, 150), np.arange(150, 200), np.arange(1000, 1050)
    w.write(a, **_rows(a))  # past shard_size: completed by the next call with rows
    fail["on"] = True
    with pytest.raises(OSError, match="injected"):
        w.write(lost, **_rows(lost))
    assert fail["hits"] == 1
    fail["on"] = False
    w.write(b, **_rows(b))
    assert w.commit() == 1
    assert verify_store(store.path) == (200, [])
    _expect(store, np.random.default_rng(6).permutation(200))
    with pytest.raises(MissingIdsError):
        store.get(lost[:1])


def test_a_shard_that_cannot_be_made_durable_fails_the_commit_and_is_never_published(store, monkeypatch):
    from torchforge.features.inspect import verify_store

    w = store.writer()
    w.write(np.arange(10), **_rows(np.arange(10)))
    assert w.commit() == 1
    fail = {"on": True, "hits": 0}
    _fail_shard_writes(monkeypatch, "fsync", fail)
    w.write(np.arange(10, 20), **_rows(np.arange(10, 20)))
    with pytest.raises(TorchforgeError, match="could not be made durable.*10 rows were dropped") as e:
        w.commit()
    assert isinstance(e.value.__cause__, OSError) and fail["hits"] == 1
    assert store.latest_version == 1
    assert len(os.listdir(os.path.join(store.path, "shards"))) == 1  # the failed shard is gone, tmp too
    fail["on"] = False
    w.write(np.arange(20, 30), **_rows(np.arange(20, 30)))
    assert w.commit() == 2  # names only the shard of this commit, not the one that failed
    assert verify_store(store.path) == (10 + 20, [])
    s = FeatureStore(store.path)
    _expect(s, np.r_[np.arange(10), np.arange(20, 30)])
    with pytest.raises(MissingIdsError):
        s.get([15])


def test_a_failed_fsync_whose_cleanup_also_fails_still_never_publishes_the_shard(store, monkeypatch):
    from torchforge.features.inspect import verify_store

    w = store.writer()
    fail = {"on": True, "hits": 0}
    _fail_shard_writes(monkeypatch, "fsync", fail)
    real_unlink = os.unlink

    def unlink(path, *a, **k):  # removing this commit's shards fails too (EIO)
        if fail["on"] and "/shards/" in str(path):
            raise OSError(5, "Input/output error (injected)", str(path))
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    w.write(np.arange(10), **_rows(np.arange(10)))
    with pytest.raises(TorchforgeError, match="could not be made durable"):
        w.commit()
    fail["on"] = False
    w.write(np.arange(10, 20), **_rows(np.arange(10, 20)))
    assert w.commit() == 1  # only this commit's shard: before, the dropped one was named too
    assert verify_store(store.path) == (10, [])
    _expect(store, np.arange(10, 20))


def test_a_shard_whose_background_task_cannot_start_is_completed_by_the_next_try(store, monkeypatch):
    from torchforge.features import writer as wmod
    from torchforge.features.inspect import verify_store

    w = store.writer()
    ids = np.arange(500)
    w.write(ids, **_rows(ids))
    real = wmod.ThreadPoolExecutor

    def no_thread(*a, **k):
        raise RuntimeError("can't start new thread (injected)")

    monkeypatch.setattr(wmod, "ThreadPoolExecutor", no_thread)
    with pytest.raises(RuntimeError, match="injected"):
        w.commit()  # the shard's bytes were all written; only its fsync could not be started
    monkeypatch.setattr(wmod, "ThreadPoolExecutor", real)
    assert w.commit() == 1  # before: the retry wrote the columns again over the held bytes: a corrupt shard
    assert verify_store(store.path) == (500, [])
    _expect(store, np.random.default_rng(7).permutation(ids))


def test_abort_removes_the_shard_being_streamed(tmp_path):
    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    w = store.writer()
    w.write(np.arange(10), **_wide(np.arange(10)))
    assert len(os.listdir(os.path.join(store.path, "shards"))) == 1  # open, under its temporary name
    w.abort()
    assert os.listdir(os.path.join(store.path, "shards")) == []
    w.write(np.arange(5), **_wide(np.arange(5), salt=1))  # the writer goes on after an abort
    assert w.commit() == 1
    got = store.get([4, 0])
    assert np.array_equal(got["emb"].numpy(), _wide([4, 0], salt=1)["emb"])


def test_get_across_shards_keeps_order_repeats_and_fills_missing(tmp_path):
    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    for k in range(3):  # three commits, each its own shards
        w = store.writer(shard_size=64 * 143)
        ids = np.arange(k, 600, 3)
        for j in range(0, 200, 50):
            w.write(ids[j:j + 50], **_wide(ids[j:j + 50]))
        w.commit()
    assert len(store._snap.manifest.shards) > 3
    q = np.array([599, 0, 5, 5, 1, 700, 2, 598, -1, 0])
    got = store.get(q, missing={"emb": 7, "loss": -1, "tag": 0})
    known = (q >= 0) & (q < 600)
    want = _wide(np.where(known, q, 0))
    assert np.array_equal(got["emb"].numpy()[known], want["emb"][known])
    assert (got["emb"].numpy()[~known] == 7).all() and (got["loss"].numpy()[~known] == -1).all()
    assert np.array_equal(got["tag"].numpy()[known], want["tag"][known])
    assert np.array_equal(store.get(q[known], ["loss"])["loss"].numpy(), want["loss"][known])


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-50, 50) | st.integers(2**40, 2**40 + 9),
                    min_size=1, max_size=200, unique=True),
       probe=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-60, 60), max_size=50))
def test_index_lookup_finds_exactly_the_ids_it_holds(ids, probe):
    from torchforge.features.index import IdIndex, write_index

    ids = np.sort(np.array(ids, dtype=np.int64))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "i.safetensors")
        size, _ = write_index(path, ids, np.zeros(len(ids), np.int32), np.arange(len(ids)))
        idx = IdIndex(path, len(ids), size)
        q = np.concatenate([ids, np.array(probe, dtype=np.int64)])
        pos, found = idx.lookup(q)
        assert np.array_equal(found, np.isin(q, ids))
        assert np.array_equal(ids[pos[found]], q[found])
        idx.close()


@settings(max_examples=30, deadline=None)
@given(parent=st.lists(st.integers(0, 40), unique=True), new=st.lists(st.integers(0, 40), max_size=60))
def test_overlay_is_last_write_wins(parent, new):
    from torchforge.features.index import overlay

    p = np.sort(np.array(parent, dtype=np.int64))
    want = {int(i): (0, r) for r, i in enumerate(p)}
    for r, i in enumerate(new):
        want[i] = (1, r)
    ids, sh, row = overlay(p, np.zeros(len(p), np.int32), np.arange(len(p)), np.array(new, dtype=np.int64),
                           np.ones(len(new), np.int32), np.arange(len(new)))
    assert ids.tolist() == sorted(want) and sh.dtype == np.int32 and row.dtype == np.int64
    assert list(zip(sh.tolist(), row.tolist())) == [want[i] for i in sorted(want)]


# --- hostile files -------------------------------------------------------------------------------
@pytest.fixture
def written(store):
    with store.writer() as w:
        w.write(np.arange(50), **_rows(np.arange(50)))
    return store


def _manifest(store):
    path = os.path.join(store.path, "versions", "v-00000001.json")
    with open(path) as f:
        return path, json.load(f)


def _lie(store, **changes):
    path, doc = _manifest(store)
    for k, v in changes.items():
        doc[k] = v
    with open(path, "w") as f:
        json.dump(doc, f)


def test_truncated_shard_raises_corrupt_shard_error(written):
    shard = os.path.join(written.path, written._snap.manifest.shards[0].file)
    os.truncate(shard, os.path.getsize(shard) - 7)
    with pytest.raises(CorruptShardError, match="truncated") as e:
        FeatureStore(written.path).get([1])
    assert e.value.path == shard


def test_truncated_index_raises_corrupt_shard_error(written):
    index = os.path.join(written.path, written._snap.manifest.index.file)
    os.truncate(index, 100)
    with pytest.raises(CorruptShardError, match="truncated"):
        FeatureStore(written.path)


@pytest.mark.parametrize("lie", [
    {"rows": 51},  # more rows than the index holds
    {"shards": [{"file": "shards/../../../etc/passwd.safetensors", "bytes": 10, "rows": 50, "digest": ""}]},
    {"shards": [{"file": "/etc/x.safetensors", "bytes": 10, "rows": 50, "digest": ""}]},
    {"shards": "all"},
    {"version": 2},
    {"parent": 5},
    {"format": "something else"},
    {"schema": {"emb": {"shape": [4], "dtype": "F99"}}},
    {"index": None},
])
def test_lying_manifest_raises_format_error(written, lie):
    _lie(written, **lie)
    with pytest.raises(FormatError):
        FeatureStore(written.path).get([1])


def test_manifest_rows_and_shard_headers_must_agree(written):
    _, doc = _manifest(written)
    doc["shards"][0]["rows"] = 60  # the shard holds 50
    doc["rows"] = 50
    _lie(written, **doc)
    with pytest.raises(CorruptShardError, match="should be"):
        FeatureStore(written.path).get([1])
    _lie(written, shards=[{**doc["shards"][0], "rows": 50, "bytes": doc["shards"][0]["bytes"] + 1}])
    with pytest.raises(CorruptShardError, match="manifest says"):
        FeatureStore(written.path).get([1])


def test_garbage_manifest_and_index_raise_typed_errors(written):
    path, _ = _manifest(written)
    with open(path, "wb") as f:
        f.write(b"{not json")
    with pytest.raises(FormatError, match="JSON"):
        FeatureStore(written.path)


def test_lying_index_raises_corrupt_shard_error_not_an_out_of_bounds_read(tmp_path, written):
    from torchforge.features.index import write_index
    from torchforge.features.writer import file_digest

    m = written._snap.manifest
    index = os.path.join(written.path, m.index.file)
    ids = np.arange(50)
    write_index(index, ids, np.zeros(50, np.int32), np.full(50, 10**9))  # rows far outside the shard
    _lie(written, index={**m.index.to_json(), "bytes": os.path.getsize(index), "digest": file_digest(index)})
    with pytest.raises(CorruptShardError, match="row 1000000000"):
        FeatureStore(written.path).get([3])
    write_index(index, ids, np.full(50, 9, np.int32), np.zeros(50))  # a shard the manifest lacks
    _lie(written, index={**m.index.to_json(), "bytes": os.path.getsize(index), "digest": file_digest(index)})
    with pytest.raises(CorruptShardError, match="shard 9"):
        FeatureStore(written.path).get([3])
    for shard, row, says in ((0, -5, "row -5"), (-2, 0, "shard -2")):  # negative: never read before the map
        write_index(index, ids, np.full(50, shard, np.int32), np.full(50, row))
        _lie(written, index={**m.index.to_json(), "bytes": os.path.getsize(index), "digest": file_digest(index)})
        for batch in ([3], list(range(50)) * 6):  # a few ids (searched one by one) and many (in rounds)
            with pytest.raises(CorruptShardError, match=says):
                FeatureStore(written.path).get(batch)


def test_lying_index_over_several_shards_is_caught_before_a_row_past_its_shard_is_read(tmp_path):
    # the shards lie side by side in one address range: a row one past its shard's end would read
    # the padding or the next shard's bytes, so every row is checked against its own shard's count
    from torchforge.features.index import write_index

    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    for k in range(2):
        with store.writer() as w:
            w.write(np.arange(k * 50, k * 50 + 50), **_wide(np.arange(k * 50, k * 50 + 50)))
    m = store._snap.manifest
    assert [e.rows for e in m.shards] == [50, 50]
    assert int(store.get(np.arange(100))["emb"][:, 0].sum()) == int(_wide(np.arange(100))["emb"][:, 0].sum())
    index = os.path.join(store.path, m.index.file)
    ids = np.arange(100)
    for lie_shard in (0, 1):
        sh = np.repeat(np.arange(2, dtype=np.int32), 50)
        rw = np.tile(np.arange(50), 2)
        rw[lie_shard * 50 + 7] = 50  # one past the end of its shard
        write_index(index, ids, sh, rw)
        assert os.path.getsize(index) == m.index.bytes  # the manifest's size still holds; get checks no digest
        for batch in ([lie_shard * 50 + 7], list(range(100)) * 3):
            with pytest.raises(CorruptShardError, match=f"row 50 of shard {lie_shard}"):
                FeatureStore(store.path).get(batch)
        assert FeatureStore(store.path).get([lie_shard * 50 + 6])["loss"].item() == (lie_shard * 50 + 6) * 0.25


def test_a_manifest_lying_about_a_shard_size_fails_that_shard_only(tmp_path):
    # the shards' address range is reserved from the manifest's sizes at open: a size too large to
    # reserve must not keep the store from opening, nor verify from reporting
    from torchforge.features.inspect import verify_store

    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    for k in range(2):
        with store.writer() as w:
            w.write(np.arange(k * 10, k * 10 + 10), **_wide(np.arange(k * 10, k * 10 + 10)))
    path = os.path.join(store.path, "versions", "v-00000002.json")
    with open(path) as f:
        doc = json.load(f)
    doc["shards"][0]["bytes"] = 2**62
    with open(path, "w") as f:
        json.dump(doc, f)
    lied = FeatureStore(store.path)
    assert np.array_equal(lied.get([15, 12])["tag"].numpy(), _wide([15, 12])["tag"])  # the intact shard
    with pytest.raises(CorruptShardError, match="manifest says 4611686018427387904"):
        lied.get([3])
    rows, problems = verify_store(store.path)
    assert rows == 10 and len(problems) == 1 and "version 2" in problems[0]


def test_many_small_shards_reserve_about_their_own_size(tmp_path):
    store = FeatureStore(tmp_path / "fs", WIDE, create=True)
    ids = np.arange(6000)
    with store.writer(shard_size=4096) as w:  # a shard every call: 30 rows
        for k in range(0, len(ids), 30):
            w.write(ids[k:k + 30], **_wide(ids[k:k + 30]))
    m = store._snap.manifest
    assert len(m.shards) == 200
    page = mmap.PAGESIZE
    pages = sum(-(-e.bytes // page) * page for e in m.shards)
    assert store._snap._region.size == pages  # not 2 MiB a shard (400 MiB here)
    _expect_wide(store, ids[::-1])


# --- loader, shared memory, join -----------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.blocks = []

    def alloc(self, n):
        a = np.empty(n, np.uint8)
        self.blocks.append(a)
        return a


def test_get_allocates_its_output_with_the_loader_arena(written):
    arena = _Recorder()
    collate.set_arena(arena)
    try:
        got = written.get([4, 2, 9])
    finally:
        collate.set_arena(None)
    ptrs = {b.ctypes.data for b in arena.blocks}
    assert {t.data_ptr() for t in got.values()} <= ptrs and len(arena.blocks) == 2
    _expect(written, [4, 2, 9])


class _Batches(torch.utils.data.Dataset):
    def __init__(self, store, batches):
        self.store, self.batches = store, batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.store.get(self.batches[i])


def test_get_in_dataloader_workers_reads_the_version_of_the_handle(written):
    batches = [list(range(k, k + 5)) for k in range(0, 45, 5)]
    loader = DataLoader(_Batches(written, batches), batch_size=None, num_workers=2)
    with FeatureStore(written.path).writer() as w:  # a newer version: the workers still read version 1
        w.write(np.arange(50), **_rows(np.arange(50), salt=1))
    for b, got in zip(batches, loader):
        assert torch.equal(got["loss"], _rows(b)["loss"])


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"id": 49 - i, "x": torch.tensor(i)}


def test_join_adds_columns_lazily_in_workers(written, tmp_path, write_jinx):
    joined = written.join(_Samples(), key="id", columns=["loss"])
    assert joined[0]["loss"] == 24.5 and joined[0]["x"] == 0
    batches = list(DataLoader(joined, batch_size=8, num_workers=2))
    assert torch.equal(torch.cat([b["loss"] for b in batches]), torch.arange(49, 9, -1) * 0.5)
    assert torch.equal(torch.cat([b["x"] for b in batches]), torch.arange(40))
    write_jinx(tmp_path / "j", ({"id": i, "text": f"t{i}"} for i in range(60)))
    from torchforge.datasets.jinx import JinxDataset

    lazy = written.join(JinxDataset(str(tmp_path / "j")), missing={"emb": -1, "loss": -1})
    batch = next(iter(DataLoader(lazy, batch_size=60, num_workers=1)))
    assert batch["text"][0] == "t0" and batch["emb"].shape == (60, 4)
    assert batch["loss"][:50].tolist() == (np.arange(50) * 0.5).tolist() and (batch["loss"][50:] == -1).all()
    with pytest.raises(MissingIdsError):
        written.join(JinxDataset(str(tmp_path / "j")))[55]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_join_reads_the_version_of_when_it_was_made_at_any_loader_setting(tmp_path, workers, persistent):
    """The join held the store's own handle, which follows its writers' commits: after a commit between
    epochs, epoch 2 read the new rows with 0 workers or fresh workers and the old ones with persistent
    workers. It now reads the version of when it was made, in every worker and epoch."""
    store = FeatureStore(tmp_path / "fs", {"loss": ((), torch.float32)}, create=True)
    with store.writer() as w:
        w.write(range(40, 50), loss=torch.zeros(10))
    loader = DataLoader(store.join(_Samples(), missing=-1.0), batch_size=40, num_workers=workers,
                        persistent_workers=persistent)
    first = next(iter(loader))["loss"]
    with store.writer() as w:
        w.write(range(40, 50), loss=torch.ones(10))
    assert store.version == 2 and store.get([40])["loss"].tolist() == [1.0]
    assert torch.equal(next(iter(loader))["loss"], first) and first[:10].eq(0).all()
    assert next(iter(DataLoader(store.join(_Samples(), missing=-1.0), batch_size=40)))["loss"][:10].eq(1).all()


def _same_batch(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_the_loader_joins_whole_columns_into_the_batch(written, tmp_path, write_jinx, monkeypatch):
    from torchforge.datasets.jinx import JinxDataset
    from torchforge.features.join import JoinedDataset

    write_jinx(tmp_path / "jb", ({"id": (i * 7) % 60, "text": f"t{i}", "n": i} for i in range(60)))
    joined = written.join(JinxDataset(str(tmp_path / "jb")), missing={"emb": -1, "loss": -1})
    for kw in ({"collate_fn": collate.padded_collate}, {}):
        theirs = list(torch.utils.data.DataLoader(joined, batch_size=16, **kw))  # samples with their rows
        ours = list(DataLoader(joined, batch_size=16, num_workers=2, **kw))  # whole columns, in the workers
        assert len(ours) == len(theirs) == 4
        for a, b in zip(ours, theirs):
            _same_batch(a, b)
    rows = []  # the batch path makes no row per sample: __getitems__ is not called
    monkeypatch.setattr(JoinedDataset, "__getitems__", lambda self, idx: rows.append(idx) or [])
    batch = next(iter(DataLoader(joined, batch_size=16, collate_fn=collate.padded_collate)))
    assert not rows and batch["emb"].shape == (16, 4) and batch["n"].tolist() == list(range(16))
    # another collate function sees every sample with its columns
    seen = next(iter(DataLoader(joined, batch_size=4, collate_fn=list)))
    assert rows and seen == []


def test_a_commit_that_loses_the_race_for_a_number_redoes_itself_on_top_of_the_winner(store, monkeypatch):
    import torchforge.features.writer as writer_mod

    a, b = store.writer(), store.writer()
    a.write([1, 2], **_rows([1, 2]))
    b.write([2, 3], **_rows([2, 3], salt=9))
    real, calls = writer_mod.list_versions, []

    def stale(root):  # a's first look at the versions happens before b's commit lands
        calls.append(1)
        if len(calls) == 1:
            assert b.commit() == 1
            return []
        return real(root)

    monkeypatch.setattr(writer_mod, "list_versions", stale)
    assert a.commit() == 2
    assert len(os.listdir(os.path.join(store.path, "index"))) == 2  # the losing attempt's index is gone
    _expect(store, [1, 2])  # a committed last: its row for 2 wins
    _expect(store, [3], salt=9)  # b's rows are not lost


# --- command line --------------------------------------------------------------------------------
def test_cli_inspect_and_verify_understand_a_store(written, capsys):
    from torchforge.cli import main

    assert main(["inspect", written.path]) == 0
    out = capsys.readouterr().out
    assert "format: feature-store" in out and "rows: 50" in out and "emb: float16 [4]" in out
    assert main(["verify", written.path]) == 0
    assert "50 rows checked over every version, 0 problems" in capsys.readouterr().out
    shard = os.path.join(written.path, written._snap.manifest.shards[0].file)
    with open(shard, "r+b") as f:  # flip a byte of the data: same size, header intact
        f.seek(os.path.getsize(shard) - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", written.path]) == 1
    assert "digest" in capsys.readouterr().out


# --- hostile stores found by review: each a typed error naming the file, never wrong rows ----------------
def _rewrite_manifest(store, version, fn):
    path = os.path.join(store.path, "versions", f"v-{version:08d}.json")
    with open(path) as f:
        doc = json.load(f)
    fn(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def test_a_missing_index_is_a_typed_error_and_verify_reports_it_and_goes_on(store, capsys):
    from torchforge.cli import main
    from torchforge.features.inspect import verify_store

    for k in range(2):
        with store.writer() as w:
            w.write(np.arange(k * 10, k * 10 + 10), **_rows(np.arange(k * 10, k * 10 + 10)))
    index1 = os.path.join(store.path, FeatureStore(store.path, version=1)._snap.manifest.index.file)
    os.unlink(index1)  # version 1's index only: version 2 stays whole
    with pytest.raises(CorruptShardError, match="index the manifest lists is missing") as e:
        FeatureStore(store.path, version=1)
    assert e.value.path == index1
    _expect(FeatureStore(store.path), np.arange(20))
    checked, problems = verify_store(store.path)
    assert checked == 20 and problems and all("version 1" in p and index1 in p for p in problems)
    assert any("index the manifest lists is missing" in p for p in problems)
    assert main(["verify", store.path]) == 1  # a report, not a traceback
    assert "missing" in capsys.readouterr().out


@pytest.mark.parametrize("lie", ["rows", "digits", "schema.json", "manifest schema"])
def test_a_manifest_or_schema_that_lies_is_a_format_error_on_open(written, lie):
    if lie == "rows":  # the index and its shard hold 50
        path = _rewrite_manifest(written, 1, lambda d: d.update(rows=49))
    elif lie == "digits":  # past Python's int-parsing limit: json raises a bare ValueError
        path = os.path.join(written.path, "versions", "v-00000001.json")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace('"parent": 0', '"parent": ' + "9" * 5000, 1))
    else:  # a shape far larger than the shards': get() must not size its output from it
        path = os.path.join(written.path, "schema.json" if lie == "schema.json" else "versions/v-00000001.json")
        with open(path) as f:
            doc = json.load(f)
        (doc["columns"] if lie == "schema.json" else doc["schema"])["emb"]["shape"] = [2**39]
        with open(path, "w") as f:
            json.dump(doc, f)
    with pytest.raises(FormatError) as e:
        FeatureStore(written.path).get([1])
    assert e.value.path in (path, os.path.join(written.path, "versions", "v-00000001.json"))


def test_a_manifest_listing_its_shards_in_another_order_is_caught_on_read_and_by_verify(store):
    from torchforge.features.inspect import verify_store

    for k in range(2):  # two commits: ids 0..49 in shard 0, ids 100..149 in shard 1
        with store.writer() as w:
            w.write(np.arange(k * 100, k * 100 + 50), **_rows(np.arange(k * 100, k * 100 + 50)))
    _expect(FeatureStore(store.path), np.r_[np.arange(50), np.arange(100, 150)])
    _rewrite_manifest(store, 2, lambda d: d.update(shards=d["shards"][::-1]))  # each entry true, the order not
    for batch, missing in (([100, 3], None), (list(range(50)) * 8, None), ([100, 7, 12345], 0.0)):
        with pytest.raises(CorruptShardError, match="holds id") as e:
            FeatureStore(store.path).get(batch, missing=missing)
        assert os.path.basename(e.value.path).endswith(".safetensors")
    _, problems = verify_store(store.path)
    assert len(problems) == 1 and "version 2" in problems[0] and "holds id" in problems[0]


def test_a_damaged_steps_field_in_the_index_is_an_error_not_ids_reported_missing(tmp_path):
    store = FeatureStore(tmp_path / "fs", SCHEMA, create=True)
    ids = np.arange(0, 3000, 3)  # 1,000 ids: a batch of all of them is looked up in rounds
    with store.writer() as w:
        w.write(ids, **_rows(ids))
    index = os.path.join(store.path, store._snap.manifest.index.file)
    with open(index, "r+b") as f:
        head = f.read(4096)
        at = head.index(b'"steps":"') + len(b'"steps":"')
        assert head[at:at + 1] != b"0" and head[at + 1:at + 2] == b'"'  # one digit: the size stays the same
        f.seek(at)
        f.write(b"0")
    reopened = FeatureStore(store.path)
    _expect(reopened, ids[:5])  # a few ids are searched one by one and still found
    for missing in (None, -1.0):
        with pytest.raises(CorruptShardError, match="steps=0") as e:
            reopened.get(ids, missing=missing)
        assert e.value.path == index
    with pytest.raises(MissingIdsError):  # a really missing id is still only that
        FeatureStore(tmp_path / "fs").get(np.r_[ids[:5], [1]])


def test_a_damaged_id_in_the_index_is_an_error_not_ids_reported_missing(tmp_path):
    store = FeatureStore(tmp_path / "fs", SCHEMA, create=True)
    ids = np.arange(1000)
    with store.writer() as w:
        w.write(ids, **_rows(ids))
    index = os.path.join(store.path, store._snap.manifest.index.file)
    with open(index, "r+b") as f:  # one flipped byte in id 500: the ids no longer increase there
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        at = 8 + n + head["id"]["data_offsets"][0] + 8 * 500 + 6
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    reopened = FeatureStore(store.path)
    _expect(reopened, [1, 2, 999])  # hits are checked by the id their row holds: still right
    for probe in ([499, 500, 501], ids):  # one by one, and in rounds
        for missing in (None, 0.0):  # a present id is never reported missing, nor given the default
            with pytest.raises(CorruptShardError, match="do not increase") as e:
                FeatureStore(store.path).get(probe, missing=missing)
            assert e.value.path == index and e.value.offset == 8 + n + head["id"]["data_offsets"][0] + 8 * 501
    with pytest.raises(CorruptShardError):
        500 in FeatureStore(store.path)  # noqa: B015


def test_a_schema_whose_rows_are_too_large_is_a_format_error_before_anything_is_sized_from_it(written):
    huge = {"shape": [2**39, 2**39], "dtype": "F16"}  # each dimension alone is in range
    path = os.path.join(written.path, "schema.json")
    with open(path) as f:
        doc = json.load(f)
    doc["columns"]["emb"] = huge
    with open(path, "w") as f:
        json.dump(doc, f)
    _, m = _manifest(written)
    _lie(written, schema={**m["schema"], "emb": huge})  # the manifest agrees with it
    with pytest.raises(FormatError, match="1 TiB") as e:
        FeatureStore(written.path).get([1])
    assert e.value.path == path


def test_store_arguments_that_do_not_fit_are_typed_errors_naming_them(written):
    with pytest.raises(TypeError, match="one id"):
        [5, 6] in written  # noqa: B015
    assert 5 in written and 60 not in written
    with pytest.raises(ValueError, match="'emb'"):
        written.get([3, 60], missing=torch.zeros(2))  # rows of emb are (4,)


def test_join_refuses_ids_that_are_not_integers(written):
    joined = written.join([{"id": 2.9}, {"id": "5"}])
    for i, shown in ((0, "float 2.9"), (1, "str 5")):  # (int() would make them ids 2 and 5)
        with pytest.raises(TypeError, match=shown):
            joined[i]
    with pytest.raises(TypeError, match="float 2.9"):  # the loader's whole-column path collates them first
        next(iter(DataLoader(written.join([{"id": 2.9}, {"id": 1.7}]), batch_size=2)))
    ok = written.join([{"id": np.int64(3)}, {"id": torch.tensor(4)}])  # integers of any kind are ids
    assert [float(s["loss"]) for s in (ok[0], ok[1])] == [1.5, 2.0]


def test_a_commit_whose_versions_fsync_fails_after_the_link_keeps_that_version_whole(store, monkeypatch):
    from torchforge.features import writer as fw

    real = fw.fsync_dir

    def failing(path):
        if os.path.basename(path) == "versions":
            raise OSError(5, "Input/output error", path)
        real(path)

    w = store.writer()
    w.write(np.arange(10), **_rows(np.arange(10)))
    monkeypatch.setattr(fw, "fsync_dir", failing)
    with pytest.raises(OSError):
        w.commit()  # the version is published; only its durability is unknown
    monkeypatch.setattr(fw, "fsync_dir", real)
    v1 = FeatureStore(store.path)
    assert v1.version == 1
    _expect(v1, np.arange(10))
    w.write(np.arange(10, 20), **_rows(np.arange(10, 20)))  # the same writer goes on: a new index name
    assert w.commit() == 2
    w.close()  # nothing of version 1 is deleted by the close's abort
    _expect(FeatureStore(store.path, version=1), np.arange(10))
    _expect(FeatureStore(store.path), np.arange(20))
    from torchforge.features.inspect import verify_store
    assert verify_store(store.path) == (30, [])


def test_values_a_column_cannot_hold_are_refused_not_wrapped(tmp_path):
    """1000 into int8 was stored as -24, 2.7 into uint8 as 2, and missing=300 for an int8 column filled 44:
    each is now a ValueError naming the column (and the row's id); nothing is kept. (A float column rounds as
    torch's casts do: 1e6 into float16 is inf, as .half() makes it.)"""
    st_ = FeatureStore(tmp_path / "fs", {"label": ((), torch.int8), "mask": ((2,), torch.uint8),
                                         "h": ((), torch.float16)}, create=True)
    ok = {"label": torch.tensor([5, -7]), "mask": np.array([[1.0, 2.0], [0.0, 255.0]]), "h": np.array([0.5, 1e4])}
    bad = [("label", torch.tensor([5, 1000]), "cannot hold the value 1000 \\(row of id 8\\).*-24"),
           ("mask", np.array([[1.0, 2.7], [0, 0]]), "cannot hold the value 2.7 \\(row of id 7\\)"),
           ("mask", np.array([[1.0, -1.0], [0, 0]]), "cannot hold the value -1"),
           ("mask", np.array([[np.nan, 0], [0, 0]]), "cannot hold the value nan")]
    with st_.writer() as w:
        for name, value, match in bad:
            with pytest.raises(ValueError, match=match):
                w.write([7, 8], **{**ok, name: value})
        w.write([7, 8], **ok)
    got = st_.get([7, 8])
    assert got["label"].tolist() == [5, -7] and got["mask"].tolist() == [[1, 2], [0, 255]]
    assert got["h"].tolist() == [0.5, 1e4]
    for missing, match in (({"label": 300, "mask": 0, "h": 0}, "'label'"), ({"label": 0, "mask": -1, "h": 0}, "'mask'")):
        with pytest.raises(ValueError, match=f"missing= for column {match}"):
            st_.get([7, 99], missing=missing)
    assert st_.get([99], missing={"label": -128, "mask": 255, "h": float("inf")})["h"].tolist() == [float("inf")]


@pytest.mark.parametrize(("dtype", "value"), [
    (torch.uint8, torch.tensor([-1], dtype=torch.int8)), (torch.int8, torch.tensor([200], dtype=torch.uint8)),
    (torch.int16, np.array([40000], np.uint16)), (torch.uint32, torch.tensor([-5], dtype=torch.int32)),
    (torch.int64, np.array([2**63], np.uint64)), (torch.uint64, [-1])])
def test_a_value_of_the_other_signedness_and_the_same_width_is_refused_not_wrapped(tmp_path, dtype, value):
    """Between integer types of one width the cast back is exact (-1 -> 255 -> -1), so the check passed and
    -1 into uint8 was stored as 255, a Python -1 into uint64 as 2**64 - 1; missing= the same."""
    store = FeatureStore(tmp_path / "fs", {"x": ((), dtype)}, create=True)
    with store.writer() as w:
        with pytest.raises(ValueError, match="column 'x' .*cannot hold the value"):
            w.write([3], x=value)
        w.write([4], x=[7])
    with pytest.raises(ValueError, match="missing= for column 'x'"):
        store.get([5], missing=torch.as_tensor(value)[0])
    assert store.get([4])["x"].tolist() == [7]


def test_numpy_values_in_either_byte_order_and_uint64_defaults_past_int64_are_taken(tmp_path):
    """A big-endian array ('>f4', read from a file) was refused with torch's byte-order error naming no
    column; missing=2**64 - 1 (or np.uint64) for a uint64 column was refused as not fitting."""
    store = FeatureStore(tmp_path / "fs", {"f": ((2,), torch.float32), "u": ((), torch.uint64)}, create=True)
    with store.writer() as w:
        w.write(np.array([1, 2], ">i8"), f=np.array([[1, 2], [3, 4]], ">f4")[:, ::-1],
                u=np.array([2**64 - 1, 5], ">u8"))
    got = store.get([1, 2])
    assert got["f"].tolist() == [[2, 1], [4, 3]] and got["u"].tolist() == [2**64 - 1, 5]
    with store.writer() as w:  # (a list of Python ints past int64: torch's "Overflow when unpacking long long")
        w.write([3, 4], f=[[0, 0], [0, 0]], u=[2**64 - 1, 0])
    assert store.get([3, 4])["u"].tolist() == [2**64 - 1, 0]
    for fill in (2**64 - 1, np.uint64(2**64 - 1)):
        assert store.get([9], missing={"f": 0, "u": fill})["u"].tolist() == [2**64 - 1]
    with pytest.raises(ValueError, match="missing= for column 'u'"):
        store.get([9], missing={"f": 0, "u": 2**64})


def test_a_shard_header_that_moves_a_column_is_a_typed_error_not_another_columns_values(tmp_path):
    """A header that swaps the data offsets of two columns of one dtype and shape passed the dtype and shape
    checks, and get() returned column b's values as column a's; the writer's layout is fixed, and checked."""
    import glob
    import struct

    store = FeatureStore(tmp_path / "fs", {"a": ((), torch.float32), "b": ((), torch.float32)}, create=True)
    with store.writer() as w:
        w.write(np.arange(10), a=np.arange(10, dtype=np.float32), b=-np.arange(10, dtype=np.float32))
    (path,) = glob.glob(str(tmp_path / "fs" / "shards" / "*.safetensors"))
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        head["a"]["data_offsets"], head["b"]["data_offsets"] = head["b"]["data_offsets"], head["a"]["data_offsets"]
        text = json.dumps(head, separators=(",", ":")).encode()
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
    with pytest.raises(CorruptShardError, match="tensor '[ab]' starts at byte") as e:
        FeatureStore(tmp_path / "fs").get([3])
    assert e.value.path == path and e.value.offset is not None


@pytest.mark.parametrize("which", ["index", "shard", "manifest"])
def test_a_fifo_in_place_of_a_stores_file_is_a_typed_error_not_a_hang(written, which):
    """open() of a FIFO blocks until a writer comes: FeatureStore(path) and verify hung for ever on a FIFO in
    place of the index; every file of a store is now opened without blocking and refused if not regular."""
    import glob

    from torchforge.cli import verify_dataset

    pattern = {"index": "index/*.safetensors", "shard": "shards/*.safetensors", "manifest": "versions/*.json"}[which]
    (path,) = glob.glob(os.path.join(written.path, pattern))
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(TorchforgeError, match="not a regular file") as e:
        FeatureStore(written.path).get([3])
    assert e.value.path == path
    _, problems = verify_dataset(written.path)
    assert problems and "not a regular file" in " ".join(problems)


def test_verify_checks_a_store_of_more_shards_than_the_process_may_open_files(tmp_path):
    """verify kept every shard mapped (one descriptor each): a store whose versions name more shards than
    RLIMIT_NOFILE allows was 'OSError: Too many open files' and nothing was checked."""
    store = FeatureStore(tmp_path / "fs", {"e": ((16,), torch.float32)}, create=True)
    with store.writer(shard_size=4096) as w:  # a shard per two writes: 150 shards
        for a in range(0, 300 * 56, 56):
            w.write(np.arange(a, a + 56), e=torch.arange(a, a + 56).float()[:, None].expand(56, 16))
    assert len(os.listdir(tmp_path / "fs" / "shards")) >= 140
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100)); "
            "from torchforge.cli import main; sys.exit(main(['verify', sys.argv[1]]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fs")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{300 * 56} rows checked over every version, 0 problems" in proc.stdout


def test_prune_keeps_the_newest_versions_and_frees_the_files_only_older_ones_name(tmp_path):
    """Each commit writes an id index of the whole store: 60 small commits to a big store grew it 40-fold,
    and nothing could remove old versions. prune(keep) deletes the older versions and their files."""
    store = FeatureStore(tmp_path / "fs", SCHEMA, create=True)
    with store.writer() as w:
        w.write(np.arange(1000), **_rows(np.arange(1000)))
    for k in range(5):  # overwrites of a few rows, one commit each
        with store.writer() as w:
            w.write(np.arange(k, 1000, 100), **_rows(np.arange(k, 1000, 100), salt=k + 1))
    old = store.at(2)
    files = {sub: set(os.listdir(tmp_path / "fs" / sub)) for sub in ("shards", "index")}
    assert len(files["index"]) == 6
    assert store.prune(keep=2) == [1, 2, 3, 4]
    assert set(os.listdir(tmp_path / "fs" / "index")) < files["index"] and len(os.listdir(tmp_path / "fs" / "index")) == 2
    assert set(os.listdir(tmp_path / "fs" / "shards")) <= files["shards"]
    assert store.version == 6 and store.at(5).version == 5
    with pytest.raises(NotFoundError, match="version 2 was pruned"):
        store.at(2)
    _expect(store, np.arange(5, 1000, 100))  # untouched since the first commit
    _expect(store, np.arange(4, 1000, 100), salt=5)
    assert store.prune(keep=2) == [] and old.version == 2  # (a handle at a deleted version is not moved)
    with store.writer() as w:  # commits go on after a prune
        w.write([5000], **_rows([5000]))
    assert store.version == 7 and len(store) == 1001
    from torchforge.cli import verify_dataset
    checked, problems = verify_dataset(store.path)
    assert problems == [] and checked == 1000 + 1000 + 1001
    with pytest.raises(ValueError, match="keep=0"):
        store.prune(keep=0)


def _commit_many(path, rank, n):
    store = FeatureStore(path)
    for k in range(n):
        with store.writer() as w:
            ids = np.arange(rank * 1000 + k * 10, rank * 1000 + k * 10 + 10)
            w.write(ids, **_rows(ids))


def _prune_while(path, stop):
    store = FeatureStore(path)
    while not stop.is_set():
        store.prune(keep=1)


def _open_while(path, stop):
    while not stop.is_set():  # a new handle opens the newest version, which a prune may remove meanwhile
        store = FeatureStore(path)
        if len(store):
            store.get(store.ids()[:1])


def test_commits_concurrent_with_prune_are_never_lost(tmp_path):
    """A commit whose parent version is pruned between its read and its claim redoes its index on the newest
    version (it raised a CorruptShardError for the vanished index), and a handle opening the newest version
    while a prune removes it opens the newer one: 3 writers x 15 commits and a process opening handles,
    against a process pruning to one version all the time, lose no row and raise nothing."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    path = str(tmp_path / "fs")
    FeatureStore(path, SCHEMA, create=True)
    stop = ctx.Event()
    pruner = ctx.Process(target=_prune_while, args=(path, stop))
    pruner.start()
    opener = ctx.Process(target=_open_while, args=(path, stop))
    opener.start()
    writers = [ctx.Process(target=_commit_many, args=(path, r, 15)) for r in range(3)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(240)
    stop.set()
    pruner.join(60)
    opener.join(60)
    assert [p.exitcode for p in writers] == [0, 0, 0] and pruner.exitcode == 0 and opener.exitcode == 0
    store = FeatureStore(path)
    ids = np.concatenate([np.arange(r * 1000, r * 1000 + 150) for r in range(3)])
    assert store.version == 45 and len(store) == 450
    _expect(store, ids)


def test_a_join_keeps_the_datasets_shards_and_prefetch(written, tmp_path):
    """GlobalSampler(store.join(ds), shard_affinity=True or bucket_size="shards") was refused (the join hid
    the shard boundaries), and the loader never asked a joined remote dataset to prefetch."""
    from torchforge.datasets.jinx import JinxDataset
    from torchforge.formats.jinx import JinxWriter

    with JinxWriter(str(tmp_path / "sh"), shard_size=1024) as w:
        for i in range(60):
            w.write({"id": i, "text": "x" * 40})
    ds = JinxDataset(str(tmp_path / "sh"))
    joined = written.join(ds, columns=["loss"], missing={"loss": -1})
    assert list(joined.shard_sizes) == list(ds._counts) and len(ds._counts) > 2
    for kw in ({"bucket_size": "shards"}, {"shard_affinity": True}):
        assert list(GlobalSampler(joined, seed=0, **kw)) == list(GlobalSampler(ds, seed=0, **kw))
    assert joined.prefetch is None  # a local dataset has none: the loader plans nothing

    class Remote(JinxDataset):  # a dataset that prefetches, as the remote ones do
        asked: ClassVar[list] = []

        def prefetch(self, indices, **kw):
            Remote.asked.append(list(indices))

    joined = written.join(Remote(str(tmp_path / "sh")), columns=["loss"], missing={"loss": -1})
    sampler = GlobalSampler(joined, seed=1)
    assert len(list(DataLoader(joined, batch_size=8, sampler=sampler))) == 8
    assert Remote.asked == [list(GlobalSampler(ds, seed=1))]


def test_a_loader_state_over_a_join_records_its_datasets_version_as_without_it(written, tmp_path):
    """The join forwarded a remote dataset's version (which hashes its URLs) and not the URL-free one a
    loader state records: through a join, a copy of the dataset at another URL was refused."""
    from torchforge.datasets.jinx import JinxDataset
    from torchforge.formats.jinx import JinxWriter

    with JinxWriter(str(tmp_path / "v")) as w:
        for i in range(8):
            w.write({"id": i})

    class Pinned(JinxDataset):  # the two versions a remote dataset pins
        version, content_version = "with-urls", "names-sizes-etags"

    ds = Pinned(str(tmp_path / "v"))
    bare = DataLoader(ds, 4).state_dict()
    joined = DataLoader(written.join(ds, columns=["loss"], missing={"loss": -1}), 4).state_dict()
    assert bare["dataset_version"] == joined["dataset_version"] == "names-sizes-etags"
