"""GlobalSampler(shard_affinity=True): rendezvous placement of shards on nodes, exact per-node shuffles,
equal counts per rank, resume at the same topology, and the errors that name the problem."""
import itertools
import json
import pickle
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from torchforge._permute import mix64
from torchforge.datasets.jinx import JinxDataset
from torchforge.datasets.mds import MDSDataset
from torchforge.sampler import GlobalSampler, IterableShards, SamplerError, rendezvous_assign


def topology(sizes, world, local, **kw):
    """One affinity sampler per rank of ``world`` ranks, ``local`` per node."""
    n = int(sum(sizes))
    return [GlobalSampler(n, rank=r, world_size=world, shard_affinity=True, shard_sizes=sizes,
                          local_world_size=local, **kw) for r in range(world)]


def shard_ranges(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    return [range(int(a), int(a) + int(c)) for a, c in zip(starts, sizes)]


def node_samples(sizes, nodes, seed):
    """Each node's dataset indices, from the rendezvous placement."""
    where = rendezvous_assign(len(sizes), nodes, seed)
    out = [set() for _ in range(nodes)]
    for shard, rng in enumerate(shard_ranges(sizes)):
        out[where[shard]].update(rng)
    return out


def interleave(outs):
    return [o[i] for i in range(len(outs[0])) for o in outs]


# --- rendezvous placement ----------------------------------------------------------------------------
def test_four_to_five_nodes_moves_few_shards_where_modulo_moves_most():
    shards = np.arange(1000)
    four, five = rendezvous_assign(1000, 4, seed=3), rendezvous_assign(1000, 5, seed=3)
    moved = four != five
    assert moved.mean() <= 0.25
    assert moved.mean() >= 0.1  # the new node does receive its share
    assert set(five[moved].tolist()) == {4}  # every moved shard went to the node that came
    modulo_moved = (shards % 4) != (shards % 5)
    assert modulo_moved.mean() > 0.70
    gone = rendezvous_assign(1000, 4, seed=3)  # the node that goes: only its shards move
    assert np.array_equal(gone[five != 4], five[five != 4])


@settings(max_examples=30, deadline=None)
@given(shards=st.integers(0, 300), nodes=st.integers(1, 9), seed=st.integers(-2**63, 2**64 - 1))
def test_rendezvous_is_the_highest_weight_node(shards, nodes, seed):
    got = rendezvous_assign(shards, nodes, seed).tolist()
    expected = [max(range(nodes), key=lambda k, s=s: (mix64(seed, s, k), -k)) for s in range(shards)]
    assert got == expected


def test_rendezvous_is_stable_balanced_and_seeded():
    assert rendezvous_assign(6, 3, seed=1).tolist() == [0, 2, 2, 1, 1, 0]  # the same in every Python run
    a = rendezvous_assign(4000, 4)
    counts = np.bincount(a, minlength=4)
    assert counts.min() > 900 and counts.max() < 1100  # expected 1000 each, sd 27
    assert (a != rendezvous_assign(4000, 4, seed=1)).mean() > 0.6
    assert rendezvous_assign(0, 3).tolist() == [] and rendezvous_assign(5, 1).tolist() == [0] * 5
    with pytest.raises(SamplerError, match="nodes"):
        rendezvous_assign(5, 0)
    with pytest.raises(SamplerError, match="num_shards"):
        rendezvous_assign(-1, 2)


# --- coverage, equal counts, node locality --------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30), nodes=st.integers(1, 4),
       local=st.integers(1, 3), drop_last=st.booleans(), shuffle=st.booleans(), seed=st.integers(0, 2**40),
       epoch=st.integers(0, 3))
def test_every_rank_reads_its_node_and_the_ranks_cover_the_data(sizes, nodes, local, drop_last, shuffle, seed,
                                                                 epoch):
    per_node = node_samples(sizes, nodes, seed)
    assume(all(len(p) >= (local if drop_last else 1) for p in per_node))
    samplers = topology(sizes, nodes * local, local, seed=seed, drop_last=drop_last, shuffle=shuffle)
    for s in samplers:
        s.set_epoch(epoch)
    outs = [list(s) for s in samplers]
    lengths = [len(p) for p in per_node]
    per_rank = min(lengths) // local if drop_last else -(-max(lengths) // local)
    assert [len(o) for o in outs] == [per_rank] * len(outs)
    assert all(len(s) == per_rank for s in samplers)
    covered = Counter()
    for k in range(nodes):
        stream = interleave(outs[k * local:(k + 1) * local])  # the node's ranks in lockstep
        m = lengths[k]
        assert set(stream) <= per_node[k]  # only samples of the node's own shards
        head = stream[:m]
        assert len(set(head)) == len(head)  # an exact shuffle: no repeat before the node's order ends
        if not drop_last:
            assert set(head) == per_node[k]
            assert stream[m:] == [head[j % m] for j in range(len(stream) - m)]  # padding repeats from the start
        if not shuffle:
            assert head == sorted(per_node[k])[:len(head)]
        covered.update(head)
    if drop_last:
        assert max(covered.values(), default=1) == 1
    else:
        assert covered == Counter(range(sum(sizes)))


