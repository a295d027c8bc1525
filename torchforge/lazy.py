"""Lazy samples: a read-only Mapping over one parsed record that decodes a value on first access only.

A record's raw keys carry extensions (``image.raw.bin``); a :class:`LazySample` shows the logical names
(``image``) at every nesting level, also inside lists, and asks its *source* to decode a value the first
time it is read. Plain JSON values (numbers, strings, booleans, null) come back as they are, with no
decoding step. A lazy sample pickles as its materialized plain value, never as a reference to the reader
or its memory maps, so it can cross process boundaries (DataLoader workers, multiprocessing queues).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

__all__ = ["LazySample", "LazySource", "materialize"]

_PLAIN = frozenset({str, int, float, bool, type(None)})
_MISSING = object()


class LazySource(Protocol):
    """What a :class:`LazySample` needs from the reader that parsed it."""

    ext_sep: str
    aliases: dict[str, tuple[str, ...]]  # logical key -> raw keys seen for it (a per-reader cache)

    def decode(self, raw_key: str, value: Any, offset: int) -> Any:
        """Decode ``value`` stored under ``raw_key`` in the record at byte ``offset``."""


class LazySample(Mapping):
    """A read-only mapping whose values are decoded on first access.

    Users get these from a lazy dataset; they are not built by hand. ``materialize()`` returns plain
    dicts and lists (bytes for binary values), decoding everything.
    """

    __slots__ = ("_raw", "_src", "_off", "_done")

    def __init__(self, raw: dict, src: LazySource, offset: int) -> None:
        self._raw = raw
        self._src = src
        self._off = offset
        self._done: dict[str, Any] | None = None

    def __getitem__(self, key: str) -> Any:
        raw = self._raw
        v = raw.get(key, _MISSING)
        if v is not _MISSING and type(v) in _PLAIN and "." not in key:  # "." for speed; _slow checks ext_sep
            return v
        return self._slow(key, v)

    def _slow(self, key: str, v: Any) -> Any:
        done = self._done
        if done is None:
            done = self._done = {}
        elif key in done:
            return done[key]
        if type(key) is not str or self._src.ext_sep in key:
            raise KeyError(key)
        if v is _MISSING:
            raw_key = self._raw_key(key)
            if raw_key is None:
                raise KeyError(key)
            v = self._src.decode(raw_key, self._raw[raw_key], self._off)
        else:
            v = _wrap(v, self._src, self._off)
        done[key] = v
        return v

    def _raw_key(self, key: str) -> str | None:
        raw = self._raw
        src = self._src
        for cand in src.aliases.get(key, ()):
            if cand in raw:
                return cand
        sep = src.ext_sep
        prefix = key + sep
        for cand in raw:
            if cand.startswith(prefix):
                src.aliases[key] = (*src.aliases.get(key, ()), cand)
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


def _wrap(v: Any, src: LazySource, offset: int) -> Any:
    t = type(v)
    if t is dict:
        return LazySample(v, src, offset)
    if t is list:
        for x in v:
            if type(x) is dict or type(x) is list:
                return [LazySample(x, src, offset) if type(x) is dict else _wrap(x, src, offset) for x in v]
    return v


def materialize(value: Any) -> Any:
    """Turn lazy samples (also nested in lists and dicts) into plain dicts; memoryviews into bytes."""
    t = type(value)
    if t is LazySample:
        return value.materialize()
    if t is dict:
        return {k: materialize(v) for k, v in value.items()}
    if t is list:
        return [materialize(x) for x in value]
    if t is memoryview:
        return value.tobytes()
    return value
