"""GlobalSampler in real torch.distributed groups (gloo, spawned processes) of 1, 2 and 3 ranks.

One module fixture runs the three groups once: world size 1, then 2 (which also saves a state
mid-epoch), then 3 (which resumes from the state of world size 2). Rank 0 gathers every rank's
output with ``all_gather_object`` and writes it to a JSON file the tests read.
"""
import json
import os
from collections import Counter

import numpy as np
import pytest
import torch.distributed as dist
from _forkserver import start_ranks

from torchforge.sampler import GlobalSampler

N = 1001  # divisible by neither 2 nor 3: padding happens
SEEDS = (0, 1)
EPOCHS = (0, 1)
RESUME = {"seed": 5, "epoch": 1, "k": 137}
KEYS = (np.arange(N) * 7919) % 97  # sort keys with many ties


def _run(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-{world}", rank=rank,
                            world_size=world)
    try:
        out: dict = {"defaults": None, "orders": {}, "drop_last": {}, "bucketed": None}
        for seed in SEEDS:
            s = GlobalSampler(N, seed=seed)  # rank and world size from torch.distributed
            out["defaults"] = [s.rank, s.world_size]
            for epoch in EPOCHS:
                s.set_epoch(epoch)
                out["orders"][f"{seed}/{epoch}"] = list(s)
        out["drop_last"] = list(GlobalSampler(N, seed=0, drop_last=True))
        out["bucketed"] = list(GlobalSampler(N, seed=3, sort_key=KEYS, bucket_size=12))
        if world == 2:  # consume k per rank, save the state
            s = GlobalSampler(N, seed=RESUME["seed"])
            s.set_epoch(RESUME["epoch"])
            it = iter(s)
            out["before"] = [next(it) for _ in range(RESUME["k"])]
            out["state"] = s.state_dict()
        if world == 3:  # resume the state saved at world size 2
            with open(os.path.join(folder, "state.json")) as f:
                state = json.load(f)
            s = GlobalSampler(N, seed=RESUME["seed"])
            s.load_state_dict(state)
            s.set_epoch(RESUME["epoch"])
            out["after"] = list(s)
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            with open(os.path.join(folder, f"world{world}.json"), "w") as f:
                json.dump(gathered, f)
            if world == 2:
                with open(os.path.join(folder, "state.json"), "w") as f:
                    json.dump(out["state"], f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dist"))

    def start(world):
        return start_ranks(_run, args=(world, folder), nprocs=world, join=False)

    def join(group):
        while not group.join():  # raises if a rank failed
            pass

    one, two = start(1), start(2)  # world size 1 runs alongside 2; 3 needs the state 2 saves
    join(two)
    three = start(3)
    join(one)
    join(three)
    results = {}
    for world in (1, 2, 3):
        with open(os.path.join(folder, f"world{world}.json")) as f:
            results[world] = json.load(f)
    return results


def _interleave(lists):
    return [lst[i] for i in range(len(lists[0])) for lst in lists]


def _global(seed, epoch, **kw):
    s = GlobalSampler(N, seed=seed, rank=0, world_size=1, **kw)
    s.set_epoch(epoch)
    return s.global_indices(0, N).tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_index_exactly_once_per_epoch(groups, world):
    ranks = groups[world]
    assert [r["defaults"] for r in ranks] == [[i, world] for i in range(world)]
    per = -(-N // world)
    for seed in SEEDS:
        for epoch in EPOCHS:
            lists = [r["orders"][f"{seed}/{epoch}"] for r in ranks]
            assert [len(x) for x in lists] == [per] * world  # same count on every rank: no DDP hang
            stream = _interleave(lists)
            order = _global(seed, epoch)
            assert Counter(stream[:N]) == Counter(range(N))  # every index exactly once ...
            assert stream[:N] == order  # ... in the world-size independent global order
            assert stream[N:] == order[:len(stream) - N]  # the named padding: the order's start again
    dropped = [r["drop_last"] for r in ranks]
    assert [len(x) for x in dropped] == [N // world] * world
    stream = _interleave(dropped)
    assert len(set(stream)) == len(stream) and stream == _global(0, 0)[:len(stream)]
    bucketed = _interleave([r["bucketed"] for r in ranks])
    assert bucketed[:N] == _global(3, 0, sort_key=KEYS, bucket_size=12)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_epochs_and_seeds_differ(groups, world):
    rank0 = groups[world][0]["orders"]
    orders = {k: tuple(v) for k, v in rank0.items()}
    assert len(set(orders.values())) == len(orders) == len(SEEDS) * len(EPOCHS)


def test_state_saved_at_world_2_resumes_at_world_3(groups):
    before = [r["before"] for r in groups[2]]
    states = [r["state"] for r in groups[2]]
    k = RESUME["k"]
    assert [s["yielded"] for s in states] == [k, k] and {s["position"] for s in states} == {2 * k}
    after = [r["after"] for r in groups[3]]
    left = N - 2 * k
    assert [len(a) for a in after] == [-(-left // 3)] * 3
    stream = _interleave(before) + _interleave(after)
    assert Counter(stream[:N]) == Counter(range(N))  # the rest of the epoch, exactly once
    order = _global(RESUME["seed"], RESUME["epoch"])
    assert stream[:N] == order
    assert stream[N:] == order[:len(stream) - N]  # padding of the resumed pass, named
