"""Zero-copy transport of nested batches through a shared-memory slab, without pickle.

:func:`encode` walks an object and writes every tensor, array and bytes payload into the worker's
:class:`~torchforge._shm.Arena` (tensors the collate already built in the slab are referenced where
they are, not copied). Everything else goes into a small JSON header (orjson), itself written into the
slab. :func:`decode` rebuilds the object in the main process: tensors and arrays are views of the slab,
the rest are ordinary Python objects.

What travels exactly (type and value): None, bool, int (any size), float (NaN and infinities too),
complex, str, bytes, bytearray (memoryview arrives as bytes), list, tuple, dict (any Mapping arrives as
a dict; keys may be any of these scalars), set, frozenset, numpy arrays and scalars (not object or
structured dtypes) and torch tensors (CPU; other devices are copied to CPU, autograd is dropped).
Anything else raises TypeError: return plain data from datasets and collate functions.

Homogeneous lists take fast paths that run at C speed: lists of str/int/float/bool/None go into the
header as one JSON array, and so do dicts and lists of dicts whose keys are str and values such scalars
(records like chat messages); lists of bytes go as one blob plus lengths; lists of sets/tuples/lists
(the dict-of-small-sets case) as lengths plus one flattened list.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import orjson
import torch

from torchforge._shm import Arena, HeapArena

__all__ = ["decode", "encode"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_CONTAINER_TAGS = {set: "e", frozenset: "z", tuple: "u", list: "l"}
_STR = frozenset({str})
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})
_TAG_CONTAINERS = {v: k for k, v in _CONTAINER_TAGS.items()}


# --- encoding -----------------------------------------------------------------------------------------
def encode(obj: Any, arena: Arena | HeapArena) -> tuple[int, int]:
    """Write ``obj`` into ``arena``; returns the slab offset and length of its header.

    Raises:
        TypeError: ``obj`` holds a type that cannot travel (see the module docstring).
    """
    with _no_gc():
        node = _enc(obj, arena)
        try:
            header = orjson.dumps(node)
        except orjson.JSONEncodeError as e:  # lone surrogates in a str, for instance
            raise TypeError(f"batch cannot be encoded for transport: {e}") from None
    off, dst = arena.put(len(header))
    dst[:] = np.frombuffer(header, dtype=np.uint8)
    return off, len(header)


def _enc(x: Any, arena: Arena | HeapArena) -> list:
    f = _ENCODERS.get(type(x))
    if f is not None:
        return f(x, arena)
    if isinstance(x, torch.Tensor):
        return _enc_tensor(x, arena)
    if isinstance(x, np.ndarray):
        return _enc_array(x, arena)
    if isinstance(x, np.generic):
        return ["g", _enc_array(np.asarray(x), arena)]
    if isinstance(x, Mapping):
        return _enc_dict(x, arena)
    if isinstance(x, memoryview):
        return _enc_bytes(x.tobytes(), arena)
    for base in (bool, int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset):
        if isinstance(x, base):  # subclasses (IntEnum, namedtuple, ...) travel as their base type
            return _ENCODERS[base](base(x), arena)
    raise TypeError(f"cannot transport an object of type {type(x).__module__}.{type(x).__qualname__}; "
                    "datasets and collate functions must return tensors, arrays, bytes, str, numbers, None "
                    "or dicts/lists/tuples/sets of them")


def _enc_int(x: int, arena: Any) -> list:
    return ["i", x] if _I64_MIN <= x <= _I64_MAX else ["I", str(x)]


def _enc_float(x: float, arena: Any) -> list:
    return ["f", x] if math.isfinite(x) else ["F", repr(x)]


def _enc_bytes(x: bytes, arena: Arena | HeapArena) -> list:
    off, dst = arena.put(len(x))
    dst[:] = np.frombuffer(x, dtype=np.uint8)
    return ["y", off, len(x)]


def _enc_bytearray(x: bytearray, arena: Arena | HeapArena) -> list:
    node = _enc_bytes(bytes(x), arena)
    node[0] = "Y"
    return node


def _enc_array(a: np.ndarray, arena: Arena | HeapArena) -> list:
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise TypeError(f"cannot transport a numpy array of dtype {a.dtype} (object or structured)")
    shape = list(a.shape)  # before ascontiguousarray, which turns 0-d arrays into 1-d ones
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return ["a", a.dtype.str, shape, _place(a.ctypes.data, a.nbytes, a.reshape(-1).view(np.uint8), arena)]


def _enc_tensor(t: torch.Tensor, arena: Arena | HeapArena) -> list:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    flat = t.reshape(-1).view(torch.uint8) if nbytes else None
    return ["t", str(t.dtype)[6:], list(t.shape), _place(t.data_ptr(), nbytes, flat, arena)]


def _place(ptr: int, nbytes: int, src_u8: Any, arena: Arena | HeapArena) -> int:
    """The slab offset of ``nbytes`` at ``ptr``: where they already are, or where they were copied to."""
    if nbytes == 0:
        return 0
    off = arena.offset_of(ptr, nbytes)
    if off is None:
        off, dst = arena.put(nbytes)
        if isinstance(src_u8, torch.Tensor):
            torch.from_numpy(dst).copy_(src_u8)
        else:
            np.copyto(dst, src_u8)
    return off


def _enc_dict(d: Mapping, arena: Arena | HeapArena) -> list:
    if type(d) is not dict:
        d = dict(d)  # any Mapping (a lazy sample, for instance) travels as a dict
    if _json_record(d):
        return ["D", d]
    return ["d", _seq(list(d.keys()), arena), _seq(list(d.values()), arena)]


def _json_record(d: dict) -> bool:
    """True if orjson round-trips ``d`` exactly: str keys and None/bool/str/int64/finite float values."""
    if not set(map(type, d)) <= _STR or not (vt := set(map(type, d.values()))) <= _JSON_SCALARS:
        return False
    if int in vt and not all(_I64_MIN <= v <= _I64_MAX for v in d.values() if type(v) is int):
        return False
    return float not in vt or all(math.isfinite(v) for v in d.values() if type(v) is float)


def _container(tag: str):
    def enc(x: Any, arena: Arena | HeapArena) -> list:
        return [tag, _seq(x if type(x) is list else list(x), arena)]
    return enc


def _seq(items: list, arena: Arena | HeapArena) -> list:
    """Encode a list of items; homogeneous lists of simple types take one C-speed path."""
    if not items:
        return ["0"]
    types = set(map(type, items))
    if len(types) == 1:
        t = types.pop()
        if t is str:
            return ["Ls", items]
        if t is int and _I64_MIN <= min(items) and max(items) <= _I64_MAX:
            return ["Li", items]
        if t is float and all(map(math.isfinite, items)):
            return ["Lf", items]
        if t is bool:
            return ["Lb", items]
        if t is type(None):
            return ["Ln", len(items)]
        if t is bytes:
            blob = b"".join(items)
            off, dst = arena.put(len(blob))
            dst[:] = np.frombuffer(blob, dtype=np.uint8)
            return ["Ly", off, list(map(len, items))]
        if t in _CONTAINER_TAGS:  # iterating a set twice visits its items in the same order
            flat = list(itertools.chain.from_iterable(items))
            return ["Lc", _CONTAINER_TAGS[t], list(map(len, items)), _seq(flat, arena)]
        if t is dict and all(map(_json_record, items)):  # records such as chat messages: one JSON array
            return ["Lj", items]
        if t is not dict and issubclass(t, Mapping):
            return _seq([dict(x) for x in items], arena)
    return ["L", [_enc(x, arena) for x in items]]


_ENCODERS = {
    type(None): lambda x, a: ["n"],
    bool: lambda x, a: ["b", x],
    int: _enc_int,
    float: _enc_float,
    complex: lambda x, a: ["c", repr(x.real), repr(x.imag)],
    str: lambda x, a: ["s", x],
    bytes: _enc_bytes,
    bytearray: _enc_bytearray,
    list: _container("l"),
    tuple: _container("u"),
    set: _container("e"),
    frozenset: _container("z"),
    dict: _enc_dict,
    torch.Tensor: _enc_tensor,
    np.ndarray: _enc_array,
}


# --- decoding -----------------------------------------------------------------------------------------
def decode(base: np.ndarray, header_offset: int, header_length: int) -> Any:
    """Rebuild an object from its slab: tensors and arrays are views of ``base`` (no copy)."""
    with _no_gc():
        node = orjson.loads(memoryview(base[header_offset:header_offset + header_length]))
        return _dec(node, base)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC: building many small acyclic objects would trigger needless full passes over
    a large heap (pickle pays them; we do not need to)."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _dec(node: list, base: np.ndarray) -> Any:
    return _DECODERS[node[0]](node, base)


def _dec_array(node: list, base: np.ndarray) -> np.ndarray:
    _, dtype, shape, off = node
    dt = np.dtype(dtype)
    n = dt.itemsize * math.prod(shape)
    if n == 0:
        return np.empty(shape, dtype=dt)
    return base[off:off + n].view(dt).reshape(shape)


def _dec_tensor(node: list, base: np.ndarray) -> torch.Tensor:
    _, dtype, shape, off = node
    dt = getattr(torch, dtype)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"unknown tensor dtype {dtype!r} in transport header")
    n = math.prod(shape) * dt.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dt)
    return torch.from_numpy(base[off:off + n]).view(dt).view(shape)


def _dec_seq(node: list, base: np.ndarray) -> list:
    tag = node[0]
    if tag in ("Ls", "Li", "Lf", "Lb", "Lj"):
        return node[1]
    if tag == "0":
        return []
    if tag == "Ln":
        return [None] * node[1]
    if tag == "Ly":
        lens = node[2]
        blob = base[node[1]:node[1] + sum(lens)].tobytes()
        return list(map(blob.__getitem__, map(slice, *_bounds(lens))))
    if tag == "Lc":
        ctor, lens, flat = _TAG_CONTAINERS[node[1]], node[2], _dec_seq(node[3], base)
        k = lens[0]
        if k and lens.count(k) == len(lens):  # equal lengths: group with zip, at C speed
            groups = zip(*[iter(flat)] * k)
            return list(groups) if ctor is tuple else list(map(ctor, groups))
        return list(map(ctor, map(flat.__getitem__, map(slice, *_bounds(lens)))))
    if tag == "L":
        return [_dec(x, base) for x in node[1]]
    raise TypeError(f"unknown sequence tag {tag!r} in transport header")


def _bounds(lens: list[int]) -> tuple[list[int], list[int]]:
    ends = np.cumsum(np.asarray(lens, dtype=np.int64))
    return (ends - np.asarray(lens, dtype=np.int64)).tolist(), ends.tolist()


def _dec_container(ctor: type):
    def dec(node: list, base: np.ndarray) -> Any:
        items = _dec_seq(node[1], base)
        return items if ctor is list else ctor(items)
    return dec


_DECODERS = {
    "n": lambda n, b: None,
    "b": lambda n, b: n[1],
    "i": lambda n, b: n[1],
    "I": lambda n, b: int(n[1]),
    "f": lambda n, b: n[1],
    "F": lambda n, b: float(n[1]),
    "c": lambda n, b: complex(float(n[1]), float(n[2])),
    "s": lambda n, b: n[1],
    "y": lambda n, b: b[n[1]:n[1] + n[2]].tobytes(),
    "Y": lambda n, b: bytearray(b[n[1]:n[1] + n[2]]),
    "a": _dec_array,
    "g": lambda n, b: _dec_array(n[1], b)[()],
    "t": _dec_tensor,
    "d": lambda n, b: dict(zip(_dec_seq(n[1], b), _dec_seq(n[2], b))),
    "D": lambda n, b: n[1],
    "l": _dec_container(list),
    "u": _dec_container(tuple),
    "e": _dec_container(set),
    "z": _dec_container(frozenset),
}
