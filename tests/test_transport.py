"""Shared-memory slabs and the zero-copy transport: round trips, zero copy, release on GC, no leaks."""
from __future__ import annotations

import collections
import dataclasses
import gc
import math
import os
import pickle
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge.loader import collate
from torchforge.loader.collate import default_collate, padded_collate
from torchforge.loader.slabs import SlabPool, SlabWriter
from torchforge.loader.transport import decode, encode


def _roundtrip(obj, pool: SlabPool, writer: SlabWriter):
    sid, path = pool.acquire()
    arena = writer.begin(sid, path)
    off, length, buffers = encode(obj, arena)
    writer.end(sid, arena)
    base = pool.lease(sid, arena.used)
    return decode(base, off, length, buffers)


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


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    names: list


def test_types_survive_the_trip(channel):
    objs = [Point(torch.ones(3), 2), _Record(role="user", content="q"), Batch(torch.arange(6).view(2, 3), ["a"]),
            {"k": bytearray(b"ab")}, [np.float32(1.5), np.int64(3)], torch.arange(10)[::2],
            torch.zeros(0, 3), torch.tensor(7), torch.arange(4, dtype=torch.bfloat16)]
    for obj in objs:
        got = _roundtrip(obj, *channel)
        assert type(got) is type(obj), obj
    p = _roundtrip(objs[0], *channel)
    assert torch.equal(p.x, torch.ones(3)) and p.y == 2
    assert dict(_roundtrip(objs[1], *channel)) == {"role": "user", "content": "q"}
    b = _roundtrip(objs[2], *channel)
    assert torch.equal(b.images, torch.arange(6).view(2, 3)) and b.names == ["a"]
    assert torch.equal(_roundtrip(objs[5], *channel), torch.arange(0, 10, 2))


def _view(base: torch.Tensor, spec) -> torch.Tensor:
    """A view of ``base`` drawn by hypothesis: a slice, a transpose, a step, an expand, an element."""
    kind, k = spec
    n = base.shape[0]
    return {"whole": lambda: base, "slice": lambda: base[k % n:], "rows": lambda: base[:, : 1 + k % base.shape[1]],
            "t": lambda: base.t(), "step": lambda: base[:: 1 + k % 3], "col": lambda: base[:, k % base.shape[1]],
            "expand": lambda: base[:1].expand(4, -1), "elem": lambda: base[k % n, 0]}[kind]()


