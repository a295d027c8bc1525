"""DataLoader.state_dict()/load_state_dict(): a fresh loader yields exactly the batches the uninterrupted
run would have yielded next: 0 and 2 workers x map-style and iterable (with and without a dataset
state) x mid-epoch (of the first and of a later pass) and epoch boundary x persistent workers; and
elastic 2 -> 3 ranks under gloo.

The samples carry random draws made inside the dataset, and those resume exactly too because the
loaders seed per batch; without ``seed_per_batch`` a resumed worker's random stream starts again from
torch's ``base_seed + worker_id`` (samples and order still resume exactly, as
test_order_resumes_without_per_batch_seeds checks)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from _forkserver import start_ranks
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchforge.loader import DataLoader
from torchforge.sampler import GlobalSampler

N, BS = 53, 4


class Noisy(Dataset):
    """Map-style; each sample carries a draw from the worker's torch RNG (seeds must resume too)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"id": i, "noise": torch.randint(0, 1 << 30, ())}


class Shards(IterableDataset):
    """Shards itself by get_worker_info(); ``state_dict`` counts what this copy's iterator yielded."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(w, N + 3 * w, k))  # uneven: worker 1 has more samples than worker 0
        start, self.pos = self.pos, 0
        for j, i in enumerate(mine[start:], start):
            self.pos = j + 1
            yield {"id": i, "noise": torch.randint(0, 1 << 30, ())}
        self.pos = 0  # exhausted: the next iterator starts from the beginning


class StatefulShards(Shards):
    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = int(state["pos"])


def _dataset(kind: str):
    return {"map": lambda: Noisy(), "iterable": lambda: StatefulShards(),
            "iterable-stateless": lambda: Shards()}[kind]()


def _loader(kind: str, workers: int, persistent: bool):
    # seed_per_batch: a worker's random draws depend on (base seed, batch) only, so they resume too
    kw = {"num_workers": workers, "persistent_workers": persistent, "seed_per_batch": True}
    if kind == "map":
        kw["shuffle"] = True  # torch's RandomSampler drawing from torch's default generator
    return DataLoader(_dataset(kind), BS, **kw)


def _flat(batch):
    return list(zip(batch["id"].tolist(), batch["noise"].tolist()))


# persistent workers need num_workers > 0 (torch refuses the option without workers)
_WORKERS = [(0, False), (2, False), (2, True)]


@pytest.mark.parametrize("where", ["mid", "boundary", "mid-second-pass"])
@pytest.mark.parametrize("kind", ["map", "iterable", "iterable-stateless"])
@pytest.mark.parametrize(("workers", "persistent"), _WORKERS)
def test_resume_yields_exactly_the_uninterrupted_batches(workers, persistent, kind, where):
    torch.manual_seed(1234)
    full = _loader(kind, workers, persistent)
    want = [[_flat(b) for b in full] for _ in range(3)]  # three passes
    assert len(want[0]) >= 12
    # every pass draws new numbers (persistent workers too: their seed is kept, the pass number is not)
    assert [x[1] for b in want[0] for x in b] != [x[1] for b in want[1] for x in b]

    torch.manual_seed(1234)
    first = _loader(kind, workers, persistent)
    if where == "mid-second-pass":  # the first pass ran to its end: its iterator (and workers) went on
        assert [_flat(b) for b in first] == want[0]
        want = want[1:]
    got: list = []
    it = iter(first)
    cut = len(want[0]) if where == "boundary" else 5
    for _ in range(cut):
        got.append(_flat(next(it)))
    if where == "boundary":
        with pytest.raises(StopIteration):
            next(it)
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    rng = torch.get_rng_state()  # what a training checkpoint saves beside the loader's state
    del it, first

    torch.manual_seed(999)  # a new process: whatever state the RNG is in
    resumed = _loader(kind, workers, persistent)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    rest = [_flat(b) for b in resumed]
    nxt = [_flat(b) for b in resumed]
    if where == "boundary":
        assert got == want[0] and rest == want[1]
    else:
        assert got + rest == want[0]
        assert nxt == want[1]


@pytest.mark.parametrize("kind", ["map", "iterable-stateless"])
def test_order_resumes_without_per_batch_seeds(kind):
    def make():
        kw = {"shuffle": True} if kind == "map" else {}
        return DataLoader(_dataset(kind), BS, num_workers=2, **kw)

    torch.manual_seed(5)
    want = [b["id"].tolist() for b in make()]
    torch.manual_seed(5)
    first = make()
    it = iter(first)
    got = [next(it)["id"].tolist() for _ in range(3)]
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [b["id"].tolist() for b in resumed] == want


@pytest.mark.parametrize("own_generator", [True, False])
def test_persistent_workers_resume_mid_way_through_a_later_pass_in_its_order(own_generator):
    """The second pass of persistent workers draws no base seed (torch's _reset): its shuffle starts
    from the generator as the first pass left it. A fresh loader resuming it draws a base seed when
    it is made, and must then replay the pass's shuffle from the saved generators, not after that draw."""
    def make():
        kw = {"generator": torch.Generator().manual_seed(5)} if own_generator else {}
        return DataLoader(list(range(40)), 3, shuffle=True, num_workers=2, persistent_workers=True, **kw)

    torch.manual_seed(11)
    ref = make()
    list(ref)
    want = [b.tolist() for b in ref]  # the second pass, uninterrupted
    torch.manual_seed(11)
    loader = make()
    list(loader)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [b.tolist() for b in resumed] == want


def test_a_version_1_state_still_resumes_its_pass():
    """Version 1 saved the generators before the iterator drew its base seed: such a state, from a
    first pass, resumes exactly as it did."""
    def make():
        return DataLoader(list(range(40)), 3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(9))

    want = [b.tolist() for b in make()]
    loader = make()
    g0 = loader.generator.get_state().numpy().tobytes().hex()  # before the iterator's draws, as version 1
    it = iter(loader)
    got = [next(it).tolist() for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    assert state["version"] == 2
    state.update(version=1, rng={"loader": g0})
    state.pop("pass")
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    more = [next(it).tolist() for _ in range(2)]
    again = json.loads(json.dumps(resumed.state_dict()))  # saved again, as version 2, mid-way
    del it
    assert again["version"] == 2
    third = make()
    third.load_state_dict(again)
    assert got + more + [b.tolist() for b in third] == want
    with pytest.raises(ValueError, match="version 3"):
        make().load_state_dict({**state, "version": 3})


def test_state_of_a_loader_never_iterated_changes_nothing():
    def make():
        return DataLoader(Noisy(), BS, shuffle=True, num_workers=2, persistent_workers=True)

    torch.manual_seed(3)
    fresh = make().state_dict()
    assert fresh["finished"] and fresh["batches"] == 0
    want = [_flat(b) for b in make()]
    torch.manual_seed(99)  # another process, seeded otherwise
    loader = make()
    loader.load_state_dict(fresh)
    # the base seed and the order are drawn as usual, from torch's generator as the saved run had it
    assert [_flat(b) for b in loader] == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["mid-epoch", "boundary"])
def test_the_epochs_after_a_resume_are_the_saved_runs_with_no_generator(workers, where):
    """shuffle=True without generator=: the loader draws each epoch's order from torch's generator. A
    resumed process seeded as the first was (the usual script) drew the next epoch in the first epoch's
    order: the loaded state now puts torch's generator back where the saved run's was."""
    ds = list(range(24))

    def make():
        return DataLoader(ds, 4, shuffle=True, num_workers=workers)

    torch.manual_seed(0)
    loader = make()
    full = [b.tolist() for b in loader] + [b.tolist() for b in loader] + [b.tolist() for b in loader]
    torch.manual_seed(0)
    first = make()
    cut = 3 if where == "mid-epoch" else 6
    it = iter(first)
    got = [next(it).tolist() for _ in range(cut)]
    if where == "boundary":
        assert next(it, None) is None
    state = json.loads(json.dumps(first.state_dict()))
    del it, first
    torch.manual_seed(0)  # the same script, started again
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed] + [b.tolist() for b in resumed]
    if where == "mid-epoch":  # (the first pass was the rest of the first epoch)
        rest += [b.tolist() for b in resumed]
    assert got + rest == full
    assert full[6:12] != full[:6]