@pytest.mark.parametrize("nodes, local", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2), (4, 2)])
def test_every_sample_exactly_once_when_the_nodes_divide_evenly(nodes, local):
    """Uneven shard sizes chosen (after placement) so that every node holds the same multiple of ``local``."""
    shards, seed = 40, 11
    where = rendezvous_assign(shards, nodes, seed)
    total = 60 * local
    sizes = np.ones(shards, dtype=int)
    for k in range(nodes):
        mine = np.flatnonzero(where == k)
        sizes[mine[0]] = total - (len(mine) - 1)
    for drop_last in (False, True):
        samplers = topology(sizes.tolist(), nodes * local, local, seed=seed, drop_last=drop_last)
        got = Counter(i for s in samplers for i in s)
        assert got == Counter(range(int(sizes.sum())))
        assert {len(s) for s in samplers} == {total // local}


def test_orders_are_seeded_and_differ_per_epoch():
    sizes = [37, 5, 80, 12, 64, 9, 50, 33]

    def stream(seed, epoch, rank=1):
        s = topology(sizes, 4, 2, seed=seed)[rank]
        s.set_epoch(epoch)
        return list(s)

    assert stream(4, 2) == stream(4, 2)
    assert stream(4, 2) != stream(4, 3)
    node_zero = [set(stream(4, e, 0) + stream(4, e, 1)) for e in (2, 3)]
    assert node_zero[0] == node_zero[1]  # the node's samples, in another order
    assert stream(4, 2) != stream(5, 2)
    plain = GlobalSampler(sum(sizes), rank=1, world_size=4, seed=4)
    plain.set_epoch(2)
    assert "affinity" not in plain.state_dict()["order"]  # the non-affinity state is unchanged


def test_nodes_that_stay_keep_their_shards_when_a_node_comes():
    sizes = [10 + (7 * i) % 13 for i in range(200)]
    four = topology(sizes, 4, 1, seed=2)
    five = topology(sizes, 5, 1, seed=2)
    for k in range(4):
        assert set(five[k]) <= set(four[k])  # the node that came took shards, no other shard moved
        assert set(four[k]) == node_samples(sizes, 4, 2)[k]


def test_datasets_give_their_shard_boundaries(tmp_path, write_jinx, write_mds):
    write_jinx(tmp_path / "j", [{"id": i, "pad": "x" * 40} for i in range(300)], shard_size=600,
               compression=None)
    jinx = JinxDataset(tmp_path / "j")
    mds = MDSDataset(write_mds(str(tmp_path / "m"), [{"id": i} for i in range(300)], columns={"id": "int"},
                               size_limit=400))
    assert len(jinx.shards) > 8 and len(mds.metas) > 8
    for ds, shard_of in ((jinx, lambda i: jinx.locate(i)[0]), (mds, lambda i: mds._locate(i)[0])):
        samplers = [GlobalSampler(ds, rank=r, world_size=4, shard_affinity=True, local_world_size=2, seed=1)
                    for r in range(4)]
        where = samplers[0].shard_nodes
        assert all(np.array_equal(s.shard_nodes, where) for s in samplers)
        assert len(where) == (len(jinx.shards) if ds is jinx else len(mds.metas))
        for r, s in enumerate(samplers):
            assert {int(where[shard_of(i)]) for i in s} == {r // 2}
        assert set(itertools.chain.from_iterable(samplers)) == set(range(300))
    declared = type("Declared", (), {"shard_sizes": [3, 4, 5], "__len__": lambda self: 12})()
    s = GlobalSampler(declared, shard_affinity=True)
    assert sorted(s) == list(range(12)) and s.shard_nodes.tolist() == [0, 0, 0]


def test_topology_from_the_environment(monkeypatch):
    sizes = [20] * 30
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    one_node = GlobalSampler(600, rank=3, world_size=4, shard_affinity=True, shard_sizes=sizes)
    assert one_node.state_dict()["order"]["affinity"]["nodes"] == 1
    assert set(one_node.shard_nodes.tolist()) == {0}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = GlobalSampler(600, rank=3, world_size=4, shard_affinity=True, shard_sizes=sizes, seed=6)
    explicit = topology(sizes, 4, 2, seed=6)[3]
    assert env.state_dict()["order"] == explicit.state_dict()["order"]
    assert list(env) == list(explicit)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(SamplerError, match="LOCAL_WORLD_SIZE=3 must be >= 1 and divide world_size=4"):
        GlobalSampler(600, rank=3, world_size=4, shard_affinity=True, shard_sizes=sizes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 0 (no process group) cannot be local rank 1
    with pytest.raises(SamplerError, match="numbered node by node"):
        GlobalSampler(600, world_size=1, shard_affinity=True, shard_sizes=sizes)


# --- resume -----------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=4, max_size=20), nodes=st.integers(1, 3),
       local=st.integers(1, 3), drop_last=st.booleans(), frac=st.floats(0, 1), saver=st.integers(0, 8))
def test_resume_mid_epoch_equals_the_uninterrupted_epoch(sizes, nodes, local, drop_last, frac, saver):
    assume(all(len(p) >= (local if drop_last else 1) for p in node_samples(sizes, nodes, 9)))
    world = nodes * local
    whole = []
    for s in topology(sizes, world, local, seed=9, drop_last=drop_last):
        s.set_epoch(1)
        whole.append(list(s))
    k = int(frac * len(whole[0]))
    before = topology(sizes, world, local, seed=9, drop_last=drop_last)
    states = []
    for s in before:
        s.set_epoch(1)
        assert list(itertools.islice(iter(s), k)) == whole[s.rank][:k]
        states.append(json.loads(json.dumps(s.state_dict())))
    assert len({st_["position"] for st_ in states}) == 1
    for s in topology(sizes, world, local, seed=9, drop_last=drop_last):
        s.load_state_dict(states[saver % world])  # any rank's state resumes every rank
        s.set_epoch(1)
        assert s.pass_length() == len(whole[s.rank]) - k and len(s) == len(whole[s.rank])
        assert list(s) == whole[s.rank][k:]
        if k < len(whole[s.rank]):  # (a pass resumed at the end yields nothing, and so does the next)
            assert list(s) == whole[s.rank]  # the next pass is the whole epoch again


def test_state_at_the_end_of_a_padded_epoch_resumes_to_nothing():
    a, b = topology([0, 3, 0], 4, 4, seed=1)[:2]  # one node of 4 ranks, 3 samples: padded to 4 positions
    assert list(a) + list(b) != [] and len(a) == 1
    end = a.state_at(len(a))
    assert end["position"] == 4 > end["n"]
    b.load_state_dict(end)
    assert b.pass_length() == 0 and list(b) == []
    b.set_epoch(1)
    assert b.pass_length() == 1 == len(b)


def test_resume_across_chunks_and_through_loader_workers_and_pickles():
    sizes = [1000 + (i * 37) % 500 for i in range(300)]
    s = topology(sizes, 2, 1, seed=3)[1]
    whole = list(s)
    assert len(whole) > 70_000  # crosses a chunk of positions
    assert s.indices(0, len(s)).tolist() == whole
    assert np.concatenate(list(s.chunks(10_000))).tolist() == whole
    it = iter(s)
    list(itertools.islice(it, 66_000))
    state = s.state_dict()
    r = pickle.loads(pickle.dumps(topology(sizes, 2, 1, seed=3)[1]))
    r.load_state_dict(state)
    assert r.indices(0, 100).tolist() == whole[66_000:66_100]
    assert list(r) == whole[66_000:]
    data = list(range(sum(sizes)))
    shards = IterableShards(data, topology(sizes, 2, 1, seed=3)[1], block_size=8)
    assert list(shards) == whole


def test_node_indices_and_no_global_order():
    sizes = [13, 0, 40, 7, 22, 31, 5, 18]
    s = topology(sizes, 6, 3, seed=8)[4]
    node_order = s.node_indices(0, 10**6).tolist()
    mine = node_samples(sizes, 2, 8)[1]
    assert sorted(node_order) == sorted(mine)
    ranks = topology(sizes, 6, 3, seed=8)[3:]
    assert interleave([list(r) for r in ranks])[:len(node_order)] == node_order
    with pytest.raises(SamplerError, match="node_indices"):
        s.global_indices(0, 10)
    with pytest.raises(SamplerError, match="shard_affinity"):
        GlobalSampler(10).node_indices(0, 10)
    with pytest.raises(SamplerError, match="shard_affinity"):
        _ = GlobalSampler(10).shard_nodes


# --- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, kwargs, match", [
    (100, {}, "needs shard boundaries, and int has none: pass shard_sizes"),
    (list(range(100)), {}, "needs shard boundaries, and list has none"),
    (100, {"shard_sizes": [50, 49]}, "add up to 99 samples but the dataset has 100"),
    (100, {"shard_sizes": [101, -1]}, "must be >= 0"),
    (100, {"shard_sizes": [[50, 50]]}, "flat sequence of integers"),
    (100, {"shard_sizes": [50.0, 50.0]}, "flat sequence of integers"),
    (100, {"shard_sizes": [50, 50], "local_world_size": 3, "world_size": 4}, "local_world_size=3 must"),
    (100, {"shard_sizes": [50, 50], "sort_key": np.arange(100)}, "no sort_key or bucket_size"),
    (100, {"shard_sizes": [50, 50], "bucket_size": 4}, "no sort_key or bucket_size"),
    (100, {"shard_sizes": [100], "world_size": 2, "local_world_size": 1}, "node [01] of 2 holds no samples"),
    (100, {"shard_sizes": [0, 100, 0], "world_size": 2, "local_world_size": 1}, "holds no samples"),
])
def test_bad_affinity_options(data, kwargs, match):
    with pytest.raises(SamplerError, match=match):
        GlobalSampler(data, shard_affinity=True, **kwargs)


