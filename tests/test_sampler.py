"""GlobalSampler and IterableShards in one process: exact coverage, padding, sorting, buckets, resume."""
import itertools
import json
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge._permute import EpochOrder, Permutation, mix64
from torchforge.datasets.base import ShardDataset
from torchforge.errors import TorchforgeError
from torchforge.sampler import GlobalSampler, IterableShards, SamplerError


def ranks(n, world, **kw):
    return [GlobalSampler(n, rank=r, world_size=world, **kw) for r in range(world)]


def interleave(outs):
    """The global stream the ranks consumed in lockstep."""
    return [o[i] for i in range(len(outs[0])) for o in outs]


# --- the bijection ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), key=st.integers(0, 2**64 - 1))
def test_permutation_is_a_bijection(n, key):
    p = Permutation(n, key)
    assert sorted(p(np.arange(n)).tolist()) == list(range(n))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 500), key=st.integers(0, 2**32), tweaks=st.lists(st.integers(0, 2**40), min_size=1, max_size=4))
def test_tweaked_permutations_are_each_bijections(n, key, tweaks):
    p = Permutation(n, key)
    pos = np.tile(np.arange(n), len(tweaks))
    tw = np.repeat(np.array(tweaks, dtype=np.int64), n)
    out = p(pos, tweak=tw).reshape(len(tweaks), n)
    for row in out:
        assert sorted(row.tolist()) == list(range(n))


def test_permutation_mixes_and_keys_differ():
    n = 100_000
    a = Permutation(n, 1)(np.arange(n))
    b = Permutation(n, 2)(np.arange(n))
    assert (a == b).sum() < 20  # unrelated permutations share ~1 fixed position
    assert (a == np.arange(n)).sum() < 20
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.02  # neighbours are not related
    assert abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.02


def test_wide_domain_over_32_bits():
    n = 2**40 + 3
    p = Permutation(n, 9)
    pos = np.concatenate([np.arange(5000), np.arange(n - 5000, n)])
    v = p(pos)
    assert v.dtype == np.int64 and v.min() >= 0 and v.max() < n
    assert len(np.unique(v)) == len(v)
    assert np.array_equal(p(pos[::-1]), v[::-1])  # positions are computed independently


def test_small_permutations_are_close_to_uniform():
    counts = Counter(tuple(Permutation(4, k)(np.arange(4)).tolist()) for k in range(1200))
    assert len(counts) == 24
    assert min(counts.values()) >= 20 and max(counts.values()) <= 95  # expected 50 each, sd 7


# --- coverage and padding over n, world size, drop_last, buckets --------------------------------
order_options = st.fixed_dictionaries({
    "shuffle": st.booleans(),
    "drop_last": st.booleans(),
    "bucket_size": st.one_of(st.none(), st.integers(1, 25)),
    "descending": st.booleans(),
    "seed": st.integers(0, 2**63),
})


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), world=st.integers(1, 6), opts=order_options, sort=st.booleans(),
       data=st.data())
def test_ranks_cover_the_global_order_exactly(n, world, opts, sort, data):
    if sort:
        opts["sort_key"] = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)), dtype=np.int64)
    outs = [list(s) for s in ranks(n, world, **opts)]
    per = n // world if opts["drop_last"] else -(-n // world)
    assert [len(o) for o in outs] == [per] * world
    order = GlobalSampler(n, **opts).global_indices(0, n).tolist()
    assert sorted(order) == list(range(n))
    stream = interleave(outs)
    if opts["drop_last"]:
        assert stream == order[:len(stream)]
    else:  # the named padding: repeat the order from its start
        assert stream[:n] == order
        assert stream[n:] == [order[j % n] for j in range(len(stream) - n)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), bucket=st.integers(1, 40), shuffle=st.booleans(), descending=st.booleans(),
       seed=st.integers(0, 1000), data=st.data())
