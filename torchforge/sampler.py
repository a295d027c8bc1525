"""GlobalSampler: one exact, seeded global order per epoch, shared out to ranks, resumable and elastic.

The *global order* of an epoch is a sequence of the ``n`` dataset indices: a seeded random permutation,
a stable sort by a key, or a length-bucketed order (the sorted order cut into buckets, shuffled). It
depends only on the dataset, the options and the epoch -- never on the number of ranks.

Ranks take the global order interleaved: in a pass that starts at global position ``s``, rank ``r`` of
``W`` yields the positions ``s + r, s + r + W, s + r + 2W, ...``. Ranks consume in lockstep, so after
each rank yielded ``k`` indices the first ``s + k * W`` positions are consumed, whatever ``W`` was. A
state saved at one world size therefore resumes at any other: the new pass starts at that position
and shares the rest out to the new ranks.

Every rank yields the same count: the pass is padded to a multiple of ``W`` by repeating the order from
its start (position ``n + j`` is position ``j % n``), or with ``drop_last`` the tail is dropped. Apart
from those named repeats, no index appears twice in an epoch.

A shuffled order is never materialised: :class:`~torchforge._permute.Permutation` computes the index at
any position directly (a Feistel bijection), so the state is O(1) and an epoch of 100M indices is
produced in chunks in constant memory. Sorted orders keep one int64 array of ``n`` (the argsort).
"""
from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from torchforge._permute import EpochOrder, mix64
from torchforge.datasets.base import ShardDataset, _dig, _to_key_array
from torchforge.errors import TorchforgeError

__all__ = ["GlobalSampler", "IterableShards", "SamplerError"]

_CHUNK = 1 << 16  # positions computed per vectorised step when yielding Python ints
_STATE_VERSION = 1


class SamplerError(TorchforgeError, ValueError):
    """A sampler option or a saved sampler state is invalid or does not match this sampler."""


