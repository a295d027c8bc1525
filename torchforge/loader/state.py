"""The loader's resume state: what it holds, and the random sources a pass is replayed from.

``DataLoader.state_dict()`` is plain data (ints, strings, lists, dicts and whatever the sampler's and
dataset's own ``state_dict()`` return):

- ``version``: 2 (a version 1 state, whose ``rng`` was saved before the iterator drew its base seed, still
  loads); ``finished``: the pass ran to its end (the next ``iter()`` starts a new pass);
- ``batches``: batches yielded by the pass (``extra``: with ``in_order=False``, later batches yielded
  ahead of that prefix); ``samples``: sampler indices the ``batches`` consumed (not ``extra``'s: the
  sampler's position is the prefix's, and the resumed pass skips ``extra``'s batches);
- ``base_seed``: the pass's worker base seed (workers seed ``base_seed + worker_id``); ``pass``: the
  passes made before this one under that base seed (persistent workers keep it from epoch to epoch;
  per-batch seeds mix it in);
- ``rng``: the random generators the pass drew from (the loader's ``generator``, else torch's default
  CPU generator, and a sampler's own ``generator``), as the pass's first sampler draw found them; a
  resumed pass replays its draws from them, then puts torch's default generator back as it found it;
- ``sampler``: the sampler's state -- ``sampler.state_at(samples)`` for a sampler that can say where it
  is after any number of indices (``GlobalSampler``: elastic across world sizes); for a sampler whose
  ``state_dict()`` changes as it yields (it says where it is, as torchdata's ``StatefulDistributedSampler``
  does), its state after the last batch yielded was drawn (None at a pass's end: the next pass begins
  anew); else its ``state_dict()`` at the start of the pass (the pass then skips ``batches`` batches);
- ``dataset``: the main process's ``dataset.state_dict()`` when the dataset is ``Stateful``;
- ``workers``: per worker, its dataset copy's state after its last yielded batch (``state``; with an
  IterableDataset whose ``__iter__`` returns a ``Stateful`` iterator, that iterator's state too, loaded
  after ``iter()``, as torchdata's StatefulDataLoader does; with ``num_workers=0`` the iterator's only), how
  many samples its IterableDataset iterator gave (``drawn``, for datasets without a state: the resumed
  worker draws and drops that many), and whether its iterator ended; ``assigned``: the workers of the
  batches already issued after the position, ``next_worker``: where the round-robin goes on.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from torchforge.loader.fetch import stateful

__all__ = ["STATE_VERSION", "Position", "generators", "get_rng", "sampler_of", "set_rng"]

STATE_VERSION = 2


def sampler_of(loader: Any) -> Any:
    """The object whose state orders the pass: a custom batch sampler, else the sampler."""
    return loader.batch_sampler if loader._custom_batch_sampler else loader.sampler


def generators(loader: Any) -> dict[str, torch.Generator | None]:
    """The generators a pass draws from: ``"loader"`` (None: torch's default CPU generator) and the
    sampler's own, when it has one."""
    out: dict[str, torch.Generator | None] = {"loader": loader.generator}
    g = getattr(sampler_of(loader), "generator", None)
    if isinstance(g, torch.Generator) and g is not loader.generator and not stateful(sampler_of(loader)):
        out["sampler"] = g
    return out


def get_rng(gens: dict[str, torch.Generator | None]) -> dict[str, str]:
    return {k: _state(g).numpy().tobytes().hex() for k, g in gens.items()}


def set_rng(gens: dict[str, torch.Generator | None], saved: dict[str, str]) -> None:
    for k, g in gens.items():
        if k in saved:
            t = torch.frombuffer(bytearray.fromhex(saved[k]), dtype=torch.uint8)
            if g is None:
                torch.set_rng_state(t)
            else:
                g.set_state(t)


def _state(g: torch.Generator | None) -> torch.Tensor:
    return torch.get_rng_state() if g is None else g.get_state()


def batch_samples(loader: Any) -> int | None:
    """The sampler indices of each of ``loader``'s batches: its ``batch_size``, 1 without batching
    (``batch_size=None``), None for a ``batch_sampler``'s batches (of any size)."""
    if not loader._auto_collation:
        return 1
    return loader.batch_size


class Position:
    """Where a pass stands, kept by the loader beyond the iterator's life (``break`` ends an iterator,
    not the position): what :meth:`state_dict` is made of."""

    def __init__(self, workers: int):
        self.finished = False
        self.batches = 0  # yielded in order
        self.extra: set[int] = set()  # in_order=False: yielded beyond the position
        self.samples = 0  # sampler indices the batches of the in-order prefix consumed
        self.base = 0  # of those, the ones a resumed sampler's start already counts
        self.ahead: dict[int, int] = {}  # in_order=False: indices of each batch in ``extra``, once known
        self.base_seed: int | None = None  # None: no pass has begun
        self.pass_no = 0  # passes made before this one under base_seed (persistent workers)
        self.epoch: Any = None  # the sampler's ``epoch`` as the pass began (None: it has none)
        self.began = True  # False: no pass began (the sampler's own state, as it is now, is the position)
        self.rng0: dict[str, str] = {}
        self.sampler_start: Any = None
        # a sampler whose state says where it is in the pass (it changes as it yields): its state after
        # each batch's indices were drawn, by batch number (see _Iter._begin_pass)
        self.positional = False
        self.own_iterator = False  # num_workers=0: the IterableDataset is its own (Stateful) iterator
        self.snapshots: dict[int, Any] = {}
        self.worker_state: list[Any] = [None] * workers
        self.drawn = [0] * workers
        self.ended = [False] * workers
        self.assigned: list[int] = []  # workers of the batches issued after the position
        self.next_worker = 0

    def state_dict(self, loader: Any, iterable: bool) -> dict[str, Any]:
        target = sampler_of(loader)
        has_state_at = callable(getattr(target, "state_at", None))
        sampler_state = None
        finished = self.finished
        moved = not finished and self.epoch is not None and getattr(target, "epoch", None) != self.epoch
        if not self.began or moved:
            # no pass began (a state loaded into the sampler stays as it is), or set_epoch() moved the sampler
            # since this pass, left with ``break``, began (the next pass begins that epoch at its start): a
            # resumed loader begins a pass as this one would, from the sampler's state as it is now
            finished = True
            sampler_state = target.state_dict() if not iterable and stateful(target) else None
        elif not iterable:
            if has_state_at:
                if self.finished and "ended" in inspect.signature(target.state_at).parameters:
                    # the pass was seen to its end: the next one begins the epoch anew, as the saved run's would
                    sampler_state = target.state_at(self.samples - self.base, ended=True)
                else:
                    sampler_state = target.state_at(self.samples - self.base)
            elif self.positional:
                # after the prefix's last batch (or where the pass began); a pass seen to its end: None, the
                # next pass begins anew as the saved run's does (its end state would resume an empty pass)
                sampler_state = None if self.finished else self.snapshots.get(self.batches - 1, self.sampler_start)
            elif self.finished and stateful(target):
                sampler_state = target.state_dict()
            else:
                sampler_state = self.sampler_start
        return {
            "version": STATE_VERSION,
            "finished": finished,
            "batches": self.batches,
            "batch_size": batch_samples(loader),  # (None: a batch_sampler's batches, of any size)
            "extra": sorted(self.extra),
            "samples": self.samples,
            "base_seed": None if self.base_seed is None else int(self.base_seed),
            "pass": self.pass_no,
            "rng": None if finished else dict(self.rng0),
            "sampler": sampler_state,
            "skip_batches": not finished and not has_state_at and not self.positional,
            # (an IterableDataset's copy in the main process is never iterated when workers are: its
            # workers' copies hold the state, and one that is made in __iter__ does not exist here)
            # (nor one that is its own iterator: its state is the iterator's, in "workers", loaded after iter())
            "dataset": loader.dataset.state_dict() if stateful(loader.dataset) and not (
                iterable and (loader.num_workers > 0 or self.own_iterator)) else None,
            "workers": [{"state": s, "drawn": d, "ended": e}
                        for s, d, e in zip(self.worker_state, self.drawn, self.ended)],
            "assigned": list(self.assigned),
            "next_worker": self.next_worker,
        }
