"""Shared-memory slabs and the zero-copy transport: round trips, zero copy, release on GC, no leaks."""
from __future__ import annotations

import gc
import math
import os
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge._collate import default_collate
from torchforge._shm import HeapArena, SlabPool, SlabWriter
from torchforge._transport import decode, encode


def _roundtrip(obj, pool: SlabPool, writer: SlabWriter):
    sid, path = pool.acquire()
    arena = writer.begin(path)
    header = encode(obj, arena)
    writer.end(path, arena)
    base = pool.lease(sid, arena.used)
    return decode(base, *header)


@pytest.fixture
def channel():
    pool, writer = SlabPool(), SlabWriter()
    yield pool, writer
    writer.close()
    pool.close()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()
           | st.binary(max_size=64) | st.complex_numbers(allow_nan=False))
hashables = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=8)
arrays = st.builds(lambda n, d: (np.arange(n) % 7).astype(d).reshape(-1, 1),
                   st.integers(0, 20), st.sampled_from(["<f4", "<i8", "|u1", "<f2", "|b1", "<c16"]))
tensors = st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 20),
                    st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool]))
objects = st.recursive(
    scalars | arrays | tensors,
    lambda kids: (st.lists(kids, max_size=6) | st.lists(kids, max_size=4).map(tuple)
                  | st.dictionaries(hashables, kids, max_size=5) | st.sets(hashables, max_size=5)
                  | st.frozensets(hashables, max_size=4)),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(objects)
def test_roundtrip_is_exact(obj):
    pool, writer = SlabPool(), SlabWriter()
    try:
        assert _same(obj, _roundtrip(obj, pool, writer))
    finally:
        writer.close()
        pool.close()


def test_fast_paths_roundtrip(channel):
    objs = [
        ["a", "bb", "", "ü" * 3], [1, -2, 2**63 - 1, -(2**63)], [2**70, 1], [0.5, float("inf"), float("nan")],
        [True, False], [None, None], [b"x", b"", b"yz"], {i: {f"s{i}", f"t{i}"} for i in range(50)},
        [(1, 2), (3, 4)], [[1], [2, 3], []], [frozenset({1}), frozenset()], [set(), set()],
        {"w": np.random.default_rng(0).normal(size=(7,))}, [np.float32(1.5), np.int64(3)],
        [bytearray(b"ab")], {"k": memoryview(b"mv")},
    ]
    for obj in objs:
        got = _roundtrip(obj, *channel)
        if isinstance(obj, dict) and "k" in obj:
            assert got == {"k": b"mv"}
        elif any(isinstance(x, float) and math.isnan(x) for x in obj if isinstance(obj, list)):
            assert got[:2] == obj[:2] and math.isnan(got[2])
        else:
            assert _same(obj, got), obj


class _Record(Mapping):
    """A read-only mapping that is not a dict, like a lazy dataset's sample."""

    def __init__(self, **kw):
        self._d = kw

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_records_travel_as_json_only_when_exact(channel):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "n": 3, "ok": None}]
    assert _same(msgs, _roundtrip(msgs, *channel))
    for inexact in ({"a": float("nan")}, {"a": 2**64}, {"a": float("-inf"), "b": 1}, {1: "x"}, {"a": (1, 2)}):
        assert _same([inexact, inexact], _roundtrip([inexact, inexact], *channel)), inexact
    got = _roundtrip({"m": [[_Record(role="user", content="q")], []]}, *channel)
    assert got == {"m": [[{"role": "user", "content": "q"}], []]} and type(got["m"][0][0]) is dict


def test_tensors_are_views_of_the_slab_and_slab_is_released_on_gc(channel):
    pool, writer = channel
    data = {"a": np.arange(1000, dtype=np.float64), "t": torch.ones(3, 4)}
    got = _roundtrip(data, pool, writer)
    assert len(pool) == 1 and pool.free_count == 0
    base_addr = np.frombuffer(pool._slabs[next(iter(pool._slabs))].mm, np.uint8).ctypes.data
    size = pool._slabs[next(iter(pool._slabs))].mapped
    assert base_addr <= got["a"].ctypes.data < base_addr + size
    assert base_addr <= got["t"].data_ptr() < base_addr + size
    a = got["a"]
    del got
    gc.collect()
    assert pool.free_count == 0  # one view still alive: the slab must not be reused
    assert np.array_equal(a, np.arange(1000, dtype=np.float64))
    del a
    assert pool.free_count == 1
    pool.acquire()  # the freed slab is reused, not a new one
    assert len(pool) == 1


def test_collated_tensors_are_not_copied_again(channel):
    pool, writer = channel
    _, path = pool.acquire()
    arena = writer.begin(path)
    batch = default_collate([{"x": np.ones(1000, np.float32)} for _ in range(8)], arena)
    used_after_collate = arena.used
    encode(batch, arena)
    assert arena.used - used_after_collate < 200  # only the header was added


def test_slab_grows_past_its_initial_size(channel):
    big = np.arange(3 << 20, dtype=np.uint8)  # 3 MiB: beyond the first 1 MiB of a slab
    got = _roundtrip([big, big[:10]], *channel)
    assert np.array_equal(got[0], big) and np.array_equal(got[1], big[:10])


def test_unsupported_types_raise_typeerror(channel):
    with pytest.raises(TypeError, match="cannot transport"):
        _roundtrip({"f": object()}, *channel)
    with pytest.raises(TypeError, match="object"):
        _roundtrip(np.array([object()]), *channel)


def _our_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("torchforge")}


@pytest.mark.parametrize("use_memfd", [True, False])
def test_pool_close_leaves_nothing_behind(use_memfd):
    if use_memfd and not hasattr(os, "memfd_create"):
        pytest.skip("memfd_create is not available on this platform")
    before_shm = _our_shm()
    before_fds = set(os.listdir("/proc/self/fd"))
    pool, writer = SlabPool(use_memfd=use_memfd), SlabWriter()
    kept = _roundtrip({"x": np.arange(10)}, pool, writer)
    _roundtrip([b"abc"], pool, writer)
    if not use_memfd:
        assert _our_shm() - before_shm
    writer.close()
    pool.close()
    assert np.array_equal(kept["x"], np.arange(10))  # a batch held across close stays readable
    assert _our_shm() == before_shm
    del kept
    gc.collect()
    assert set(os.listdir("/proc/self/fd")) == before_fds


def test_heap_arena_collate():
    batch = default_collate([(1, 2.0, "a", b"xy"), (3, 4.0, "b", b"z")], HeapArena())
    ids, vals, names, blobs = batch
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 3]
    assert vals.dtype == torch.float64 and vals.tolist() == [2.0, 4.0]
    assert names == ["a", "b"]
    assert blobs["data"].tolist() == [[120, 121], [122, 0]] and blobs["lengths"].tolist() == [2, 1]