class GlobalSampler(torch.utils.data.Sampler[int]):
    """Yields this rank's share of one exact global order per epoch.

    >>> s = GlobalSampler(10, seed=1, rank=0, world_size=2)
    >>> len(s), len(set(s) | set(GlobalSampler(10, seed=1, rank=1, world_size=2)))
    (5, 10)
    >>> s.set_epoch(1)  # call at the start of every epoch: each epoch has its own order

    Args:
        dataset_or_len: the dataset (anything with ``len``) or the number of samples.
        shuffle: a seeded random order (a fresh one each epoch). With ``sort_key`` and no
            ``bucket_size`` the sorted order is used as is and ``shuffle`` has no effect.
        seed: the seed; all ranks must pass the same.
        sort_key: order by a key with a stable sort: a field name (read with ``dataset.keys(name)``,
            which reads only that field and caches the result beside the shards), a callable taking a
            sample (``dataset.keys(fn)``), or a precomputed array of ``n`` keys.
        descending: sort largest first (ties still in index order).
        bucket_size: with ``shuffle``, cut the sorted order (or, without ``sort_key``, the index
            range) into buckets of this many consecutive positions and shuffle the full buckets among
            themselves *and* the contents of each bucket; the last, partial bucket stays last. With
            ``bucket_size = batch_size * world_size`` each global batch is one bucket of similar keys.
        rank: this rank; default ``torch.distributed.get_rank()`` when initialised, else 0.
        world_size: number of ranks; default ``torch.distributed.get_world_size()`` when
            initialised, else 1.
        drop_last: drop the tail that does not divide evenly among ranks instead of padding.

    Iterating yields Python ints. :meth:`indices` returns any range of this rank's positions as one
    numpy array and :meth:`chunks` streams the pass as arrays (the fast paths for loaders).
    """

    def __init__(self, dataset_or_len: Any, *, shuffle: bool = True, seed: int = 0,
                 sort_key: str | Callable[[Any], Any] | Sequence[Any] | np.ndarray | torch.Tensor | None = None,
                 descending: bool = False, bucket_size: int | None = None, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False) -> None:
        self.n = _length(dataset_or_len)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.descending = bool(descending)
        if bucket_size is not None and (isinstance(bucket_size, bool) or int(bucket_size) < 1):
            raise SamplerError(f"{bucket_size=} must be a positive integer or None")
        self.bucket_size = None if bucket_size is None else int(bucket_size)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.drop_last = bool(drop_last)
        self._ranked = None if sort_key is None else _sort_order(dataset_or_len, sort_key, self.n, descending)
        self._digest: str | None = None
        self.epoch = 0
        self._start = 0  # global position where the current pass starts
        self._yielded = 0  # indices yielded by the current pass, up to the live iterator's chunk
        self._live: tuple[int, int, Iterator[int]] | None = None  # (base, chunk length, chunk iterator)
        self._cached_order: tuple[int, EpochOrder] | None = None
        self._cached_block: tuple[tuple[int, int, int], np.ndarray] | None = None

    # --- epochs and passes -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass yields; a new epoch starts at its beginning.

        Setting the epoch the sampler is already in changes nothing, so a state loaded mid-epoch
        survives the usual ``sampler.set_epoch(epoch)`` at the top of the training loop.
        """
        epoch = int(epoch)
        if epoch < 0:
            raise SamplerError(f"{epoch=} must be >= 0")
        if epoch != self.epoch:
            self.epoch, self._start, self._yielded, self._live = epoch, 0, 0, None

    def __len__(self) -> int:
        """How many indices this rank yields in the current pass (the whole epoch unless resumed)."""
        return self._count(self._start)

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices of the current pass as Python ints.

        A pass resumes where a loaded state left off; once a pass has yielded anything, the next
        ``iter()`` starts the epoch again from its beginning (as torch's DistributedSampler does).
        """
        start = self._begin_pass()
        return self._ints(start, self._count(start))

    def chunks(self, size: int = _CHUNK) -> Iterator[np.ndarray]:
        """Like iterating, but yield int64 numpy arrays of up to ``size`` indices (the state counts
        each array as yielded when it is handed out)."""
        if size < 1:
            raise SamplerError(f"{size=} must be >= 1")
        start = self._begin_pass()
        return self._arrays(start, self._count(start), int(size))

    def indices(self, start: int, stop: int, step: int = 1) -> np.ndarray:
        """This rank's indices at positions ``[start:stop:step]`` of the current pass, as int64.

        Positions count from the start of the current pass (0, or where a loaded state resumes) and
        follow Python slice rules against ``len(self)``. Pure: the sampler's state does not change.
        """
        lo, hi, st = slice(start, stop, step).indices(len(self))
        if st != 1 or hi - lo > _CHUNK:
            return self._at(self._start, np.arange(lo, hi, st, dtype=np.int64))
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        # batch-sized requests are served from a cached, aligned block of positions
        first, last = lo // _CHUNK, (hi - 1) // _CHUNK
        parts = [self._block(b)[max(lo - b * _CHUNK, 0):hi - b * _CHUNK] for b in range(first, last + 1)]
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def global_indices(self, start: int, stop: int) -> np.ndarray:
        """The epoch's global order at positions ``[start, stop)`` (clipped to ``[0, n)``), for all ranks."""
        lo, hi, _ = slice(start, stop).indices(self.n)
        return self._order()(np.arange(lo, max(lo, hi), dtype=np.int64))

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the epoch, this rank's yielded count and the global position it implies.

        ``position`` is ``pass start + yielded * world_size`` (capped at ``n``): the number of global
        positions consumed, which is what a sampler at another world size resumes from. A loader that
        prefetches has drawn more than the model consumed; use :meth:`state_at` with the consumed count.
        """
        return self.state_at(self._current_yielded())

    def state_at(self, yielded: int) -> dict[str, Any]:
        """The state after this rank has yielded ``yielded`` indices of the current pass."""
        yielded = min(max(int(yielded), 0), len(self))
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": min(self._start + yielded * self.world_size, self.n),
            "yielded": yielded,
            "world_size": self.world_size,
            "rank": self.rank,
            "n": self.n,
            "order": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a sampler over the same data and options, at any world
        size: the next pass yields this rank's share of the positions not yet consumed."""
        try:
            version, epoch, position, n = (int(state[k]) for k in ("version", "epoch", "position", "n"))
            order = state["order"]
        except (KeyError, TypeError, ValueError):
            raise SamplerError(f"not a GlobalSampler state: {state!r}") from None
        if version != _STATE_VERSION:
            raise SamplerError(f"sampler state {version=} is not {_STATE_VERSION}")
        if n != self.n:
            raise SamplerError(f"the state is for {n} samples but this sampler has {self.n}; "
                               "resume over the same dataset")
        if order != self._fingerprint():
            raise SamplerError(f"the state's order {order!r} differs from this sampler's "
                               f"{self._fingerprint()!r}: pass the same seed, shuffle, sort_key, "
                               "descending and bucket_size")
        if epoch < 0 or not 0 <= position <= n:
            raise SamplerError(f"state has {epoch=} and {position=}, expected epoch >= 0 and 0 <= position <= {n}")
        self.epoch, self._start, self._yielded, self._live = epoch, position, 0, None

    def __getstate__(self) -> dict[str, Any]:
        # for DataLoader workers: the live iterator is folded into the count; caches are rebuilt
        state = self.__dict__.copy()
        state.update(_yielded=self._current_yielded(), _live=None, _cached_order=None, _cached_block=None)
        return state

    # --- internals -----------------------------------------------------------------------------------
    def _count(self, start: int) -> int:
        left = max(self.n - start, 0)
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    def _begin_pass(self) -> int:
        if self._yielded or self._live is not None:  # the previous pass started: begin the epoch anew
            self._start = 0
        self._yielded, self._live = 0, None
        return self._start

    def _current_yielded(self) -> int:
        if self._live is None:
            return self._yielded
        base, size, it = self._live
        return base + size - operator.length_hint(it)

    def _ints(self, start: int, count: int) -> Iterator[int]:
        for lo in range(0, count, _CHUNK):
            block = self._at(start, np.arange(lo, min(lo + _CHUNK, count), dtype=np.int64)).tolist()
            it = iter(block)
            self._live = (lo, len(block), it)
            yield from it
        self._live, self._yielded = None, count

    def _arrays(self, start: int, count: int, size: int) -> Iterator[np.ndarray]:
        for lo in range(0, count, size):
            hi = min(lo + size, count)
            block = self._at(start, np.arange(lo, hi, dtype=np.int64))
            self._yielded = hi
            yield block

    def _block(self, b: int) -> np.ndarray:
        key = (self.epoch, self._start, b)
        if self._cached_block is None or self._cached_block[0] != key:
            lo = b * _CHUNK
            local = np.arange(lo, min(lo + _CHUNK, len(self)), dtype=np.int64)
            self._cached_block = (key, self._at(self._start, local))
        return self._cached_block[1]

    def _at(self, start: int, local: np.ndarray) -> np.ndarray:
        """Dataset indices at local positions of a pass starting at global position ``start``."""
        if local.size == 0:
            return local
        q = local * self.world_size + (start + self.rank)
        if q[-1] >= self.n or q[0] >= self.n:  # padding: repeat the order from its start
            q = np.where(q >= self.n, (q - self.n) % self.n, q)
        return self._order()(q)

    def _order(self) -> EpochOrder:
        if self._cached_order is None or self._cached_order[0] != self.epoch:
            shuffle = self.shuffle and (self._ranked is None or self.bucket_size is not None)
            order = EpochOrder(self.n, mix64(self.seed, self.epoch), shuffle=shuffle, ranked=self._ranked,
                               bucket_size=self.bucket_size)
            self._cached_order = (self.epoch, order)
        return self._cached_order[1]

    def _fingerprint(self) -> dict[str, Any]:
        if self._ranked is not None and self._digest is None:
            self._digest = hashlib.blake2b(memoryview(self._ranked), digest_size=16).hexdigest()
        return {"shuffle": self.shuffle, "seed": self.seed, "bucket_size": self.bucket_size,
                "descending": self.descending, "sorted": self._digest}