def test_sorted_and_bucketed_orders(n, bucket, shuffle, descending, seed, data):
    keys = np.array(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    sorted_order = GlobalSampler(n, sort_key=keys, descending=descending, shuffle=shuffle, seed=seed).global_indices(0, n)
    expected = sorted(range(n), key=lambda i: (-keys[i] if descending else keys[i], i))  # stable
    assert sorted_order.tolist() == expected
    order = GlobalSampler(n, sort_key=keys, descending=descending, bucket_size=bucket, shuffle=shuffle,
                          seed=seed).global_indices(0, n)
    assert sorted(order.tolist()) == list(range(n))
    full = n // bucket * bucket
    sorted_buckets = [frozenset(expected[i:i + bucket]) for i in range(0, full, bucket)]
    got_buckets = [frozenset(order[i:i + bucket].tolist()) for i in range(0, full, bucket)]
    assert Counter(got_buckets) == Counter(sorted_buckets)  # buckets are runs of the sorted order
    assert set(order[full:].tolist()) == set(expected[full:])  # the partial bucket stays last
    if not shuffle:
        assert order.tolist() == expected


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64", "uint64", "float32", "bool"])
@pytest.mark.parametrize("span", [2, 60_000, 70_000, 2**40])
def test_sort_matches_a_stable_sort_for_every_key_type(dtype, span):
    rng = np.random.default_rng(span)
    raw = rng.integers(0, span, 3000, dtype=np.int64) - (span // 2 if dtype[0] in "if" else 0)
    keys = raw.astype(dtype)  # narrow types wrap: still a valid key array
    for descending in (False, True):
        got = GlobalSampler(3000, sort_key=keys, descending=descending).global_indices(0, 3000).tolist()
        expected = sorted(range(3000), key=lambda i: (-keys[i].item() if descending else keys[i].item(), i))
        assert got == expected


def test_buckets_shuffle_between_and_within():
    n, b = 4000, 40
    keys = np.arange(n) // 7  # many ties
    s = GlobalSampler(n, sort_key=keys, bucket_size=b, seed=3)
    order = s.global_indices(0, n)
    first = order[:b]
    assert keys[first].max() - keys[first].min() <= b // 7 + 1  # a bucket holds similar keys
    starts = [int(order[i:i + b].min()) for i in range(0, n, b)]
    assert starts != sorted(starts)  # buckets are shuffled among themselves
    within = [order[i:i + b] for i in range(0, n, b)]
    assert sum(not np.all(np.diff(w) > 0) for w in within) > len(within) // 2  # and inside
    s.set_epoch(1)
    assert not np.array_equal(s.global_indices(0, n), order)


def test_buckets_without_a_key_are_contiguous_index_ranges():
    order = GlobalSampler(103, bucket_size=10, seed=5).global_indices(0, 103)
    for i in range(0, 100, 10):
        chunk = order[i:i + 10]
        assert chunk.max() - chunk.min() == 9 and chunk.min() % 10 == 0
    assert sorted(order[100:].tolist()) == [100, 101, 102]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=12), seed=st.integers(0, 5),
       world=st.integers(1, 3), frac=st.floats(0, 1))
def test_shard_buckets_read_one_shard_at_a_time(sizes, seed, world, frac):
    n = sum(sizes)
    bounds = np.cumsum([0, *sizes])
    shard_of = np.searchsorted(bounds, np.arange(n), side="right") - 1
    s = GlobalSampler(n, seed=seed, bucket_size="shards", shard_sizes=sizes)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        order = s.global_indices(0, n)
        assert sorted(order.tolist()) == list(range(n))
        runs = [k for k, _ in itertools.groupby(shard_of[order].tolist())]
        assert len(runs) == len(set(runs))  # each shard's samples are read together, then never again
    # a dataset's own shard boundaries; ranks share the order; resume at another world size
    ds = type("Shards", (), {"shard_sizes": sizes, "__len__": lambda self: n})()
    whole = GlobalSampler(ds, seed=seed, bucket_size="shards").global_indices(0, n).tolist()
    everyone = [GlobalSampler(ds, seed=seed, bucket_size="shards", rank=r, world_size=world) for r in range(world)]
    assert interleave([list(r) for r in everyone])[:n] == whole
    k = int(frac * len(everyone[0]))
    rest = GlobalSampler(ds, seed=seed, bucket_size="shards")
    rest.load_state_dict(everyone[0].state_at(k))
    assert list(rest) == whole[min(k * world, n):]