def test_drop_last_with_fewer_samples_than_ranks_on_a_node():
    where = rendezvous_assign(8, 2, 0)
    small = int(np.bincount(where).argmin())
    sizes = [1 if node == small else 50 for node in where.tolist()]
    assert 0 < sum(size for size, node in zip(sizes, where) if node == small) < 4
    GlobalSampler(sum(sizes), shard_affinity=True, shard_sizes=sizes, world_size=8, local_world_size=4)
    with pytest.raises(SamplerError, match="with drop_last every rank would yield nothing"):
        GlobalSampler(sum(sizes), shard_affinity=True, shard_sizes=sizes, world_size=8, local_world_size=4,
                      drop_last=True)


def test_affinity_options_need_shard_affinity():
    with pytest.raises(SamplerError, match="options of shard_affinity=True"):
        GlobalSampler(10, shard_sizes=[5, 5])
    with pytest.raises(SamplerError, match="options of shard_affinity=True"):
        GlobalSampler(10, local_world_size=1)


def test_affinity_state_mismatch_is_refused():
    sizes = [30, 12, 44, 9, 25, 40, 18, 22]
    n = sum(sizes)
    s = topology(sizes, 4, 2, seed=1)[0]
    list(itertools.islice(iter(s), 5))
    state = s.state_dict()
    with pytest.raises(SamplerError, match="resumes only at the same topology: it was saved at world_size=4"):
        topology(sizes, 6, 2, seed=1)[0].load_state_dict(state)  # more nodes
    with pytest.raises(SamplerError, match="same topology"):
        topology(sizes, 4, 4, seed=1)[0].load_state_dict(state)  # same world, other nodes
    with pytest.raises(SamplerError, match="same topology"):
        topology(sizes, 4, 2, seed=1)[0].load_state_dict({**state, "world_size": 8})
    with pytest.raises(SamplerError, match="other shard sizes"):
        topology([n - 100, 100], 4, 2, seed=1)[0].load_state_dict(state)
    with pytest.raises(SamplerError, match="saved with shard_affinity but this sampler has shard_affinity=False"):
        GlobalSampler(n, rank=0, world_size=4, seed=1).load_state_dict(state)
    with pytest.raises(SamplerError, match="saved without shard_affinity but this sampler has shard_affinity=True"):
        s.load_state_dict(GlobalSampler(n, rank=0, world_size=4, seed=1).state_dict())
    with pytest.raises(SamplerError, match="same seed"):
        topology(sizes, 4, 2, seed=2)[0].load_state_dict(state)
    with pytest.raises(SamplerError, match="multiple of local_world_size 2"):
        s.load_state_dict({**state, "position": 11})
    with pytest.raises(SamplerError, match="position <= "):
        s.load_state_dict({**state, "position": 10**6})
    s.load_state_dict(state)
    assert s.state_dict()["position"] == 10 and s.pass_length() == len(topology(sizes, 4, 2, seed=1)[0]) - 5