class IterableShards(torch.utils.data.IterableDataset):
    """An ``IterableDataset`` for torch's own DataLoader: this rank's sampler stream, split across
    the loader's workers without gaps or repeats.

    Worker ``w`` of ``K`` takes the blocks ``w, w + K, w + 2K, ...`` of ``block_size`` consecutive
    positions. torch's DataLoader collects each batch from one worker, round-robin, so with
    ``block_size = batch_size`` the batches come out in exactly the sampler's order; then, after
    consuming ``k`` samples, ``state_at(k)`` is exact and ``load_state_dict`` resumes after them.

    >>> ds = IterableShards(list(range(100)), GlobalSampler(100), block_size=8)
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)  # doctest: +SKIP

    Args:
        dataset: a map-style dataset (``dataset[i]``).
        sampler: the order; default ``GlobalSampler(dataset)``.
        block_size: positions per worker turn (set it to the DataLoader's ``batch_size``).
    """

    def __init__(self, dataset: Any, sampler: GlobalSampler | None = None, *, block_size: int = 1) -> None:
        if block_size < 1:
            raise SamplerError(f"{block_size=} must be >= 1")
        self.dataset = dataset
        self.sampler = sampler if sampler is not None else GlobalSampler(dataset)
        self.block_size = int(block_size)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the sampler (call it before creating the loader's iterator)."""
        self.sampler.set_epoch(epoch)

    def state_at(self, consumed: int) -> dict[str, Any]:
        """The sampler state after ``consumed`` samples of this pass came out of the loader."""
        return self.sampler.state_at(consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (from :meth:`state_at` or ``GlobalSampler.state_dict``)."""
        self.sampler.load_state_dict(state)

    def worker_positions(self, worker: int, workers: int) -> Iterator[np.ndarray]:
        """The pass positions worker ``worker`` of ``workers`` reads, in order, a few blocks at a time."""
        count, b = len(self.sampler), self.block_size
        stride = b * workers
        per = max(1, _CHUNK // b)  # blocks per step
        for first in range(worker * b, count, stride * per):
            starts = np.arange(first, min(first + stride * per, count), stride, dtype=np.int64)
            pos = (starts[:, None] + np.arange(b, dtype=np.int64)[None, :]).ravel()
            yield pos[pos < count]

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        sampler = self.sampler
        for pos in self.worker_positions(worker, workers):
            for i in sampler._at(sampler._start, pos).tolist():
                yield self.dataset[i]


def _length(dataset_or_len: Any) -> int:
    if isinstance(dataset_or_len, (int, np.integer)) and not isinstance(dataset_or_len, bool):
        n = int(dataset_or_len)
    else:
        try:
            n = len(dataset_or_len)
        except TypeError:
            raise SamplerError(f"expected a dataset with len() or a sample count, got "
                               f"{type(dataset_or_len).__name__}") from None
    if n < 0:
        raise SamplerError(f"the number of samples must be >= 0, got {n}")
    return n


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    world_size, rank = int(world_size), int(rank)
    if world_size < 1:
        raise SamplerError(f"{world_size=} must be >= 1")
    if not 0 <= rank < world_size:
        raise SamplerError(f"{rank=} must be in [0, {world_size})")
    return rank, world_size


def _keys(dataset: Any, sort_key: Any, n: int) -> np.ndarray:
    """Keys of a field name (through the dataset's cached key pass) or an array of keys."""
    if isinstance(sort_key, str):
        if isinstance(dataset, ShardDataset):
            keys = dataset.keys(sort_key)
        elif isinstance(dataset, (int, np.integer)):
            raise SamplerError(f"sort_key={sort_key!r} needs a dataset to read keys from, got a length; "
                               "pass the dataset or an array of keys")
        else:
            parts = sort_key.split(".")
            keys = _to_key_array([_dig(dataset[i], parts, sort_key) for i in range(n)])
    else:
        keys = sort_key.numpy() if isinstance(sort_key, torch.Tensor) else np.asarray(sort_key)
    return _checked(keys, n)


def _checked(keys: np.ndarray, n: int) -> np.ndarray:
    if keys.ndim != 1 or len(keys) != n:
        raise SamplerError(f"sort keys must be one per sample: got shape {keys.shape} for {n} samples")
    if keys.dtype == object:
        raise SamplerError("sort keys must be numbers, strings or bytes (not Python objects)")
    return keys


def _sort_order(dataset: Any, sort_key: Any, n: int, descending: bool) -> np.ndarray:
    """The stable order by key (ties keep index order).

    String keys of a callable are ordered by Python's sort on the list of keys: building a numpy string
    array (UCS-4, padded to the longest key) costs several times more than the sort itself.
    """
    if not callable(sort_key) or isinstance(sort_key, (np.ndarray, torch.Tensor)):
        return _argsort(_keys(dataset, sort_key, n), descending)
    if isinstance(dataset, ShardDataset):
        values = dataset.key_values(sort_key)
    elif isinstance(dataset, (int, np.integer)):
        raise SamplerError("a callable sort_key needs a dataset to read keys from, got a length; "
                           "pass the dataset or an array of keys")
    else:
        values = [sort_key(dataset[i]) for i in range(n)]
    if len(values) != n:
        raise SamplerError(f"sort keys must be one per sample: got {len(values)} for {n} samples")
    if n and set(map(type, values)) == {str}:
        order = sorted(range(n), key=values.__getitem__, reverse=descending)  # stable both ways
        return np.array(order, dtype=np.int64)
    return _argsort(_checked(_to_key_array(values), n), descending)


def _argsort(keys: np.ndarray, descending: bool) -> np.ndarray:
    keys = _narrow(keys)
    if not descending:
        return np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    # stable descending: sort the reversed keys ascending, then map back (ties keep index order)
    rev = np.argsort(keys[::-1], kind="stable")[::-1]
    out = (len(keys) - 1) - rev.astype(np.int64, copy=False)
    return np.ascontiguousarray(out)


def _narrow(keys: np.ndarray) -> np.ndarray:
    """Integer keys spanning fewer than 65536 values as uint16 offsets: numpy's stable sort is then a
    radix sort, several times faster than the merge sort it uses for wider types (same order)."""
    if keys.dtype.kind not in "iu" or keys.dtype.itemsize <= 2 or keys.size == 0:
        return keys
    lo, hi = keys.min(), keys.max()
    if int(hi) - int(lo) >= 1 << 16:
        return keys
    # exact: every difference lies in [0, 65536); computed buffer-wise, with no full-size temporary
    return np.subtract(keys, lo, out=np.empty(keys.shape, dtype=np.uint16), casting="unsafe")