def test_shard_buckets_need_boundaries_and_no_sort_key():
    with pytest.raises(SamplerError, match="shard boundaries"):
        GlobalSampler(10, bucket_size="shards")
    with pytest.raises(SamplerError, match="sort_key"):
        GlobalSampler(10, bucket_size="shards", shard_sizes=[5, 5], sort_key=np.arange(10))
    with pytest.raises(SamplerError, match="add up"):
        GlobalSampler(10, bucket_size="shards", shard_sizes=[5, 4])
    with pytest.raises(SamplerError, match="bucket_size"):
        GlobalSampler(10, bucket_size="blocks")
    a = GlobalSampler(10, bucket_size="shards", shard_sizes=[5, 5]).state_dict()
    with pytest.raises(SamplerError, match="order"):  # other shard boundaries: another order
        GlobalSampler(10, bucket_size="shards", shard_sizes=[4, 6]).load_state_dict(a)


def test_no_shuffle_no_sort_is_identity_and_padding_repeats_start():
    outs = [list(s) for s in ranks(7, 3, shuffle=False)]
    assert outs == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    outs = [list(s) for s in ranks(7, 3, shuffle=False, drop_last=True)]
    assert outs == [[0, 3], [1, 4], [2, 5]]
    assert [list(s) for s in ranks(2, 5, shuffle=False)] == [[0], [1], [0], [1], [0]]


# --- epochs and seeds ----------------------------------------------------------------------------
def test_epochs_and_seeds_give_different_orders():
    def order(seed, epoch):
        s = GlobalSampler(1000, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(4, 2)) == list(range(1000))
    assert order(0, 0) != list(range(1000))


def test_sort_without_buckets_is_the_same_every_epoch():
    keys = np.random.default_rng(0).integers(0, 50, 500)
    s = GlobalSampler(500, sort_key=keys)
    a = list(s)
    s.set_epoch(3)
    assert list(s) == a


