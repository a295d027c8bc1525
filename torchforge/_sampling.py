"""How the loader reads a sampler: the default sampler and the cut of an index stream into batches."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["batches", "default_sampler"]


class _RangeSampler:
    """Index order or a seeded per-epoch permutation; the fallback when ``torchforge.sampler`` is absent."""

    def __init__(self, n: int, *, shuffle: bool, seed: int):
        self.n, self.shuffle, self.seed, self.epoch = int(n), bool(shuffle), int(seed), 0
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._perm = int(epoch), None

    def indices(self, start: int, stop: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return self._perm[start:stop]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(0, self.n).tolist())


def default_sampler(dataset: Any, *, shuffle: bool, seed: int) -> Any:
    """The sampler a loader uses when none is given (in index order unless ``shuffle``)."""
    return _RangeSampler(len(dataset), shuffle=shuffle, seed=seed)


def batches(sampler: Iterable[int], batch_size: int, drop_last: bool, start: int) -> Iterator[tuple[int, list[int]]]:
    """``(batch_number, indices)`` from batch ``start`` on. Samplers with ``indices(start, stop)`` and a
    length are sliced directly; other iterables are read and the first ``start`` batches discarded."""
    if callable(getattr(sampler, "indices", None)) and hasattr(sampler, "__len__"):
        n = len(sampler)  # type: ignore[arg-type]
        count = n // batch_size if drop_last else math.ceil(n / batch_size)
        for b in range(start, count):
            idx = sampler.indices(b * batch_size, min(n, (b + 1) * batch_size))  # type: ignore[attr-defined]
            yield b, np.asarray(idx, dtype=np.int64).tolist()
        return
    it = iter(sampler)
    for _ in itertools.islice(it, start * batch_size):
        pass
    b = start
    while True:
        chunk = [int(i) for i in itertools.islice(it, batch_size)]
        if not chunk or (drop_last and len(chunk) < batch_size):
            return
        yield b, chunk
        b += 1
