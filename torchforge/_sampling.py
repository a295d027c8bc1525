"""How the loader reads a sampler: the default sampler and the cut of an index stream into batches."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from torchforge.sampler import GlobalSampler

__all__ = ["batches", "default_sampler"]


def default_sampler(dataset: Any, *, shuffle: bool, seed: int) -> GlobalSampler:
    """The sampler a loader uses when none is given: a :class:`GlobalSampler` over ``len(dataset)``
    (index order unless ``shuffle``; under torch.distributed, this rank's share of the global order)."""
    return GlobalSampler(len(dataset), shuffle=shuffle, seed=seed)


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
