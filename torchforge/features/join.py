"""Join a dataset with a feature store: each sample gains the store's columns for its id.

:class:`JoinedDataset` reads nothing when it is made: the store handle it holds pickles as a path and
a version, so each DataLoader worker maps the store itself and every worker reads the same version.
The loader fetches a batch through ``__getitems__``: the samples of the batch come from the dataset
(through its own ``__getitems__`` where it has one), then one :meth:`FeatureStore.get` reads the
columns for all their ids at once, and each sample gets its row as a view of that gather.

A plain dict sample becomes a new dict with the columns added; a lazy sample a new lazy sample with the
columns as fields (its own fields stay lazy); any other mapping is wrapped in a read-only mapping that
serves the columns and leaves the sample's own fields as they are.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch.utils.data

from torchforge.errors import TorchforgeError
from torchforge.features.layout import pick_columns
from torchforge.lazy import LazySample
from torchforge.loader.collate import default_collate, padded_collate

__all__ = ["JoinedDataset"]


class JoinedSample(Mapping):
    """A read-only mapping: the store's columns, then the sample's own fields (left lazy)."""

    __slots__ = ("extra", "sample")

    def __init__(self, sample: Mapping, extra: dict[str, Any]):
        self.sample = sample
        self.extra = extra

    def __getitem__(self, k: str) -> Any:
        if k in self.extra:
            return self.extra[k]
        return self.sample[k]

    def __iter__(self) -> Iterator[str]:
        yield from self.sample
        for k in self.extra:
            if k not in self.sample:
                yield k

    def __len__(self) -> int:
        return len(self.sample) + sum(k not in self.sample for k in self.extra)

    def materialize(self) -> dict[str, Any]:
        m = getattr(self.sample, "materialize", None)
        base = m() if callable(m) else dict(self.sample)
        return {**base, **self.extra}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.materialize(),))


def _with_fields(s: LazySample, extra: dict[str, Any], clashes: dict[tuple, list[str]]) -> LazySample:
    """A lazy sample like ``s`` with ``extra``'s values as fields (replacing its own of the same names):
    collating it takes the lazy sample's own fast path, not a wrapper's ``__getitem__`` per field.
    ``clashes`` caches, per set of stored keys, the ones a column replaces."""
    raw = s._raw.copy()
    layout = tuple(raw)
    drop = clashes.get(layout)
    if drop is None:
        sep = s._src.ext_sep
        drop = clashes[layout] = [k for k in layout if (k.partition(sep)[0] if sep in k else k) in extra]
    for k in drop:
        del raw[k]
    raw.update(extra)
    out = LazySample.__new__(LazySample)
    out._raw, out._src, out._off, out._done = raw, s._src, s._off, None
    return out


class JoinedDataset(torch.utils.data.Dataset):
    """``dataset`` with each sample gaining ``store``'s columns for ``sample[key]``.

    Args:
        dataset: a map-style dataset of mapping samples (any torchforge dataset).
        store: the FeatureStore. The join reads the version ``store`` reads when the join is made, in
            every worker and every epoch, through a handle of its own (``store.at(store.version)``): the
            store's later commits, its own writers' included, are read by a later join.
        key: the sample field holding the int64 id.
        columns: the store columns added: one name, several, or None (default) for all; they replace
            sample fields of the same name.
        missing: as in :meth:`FeatureStore.get`: None raises MissingIdsError for ids not in the store.

    >>> loader = DataLoader(store.join(JinxDataset("data"), key="id"), batch_size=64)  # doctest: +SKIP
    """

    def __init__(self, dataset: Any, store: Any, *, key: str = "id", columns: str | Iterable[str] | None = None,
                 missing: Any = None):
        self.dataset = dataset
        self.store = store.at(store.version)
        self.key = key
        self.columns = pick_columns(store.schema, columns)
        self.missing = missing

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def shard_sizes(self) -> Any:
        """The joined dataset's samples per shard (None without shards): the join keeps its indices, so a
        GlobalSampler's ``shard_affinity`` and ``bucket_size="shards"`` apply to it unchanged."""
        from torchforge.sampler import dataset_shard_sizes

        return dataset_shard_sizes(self.dataset)[0]

    @property
    def version(self) -> Any:
        """The joined dataset's pinned version (a remote dataset's), or None."""
        return getattr(self.dataset, "version", None)

    @property
    def content_version(self) -> Any:
        """The joined dataset's version without its URLs (a remote dataset's), or None: what a loader state
        records, through the join as without it."""
        return getattr(self.dataset, "content_version", None)

    @property
    def prefetch(self) -> Any:
        """The joined dataset's ``prefetch`` (a remote dataset's), or None: torchforge's DataLoader plans
        the fetches of a pass in the sampler's order through the join as without it."""
        return getattr(self.dataset, "prefetch", None)

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        samples = self._samples(indices)
        got = self.store.get(self._ids(samples), self.columns, missing=self.missing)
        rows = [got[c].unbind(0) for c in self.columns]  # every sample's row as a view, one call per column
        out: list[Any] = []
        clashes: dict[tuple, list[str]] = {}
        for s, *r in zip(samples, *rows):
            extra = dict(zip(self.columns, r))
            if type(s) is dict:
                out.append({**s, **extra})
            elif type(s) is LazySample:
                out.append(_with_fields(s, extra, clashes))
            else:
                out.append(JoinedSample(s, extra))
        return out

    def _collated_batch(self, indices: list[int], collate_fn: Any) -> Any:
        """The batch torchforge's DataLoader asks for when ``collate_fn`` is one that stacks fixed-shape
        values (torchforge's ``default_collate`` or ``padded_collate``): the dataset's own samples collated,
        then one :meth:`FeatureStore.get` of the batch's ids whose tensors are the batch's columns as they
        are (inside a worker they are gathered straight into the batch's shared memory), with no row per
        sample to make and stack again. The same batch as collating :meth:`__getitems__`. None where that
        does not apply (another collate function, or samples with fields of a column's name)."""
        if collate_fn is not default_collate and collate_fn is not padded_collate:
            return None
        samples = self._samples(indices)
        if not samples or any(c in samples[0] for c in self.columns):
            return None
        batch = collate_fn(samples)
        if type(batch) is not dict:
            return None
        ids = batch.get(self.key)  # the ids collated already: no field read per sample
        if not (type(ids) is torch.Tensor and ids.dim() == 1 and len(ids) == len(samples)
                and not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool):
            ids = self._ids(samples)
        batch.update(self.store.get(ids, self.columns, missing=self.missing))
        return batch

    def _samples(self, indices: list[int]) -> list[Any]:
        many = getattr(self.dataset, "__getitems__", None)
        return many(list(indices)) if many is not None else [self.dataset[i] for i in indices]

    def _ids(self, samples: list[Any]) -> list[int]:
        key = self.key
        ids = []
        for s in samples:
            try:
                if not isinstance(s, Mapping):
                    raise TypeError
                v = s[key]
            except (KeyError, TypeError):
                raise TorchforgeError(f"join needs mapping samples with an id field {key!r}; got a "
                                      f"{type(s).__name__}" + (f" with fields {sorted(s)[:10]}"
                                                               if isinstance(s, Mapping) else "")) from None
            try:  # an integer as store.get takes it: 2.9 or "5" is no id (int() would make them 2 and 5)
                if isinstance(v, bool):
                    raise TypeError
                ids.append(operator.index(v))
            except TypeError:
                raise TypeError(f"join: the id field {key!r} must hold an integer, got {type(v).__name__} "
                                f"{str(v)[:40]}") from None
        return ids

    def __repr__(self) -> str:
        return f"JoinedDataset({self.dataset!r}, {self.store!r}, key={self.key!r}, columns={self.columns})"