def test_sort_key_forms():
    data = [{"len": L, "meta": {"len": L}} for L in [5, 3, 9, 3, 1]]
    expected = [4, 1, 3, 0, 2]
    assert list(GlobalSampler(data, sort_key="len")) == expected
    assert list(GlobalSampler(data, sort_key="meta.len")) == expected
    assert list(GlobalSampler(data, sort_key=lambda s: s["len"])) == expected
    assert list(GlobalSampler(data, sort_key=torch.tensor([5, 3, 9, 3, 1]))) == expected
    assert list(GlobalSampler(data, sort_key=[5, 3, 9, 3, 1], descending=True)) == [2, 0, 1, 3, 4]
    words = ["pear", "apple", "fig", "apple"]
    assert list(GlobalSampler(4, sort_key=np.array(words))) == [1, 3, 2, 0]
    assert list(GlobalSampler(4, sort_key=words, descending=True)) == [0, 2, 1, 3]


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket_size": 0}, "bucket_size"),
    ({"rank": 3, "world_size": 3}, "rank"),
    ({"world_size": 0}, "world_size"),
    ({"sort_key": "len"}, "needs a dataset"),
    ({"sort_key": np.arange(9)}, "one per sample"),
    ({"sort_key": np.array([object()] * 10)}, "numbers, strings or bytes"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(SamplerError, match=match):
        GlobalSampler(10, **kwargs)
    assert issubclass(SamplerError, TorchforgeError)


def test_bad_lengths():
    with pytest.raises(SamplerError, match="len"):
        GlobalSampler(object())
    with pytest.raises(SamplerError, match=">= 0"):
        GlobalSampler(-1)


# --- state and resume -----------------------------------------------------------------------------
def test_state_counts_what_the_iterator_yielded():
    s = GlobalSampler(200_000, seed=1, rank=1, world_size=2)
    it = iter(s)
    first = list(itertools.islice(it, 70_001))  # crosses a chunk boundary
    st_ = s.state_dict()
    assert st_["yielded"] == 70_001 and st_["position"] == 140_002 and st_["epoch"] == 0
    assert json.loads(json.dumps(st_)) == st_  # plain data
    rest = list(it)
    assert s.state_dict()["yielded"] == 100_000 and s.state_dict()["position"] == 200_000
    r = GlobalSampler(200_000, seed=1, rank=1, world_size=2)
    r.load_state_dict(st_)
    r.set_epoch(0)  # the loop's set_epoch of the same epoch keeps the resume point
    assert r.pass_length() == 100_000 - 70_001 and len(r) == 100_000  # len: the epoch's, as torch's samplers
    assert list(r) == rest
    assert first + rest == list(GlobalSampler(200_000, seed=1, rank=1, world_size=2))


def test_passes_restart_and_new_epochs_reset():
    s = GlobalSampler(50, seed=2)
    whole = list(s)
    assert list(s) == whole  # a second pass repeats the epoch (DistributedSampler's behaviour)
    it = iter(s)
    part = list(itertools.islice(it, 10))
    saved = s.state_dict()
    assert list(s) == whole  # an abandoned pass: the next iter starts over
    s.load_state_dict(saved)
    assert list(s) == whole[10:]
    assert list(s) == whole
    s.load_state_dict(saved)
    s.set_epoch(1)  # another epoch: the resume point is dropped
    assert len(s) == 50 and sorted(s) == list(range(50)) and list(s) != whole
    assert part == whole[:10]


def test_state_at_end_of_epoch_resumes_to_nothing():
    s = GlobalSampler(11, world_size=2, rank=0)
    list(s)
    end = s.state_at(len(s))  # every index yielded, the pass's end not seen by its consumer
    assert end["position"] == 11
    t = GlobalSampler(11, world_size=3, rank=2)
    t.load_state_dict(end)
    assert t.pass_length() == 0 and list(t) == [] and len(t) == 4
    t.set_epoch(1)
    assert t.pass_length() == 4


def test_state_dict_after_a_whole_pass_resumes_as_the_sampler_goes_on():
    """state_dict() of a sampler whose pass ran to its end says so: the loaded sampler's next pass is the
    whole epoch again, as the saved sampler's is (it resumed an empty remainder)."""
    s = GlobalSampler(11, seed=3, world_size=2, rank=0)
    first = list(s)
    t = GlobalSampler(11, seed=3, world_size=2, rank=0)
    t.load_state_dict(s.state_dict())
    assert list(t) == list(s) == first


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 250), w1=st.integers(1, 5), w2=st.integers(1, 5), drop_last=st.booleans(),
       bucket=st.one_of(st.none(), st.integers(1, 12)), sort=st.booleans(), frac=st.floats(0, 1), data=st.data())
