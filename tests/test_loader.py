"""torchforge.DataLoader: order, exactly once, worker death, user errors, resume, shutdown without leaks
(the torch-contract tests are in test_loader_contract.py, resume in test_loader_resume.py)."""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
from multiprocessing import resource_tracker

import numpy as np
import pytest
import torch

from torchforge.errors import WorkerError
from torchforge.loader import DataLoader as _DataLoader
from torchforge.loader import padded_collate
from torchforge.sampler import GlobalSampler


def DataLoader(dataset, batch_size=1, **kw):  # these records need the padded collate
    kw.setdefault("collate_fn", padded_collate)
    return _DataLoader(dataset, batch_size, **kw)


class Samples:
    """Multimodal-like samples: int id, ragged bytes image, chat messages, a fixed-size array."""

    def __init__(self, n: int, *, jitter: float = 0.0):
        self.n, self.jitter = n, jitter

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.jitter:  # scramble which worker finishes first
            time.sleep(self.jitter * ((i * 7919) % 5))
        return {"id": i, "image": bytes([i % 251]) * (100 + (i * 37) % 900),
                "messages": [{"role": "user", "content": f"q{i}"}] * (1 + i % 3),
                "vec": np.full(4, i, dtype=np.float32)}


class Failing(Samples):
    """Raises ValueError on the given indices."""

    def __init__(self, n: int, bad: set[int]):
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


class Dying(Samples):
    """Kills its own process the first time (or every time) it reads index ``at``."""

    def __init__(self, n: int, at: int, marker: str, how: str = "kill", always: bool = False):
        super().__init__(n)
        self.at, self.marker, self.how, self.always = at, marker, how, always

    def __getitem__(self, i: int) -> dict:
        if i == self.at and (self.always or not os.path.exists(self.marker)):
            open(self.marker, "w").close()
            if self.how == "segv":
                ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class Slow(Samples):
    def __getitem__(self, i: int) -> dict:
        time.sleep(5)
        return super().__getitem__(i)


def _children() -> set[int]:
    me, kids = str(os.getpid()), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                kids.add(int(pid))
    return kids


@pytest.fixture
def no_leaks(our_shm):
    """Fails the test if it leaves a /dev/shm entry, a child process or an open descriptor behind."""
    resource_tracker.ensure_running()  # multiprocessing's shared helper (spawn starts it once): not ours
    gc.collect()
    shm, kids, fds = our_shm(), _children(), set(os.listdir("/proc/self/fd"))
    yield
    gc.collect()
    deadline = time.monotonic() + 5
    while _children() - kids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert our_shm() == shm
    assert _children() - kids == set()
    assert set(os.listdir("/proc/self/fd")) - fds == set()


def _ids(loader) -> list[list[int]]:
    return [b["id"].tolist() for b in loader]


def _expected(order: list[int], bs: int, drop_last: bool = False) -> list[list[int]]:
    out = [order[i:i + bs] for i in range(0, len(order), bs)]
    return out[:-1] if drop_last and out and len(out[-1]) < bs else out


def test_batches_in_sampler_order_exactly_once(no_leaks):
    ds = Samples(203, jitter=0.0004)
    sampler = np.random.default_rng(1).permutation(203).tolist()
    got = _ids(DataLoader(ds, 16, sampler=sampler, num_workers=2, prefetch_factor=3))
    assert got == _expected(sampler, 16)
    flat = sorted(i for b in got for i in b)
    assert flat == list(range(203))


def test_batch_contents_and_default_collate(no_leaks):
    batches = list(DataLoader(Samples(10), 4, num_workers=2))
    b = batches[1]
    assert b["id"].dtype == torch.int64 and b["id"].tolist() == [4, 5, 6, 7]
    lens = [100 + (i * 37) % 900 for i in range(4, 8)]
    assert b["image"]["lengths"].tolist() == lens
    data = b["image"]["data"]
    assert data.dtype == torch.uint8 and data.shape == (4, max(lens))
    for row, i, n in zip(data, range(4, 8), lens):
        assert bool((row[:n] == i % 251).all()) and bool((row[n:] == 0).all())
    assert b["messages"][0] == [{"role": "user", "content": "q4"}] * 2
    assert torch.equal(b["vec"], torch.arange(4, 8, dtype=torch.float32)[:, None].expand(4, 4))
    assert [len(x["id"]) for x in batches] == [4, 4, 2]


