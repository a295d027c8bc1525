"""What one batch is made of: the samples an index names (map-style) or the next samples of an
iterator (IterableDataset), collated. Shared by the worker processes and the in-process path; the
semantics are torch's ``_MapDatasetFetcher`` / ``_IterableDatasetFetcher``, plus ``on_error="skip"``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data._utils.collate import default_collate as _torch_default_collate

from torchforge.loader.collate import default_collate

__all__ = ["SKIPPED", "Source", "carried_part", "stateful"]

SKIPPED = object()  #: what :meth:`Source.fetch` returns for a batch whose every sample was skipped


ITERATOR = "__torchforge_iterator__"  #: the key of a Stateful iterator's state in a worker's state
#: the key of the state of a Stateful iterator that a persistent worker's last pass ended with
ENDED = "__torchforge_iterator_ended__"


def _has_iterator(state: Any, key: str = ITERATOR) -> bool:
    return isinstance(state, dict) and key in state and set(state) == {key, "dataset"}


def carried_part(state: Any) -> Any:
    """What a persistent worker whose pass ended with ``state`` starts its next pass from: the dataset's
    state, and a Stateful iterator's as the ended iterator's (:meth:`Source.start` loads it into a new
    iterator, then begins the pass on another: torchdata's StatefulDataLoader does so, and the state's
    side effects, the worker's random streams an iterator saves, say, carry into the next pass as in the
    saved run's worker)."""
    if _has_iterator(state):
        return {ENDED: state[ITERATOR], "dataset": state["dataset"]}
    return state


def stateful(obj: Any) -> bool:
    """True for torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Source:
    """Fetches batches from one copy of a dataset.

    Args:
        dataset: the dataset (this process's copy).
        iterable: an IterableDataset (drawn from one iterator per pass) rather than map-style.
        auto_collation: indices come in lists (a batch sampler) rather than one at a time.
        collate_fn: the loader's collate function; torch's ``default_collate`` is replaced by
            :func:`~torchforge.loader.collate.default_collate` (same output, built in shared memory).
        drop_last: IterableDataset: drop a last batch shorter than the index list.
        on_error: ``"skip"`` leaves out map-style samples whose ``__getitem__`` raised.
    """

    def __init__(self, dataset: Any, *, iterable: bool, auto_collation: bool, collate_fn: Callable,
                 drop_last: bool, on_error: str):
        self.dataset = dataset
        self.iterable = iterable
        self.auto_collation = auto_collation
        self.collate_fn = default_collate if collate_fn is _torch_default_collate else collate_fn
        self.drop_last = drop_last
        self.on_error = on_error
        self._it: Any = None
        self.ended = False

    def start(self, skip: int = 0, state: Any = None) -> None:
        """A fresh pass: ``state`` (what :meth:`state` returned) loaded, then a new iterator of an
        IterableDataset, put back where it was by its own state when it has one (torchdata saves a
        ``Stateful`` iterator's state as the dataset's: a dataset that is its own iterator and resets its
        position in ``__iter__`` gets it back after), else advanced past ``skip`` samples."""
        ended = _has_iterator(state, ENDED)
        ds_state, it_state = (state["dataset"], state[ENDED if ended else ITERATOR]) \
            if ended or _has_iterator(state) else (state, None)
        if ds_state is not None:
            self.dataset.load_state_dict(ds_state)
        self.ended = False
        if self.iterable:
            self._it = iter(self.dataset)
            if ended:  # the last pass's iterator, for its state's side effects; the pass begins on a new one
                if stateful(self._it):
                    self._it.load_state_dict(it_state)
                self._it = iter(self.dataset)
                return
            if it_state is not None and stateful(self._it):
                self._it.load_state_dict(it_state)
                return
            for _ in range(skip):
                try:
                    next(self._it)
                except StopIteration:
                    self.ended = True
                    break

    def state(self, dataset: bool = True) -> Any:
        """What resumes this copy where it is: None, the dataset's ``state_dict()`` (with ``dataset``), or,
        for an IterableDataset whose iterator is ``Stateful``, ``{ITERATOR: its state, "dataset": ...}``."""
        ds = self.dataset.state_dict() if dataset and stateful(self.dataset) else None
        if self.iterable and self._it is not None and stateful(self._it):
            # a dataset that is its own iterator: its state once, loaded after iter() (its __iter__ may make
            # what its load_state_dict sets)
            return {ITERATOR: self._it.state_dict(), "dataset": None if self.own_iterator() else ds}
        return ds

    def own_iterator(self) -> bool:
        """The IterableDataset is its own iterator (``__iter__`` returns it)."""
        return self.iterable and self._it is self.dataset

    def fetch(self, index: Any) -> tuple[Any, list, int]:
        """The collated batch for ``index``.

        Returns:
            ``(batch, skipped, drawn)``: ``skipped`` lists ``[index, "Type: message"]`` pairs left out
            under ``on_error="skip"`` (the batch is :data:`SKIPPED` when every sample was: a collate
            function may return None, which is a batch like any other, as in torch); ``drawn`` counts the
            samples taken from an IterableDataset's iterator.

        Raises:
            StopIteration: the IterableDataset has no more samples for this batch.
        """
        if self.iterable:
            return self._next_iterable(index)
        if not self.auto_collation:
            return self.collate_fn(self.dataset[index]), [], 0
        if self.on_error == "raise":
            collated = getattr(self.dataset, "_collated_batch", None)  # a FeatureStore join: whole columns
            if collated is not None:
                batch = collated(index, self.collate_fn)
                if batch is not None:
                    return batch, [], 0
            getitems = getattr(self.dataset, "__getitems__", None)
            data = getitems(index) if getitems is not None else [self.dataset[i] for i in index]
            return self.collate_fn(data), [], 0
        data, skipped = [], []
        for i in index:
            try:
                data.append(self.dataset[i])
            except Exception as e:  # noqa: BLE001 - the policy is to skip whatever user code raises
                skipped.append([i, f"{type(e).__name__}: {e}"])
        return (self.collate_fn(data) if data else SKIPPED), skipped, 0

    def _next_iterable(self, index: Any) -> tuple[Any, list, int]:
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            try:
                item = next(self._it)
            except StopIteration:
                self.ended = True
                raise
            return self.collate_fn(item), [], 1
        data = []
        for _ in index:
            try:
                data.append(next(self._it))
            except StopIteration:
                self.ended = True
                break
        if not data or (self.drop_last and len(data) < len(index)):
            raise StopIteration
        return self.collate_fn(data), [], len(data)