def test_elastic_resume_covers_the_rest_exactly_once(n, w1, w2, drop_last, bucket, sort, frac, data):
    kw = {"seed": 7, "drop_last": drop_last, "bucket_size": bucket}
    if sort:
        kw["sort_key"] = np.array(data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    before_ranks = ranks(n, w1, **kw)
    for s in before_ranks:
        s.set_epoch(2)
    k = int(frac * len(before_ranks[0]))
    before = []
    states = []
    for s in before_ranks:
        it = iter(s)
        before.append(list(itertools.islice(it, k)))
        states.append(s.state_dict())
    assert len({st_["position"] for st_ in states}) == 1
    after_ranks = ranks(n, w2, **kw)
    for s in after_ranks:
        s.load_state_dict(states[0])
        s.set_epoch(2)
    after = [list(s) for s in after_ranks]
    assert len({len(a) for a in after}) == 1
    consumed = min(k * w1, n)
    left = n - consumed
    real_after = left if not drop_last else left // w2 * w2
    got = Counter(interleave(before)[:consumed] + interleave(after)[:real_after])
    if drop_last:
        assert all(c == 1 for c in got.values()) and sum(got.values()) == consumed + real_after
    else:
        assert got == Counter(range(n))
        padding = interleave(after)[real_after:]
        order = GlobalSampler(n, **kw)
        order.set_epoch(2)
        g = order.global_indices(0, n).tolist()
        assert padding == [g[j % n] for j in range(len(padding))]  # named repeats from the start


def test_state_mismatch_is_refused():
    s = GlobalSampler(100, seed=1)
    st_ = s.state_dict()
    with pytest.raises(SamplerError, match="100 samples"):
        GlobalSampler(99, seed=1).load_state_dict(st_)
    with pytest.raises(SamplerError, match="same seed"):
        GlobalSampler(100, seed=2).load_state_dict(st_)
    with pytest.raises(SamplerError, match="same seed"):
        GlobalSampler(100, seed=1, sort_key=np.arange(100)[::-1].copy()).load_state_dict(st_)
    with pytest.raises(SamplerError, match="not a GlobalSampler state"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(SamplerError, match="position"):
        s.load_state_dict({**st_, "position": 101})


# --- vectorised access --------------------------------------------------------------------------
def test_indices_and_chunks_match_iteration():
    s = GlobalSampler(100_003, seed=5, rank=2, world_size=3, bucket_size=64)
    whole = list(s)
    assert s.indices(0, len(s)).tolist() == whole
    assert s.indices(10, 5000, 7).tolist() == whole[10:5000:7]
    assert s.indices(-5, None).tolist() == whole[-5:]
    assert s.indices(len(s), len(s) + 10).size == 0
    chunks = s.chunks(10_000)
    a = next(chunks)
    assert s.state_dict()["yielded"] == 10_000
    assert np.concatenate([a, *chunks]).tolist() == whole
    assert s.state_dict()["yielded"] == len(s)
    with pytest.raises(SamplerError):
        s.chunks(0)


def test_batch_sized_indices_are_exact_across_blocks_epochs_and_resumes():
    s = GlobalSampler(150_001, seed=6, rank=0, world_size=2)
    whole = list(s)
    assert np.concatenate([s.indices(b, b + 1000) for b in range(0, len(s), 1000)]).tolist() == whole
    assert s.indices(65_530, 65_540).tolist() == whole[65_530:65_540]  # straddles a cached block
    got = s.indices(0, 10)
    got[:] = -1  # the caller's copy, not the cache
    assert s.indices(0, 10).tolist() == whole[:10]
    s.set_epoch(1)
    assert s.indices(0, 10).tolist() == list(s)[:10] != whole[:10]
    s.load_state_dict(s.state_at(100))
    assert s.indices(0, 10).tolist() == list(s)[:10]


def test_sampler_pickles_for_loader_workers():
    s = GlobalSampler(100_000, seed=3, rank=1, world_size=2, bucket_size=10, sort_key=np.arange(100_000) % 17)
    s.set_epoch(2)
    it = iter(s)
    head = list(itertools.islice(it, 1234))
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    assert clone.indices(0, 2000).tolist() == s.indices(0, 2000).tolist()
    assert head + list(it) == clone.indices(0, len(clone)).tolist()


def test_epoch_order_pieces_agree():
    n, key = 1000, mix64(1, 2)
    o = EpochOrder(n, key, shuffle=True, bucket_size=30)
    pos = np.arange(n)
    assert np.array_equal(o(pos), np.concatenate([o(pos[:500]), o(pos[500:])]))
    assert np.array_equal(o(pos[::-1]), o(pos)[::-1])


# --- IterableShards under torch's DataLoader ------------------------------------------------------
@pytest.mark.parametrize("block", [1, 4])
def test_iterable_shards_two_workers_cover_exactly_once(block):
    n = 203
    sampler = GlobalSampler(n, seed=11, rank=1, world_size=2)
    shards = IterableShards(list(range(1000, 1000 + n)), sampler, block_size=block)
    loader = torch.utils.data.DataLoader(shards, batch_size=4, num_workers=2)
    got = [int(x) - 1000 for batch in loader for x in batch]
    expected = list(sampler)
    assert Counter(got) == Counter(expected) and len(got) == len(sampler)
    if block == 4:  # batch-sized blocks: the loader's order is the sampler's
        assert got == expected
        consumed = 4 * 13
        resumed = IterableShards(shards.dataset, GlobalSampler(n, seed=11, rank=1, world_size=2), block_size=4)
        resumed.load_state_dict(shards.state_at(consumed))
        rest = [int(x) - 1000 for b in torch.utils.data.DataLoader(resumed, batch_size=4, num_workers=2) for x in b]
        assert got[:consumed] + rest == expected


def test_iterable_shards_in_process_and_positions():
    shards = IterableShards(list(range(10)), GlobalSampler(10, shuffle=False), block_size=3)
    assert list(shards) == list(range(10))
    parts = [np.concatenate(list(shards.worker_positions(w, 3))).tolist() for w in range(3)]
    assert parts == [[0, 1, 2, 9], [3, 4, 5], [6, 7, 8]]
    assert len(shards) == 10
    with pytest.raises(SamplerError):
        IterableShards([], block_size=0)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 400), workers=st.integers(1, 5), block=st.integers(1, 9))