def test_num_workers_zero_gives_the_same_batches(no_leaks):
    kw = {"shuffle": True, "generator": torch.Generator().manual_seed(3), "drop_last": True}
    a = list(DataLoader(Samples(50), 8, num_workers=0, **kw))
    kw["generator"].manual_seed(3)
    b = list(DataLoader(Samples(50), 8, num_workers=2, **kw))
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert torch.equal(x["id"], y["id"]) and torch.equal(x["image"]["data"], y["image"]["data"])
        assert x["messages"] == y["messages"]
    assert sorted(i for x in a for i in x["id"].tolist()) != list(range(48))  # shuffled, dropped 2


def test_held_batch_is_never_overwritten_and_slabs_are_recycled(no_leaks):
    loader = DataLoader(Samples(400), 8, num_workers=2, prefetch_factor=1)
    it = iter(loader)
    first = next(it)
    snapshot = first["image"]["data"].clone()
    rest, pool_sizes = [], []
    for b in it:
        rest.append(b["id"].tolist())
        pool_sizes.append(loader.slab_stats()["slabs"])
    assert torch.equal(first["image"]["data"], snapshot) and first["id"].tolist() == list(range(8))
    assert rest == _expected(list(range(8, 400)), 8)
    # 49 batches went through, but only the tasks in flight, the held batch, the loop's previous batch
    # (still bound to `b` while next() runs) and the batch being received need slabs at a time
    assert pool_sizes and max(pool_sizes) <= loader.prefetch_factor * loader.num_workers + 3


def test_default_samplers_are_torchs(no_leaks):
    theirs = torch.utils.data.DataLoader(Samples(45), 7, shuffle=True, generator=torch.Generator().manual_seed(9),
                                         collate_fn=padded_collate)
    got = _ids(DataLoader(Samples(45), 7, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(9)))
    assert got == _ids(theirs) and got != _expected(list(range(45)), 7)
    assert _ids(DataLoader(Samples(45), 7, num_workers=0)) == _expected(list(range(45)), 7)


@pytest.mark.parametrize("how", ["kill", "segv"])
def test_dead_worker_is_replaced_and_batches_reissued(tmp_path, how, no_leaks):
    ds = Dying(120, at=37, marker=str(tmp_path / "died"), how=how)
    got = _ids(DataLoader(ds, 10, num_workers=2))
    assert os.path.exists(tmp_path / "died")
    assert got == _expected(list(range(120)), 10)


