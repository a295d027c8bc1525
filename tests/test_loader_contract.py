"""torch's DataLoader contract, checked against torch's own loader in the same test: signature and
argument checks, default collate (hypothesis), IterableDataset with get_worker_info, seeds, exceptions,
any picklable batch, and the smaller defects the drop-in issue lists."""
from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import resource
import signal
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchforge.loader import DataLoader
from torchforge.sampler import GlobalSampler, IterableShards

TorchLoader = torch.utils.data.DataLoader


def same(a, b) -> bool:
    """Equal values of equal types, recursively (tensors by dtype, shape and value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --- signature and arguments ----------------------------------------------------------------------------
def test_signature_order_and_defaults_are_torchs():
    ours = list(inspect.signature(DataLoader.__init__).parameters.values())
    theirs = list(inspect.signature(TorchLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs):])
    loader = DataLoader(list(range(5)))
    assert isinstance(loader, TorchLoader) and loader.batch_size == 1 and loader.num_workers == 0
    assert [b.tolist() for b in loader] == [[i] for i in range(5)]
    assert DataLoader[int] is not None


@pytest.mark.parametrize("kw", [
    {"num_workers": -1}, {"timeout": -1}, {"prefetch_factor": 2}, {"persistent_workers": True},
    {"batch_sampler": [[0, 1]], "batch_size": 2}, {"batch_sampler": [[0, 1]], "shuffle": True},
    {"sampler": [0, 1], "shuffle": True}, {"batch_size": None, "drop_last": True},
    {"num_workers": 2, "prefetch_factor": -1}, {"multiprocessing_context": "spawn"},
    {"num_workers": 1, "multiprocessing_context": "nope"}, {"num_workers": 1, "multiprocessing_context": 3},
])
def test_argument_errors_are_torchs(kw):
    with pytest.raises(Exception) as theirs:
        TorchLoader(list(range(4)), **kw)
    with pytest.raises(type(theirs.value)) as ours:
        DataLoader(list(range(4)), **kw)
    assert str(ours.value) == str(theirs.value)


def test_iterable_dataset_refuses_sampler_and_shuffle_as_torch():
    ds = _Range(8)
    for kw in ({"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]}):
        with pytest.raises(ValueError) as theirs:
            TorchLoader(ds, **kw)
        with pytest.raises(ValueError, match=str(theirs.value)[:40]):
            DataLoader(ds, **kw)


def test_more_workers_than_cpus_warns_as_torch():
    n = len(os.sched_getaffinity(0)) + 1  # what torch's check counts (torch._utils.cpu_count, torch >= 2.12)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        DataLoader(list(range(4)), num_workers=n)
    assert any("worker processes in total" in str(w.message) for w in got)


def test_batch_sampler_and_no_auto_batching():
    ds = list(range(10))
    bs = [[3, 1], [0], [9, 8, 7]]
    for workers in (0, 2):
        got = [b.tolist() for b in DataLoader(ds, batch_sampler=bs, num_workers=workers)]
        assert got == [[3, 1], [0], [9, 8, 7]]
        got = list(DataLoader(ds, batch_size=None, num_workers=workers))
        assert got == ds and got == list(TorchLoader(ds, batch_size=None, num_workers=workers))


# --- default collate: the same batches as torch's loader --------------------------------------------------
Pt = collections.namedtuple("Pt", ["a", "b"])


class MyDict(dict):
    pass


def _leaf(kind):
    """A function of the sample index giving a value of one fixed type and shape."""
    name, arg = kind
    if name == "int":
        return lambda i: i * 3 - 7
    if name == "float":
        return lambda i: i / 4.0
    if name == "bool":
        return lambda i: i % 2 == 0
    if name == "str":
        return lambda i: f"s{i}"
    if name == "bytes":
        return lambda i: bytes([i % 256]) * arg
    if name == "tensor":
        shape, dtype = arg
        return lambda i: torch.full(shape, i, dtype=dtype)
    if name == "array":
        shape, dtype = arg
        return lambda i: np.full(shape, i, dtype=dtype)
    if name == "np-scalar":
        return lambda i: np.float32(i) if arg else np.int16(i)
    raise AssertionError(name)


leaves = st.one_of(
    st.tuples(st.sampled_from(["int", "float", "bool", "str"]), st.none()),
    st.tuples(st.just("bytes"), st.integers(0, 5)),
    st.tuples(st.just("tensor"), st.tuples(st.lists(st.integers(0, 3), max_size=3).map(tuple),
                                           st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.bool,
                                                            torch.bfloat16, torch.float64]))),
    st.tuples(st.just("array"), st.tuples(st.lists(st.integers(1, 3), max_size=2).map(tuple),
                                          st.sampled_from([np.float32, np.int32, np.uint8, np.float64]))),
    st.tuples(st.just("np-scalar"), st.booleans()),
).map(_leaf)


def _node(kids):
    return st.one_of(
        st.lists(kids, min_size=1, max_size=3).map(lambda fs: lambda i: [f(i) for f in fs]),
        st.lists(kids, min_size=1, max_size=3).map(lambda fs: lambda i: tuple(f(i) for f in fs)),
        st.tuples(kids, kids).map(lambda fs: lambda i: Pt(fs[0](i), fs[1](i))),
        st.dictionaries(st.text("abc", min_size=1, max_size=3), kids, min_size=1, max_size=3)
        .map(lambda d: lambda i: {k: f(i) for k, f in d.items()}),
        st.dictionaries(st.text("xyz", min_size=1, max_size=2), kids, min_size=1, max_size=2)
        .map(lambda d: lambda i: MyDict({k: f(i) for k, f in d.items()})),
    )


samples = st.recursive(leaves, _node, max_leaves=8)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(make=samples, n=st.integers(1, 12), bs=st.integers(1, 5), drop_last=st.booleans())
def test_batches_equal_torchs_for_random_nested_samples(make, n, bs, drop_last):
    ds = [make(i) for i in range(n)]
    kw = {"batch_size": bs, "drop_last": drop_last, "num_workers": 2}
    try:
        want = list(TorchLoader(ds, **kw))
    except Exception as e:  # noqa: BLE001 - then ours must fail the same way
        with pytest.raises(type(e)):
            list(DataLoader(ds, **kw))
        return
    got = list(DataLoader(ds, **kw))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert same(g, w), (g, w)


# --- IterableDataset ----------------------------------------------------------------------------------------
class _Range(IterableDataset):
    """Shards itself by get_worker_info(): worker w of k yields w, w + k, ... (uneven on purpose)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n + 2 * info.id, info.num_workers))


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("bs", [None, 1, 4])
def test_iterable_dataset_batches_interleave_as_torchs(workers, bs):
    ds = _Range(23)
    kw = {"batch_size": bs, "num_workers": workers}
    want = [_plain(b) for b in TorchLoader(ds, **kw)]
    assert [_plain(b) for b in DataLoader(ds, **kw)] == want
    if workers:
        got = [_plain(b) for b in DataLoader(ds, in_order=False, **kw)]
        assert sorted(map(str, got)) == sorted(map(str, want))