def test_worker_split_has_no_gaps_or_repeats(n, workers, block):
    shards = IterableShards(list(range(n)), GlobalSampler(n, shuffle=False), block_size=block)
    parts = [[p.tolist() for p in shards.worker_positions(w, workers)] for w in range(workers)]
    flat = [sorted(x for chunk in part for x in chunk) for part in parts]
    assert sorted(x for part in flat for x in part) == list(range(n))
    # round-robin over the workers, one block at a time, gives the sampler's order back
    streams = [[x for chunk in part for x in chunk] for part in parts]
    merged, turn = [], 0
    while any(streams):
        w = turn % workers
        merged += streams[w][:block]
        streams[w] = streams[w][block:]
        turn += 1
    assert merged == list(range(n))


def test_as_the_sampler_of_torch_dataloader():
    data = list(range(500, 600))
    sampler = GlobalSampler(data, seed=8, rank=2, world_size=3, bucket_size=5, sort_key=[x % 7 for x in data])
    loader = torch.utils.data.DataLoader(data, batch_size=6, sampler=sampler, num_workers=2)
    assert len(loader) == 6
    got = [int(x) - 500 for batch in loader for x in batch]
    assert got == sampler.indices(0, len(sampler)).tolist() and len(got) == 34


class _StrDataset(ShardDataset):
    def __init__(self, keys):
        self._k = keys

    def __len__(self):
        return len(self._k)

    def _get(self, i):
        return {"k": self._k[i]}

    def shard_files(self):
        return []


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.sampled_from(["", "a", "ab", "b", "é", "漢", "a\u0301", "zz"]), max_size=40),
       descending=st.booleans(), shard_dataset=st.booleans())
def test_callable_string_sort_matches_array_sort(keys, descending, shard_dataset):
    ds = _StrDataset(keys) if shard_dataset else [{"k": k} for k in keys]
    by_fn = list(GlobalSampler(ds, shuffle=False, sort_key=lambda s: s["k"], descending=descending))
    by_array = list(GlobalSampler(len(keys), shuffle=False, sort_key=np.array(keys, dtype=str),
                                  descending=descending))
    assert by_fn == by_array


@pytest.mark.parametrize("fmt", ["jinx", "mds"])
def test_a_sort_key_field_one_sample_lacks_names_that_sample_and_its_fields(tmp_path, fmt):
    """KeyError "sample has no field 'len'" said neither which sample of a million nor what it holds."""
    import torchforge
    from torchforge.formats.mds import MDSWriter

    rows = [{"id": i, "len": i} if i != 4 else {"id": i} for i in range(10)]
    if fmt == "jinx":
        with torchforge.JinxWriter(tmp_path / "d") as w:
            for r in rows:
                w.write(r)
    else:  # MDS has one set of columns: the field is missing from the dataset (every sample)
        with MDSWriter(str(tmp_path / "d"), {"id": "int"}) as w:
            for r in rows:
                w.write({"id": r["id"]})
    ds = torchforge.open_dataset(str(tmp_path / "d"))
    with pytest.raises(KeyError) as e:
        GlobalSampler(ds, sort_key="len")
    at = 4 if fmt == "jinx" else 0
    assert f"sample {at} has no field 'len' (its fields: ['id'])" in str(e.value), e.value