def test_worker_killed_from_outside_mid_epoch(no_leaks):
    loader = DataLoader(Samples(300, jitter=0.0002), 10, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    got = [next(it)["id"].tolist() for _ in range(3)]
    os.kill(it._workers[0].pid, signal.SIGKILL)
    got += [b["id"].tolist() for b in it]
    assert got == _expected(list(range(300)), 10)


def test_batch_that_always_kills_its_worker_raises_after_max_retries(tmp_path, no_leaks):
    ds = Dying(40, at=12, marker=str(tmp_path / "m"), always=True)
    loader = DataLoader(ds, 10, num_workers=2, max_retries=1)
    with pytest.raises(WorkerError, match=r"DataLoader worker \(pid \d+\) is killed by signal: .*max_retries=1"):
        list(loader)
    assert isinstance(WorkerError("x"), RuntimeError)


def test_user_exception_is_raised_as_its_type_with_worker_traceback(no_leaks):
    loader = DataLoader(Failing(50, {23}), 5, num_workers=2)
    seen = []
    it = iter(loader)
    with pytest.raises(ValueError) as err:
        for b in it:
            seen.append(b["id"].tolist())
    assert seen == _expected(list(range(20)), 5)  # every batch before the failing one arrived, in order
    msg = str(err.value)
    assert "ValueError" in msg and "bad sample 23" in msg and "Traceback" in msg and "__getitem__" in msg
    assert "in DataLoader worker process" in msg
    assert [b["id"].tolist() for b in it] == _expected(list(range(25, 50)), 5)  # as torch: the pass goes on


def test_user_exception_in_process_is_the_original(no_leaks):
    with pytest.raises(ValueError, match="bad sample 3"):
        list(DataLoader(Failing(10, {3}), 5, num_workers=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_mode_counts_and_drops_failing_samples(workers, no_leaks):
    bad = {3, 4, 17}
    loader = DataLoader(Failing(30, bad), 5, num_workers=workers, on_error="skip")
    got = _ids(loader)
    assert [i for b in got for i in b] == [i for i in range(30) if i not in bad]
    assert loader.skipped == 3
    assert got[0] == [0, 1, 2]


def test_skip_mode_drops_a_batch_whose_samples_all_fail(no_leaks):
    loader = DataLoader(Failing(15, set(range(5, 10))), 5, num_workers=2, on_error="skip")
    assert _ids(loader) == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    assert loader.skipped == 5


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_exact(workers, no_leaks):
    def make():
        return DataLoader(Samples(97), 8, shuffle=True, generator=torch.Generator().manual_seed(11),
                          num_workers=workers)

    full = _ids(make())
    loader = make()
    it = iter(loader)
    head = [next(it)["id"].tolist() for _ in range(5)]
    state = loader.state_dict()
    assert state["batches"] == 5 and not state["finished"]
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + _ids(resumed) == full
    assert resumed.state_dict()["finished"]


def test_break_restarts_the_epoch_and_state_roundtrips(no_leaks):
    loader = DataLoader(Samples(40), 10, num_workers=2)
    for _ in loader:
        break
    assert loader.state_dict()["batches"] == 1
    assert _ids(loader)[0] == list(range(10))
    with pytest.raises(ValueError, match="not a DataLoader state"):
        loader.load_state_dict({"batch": 1})


def test_shutdown_after_break_exception_interrupt_and_gc(no_leaks):
    loader = DataLoader(Samples(200), 10, num_workers=2)
    for _ in loader:
        break
    with pytest.raises(RuntimeError):
        for _ in loader:
            raise RuntimeError("user code failed")
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            raise KeyboardInterrupt
    it = iter(loader)
    keep = next(it)
    del it, loader
    gc.collect()
    assert keep["id"].tolist() == list(range(10))  # a batch outlives its loader


def test_timeout_raises_runtime_error(no_leaks):
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
        list(DataLoader(Slow(4), 2, num_workers=1, timeout=0.3))


def test_custom_collate_and_sampler_and_device_cpu(no_leaks):
    def collate(samples):
        return {"ids": [s["id"] for s in samples], "vec": torch.stack([torch.from_numpy(s["vec"]) for s in samples])}

    loader = DataLoader(Samples(20), 6, sampler=range(19, -1, -1), collate_fn=collate, num_workers=2,
                        device="cpu", drop_last=True)
    got = list(loader)
    assert [b["ids"] for b in got] == _expected(list(range(19, -1, -1)), 6, drop_last=True)
    assert got[0]["vec"][0, 0].item() == 19.0 and len(loader) == 3


def test_spawn_context_works(no_leaks):
    got = _ids(DataLoader(Samples(12), 4, num_workers=1, multiprocessing_context="spawn"))
    assert got == _expected(list(range(12)), 4)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="on_error"):
        DataLoader(Samples(4), 2, on_error="ignore")
    with pytest.raises(ValueError, match="max_retries"):
        DataLoader(Samples(4), 2, max_retries=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
def test_cuda_device_batches_match_host_batches(no_leaks):  # pragma: no cover - runs on GPU machines
    host = list(DataLoader(Samples(64), 8, num_workers=2))
    dev = list(DataLoader(Samples(64), 8, num_workers=2, device="cuda"))
    for h, d in zip(host, dev):
        assert d["image"]["data"].is_cuda and torch.equal(h["image"]["data"], d["image"]["data"].cpu())
        assert torch.equal(h["id"], d["id"].cpu())


def test_worker_dying_on_the_last_batch_while_others_retire(tmp_path, no_leaks):
    ds = Dying(64, at=63, marker=str(tmp_path / "late"))
    got = _ids(DataLoader(ds, 4, num_workers=2, prefetch_factor=1))
    assert os.path.exists(tmp_path / "late")
    assert got == _expected(list(range(64)), 4)


def test_persistent_workers_survive_epochs_and_stop_on_close(no_leaks):
    ds = Samples(100)
    sampler = GlobalSampler(100, shuffle=True, seed=3)
    plain_sampler = GlobalSampler(100, shuffle=True, seed=3)
    plain = DataLoader(ds, 8, sampler=plain_sampler, num_workers=2)
    loader = DataLoader(ds, 8, sampler=sampler, num_workers=2, persistent_workers=True)
    want = []
    for epoch in range(3):
        plain_sampler.set_epoch(epoch)
        want.append(_ids(plain))
    got, pids = [], []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        got.append(_ids(loader))
        pids.append(sorted(p.pid for p in loader._iterator._workers))
    assert got == want and want[0] != want[1]  # same batches as without, epochs advance
    assert pids[0] == pids[1] == pids[2]  # the same processes served every epoch
    for pid in pids[0]:
        assert os.path.exists(f"/proc/{pid}")
    # leaving an epoch early with batches in flight stops them; the next epoch starts new ones
    it = iter(loader)
    next(it)
    it.close()
    for pid in pids[0]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
        except FileNotFoundError:
            pass  # exited and reaped
    assert _ids(loader) == _ids(plain)  # the interrupted epoch (the 3rd) again, from its first batch
    loader.close()
    assert loader._iterator is None


def test_persistent_workers_released_when_loader_is_collected(no_leaks):
    loader = DataLoader(Samples(40), 8, num_workers=2, persistent_workers=True)
    assert [len(b) for b in _ids(loader)] == [8] * 5
    del loader  # the no_leaks fixture checks that the workers and slabs are gone


def test_persistent_epoch_left_with_batches_in_flight_then_a_full_epoch_is_exact(no_leaks):
    # the left epoch's tasks still run in the workers while the next epoch's are issued: their slabs
    # must not be handed to the new tasks before those late replies arrive
    loader = DataLoader(Samples(240, jitter=0.0003), 8, num_workers=2, persistent_workers=True, prefetch_factor=3)
    want = _expected(list(range(240)), 8)
    for _ in range(3):
        it = iter(loader)
        assert [next(it)["id"].tolist() for _ in range(2)] == want[:2]
        got = [(b["id"].tolist(), b["image"]["data"][:, 0].tolist()) for b in loader]
        assert [ids for ids, _ in got] == want
        assert all(firsts == [i % 251 for i in ids] for ids, firsts in got)  # no batch overwritten
    loader.close()


_CHILD_COLLECTS = """
import os
from torchforge import DataLoader

it = iter(DataLoader(list(range(64)), batch_size=1, num_workers=2, multiprocessing_context="fork"))
first = next(it)
before = [p.pid for p in it._workers]
pid = os.fork()
if pid == 0:  # what a forked worker's garbage collector does to the parent's garbage iterator
    it._res.finalizer()
    os._exit(0)
os.waitpid(pid, 0)
rest = [int(b) for b in it]
assert [int(first)] + rest == list(range(64))
assert [p.pid for p in it._workers] == before, "the parent's workers were stopped"
print("ok")
"""


def test_a_forked_childs_collector_never_shuts_down_the_parents_workers():
    """A worker forked while a failed epoch's iterator was still garbage (a cycle through its traceback)
    ran that iterator's shutdown when its own collector met it: it told the parent's workers to stop
    through the inherited pipes and failed to join them ("can only join a child process" on stderr,
    hundreds of lines over a long run). The shutdown now belongs to the process that made the iterator."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _CHILD_COLLECTS], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert "exited unexpectedly" not in proc.stderr and "can only join" not in proc.stderr, proc.stderr[-2000:]


class _Counted(torch.utils.data.Dataset):
    """Eight samples, with a folder where each worker's worker_init_fn leaves a file."""

    def __init__(self, folder: str):
        self.folder = folder

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i


def _mark_start(folder: str, wid: int) -> None:
    open(os.path.join(folder, f"{wid}-{os.getpid()}"), "w").close()


_MAIN_KILLED = """
import os, sys, time
import functools
sys.path.insert(0, sys.argv[2])
from test_loader import _Counted, _DataLoader, _mark_start
dl = _DataLoader(_Counted(sys.argv[1]), batch_size=1, num_workers=2, multiprocessing_context="forkserver",
                persistent_workers=True, worker_init_fn=functools.partial(_mark_start, sys.argv[1]))
it = iter(dl)
next(it)
print("ready", flush=True)
time.sleep(600)
"""


def test_forkserver_workers_idle_past_half_a_second_live_on_and_exit_with_the_main_process(tmp_path):
    """A forkserver worker's parent is the fork server, not the loader's process: the idle check took that
    for the loader's death, so every worker idle for 0.5 s (a long step, the gap between epochs) exited, and
    was restarted as dead (worker_init_fn again, persistent state lost; with max_retries=0 a WorkerError)."""
    import functools
    import subprocess
    import sys

    dl = _DataLoader(_Counted(str(tmp_path)), batch_size=1, num_workers=2, multiprocessing_context="forkserver",
                     persistent_workers=True, max_retries=0,
                     worker_init_fn=functools.partial(_mark_start, str(tmp_path)))
    for _ in range(2):
        got = []
        for b in dl:
            got.append(int(b))
            time.sleep(0.3 if len(got) < 7 else 0.8)  # workers idle past half a second
        assert got == list(range(8))
    assert len(os.listdir(tmp_path)) == 2  # two workers started, once: none taken for dead
    dl.close()
    # the loader's process killed: its forkserver workers do not outlive it
    marks = tmp_path / "killed"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _MAIN_KILLED, str(marks), os.path.dirname(__file__)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:  # (the second may still be starting)
        time.sleep(0.1)
    pids = [int(n.split("-")[1]) for n in os.listdir(marks)]
    assert len(pids) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