def _extent(t: torch.Tensor) -> int:
    """Elements from a view's first to its last in its storage."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.sampled_from([torch.float32, torch.int16, torch.uint8,
                                                              torch.complex64, torch.bool, torch.bfloat16]),
       st.lists(st.tuples(st.sampled_from(["whole", "slice", "rows", "t", "step", "col", "expand", "elem"]),
                          st.integers(0, 50)), min_size=1, max_size=5))
def test_views_of_one_storage_arrive_equal_with_their_strides_and_share_where_they_overlap(rows, cols, dtype, specs):
    base = (torch.arange(rows * cols) % 251).to(dtype).view(rows, cols)
    views = [_view(base, spec) for spec in specs]
    pool, writer = SlabPool(), SlabWriter()
    try:
        got = _roundtrip(views, pool, writer)
        for v, g in zip(views, got):
            assert g.dtype == v.dtype and g.shape == v.shape and torch.equal(g, v)
            if v.stride() != g.stride():  # copied compactly: a thin view of its storage
                assert g.is_contiguous() and v.numel() * 2 < _extent(v)
        first = got[0]
        for v, g in zip(views[1:], got[1:]):  # a view inside the first one's bytes shares its storage
            if v.stride() == g.stride() and first.stride() == views[0].stride() and v.dtype == views[0].dtype:
                lo0, lo = views[0].storage_offset(), v.storage_offset()
                if lo0 <= lo and lo + _extent(v) <= lo0 + _extent(views[0]):
                    assert g.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    assert g.storage_offset() - first.storage_offset() == lo - lo0
    finally:
        writer.close()
        pool.close()


def test_a_language_model_batch_sends_its_token_bytes_once(channel):
    """inputs and targets sliced from one token tensor: one copy of the bytes, shared as torch shares it."""
    tokens = torch.arange(4 * 1025).view(4, 1025)
    pool, writer = channel
    sid, path = pool.acquire()
    arena = writer.begin(sid, path)
    off, length, buffers = encode({"tokens": tokens, "inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, arena)
    assert sum(buffers[1::2]) == tokens.numel() * 8  # one buffer: the tokens' bytes
    got = decode(pool.lease(sid, arena.used), off, length, buffers)
    got["tokens"][0, 1] = -1  # an in-place change shows in every view, as with torch's workers
    assert got["inputs"][0, 1] == -1 and got["targets"][0, 0] == -1
    assert got["inputs"].stride() == (1025, 1) and torch.equal(got["targets"], tokens[:, 1:].clone().index_put_(
        (torch.tensor([0]), torch.tensor([0])), torch.tensor(-1)))


def test_nested_and_grad_tensors_travel_in_band(channel):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    got = _roundtrip({"nt": nt, "g": torch.ones(3, requires_grad=True)}, *channel)
    assert got["nt"].is_nested and [t.tolist() for t in got["nt"].unbind()] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert got["g"].requires_grad


def test_tensors_are_views_of_the_slab_and_slab_is_released_on_gc(channel):
    pool, writer = channel
    data = {"a": np.arange(1000, dtype=np.float64), "t": torch.ones(30, 4)}
    got = _roundtrip(data, pool, writer)
    assert len(pool) == 1 and pool.free_count == 0
    ((base_addr, size),) = pool.regions()
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
    sid, path = pool.acquire()
    arena = writer.begin(sid, path)
    collate.set_arena(arena)
    try:
        batch = default_collate([{"x": np.ones(1000, np.float32), "t": torch.ones(500)} for _ in range(8)])
    finally:
        collate.set_arena(None)
    used_after_collate = arena.used
    assert used_after_collate >= 8 * 1000 * 4 + 8 * 500 * 4  # built in the slab
    encode(batch, arena)
    assert arena.used - used_after_collate < 400  # only the pickle stream was added


def test_slab_grows_past_its_initial_size(channel):
    big = np.arange(3 << 20, dtype=np.uint8)  # 3 MiB: beyond the first 1 MiB of a slab
    got = _roundtrip([big, big[:10]], *channel)
    assert np.array_equal(got[0], big) and np.array_equal(got[1], big[:10])


def test_unpicklable_objects_raise(channel):
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        _roundtrip({"f": lambda: 1}, *channel)


@pytest.mark.parametrize("use_memfd", [True, False])
def test_pool_close_leaves_nothing_behind(our_shm, use_memfd):
    if use_memfd and not hasattr(os, "memfd_create"):
        pytest.skip("memfd_create is not available on this platform")
    before_shm = our_shm()
    before_fds = set(os.listdir("/proc/self/fd"))
    pool, writer = SlabPool(use_memfd=use_memfd), SlabWriter()
    kept = _roundtrip({"x": np.arange(10)}, pool, writer)
    _roundtrip([b"abc"], pool, writer)
    if not use_memfd:
        assert our_shm() - before_shm
    writer.close()
    pool.close()
    assert np.array_equal(kept["x"], np.arange(10))  # a batch held across close stays readable
    assert our_shm() == before_shm
    del kept
    gc.collect()
    assert set(os.listdir("/proc/self/fd")) - before_fds == set()


def test_padded_collate_on_the_heap():
    batch = padded_collate([(1, 2.0, "a", b"xy"), (3, 4.0, "b", b"z")])
    ids, vals, names, blobs = batch
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 3]
    assert vals.dtype == torch.float64 and vals.tolist() == [2.0, 4.0]
    assert names == ["a", "b"]
    assert blobs["data"].tolist() == [[120, 121], [122, 0]] and blobs["lengths"].tolist() == [2, 1]


def test_padded_collate_pads_zero_copy_byte_views_like_bytes():
    from torchforge.formats.values import byte_view

    views = [byte_view(b"xy"), byte_view(b"zzz"), byte_view(b"")]
    batch = padded_collate([{"id": i, "img": v} for i, v in enumerate(views)])
    assert batch["img"]["lengths"].tolist() == [2, 3, 0]
    assert batch["img"]["data"].tolist() == [[120, 121, 0], [122, 122, 122], [0, 0, 0]]
