"""Messages between the main process and a worker (pickled over one duplex pipe per worker).

main -> worker: :class:`NewPass` at the start of every pass (and after a restart), then :class:`Task`
per batch, :class:`Forget` when slabs were detached, and ``None`` to stop.
worker -> main: one :class:`Reply` per task, in the order of the tasks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Forget", "NewPass", "Reply", "Task"]


@dataclass(slots=True)
class NewPass:
    """Start a pass: load a dataset state, make a fresh iterator of an IterableDataset."""

    pass_id: int
    dataset_state: Any = None  #: the worker's state to resume from (``Source.start``), when not None
    skip: int = 0  #: IterableDataset: samples to draw and drop first (fast-forward without a state)
    shared_seed: int | None = None  #: an IterDataPipe's pass seed (torch's ``_shared_seed``), else None


@dataclass(slots=True)
class Task:
    """Load one batch into a slab."""

    pass_id: int
    seq: int  #: batch number in the pass
    slab: int  #: slab id (unique for the pool's lifetime)
    path: str  #: where the worker opens the slab the first time it sees its id
    index: Any  #: what the index sampler yielded: a list of indices, one index, or Nones (iterable)
    seed: int | None = None  #: seed torch, random and numpy with this first (per-batch seeding)


@dataclass(slots=True)
class Forget:
    """Slabs the main process detached: close their descriptors and maps."""

    slabs: list[int]


@dataclass(slots=True)
class Reply:
    """The outcome of one task."""

    pass_id: int
    seq: int
    slab: int = -1  #: the task's slab id
    used: int = 0  #: slab bytes the batch occupies
    stream: tuple[int, int] | None = None  #: pickle stream (offset, length); None: no batch
    buffers: list[int] = field(default_factory=list)  #: out-of-band buffers, flat [offset, length, ...]
    skipped: list = field(default_factory=list)  #: [index, "Type: message"] left out (on_error="skip")
    error: Any = None  #: a torch ``ExceptionWrapper`` of what user code raised
    ended: bool = False  #: the worker's IterableDataset iterator is exhausted (with or without a last batch)
    count: int = 0  #: samples the task drew from the dataset (IterableDataset fast-forward)
    state: Any = None  #: the worker's state after the task (``Source.state``): its dataset's, its iterator's