def _plain(b):
    return b.tolist() if isinstance(b, torch.Tensor) else b


class _SlowFirst(Dataset):
    """Sample 0 takes a second; each sample says which worker made it."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 0:
            import time

            time.sleep(1.0)
        return get_worker_info().id, i


def test_in_order_false_passes_over_a_worker_stuck_on_a_slow_sample_as_torchs_does():
    kw = {"num_workers": 2, "prefetch_factor": 2, "in_order": False}
    want = [(int(w), int(i)) for w, i in TorchLoader(_SlowFirst(), **kw)]
    got = [(int(w), int(i)) for w, i in DataLoader(_SlowFirst(), **kw)]
    # the stuck worker keeps its 2 tasks (0 and 2) and gets no more: the other serves the rest meanwhile
    assert got == want == [(1, 1), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9), (0, 0), (0, 2)]


def test_worker_info_inside_workers():
    class Info(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            info = get_worker_info()
            return [info.id, info.num_workers, info.seed, type(info.dataset).__name__]

    g = torch.Generator().manual_seed(3)
    theirs = list(TorchLoader(Info(), batch_size=None, num_workers=2, generator=g))
    g.manual_seed(3)
    ours = list(DataLoader(Info(), batch_size=None, num_workers=2, generator=g))
    assert ours == theirs  # same worker ids, counts and seeds (base seed + worker id) for the same batches


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_workers_run_as_batch_jobs_and_the_main_process_keeps_its_policy():
    """A worker is scheduled as a batch job, so one woken by its next task does not preempt the training
    process that sent it; the main process's policy is untouched."""
    class Policy(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return os.sched_getscheduler(0)

    mine = os.sched_getscheduler(0)
    assert list(DataLoader(Policy(), batch_size=None, num_workers=2)) == [os.SCHED_BATCH] * 4
    assert os.sched_getscheduler(0) == mine


def test_iterable_shards_with_torchforges_loader():
    data = list(range(50))
    want = [b.tolist() for b in TorchLoader(IterableShards(data, GlobalSampler(50, seed=2), block_size=8),
                                            batch_size=8, num_workers=2)]
    got = [b.tolist() for b in DataLoader(IterableShards(data, GlobalSampler(50, seed=2), block_size=8),
                                          batch_size=8, num_workers=2)]
    assert got == want and sorted(i for b in got for i in b) == data


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_datapipe_shuffle_is_seeded_per_pass_and_sharded_over_workers_as_torchs(workers, persistent):
    """A DataPipe's shuffle buffer is seeded from each pass's shared seed (the same in every worker, so a
    sharding_filter after it splits one order) and sharded over the workers: the same epochs as torch's."""
    from torch.utils.data import datapipes as dp

    def epochs(make):
        loader = make(dp.iter.IterableWrapper(range(60)).shuffle(buffer_size=16).sharding_filter(),
                      num_workers=workers, shuffle=True, persistent_workers=persistent, batch_size=4)
        out = []
        for seed in (123, 123, 321):
            torch.manual_seed(seed)
            out.append([x for b in loader for x in b.tolist()])
        return out

    ours, theirs = epochs(DataLoader), epochs(TorchLoader)
    assert ours == theirs
    assert ours[0] == ours[1] != ours[2] and sorted(ours[2]) == list(range(60))


# --- seeds -------------------------------------------------------------------------------------------------
class _Draws(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        import random
        return [torch.randint(0, 1 << 30, ()).item(), random.random(), float(np.random.rand())]


def test_base_seed_is_drawn_per_iterator_as_torchs():
    for workers in (1, 2):
        loader = DataLoader(_Draws(), batch_size=None, num_workers=workers)
        torch.manual_seed(7)
        a = list(loader)
        b = list(loader)  # a new iterator: a new base seed, other draws
        torch.manual_seed(7)
        theirs = list(TorchLoader(_Draws(), batch_size=None, num_workers=workers))
        assert a != b
        assert a == theirs  # the same draws as torch's workers make


def test_worker_init_fn_gets_the_worker_id(tmp_path):
    def init(worker_id):
        (tmp_path / f"w{worker_id}-{get_worker_info().id}").touch()

    list(DataLoader(list(range(8)), num_workers=2, worker_init_fn=init))
    assert sorted(os.listdir(tmp_path)) == ["w0-0", "w1-1"]


class _DiesOnce(_Draws):
    def __init__(self, marker):
        self.marker = marker

    def __getitem__(self, i):
        if i == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def test_seed_per_batch_makes_data_independent_of_workers_and_deaths(tmp_path):
    def run(workers, ds=None):
        torch.manual_seed(11)
        return list(DataLoader(ds or _Draws(), batch_size=3, num_workers=workers, seed_per_batch=True))

    base = run(0)
    for workers in (1, 2, 3):
        assert all(same(x, y) for x, y in zip(run(workers), base))
    after_death = run(2, _DiesOnce(str(tmp_path / "died")))
    assert os.path.exists(tmp_path / "died")
    assert all(same(x, y) for x, y in zip(after_death, base))  # the re-issued batch is the lost one
    torch.manual_seed(11)
    assert not all(same(x, y) for x, y in zip(list(DataLoader(_Draws(), batch_size=3, num_workers=2)), base))


# --- exceptions ----------------------------------------------------------------------------------------------
class _KeyErrors(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise KeyError("missing-key")
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_original_exception_type_at_any_worker_count(workers):
    with pytest.raises(KeyError) as err:
        list(DataLoader(_KeyErrors(), num_workers=workers))
    if workers:
        assert "Caught KeyError in DataLoader worker process" in str(err.value)
        assert "missing-key" in str(err.value) and "Traceback" in str(err.value)


class _RemoteFails(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        from torchforge.remote.errors import RemoteAccessError

        if i == 2:
            raise RemoteAccessError("access denied (expired token)", url="s3://bkt/data/shard.00003.mds", offset=64)
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torchforge_error_comes_back_from_a_worker_as_itself_with_its_url_path_and_offset(workers):
    """torch rebuilds a worker's exception as ``type(e)(message)``: a RemoteError (whose constructor takes
    ``url=``) came back as a plain RuntimeError, so ``except RemoteError`` (reopen on RemoteChangedError,
    say) never ran with workers, and every torchforge error lost its url, path and offset."""
    from torchforge.remote.errors import RemoteAccessError

    with pytest.raises(RemoteAccessError) as err:
        list(DataLoader(_RemoteFails(), num_workers=workers))
    e = err.value
    assert isinstance(e, PermissionError) and e.url == "s3://bkt/data/shard.00003.mds" and e.offset == 64
    assert str(e) == "s3://bkt/data/shard.00003.mds: byte 64: access denied (expired token)", str(e)
    if workers:  # the worker's traceback comes along, as a note
        note = "".join(getattr(e, "__notes__", []))
        assert "Caught RemoteAccessError in DataLoader worker process" in note and "__getitem__" in note, note


def test_error_in_worker_init_fn_is_raised():
    def init(worker_id):
        raise OSError(f"init failed in {worker_id}")

    with pytest.raises(OSError, match="init failed in 0"):
        list(DataLoader(list(range(4)), num_workers=2, worker_init_fn=init))


# --- any picklable batch -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    label: str

    def pin_memory(self):
        return self


def _pairs(samples):
    return Pair(torch.stack([torch.as_tensor(s) for s in samples]), "b")


def test_custom_batches_namedtuples_mappings_and_nested_tensors_travel():
    got = list(DataLoader(list(range(6)), batch_size=3, num_workers=2, collate_fn=_pairs))
    assert [type(b) for b in got] == [Pair, Pair] and got[1].x.tolist() == [3, 4, 5]
    pts = [Pt(torch.tensor(i), MyDict(v=i)) for i in range(4)]
    b = next(iter(DataLoader(pts, batch_size=4, num_workers=2)))
    assert type(b) is Pt and type(b.b) is MyDict and b.b["v"].tolist() == [0, 1, 2, 3]
    nested = list(DataLoader(list(range(4)), batch_size=2, num_workers=2,
                             collate_fn=lambda s: torch.nested.nested_tensor([torch.ones(i + 1) for i in s])))
    assert nested[1].is_nested and [t.numel() for t in nested[1].unbind()] == [3, 4]


def _drop_small(batch):
    """The usual "drop bad samples" collate: None when nothing is left."""
    kept = [b for b in batch if b >= 2]
    return torch.utils.data.default_collate(kept) if kept else None


class _SomeNone(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return None if i % 2 else {"x": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_none_batch_is_yielded_as_torch_yields_it(workers):
    for make in (lambda cls: cls(list(range(6)), batch_size=2, collate_fn=_drop_small, num_workers=workers),
                 lambda cls: cls(_SomeNone(), batch_size=None, num_workers=workers)):
        want, ours = list(make(TorchLoader)), make(DataLoader)
        got = list(ours)
        assert same(got, want) and len(got) == len(ours), got
        assert None in got
    # a batch whose every sample was skipped under on_error="skip" is left out (there is no batch)
    skip = DataLoader(_SecondPairFails(), batch_size=2, num_workers=workers, on_error="skip")
    assert [b.tolist() for b in skip] == [[0, 1], [4, 5]] and skip.skipped == 2


class _SecondPairFails(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i in (2, 3):
            raise KeyError(i)
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_conjugate_and_negative_views_arrive_as_their_values(workers):
    def collate(samples):
        z = torch.tensor([complex(s, s + 1) for s in samples])
        return {"conj": z.conj(), "neg": torch._neg_view(z), "z": z}

    for b in DataLoader(list(range(4)), batch_size=2, num_workers=workers, collate_fn=collate):
        z = b["z"]
        assert torch.equal(b["conj"].resolve_conj(), z.conj().resolve_conj())
        assert torch.equal(b["neg"].resolve_neg(), torch.neg(z))


def test_a_timeout_without_workers_is_refused_as_torch_refuses_it():
    for cls in (TorchLoader, DataLoader):
        with pytest.raises(AssertionError, match="requires timeout == 0"):
            iter(cls(list(range(4)), timeout=5))


# --- the smaller defects -------------------------------------------------------------------------------------
def _no_descriptors(worker_id):
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))


def test_worker_that_cannot_open_its_slab_says_so():
    with pytest.raises(RuntimeError, match="cannot open the batch's shared-memory slab"):
        list(DataLoader(list(range(8)), batch_size=2, num_workers=1, worker_init_fn=_no_descriptors))


class _FailsAt(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 12:
            raise ValueError("bad 12")
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_with_device_a_batch_comes_out_before_the_next_ones_error(workers):
    seen = []
    with pytest.raises(ValueError, match="bad 12"):
        for b in DataLoader(_FailsAt(), batch_size=4, num_workers=workers, device="cpu"):
            seen.append(b.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def _slab_bytes() -> int:
    """Resident bytes of this process's slab mappings."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                ours = "torchforge-slab" in line
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_held_batches_cost_their_size_and_no_descriptor():
    fds = len(os.listdir("/proc/self/fd"))
    loader = DataLoader(list(range(8000)), batch_size=8, num_workers=2)
    it = iter(loader)
    held = [next(it) for _ in range(500)]  # 500 batches held at once, the pass still going
    assert held[-1].tolist() == list(range(3992, 4000))
    # the pool's slabs, one received ahead, each worker's pipe and process sentinel: not one per held batch
    assert len(os.listdir("/proc/self/fd")) - fds < 24
    window = loader.prefetch_factor * loader.num_workers
    assert _slab_bytes() <= (window + 4) * (1 << 20) + 500 * 2 * 4096  # a page or two per small batch


def test_a_second_iterator_does_not_close_the_first():
    loader = DataLoader(list(range(40)), batch_size=4, num_workers=2)
    first = iter(loader)
    a = [next(first).tolist() for _ in range(2)]
    second = iter(loader)
    assert next(second).tolist() == [0, 1, 2, 3]
    assert a + [b.tolist() for b in first] == [list(range(i, i + 4)) for i in range(0, 40, 4)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
def test_cuda_device_keeps_the_fork_start():  # pragma: no cover - runs on GPU machines
    torch.cuda.init()
    loader = DataLoader(list(range(16)), batch_size=4, num_workers=2, device="cuda")
    it = iter(loader)
    assert next(it).is_cuda
    assert all(type(p).__name__ == "ForkProcess" for p in it._workers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
def test_pin_memory_pins_batches_as_torch():  # pragma: no cover - runs on GPU machines
    for workers in (0, 2):
        b = next(iter(DataLoader([torch.ones(3)] * 8, batch_size=4, num_workers=workers, pin_memory=True)))
        assert b.is_pinned()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_ended_device_iterator_frees_its_batches_without_the_garbage_collector(workers):
    """With ``device=`` the end of the epoch is found one batch ahead and raised later; what is kept for
    that must not hold the last batch in a reference cycle: a process forked before the collector runs
    (another loader's worker) would free those (CUDA) tensors in the child."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        refs = []
        for b in DataLoader(list(range(32)), batch_size=4, num_workers=workers, device="cpu"):
            refs.append(weakref.ref(b))
        del b
        assert [r() is None for r in refs] == [True] * 8
    finally:
        gc.enable()


def test_device_stage_walk_keeps_types_and_leaves_tensorless_parts_alone():
    from collections import OrderedDict, namedtuple

    from torchforge.loader.device import map_tensors

    Pair = namedtuple("Pair", "a b")
    text = [[{"role": "user", "content": "hi"}] * 3] * 4
    batch = {"x": Pair(torch.ones(2), [torch.zeros(1), "s"]), "od": OrderedDict(z=torch.ones(1)),
             "t": (1, torch.ones(1)), "text": text, "r": range(3)}
    out = map_tensors(batch, lambda t: t + 1)
    assert isinstance(out["x"], Pair) and torch.equal(out["x"].a, torch.full((2,), 2.0))
    assert torch.equal(out["x"].b[0], torch.ones(1)) and out["x"].b[1] == "s"
    assert type(out["od"]) is OrderedDict and torch.equal(out["od"]["z"], torch.full((1,), 2.0))
    assert type(out["t"]) is tuple and out["t"][0] == 1 and torch.equal(out["t"][1], torch.full((1,), 2.0))
    assert out["text"] is text and out["r"] == [0, 1, 2]  # nothing to move: the same list, not a copy
    assert torch.equal(batch["t"][1], torch.ones(1))  # the input batch is not changed
