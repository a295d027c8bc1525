"""Lazy samples: a read-only Mapping over one parsed record that decodes a value on first access only.

A record's raw keys carry extensions (``image.raw.bin``); a :class:`LazySample` shows the logical names
(``image``) at every nesting level, also inside lists, and asks its *source* to decode a value the first
time it is read. Plain JSON values (numbers, strings, booleans, null) come back as they are, with no
decoding step, and so does a nested record made of them alone (a chat turn): a plain dict, fresh for
every read of the sample. A lazy sample pickles as its materialized plain value, never as a reference to the reader
or its memory maps, so it can cross process boundaries (DataLoader workers, multiprocessing queues).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from torchforge.formats.values import ByteView

__all__ = ["Decoder", "LazySample", "LazySource", "lazy_sample", "materialize"]

_PLAIN = frozenset({str, int, float, bool, type(None)})
MAX_PLANS = 4096  # logical keys a source remembers (beyond that, keys are looked up record by record)
_MISSING = object()


# (source, stored value, byte offset of its record) -> decoded value. The source is an argument, not
# bound in, so that a source's cache of decoders holds no reference cycle back to it.
Decoder = Callable[[Any, Any, int], Any]


class LazySource(Protocol):
    """What a :class:`LazySample` needs from the reader that parsed it."""

    ext_sep: str
    # logical key -> ((raw key, its decoder), ...) for the raw keys seen for it: a per-reader cache
    plans: dict[str, tuple[tuple[str, Decoder], ...]]

    def decoder(self, raw_key: str, offset: int) -> Decoder:
        """The function that decodes values stored under ``raw_key`` (``offset``: of the record that
        asks, for errors about the key itself, such as an unknown extension)."""


class LazySample(Mapping):
    """A read-only mapping whose values are decoded on first access.

    Users get these from a lazy dataset; they are not built by hand (readers call :func:`lazy_sample`).
    ``materialize()`` returns plain dicts and lists (bytes for binary values), decoding everything.
    """

    # No __init__: ``LazySample()`` then four slot stores (what lazy_sample does, and what the hottest
    # loops do inline) costs a third less than a call that runs an __init__ frame.
    __slots__ = ("_done", "_off", "_raw", "_src")
    _done: dict[str, Any] | None
    _off: int
    _raw: dict
    _src: LazySource

    def __getitem__(self, key: str) -> Any:
        raw = self._raw
        v = raw.get(key, _MISSING)
        if type(v) in _PLAIN and "." not in key and self._src.ext_sep not in key:  # "." first: cheapest
            return v
        # Everything else, in this one frame: cached, nested container, or a value to decode.
        done = self._done
        if done is not None:
            hit = done.get(key, _MISSING)
            if hit is not _MISSING:
                return hit
        src = self._src
        if type(key) is not str or src.ext_sep in key:
            raise KeyError(key)
        if v is _MISSING:
            for raw_key, dec in src.plans.get(key, ()):
                v = raw.get(raw_key, _MISSING)
                if v is not _MISSING:
                    break
            else:
                raw_key, dec = self._plan(key)
                v = raw[raw_key]
            v = dec(src, v, self._off)
        elif type(v) is dict:
            v = v if _plain_record(v, src.ext_sep) else lazy_sample(v, src, self._off)
        elif type(v) is list:
            v = _wrap_list(v, src, self._off)
        else:  # a plain value under a key with a "." (the shard's separator is another one)
            return v
        if done is None:
            self._done = {key: v}
        else:
            done[key] = v
        return v

    def _plan(self, key: str) -> tuple[str, Decoder]:
        """The stored key (with extensions) of logical ``key`` and its decoder, remembered in the
        source's plans; KeyError if the record has no such key."""
        raw_key = self._raw_key(key)
        if raw_key is None:
            raise KeyError(key)
        src = self._src
        entry = (raw_key, src.decoder(raw_key, self._off))
        plans = src.plans
        if key in plans or len(plans) < MAX_PLANS:  # records keyed by ids must not grow it without end
            plans[key] = (*plans.get(key, ()), entry)
        return entry

    def _raw_key(self, key: str) -> str | None:
        """The stored key (with extensions) of logical ``key``, or None."""
        raw = self._raw
        for cand, _ in self._src.plans.get(key, ()):
            if cand in raw:
                return cand
        prefix = key + self._src.ext_sep
        for cand in raw:
            if cand.startswith(prefix):
                return cand
        return None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str) or self._src.ext_sep in key:
            return False
        return key in self._raw or self._raw_key(key) is not None

    def __iter__(self) -> Iterator[str]:
        sep = self._src.ext_sep
        for k in self._raw:
            yield k.partition(sep)[0] if sep in k else k

    def __len__(self) -> int:
        return len(self._raw)

    def raw_keys(self) -> list[str]:
        """The keys as stored, extensions included."""
        return list(self._raw)

    def materialize(self) -> dict[str, Any]:
        """Decode every value; returns plain dicts and lists, with bytes for binary values."""
        return {k: materialize(self[k]) for k in self}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.materialize(),))

    def __repr__(self) -> str:
        return f"LazySample({list(self)!r})"


def lazy_sample(raw: dict, src: LazySource, offset: int) -> LazySample:
    """A :class:`LazySample` over the parsed record (or part of one) ``raw`` at byte ``offset`` of ``src``."""
    s = LazySample()
    s._raw = raw
    s._src = src
    s._off = offset
    s._done = None
    return s


def _wrap_list(v: list, src: LazySource, offset: int) -> list:
    """A list with its dicts (at any depth) as lazy samples; the list itself if it holds none."""
    if not v or type(v[0]) is not dict:
        for x in v:
            if type(x) is dict or type(x) is list:
                break
        else:
            return v
    out = []
    sep = src.ext_sep
    for x in v:  # lazy_sample inlined (hot: chat turns)
        if type(x) is dict:
            if _plain_record(x, sep):
                out.append(x)
                continue
            s = LazySample()
            s._raw = x
            s._src = src
            s._off = offset
            s._done = None
            out.append(s)
        elif type(x) is list:
            out.append(_wrap_list(x, src, offset))
        else:
            out.append(x)
    return out


def _plain_record(raw: dict, sep: str) -> bool:
    """Whether a nested record holds plain JSON values only, under keys with no extension: then it is
    its own decoded value, handed out as the plain dict it was parsed into (fresh for every read of the
    sample), at a fraction of a lazy view's cost for the reader (chat turns: ``dict(turn)``, ``turn["content"]``)."""
    for k, v in raw.items():
        if type(v) not in _PLAIN or "." in k or sep in k:
            return False
    return True


def materialize(value: Any) -> Any:
    """Turn lazy samples (also nested in lists and dicts) into plain dicts; byte views into bytes."""
    t = type(value)
    if t is LazySample:
        return value.materialize()
    if t is dict:
        return {k: materialize(v) for k, v in value.items()}
    if t is list:
        return [materialize(x) for x in value]
    if t is memoryview or t is ByteView:
        return value.tobytes()
    return value