def test_loader_never_overrides_a_state_loaded_into_the_sampler():
    sampler = GlobalSampler(40, shuffle=True, seed=5)
    order = list(GlobalSampler(40, shuffle=True, seed=5))
    ref = GlobalSampler(40, shuffle=True, seed=5)
    ref_it = iter(ref)
    for _ in range(12):
        next(ref_it)
    sampler.load_state_dict(ref.state_dict())
    got = [i for b in DataLoader(list(range(40)), 4, sampler=sampler, num_workers=2) for i in b.tolist()]
    assert got == order[12:]


def _elastic_rank(rank: int, world: int, init: str, phase: str, out: str, n: int, k: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        sampler = GlobalSampler(n, shuffle=True, seed=7)
        loader = DataLoader(list(range(n)), 5, sampler=sampler, num_workers=2)
        seen = []
        if phase == "save":
            it = iter(loader)
            for _ in range(k):
                seen += next(it).tolist()
            state = loader.state_dict()
            del it
        else:
            with open(os.path.join(out, "state.json")) as f:
                loader.load_state_dict(json.load(f))
            seen = [i for b in loader for i in b.tolist()]
            state = None
        dist.barrier()
        with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
            json.dump({"seen": seen, "state": state}, f)
    finally:
        dist.destroy_process_group()


def test_elastic_resume_from_2_to_3_ranks_covers_the_rest_exactly_once(tmp_path):
    n, k = 97, 4
    for phase, world in (("save", 2), ("load", 3)):
        if phase == "load":
            with open(tmp_path / "save-0.json") as f:
                (tmp_path / "state.json").write_text(json.dumps(json.load(f)["state"]))
        init = f"file://{tmp_path}/store-{phase}"
        start_ranks(_elastic_rank, args=(world, init, phase, str(tmp_path), n, k), nprocs=world)
    before = [i for r in range(2) for i in json.loads((tmp_path / f"save-{r}.json").read_text())["seen"]]
    after = [i for r in range(3) for i in json.loads((tmp_path / f"load-{r}.json").read_text())["seen"]]
    assert len(before) == 2 * k * 5 and len(set(before)) == len(before)
    # every index exactly once over the epoch, apart from the sampler's padding repeats at the end
    assert set(before) | set(after) == set(range(n)) and not set(before) & set(after[:len(after) - 2])
    assert len(before) + len(after) - n < 3  # padding to a multiple of 3 ranks: at most 2 repeats


# --- resumes the first tests do not make (found by a review; each lost samples silently) -----------------
def _ids(loader, k=None):
    out, it = [], iter(loader)
    while k is None or k > 0:
        try:
            out += next(it).tolist()
        except StopIteration:
            break
        k = None if k is None else k - 1
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_twice_in_one_epoch_yields_exactly_the_uninterrupted_batches(workers):
    """The resumed sampler starts at the saved position, and the loader counted the saved run's samples
    again on top of it: the second state was that many samples ahead (12 of 50 lost after two resumes)."""
    def make():
        return DataLoader(list(range(50)), 4, sampler=GlobalSampler(50, seed=1), num_workers=workers)

    full = _ids(make())
    first = make()
    a = _ids(first, 3)
    second = make()
    second.load_state_dict(first.state_dict())
    assert second.state_dict()["sampler"]["position"] == 12  # a state taken before any batch: the same
    b = _ids(second, 2)
    state = second.state_dict()
    assert state["samples"] == 20 and state["sampler"]["position"] == 20, state
    third = make()
    third.load_state_dict(state)
    assert a + b + _ids(third) == full


class _SlowFirst(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 0:
            time.sleep(1.0)  # batch 0 is overtaken by batches 1 and 3
        return i


def test_in_order_false_resumes_the_batches_not_yet_yielded_and_refuses_another_world_size():
    """The sampler's position counted batches yielded ahead of a slower one: the resumed pass skipped the
    slow batch, never yielded, and the batches after it (8 of 40 lost)."""
    def make(world=1, rank=0):
        sampler = GlobalSampler(40, shuffle=False, rank=rank, world_size=world)
        return DataLoader(_SlowFirst(), 4, sampler=sampler, num_workers=2, in_order=False)

    run = make()
    it = iter(run)
    first = next(it).tolist() + next(it).tolist()
    state = run.state_dict()
    run.close()
    assert 0 not in first and state["batches"] == 0 and state["extra"] and state["samples"] == 0, state
    resumed = make()
    resumed.load_state_dict(state)
    seen = first + _ids(resumed)
    assert sorted(seen) == list(range(40)), sorted(seen)
    with pytest.raises(ValueError, match="resumes at that world size only"):
        make(world=2).load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_an_epochs_last_batch_then_set_epoch_of_the_next_yields_the_next_epoch(workers):
    """Checkpointing every k steps where k divides an epoch saves a state at the end of the pass that has
    not seen its end: the loader applied it at iter() over the user's set_epoch(e + 1), and epoch e + 1
    yielded nothing (then the sampler was back at epoch e)."""
    def make():
        return DataLoader(list(range(50)), 4, sampler=GlobalSampler(50, seed=2), num_workers=workers)

    full = make()
    full.sampler.set_epoch(1)
    want = _ids(full)
    run = make()
    _ids(run, 13)  # every batch of epoch 0, its end not seen yet
    state = run.state_dict()
    assert not state["finished"] and state["sampler"]["position"] == 50
    resumed = make()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    with pytest.warns(UserWarning, match="loaded for epoch 0 was not resumed"):
        got = _ids(resumed)
    assert got == want and resumed.sampler.epoch == 1
    same = make()  # set_epoch of the state's own epoch resumes it: an empty remainder
    same.load_state_dict(state)
    same.sampler.set_epoch(0)
    assert _ids(same) == []


def test_a_finished_state_resumes_later_passes_like_the_saved_runs_without_set_epoch():
    """A state saved after the pass ended put the sampler at the end of the epoch, and every later pass of
    a loop without set_epoch was empty; the saved run's next passes restart the epoch."""
    def make():
        return DataLoader(list(range(50)), 4, sampler=GlobalSampler(50, seed=3), num_workers=0)

    run = make()
    _ids(run)
    state = run.state_dict()
    assert state["finished"]
    resumed = make()
    resumed.load_state_dict(state)
    assert [len(_ids(resumed)) for _ in range(3)] == [len(_ids(run)) for _ in range(3)] == [50, 50, 50]


def test_a_sampler_state_into_a_loader_whose_sampler_cannot_load_it_is_refused_at_once():
    saved = DataLoader(list(range(20)), 4, sampler=GlobalSampler(20, seed=0))
    _ids(saved, 1)
    with pytest.raises(ValueError, match="RandomSampler cannot load one"):
        DataLoader(list(range(20)), 4, shuffle=True).load_state_dict(saved.state_dict())


class _Yielded(torch.utils.data.Sampler):
    """A sampler whose state says where it is in the pass, as torchdata's StatefulDistributedSampler's:
    ``{"yielded": n}``, resumed from there by its next ``__iter__``."""

    def __init__(self, n: int):
        self.n, self.yielded, self.next_yielded = n, 0, None

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.yielded = 0
        if self.next_yielded is not None:
            self.yielded, self.next_yielded = self.next_yielded, None
        for i in range(self.yielded, self.n):
            self.yielded += 1
            yield (i * 7) % self.n

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.next_yielded = state["yielded"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_whose_state_says_where_it_is_resumes_from_it_without_losing_a_batch(workers):
    def loader():
        return DataLoader(list(range(50)), batch_size=5, sampler=_Yielded(50), num_workers=workers)

    whole = [b.tolist() for epoch in range(2) for b in loader()]
    for k in (0, 1, 4, 10):  # 10: right after the epoch's last batch
        dl = loader()
        it = iter(dl)
        head = [next(it).tolist() for _ in range(k)]
        state = dl.state_dict()
        again = loader()
        again.load_state_dict(state)
        rest = [b.tolist() for b in again]
        if k == 10:  # saved after the pass's last batch, before its end was seen: the pass has nothing left,
            assert rest == [] and [b.tolist() for b in again] == whole[10:]  # and the next one begins anew
            continue
        mid = loader()
        mid.load_state_dict(state)  # resumed twice: the second resume continues from the first's position
        it2 = iter(mid)
        more = [next(it2).tolist() for _ in range(2)]
        third = loader()
        third.load_state_dict(mid.state_dict())
        assert head + rest == whole[:10] and head + more + [b.tolist() for b in third] == whole[:10], k
    done = loader()
    assert [b.tolist() for b in done] == whole[:10]
    after = loader()
    after.load_state_dict(done.state_dict())  # a pass seen to its end: the next begins anew (not empty)
    assert [b.tolist() for b in after] == whole[10:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_finished_state_loaded_into_a_loader_mid_pass_is_what_its_state_dict_says(workers):
    data = list(range(10))
    start = DataLoader(data, batch_size=2, num_workers=workers).state_dict()  # never iterated: a pass's end
    dl = DataLoader(data, batch_size=2, num_workers=workers)
    it = iter(dl)
    for _ in range(3):
        next(it)
    dl.load_state_dict(start)
    state = dl.state_dict()  # a checkpoint right after the load: the loaded state, not the live pass's
    assert state["batches"] == start["batches"] and state["finished"]
    fresh = DataLoader(data, batch_size=2, num_workers=workers)
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


@pytest.mark.parametrize(("saved", "resumed"), [(3, 2), (3, 1), (2, 3), (3, 0), (0, 3)])
def test_a_map_style_state_resumes_with_another_number_of_workers(saved, resumed):
    data = list(range(24))
    dl = DataLoader(data, batch_size=2, num_workers=saved)
    it = iter(dl)
    for _ in range(2):
        next(it)
    state = dl.state_dict()
    rest = [b.tolist() for b in it]
    again = DataLoader(data, batch_size=2, num_workers=resumed)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest  # was an IndexError with fewer workers than saved


class _Counted:
    """A Stateful iterator, as an IterableDataset's ``__iter__`` may return (torchdata saves its state):
    its samples draw from torch's RNG, whose state its own state carries."""

    def __init__(self, values: list[int]):
        self.values, self.i = values, 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int]:
        if self.i >= len(self.values):
            raise StopIteration
        self.i += 1
        return self.values[self.i - 1], int(torch.randint(1000, ()))

    def state_dict(self) -> dict:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class _IterOfState(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        return _Counted(list(range(w, 24, n)))


class _OwnIterator(IterableDataset):
    """Its own iterator, whose ``__iter__`` sets the position to the worker's start (the restored position
    must come back after it); its state exists only once it was iterated."""

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        self.pos = {"at": w * (24 // n), "end": (w + 1) * (24 // n)}
        return self

    def __next__(self) -> int:
        if self.pos["at"] >= self.pos["end"]:
            raise StopIteration
        self.pos["at"] += 1
        return self.pos["at"] - 1

    def state_dict(self) -> dict:
        return {"pos": dict(self.pos)}

    def load_state_dict(self, state: dict) -> None:
        self.pos = dict(state["pos"])


class _MadeInIter(_OwnIterator):
    """Its state object is made by ``__iter__``: its ``load_state_dict`` works only after it."""

    def __iter__(self):
        super().__iter__()
        self.made = True
        return self

    def load_state_dict(self, state: dict) -> None:
        assert self.made, "load_state_dict before __iter__"
        super().load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", [_IterOfState, _OwnIterator, _MadeInIter])
def test_an_iterable_datasets_stateful_iterator_resumes_where_it_was(kind, workers):
    for k in (0, 3):
        torch.manual_seed(0)
        dl = DataLoader(kind(), batch_size=2, num_workers=workers)
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()  # with workers, before any batch: no copy of the dataset was iterated yet
        rest = [_listed(b) for b in it]
        torch.manual_seed(1)  # a new job: its own random state
        again = DataLoader(kind(), batch_size=2, num_workers=workers)
        again.load_state_dict(state)
        assert [_listed(b) for b in again] == rest, (kind.__name__, workers, k)


def _listed(batch):
    return batch.tolist() if isinstance(batch, torch.Tensor) else [x.tolist() for x in batch]


class _Served(Dataset):
    """Each copy counts the samples it served (a curriculum's step, say): its state."""

    def __init__(self):
        self.served = 0

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.served += 1
        return i, self.served

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


class _Epochs(IterableDataset):
    """Counts its passes: the count changes as the pass ends, after the worker's last batch."""

    def __init__(self):
        self.epoch = 0

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, 6, info.num_workers):
            yield i, self.epoch
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


@pytest.mark.parametrize("kind", [_Served, _Epochs, _IterOfState])
def test_persistent_workers_dataset_states_at_an_epoch_boundary_carry_into_the_next_epoch(kind):
    """(_IterOfState: its ended iterator's state holds the worker's torch random state, which the saved run's
    workers went on drawing from in the next epoch; torchdata's StatefulDataLoader loads it, as here)"""
    def loader():
        return DataLoader(kind(), batch_size=None, num_workers=2, persistent_workers=True)

    dl = loader()
    list(dl)
    state = dl.state_dict()  # at the boundary: the saved run's workers keep their copies into epoch 1
    expected = [tuple(int(x) for x in b) for b in dl]
    again = loader()
    again.load_state_dict(state)
    assert [tuple(int(x) for x in b) for b in again] == expected, kind.__name__


class _RngState(Dataset):
    """Its state is its process's torch random state, from which each sample draws."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return int(torch.randint(100, ()))

    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_state_loaded_back_into_the_loader_with_live_persistent_workers_resumes_as_a_fresh_one(k):
    dl = DataLoader(_RngState(), batch_size=None, num_workers=2, persistent_workers=True)
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = dl.state_dict()
    expected = [int(b) for b in it]
    dl.load_state_dict(state)  # roll back: its workers went on past the state
    assert [int(b) for b in dl] == expected


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["global", "distributed"])
def test_a_pass_left_with_break_then_set_epoch_resumes_the_new_epoch_from_its_start(kind, workers):
    """An epoch cut short (``break``: a limit of batches per epoch), ``set_epoch`` of the next, a checkpoint
    before its first batch: the state said the new epoch at the old pass's position, and the resumed run
    lost that many samples of the new epoch."""
    def make():
        sampler = GlobalSampler(20, seed=1) if kind == "global" else torch.utils.data.DistributedSampler(
            list(range(20)), num_replicas=1, rank=0, seed=1)
        return sampler, DataLoader(list(range(20)), batch_size=2, sampler=sampler, num_workers=workers)

    def cut_then_next_epoch():
        sampler, loader = make()
        for i, _ in enumerate(loader):
            if i == 2:
                break
        sampler.set_epoch(1)
        return sampler, loader

    _, loader = cut_then_next_epoch()
    expected = [x for b in loader for x in b.tolist()]
    _, loader = cut_then_next_epoch()
    state = loader.state_dict()
    sampler, again = make()
    again.load_state_dict(state)
    sampler.set_epoch(1)  # the resumed loop's own set_epoch at the top of the epoch
    assert [x for b in again for x in b.tolist()] == expected and len(expected) == 20


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_over_a_resumed_sampler_saves_the_samplers_position_before_its_first_pass(workers):
    """A sampler given a state (position 10 of 20) in a new loader: the loader's state before any batch said
    the pass had ended there, and a loader restored from it replayed the whole epoch (10 duplicates)."""
    src = GlobalSampler(20, seed=1)
    it = iter(src)
    consumed = [next(it) for _ in range(10)]
    sampler = GlobalSampler(20, seed=1)
    sampler.load_state_dict(src.state_dict())
    loader = DataLoader(list(range(20)), batch_size=2, sampler=sampler, num_workers=workers)
    state = loader.state_dict()  # a checkpoint taken right after the resume
    rest = [x for b in loader for x in b.tolist()]
    assert sorted(rest + consumed) == list(range(20))
    again = DataLoader(list(range(20)), batch_size=2, sampler=GlobalSampler(20, seed=1), num_workers=workers)
    again.load_state_dict(state)
    assert [x for b in again for x in b.tolist()] == rest


def test_a_state_the_sampler_cannot_load_is_refused_when_loaded_and_by_a_restore_before_the_model_changes(
        tmp_path):
    """Another seed or dataset length: the SamplerError came at the first iter(), after restore() had
    changed the model, and the state was gone by then (a second iter() began the epoch silently)."""
    from torchforge import Checkpointer
    from torchforge.errors import CheckpointError
    from torchforge.sampler import SamplerError

    loader = DataLoader(list(range(20)), batch_size=2, sampler=GlobalSampler(20, seed=0))
    next(iter(loader))
    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path).save(1, model=model, loader=loader)
    for sampler, n in ((GlobalSampler(20, seed=1), 20), (GlobalSampler(30, seed=0), 30)):
        other = DataLoader(list(range(n)), batch_size=2, sampler=sampler)
        before = other.state_dict()
        with pytest.raises(SamplerError):
            other.load_state_dict(loader.state_dict())
        assert other.state_dict() == before
        fresh = torch.nn.Linear(2, 2)
        weight = fresh.weight.detach().clone()
        with pytest.raises(CheckpointError, match="DataLoader state does not fit this loader"):
            Checkpointer(tmp_path).restore(model=fresh, loader=other)
        assert torch.equal(fresh.weight, weight)  # all or nothing


@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_a_resumed_loader_is_the_epochs(workers):
    """len(sampler) and len(loader) stay the epoch's after a mid-epoch resume (torch's samplers' meaning);
    the resumed pass yields the rest, and the next pass the whole epoch."""
    ds = list(range(50))
    first = DataLoader(ds, 4, sampler=GlobalSampler(ds, seed=2), num_workers=workers)
    it = iter(first)
    got = [next(it).tolist() for _ in range(5)]
    state = first.state_dict()
    del it
    resumed = DataLoader(ds, 4, sampler=GlobalSampler(ds, seed=2), num_workers=workers)
    resumed.load_state_dict(state)
    assert len(resumed) == len(first) == 13 and len(resumed.sampler) == 50
    rest = [b.tolist() for b in resumed]
    assert len(got) + len(rest) == 13 and sorted(x for b in got + rest for x in b) == ds
    assert resumed.sampler.pass_length() == 30  # the resumed pass: what was left of the epoch
    assert len([b for b in resumed]) == 13


def test_state_dict_of_a_loaded_loader_holds_the_generator_as_it_is_now():
    """Loaded, then seeded again before the next pass: state_dict() still gave the loaded generator state,
    and a run resumed from it shuffled that pass otherwise than the run it was saved from."""
    def make():
        return DataLoader(list(range(16)), 4, shuffle=True)

    torch.manual_seed(0)
    first = make()
    _ = [b for b in first]
    state = first.state_dict()
    b = make()
    b.load_state_dict(state)
    torch.manual_seed(7)  # seeding after loading wins
    saved = b.state_dict()
    want = [x.tolist() for x in b]
    c = make()
    torch.manual_seed(99)
    c.load_state_dict(saved)
    assert [x.tolist() for x in c] == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_state_resumes_at_another_batch_size_where_its_samples_end_or_is_refused(workers, shuffle):
    """The pass skipped the state's count of batches at the new batch size: 4 -> 2 after two batches
    yielded samples 4..7 again, 2 -> 4 never yielded them. It resumes after the state's samples when they
    end a batch of the new size, and is refused otherwise."""
    data = list(range(20))

    def loader(bs):
        return DataLoader(data, batch_size=bs, num_workers=workers, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(5))

    for before, after in ((4, 2), (2, 4), (4, 8), (4, None), (None, 2)):  # (None: unbatched, one a batch)
        it = iter(first := loader(before))
        seen = [torch.as_tensor(next(it)).tolist() for _ in range(2)]
        state = first.state_dict()
        del it
        second = loader(after)
        second.load_state_dict(state)
        rest = [torch.as_tensor(b).tolist() for b in second]
        flat = [i for batch in seen + rest for i in (batch if isinstance(batch, list) else [batch])]
        assert sorted(flat) == data, (before, after, seen, rest)
        assert (len(rest[0]) if after else rest[0] in data) == (after or True), (before, after, rest)
    it = iter(first := loader(4))
    next(it)
    state = first.state_dict()
    with pytest.raises(ValueError, match="after 4 samples in batches of 4, and this loader's batches of 3"):
        loader(3).load_state_dict(state)


class _RollsOver(IterableDataset):
    """A Stateful dataset whose state moves on to its next epoch when a pass ends."""

    def __init__(self, lens):
        self.lens, self.pos, self.epoch = lens, 0, 0

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info else 0
        while self.pos < self.lens[w]:
            self.pos += 1
            yield self.epoch * 1000 + w * 100 + self.pos - 1
        self.pos, self.epoch = 0, self.epoch + 1

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.pos, self.epoch = state["pos"], state["epoch"]


@pytest.mark.parametrize(("workers", "taken"), [(0, 3), (0, 2), (2, 4), (2, 3), (2, 1)])
def test_an_iterator_seen_to_its_end_stays_ended_after_a_resume(workers, taken):
    """A state saved after an iterable's last, short batch (its end seen, no StopIteration yet) did not say
    the iterator had ended: the resumed loader began it again from the dataset's rolled-over state and
    yielded a whole next epoch (and, with workers, a task the saved run gave an ended worker was sent)."""
    whole = DataLoader(_RollsOver([5, 2]), batch_size=2, num_workers=workers)
    full = [b.tolist() for b in whole]
    again = [b.tolist() for b in whole]  # the uninterrupted run's next pass (workers: new copies, as torch's)
    first = DataLoader(_RollsOver([5, 2]), batch_size=2, num_workers=workers)
    it = iter(first)
    got = [next(it).tolist() for _ in range(taken)]
    state = first.state_dict()
    del it
    second = DataLoader(_RollsOver([5, 2]), batch_size=2, num_workers=workers)
    second.load_state_dict(state)
    assert got + [b.tolist() for b in second] == full
    assert [b.tolist() for b in second] == again
    assert again == ([[b + 1000 for b in batch] for batch in full] if workers == 0 else full)
