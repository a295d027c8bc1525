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

Node affinity (``shard_affinity=True``), for datasets too big for every node to read all of: the
shards are assigned to nodes by rendezvous (highest-random-weight) hashing, see
:func:`rendezvous_assign`, and each node has its own order per epoch, an exact seeded shuffle of the
samples of its shards, shared out to the node's local ranks as above (local rank ``l`` of ``L`` takes
node positions ``s + l, s + l + L, ...``). A shard's node depends only on the seed, the shard and the
node, never on the number of nodes, so when nodes come or go only the shards of those nodes move
(about ``1/N`` of them), and a node keeps its shards from epoch to epoch (its page cache stays warm).
Nodes hold different numbers of samples, yet every rank yields the same count: each node's order is
padded by repeating it from its start up to ``L * ceil(largest node / L)`` positions, or with
``drop_last`` cut to ``L * floor(smallest node / L)``.
"""
from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data

from torchforge._permute import EpochOrder, mix64
from torchforge.datasets.base import ShardDataset, _dig, _to_key_array
from torchforge.errors import TorchforgeError

__all__ = ["GlobalSampler", "IterableShards", "SamplerError", "dataset_shard_sizes", "rendezvous_assign"]

_CHUNK = 1 << 16  # positions computed per vectorised step when yielding Python ints
_STATE_VERSION = 1
_NODE_ORDER = 5  # mix64 purpose word of a node's epoch key (affinity mode)


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
            ``"shards"``: one bucket per shard of the dataset (its shard boundaries, as ``shard_affinity``
            reads them, or ``shard_sizes``): the shards in a random order, each one's samples shuffled
            and read before the next shard's, so a reader needs about one shard at a time (a cache that
            holds a few shards fetches each shard once per epoch; MosaicML Streaming's ``py1s``). Not
            with ``sort_key``.
        rank: this rank; default ``torch.distributed.get_rank()`` when initialised, else 0.
        world_size: number of ranks; default ``torch.distributed.get_world_size()`` when
            initialised, else 1.
        drop_last: drop the tail that does not divide evenly among ranks instead of padding.
        shard_affinity: assign whole shards to nodes by rendezvous hashing (see the module docstring)
            and yield only samples of this node's shards. Needs the shard boundaries: ``shard_sizes``,
            else the dataset's (``dataset.shard_sizes``, MDS ``metas``, or the per-shard counts of the
            Jinx and safetensors datasets). Every node must receive at least one sample. Not combinable
            with ``sort_key`` or ``bucket_size``. A state resumes only at the same world size and
            local world size; :meth:`global_indices` does not exist (see :meth:`node_indices`).
        shard_sizes: the number of samples of each shard, in index order (shard ``i`` holds the
            indices after those of shards ``0..i-1``); they must add up to the dataset's length.
            Only with ``shard_affinity`` or ``bucket_size="shards"``.
        local_world_size: ranks per node; default the ``LOCAL_WORLD_SIZE`` environment variable
            (set by torchrun), else ``world_size`` (a single node). Ranks are numbered node by node:
            this rank's node is ``rank // local_world_size`` and its local rank
            ``rank % local_world_size``. Every node has the same number of ranks. Only with
            ``shard_affinity``.

    Raises:
        SamplerError: an invalid option, sort keys that are not one per sample, or with
            ``shard_affinity``: no shard boundaries, sizes that do not add up, a local world size
            that does not divide the world size, a node without samples, ``LOCAL_RANK`` that is not
            ``rank % LOCAL_WORLD_SIZE`` (checked when the rank comes from torch.distributed and the local
            world size from ``LOCAL_WORLD_SIZE``).

    Iterating yields Python ints. :meth:`indices` returns any range of this rank's positions as one
    numpy array and :meth:`chunks` streams the pass as arrays (the fast paths for loaders).
    """

    def __init__(self, dataset_or_len: Any, *, shuffle: bool = True, seed: int = 0,
                 sort_key: str | Callable[[Any], Any] | Sequence[Any] | np.ndarray | torch.Tensor | None = None,
                 descending: bool = False, bucket_size: int | str | None = None, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False, shard_affinity: bool = False,
                 shard_sizes: Sequence[int] | np.ndarray | None = None,
                 local_world_size: int | None = None) -> None:
        self.n = _length(dataset_or_len)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.descending = bool(descending)
        self._bounds: np.ndarray | None = None  # with bucket_size="shards": the shards' first indices, then n
        if bucket_size == "shards":
            if sort_key is not None:
                raise SamplerError('bucket_size="shards" shuffles the shards of the index range: it takes no '
                                   "sort_key")
            if shard_affinity:
                raise SamplerError("shard_affinity shuffles within each node's shards: it takes no sort_key "
                                   "or bucket_size")
            sizes = _shard_sizes(dataset_or_len, shard_sizes, self.n, 'bucket_size="shards"')
            self._bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            shard_sizes = None
        elif bucket_size is not None and (isinstance(bucket_size, (bool, str)) or int(bucket_size) < 1):
            raise SamplerError(f"{bucket_size=} must be a positive integer, \"shards\" or None")
        self.bucket_size = bucket_size if bucket_size is None or bucket_size == "shards" else int(bucket_size)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.drop_last = bool(drop_last)
        self._ranked = None if sort_key is None else _sort_order(dataset_or_len, sort_key, self.n, descending)
        self._affinity: _Affinity | None = None
        if shard_affinity:
            if sort_key is not None or bucket_size is not None:
                raise SamplerError("shard_affinity shuffles within each node's shards: it takes no sort_key "
                                   "or bucket_size")
            self._affinity = _Affinity(dataset_or_len, self.n, shard_sizes, self.seed, self.rank,
                                       self.world_size, local_world_size, self.drop_last, rank is None)
        elif shard_sizes is not None or local_world_size is not None:
            raise SamplerError("shard_sizes and local_world_size are options of shard_affinity=True")
        self._digest: str | None = None
        self.epoch = 0
        self._start = 0  # global position (node position with shard_affinity) where the current pass starts
        self._yielded = 0  # indices yielded by the current pass, up to the live iterator's chunk
        self._live: tuple[int, int, Iterator[int]] | None = None  # (base, chunk length, chunk iterator)
        self._ended = False  # the current pass ran to its end (an empty one too): the next begins anew
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
            self.epoch, self._start, self._yielded, self._live, self._ended = epoch, 0, 0, None, False

    def __len__(self) -> int:
        """How many indices this rank yields in a whole pass of the current epoch: constant across a
        resume, as torch's samplers' (a training loop that reads ``len(loader)`` once, Lightning's, counts
        every later epoch by it). A pass resumed from a loaded state yields :meth:`pass_length` of them."""
        return self._count(0)

    def pass_length(self) -> int:
        """How many indices this rank yields in the current pass: ``len(self)``, or fewer in a pass that
        resumes a loaded state (the rest of its epoch)."""
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
        follow Python slice rules against :meth:`pass_length`. Pure: the sampler's state does not change.
        """
        lo, hi, st = slice(start, stop, step).indices(self.pass_length())
        if st != 1 or hi - lo > _CHUNK:
            return self._at(self._start, np.arange(lo, hi, st, dtype=np.int64))
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        # batch-sized requests are served from a cached, aligned block of positions
        first, last = lo // _CHUNK, (hi - 1) // _CHUNK
        parts = [self._block(b)[max(lo - b * _CHUNK, 0):hi - b * _CHUNK] for b in range(first, last + 1)]
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def global_indices(self, start: int, stop: int) -> np.ndarray:
        """The epoch's global order at positions ``[start, stop)`` (clipped to ``[0, n)``), for all ranks.

        Raises:
            SamplerError: with ``shard_affinity``, where there is no global order (one per node).
        """
        if self._affinity is not None:
            raise SamplerError("with shard_affinity there is no global order, one per node: use node_indices")
        lo, hi, _ = slice(start, stop).indices(self.n)
        return self._order()(np.arange(lo, max(lo, hi), dtype=np.int64))

    def node_indices(self, start: int, stop: int) -> np.ndarray:
        """This node's epoch order at node positions ``[start, stop)`` (clipped to the node's sample
        count, without padding), for all of the node's local ranks; int64.

        Raises:
            SamplerError: without ``shard_affinity``.
        """
        aff = self._affinity
        if aff is None:
            raise SamplerError("node_indices needs shard_affinity=True; without it see global_indices")
        lo, hi, _ = slice(start, stop).indices(aff.size)
        return aff.dataset_index(self._order()(np.arange(lo, max(lo, hi), dtype=np.int64)))

    @property
    def shard_nodes(self) -> np.ndarray:
        """The node of every shard (a read-only int64 array), with ``shard_affinity``.

        Raises:
            SamplerError: without ``shard_affinity``.
        """
        if self._affinity is None:
            raise SamplerError("shard_nodes needs shard_affinity=True")
        return self._affinity.shard_node

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the epoch, this rank's yielded count and the global position it implies.

        ``position`` is ``pass start + yielded * world_size`` (capped at ``n``): the number of global
        positions consumed, which is what a sampler at another world size resumes from. A loader that
        prefetches has drawn more than the model consumed; use :meth:`state_at` with the consumed count.
        With ``shard_affinity`` it counts the positions of each node's (padded) order instead,
        ``pass start + yielded * local_world_size``, the same on every node. A pass that ran to its end
        is recorded as ended: the loaded sampler's next pass begins the epoch anew, as this one's does.
        """
        return self.state_at(self._current_yielded(), ended=self._ended)

    def state_at(self, yielded: int, *, ended: bool = False) -> dict[str, Any]:
        """The state after this rank has yielded ``yielded`` indices of the current pass; ``ended``: and its
        consumer saw the pass end (the next pass after loading the state begins the epoch anew, as the next
        pass of the saved run would have; without it, a state at the end of the pass resumes an empty
        remainder)."""
        yielded = min(max(int(yielded), 0), self.pass_length())
        aff = self._affinity
        if aff is None:
            position = min(self._start + yielded * self.world_size, self.n)
        else:
            position = min(self._start + yielded * aff.local_world_size, aff.length)
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": position,
            "yielded": yielded,
            "world_size": self.world_size,
            "rank": self.rank,
            "n": self.n,
            "order": self._fingerprint(),
            **({"ended": True} if ended else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a sampler over the same data and options, at any world
        size: the next pass yields this rank's share of the positions not yet consumed.

        With ``shard_affinity`` the state of any rank resumes every rank, at the same world size and
        local world size only (the nodes' orders depend on the number of nodes).

        Raises:
            SamplerError: not a sampler state, another version, dataset or order, a position out of
                range, or with ``shard_affinity`` another topology or a state saved without it.
        """
        epoch, position = self.check_state(state)
        self.epoch, self._start, self._yielded, self._live = epoch, position, 0, None
        self._ended = state.get("ended") is True

    def check_state(self, state: dict[str, Any]) -> tuple[int, int]:
        """Check that :meth:`load_state_dict` can load ``state``, changing nothing (a loader checks a state
        when it is loaded, before its pass loads it into the sampler); returns its epoch and position.

        Raises:
            SamplerError: as :meth:`load_state_dict`.
        """
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
        theirs = order.get("affinity") if isinstance(order, dict) else None
        if (theirs is None) != (self._affinity is None):
            raise SamplerError(f"the state was saved {'with' if theirs else 'without'} shard_affinity but this "
                               f"sampler has shard_affinity={self._affinity is not None}")
        if self._affinity is not None:
            self._affinity.check_resume(theirs, state.get("world_size"))
        if order != self._fingerprint():
            raise SamplerError(f"the state's order {order!r} differs from this sampler's "
                               f"{self._fingerprint()!r}: pass the same seed, shuffle, sort_key, "
                               "descending and bucket_size")
        limit = n if self._affinity is None else self._affinity.length
        if epoch < 0 or not 0 <= position <= limit:
            raise SamplerError(f"state has {epoch=} and {position=}, expected epoch >= 0 and 0 <= position <= "
                               f"{limit}")
        if self._affinity is not None:
            self._affinity.check_position(position)
        return epoch, position

    def __getstate__(self) -> dict[str, Any]:
        # for DataLoader workers: the live iterator is folded into the count; caches are rebuilt
        state = self.__dict__.copy()
        state.update(_yielded=self._current_yielded(), _live=None, _cached_order=None, _cached_block=None)
        return state

    # --- internals -----------------------------------------------------------------------------------
    def _count(self, start: int) -> int:
        if self._affinity is not None:
            return max(self._affinity.length - start, 0) // self._affinity.local_world_size
        left = max(self.n - start, 0)
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    def _begin_pass(self) -> int:
        if self._yielded or self._live is not None or self._ended:  # the previous pass started (or ended
            self._start = 0  # empty, at the end of a loaded state): begin the epoch anew
        self._yielded, self._live, self._ended = 0, None, False
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
        self._live, self._yielded, self._ended = None, count, True

    def _arrays(self, start: int, count: int, size: int) -> Iterator[np.ndarray]:
        for lo in range(0, count, size):
            hi = min(lo + size, count)
            block = self._at(start, np.arange(lo, hi, dtype=np.int64))
            self._yielded = hi
            yield block
        self._ended = True

    def _block(self, b: int) -> np.ndarray:
        key = (self.epoch, self._start, b)
        if self._cached_block is None or self._cached_block[0] != key:
            lo = b * _CHUNK
            local = np.arange(lo, min(lo + _CHUNK, self.pass_length()), dtype=np.int64)
            self._cached_block = (key, self._at(self._start, local))
        return self._cached_block[1]

    def _at(self, start: int, local: np.ndarray) -> np.ndarray:
        """Dataset indices at local positions of a pass starting at global position ``start``."""
        if local.size == 0:
            return local
        if self._affinity is not None:
            return self._affinity_at(start, local)
        q = local * self.world_size + (start + self.rank)
        if q[-1] >= self.n or q[0] >= self.n:  # padding: repeat the order from its start
            q = np.where(q >= self.n, (q - self.n) % self.n, q)
        return self._order()(q)

    def _affinity_at(self, start: int, local: np.ndarray) -> np.ndarray:
        aff = self._affinity
        assert aff is not None
        q = local * aff.local_world_size + (start + aff.local_rank)
        if q[-1] >= aff.size or q[0] >= aff.size:  # padding: repeat the node's order from its start
            q = np.where(q >= aff.size, (q - aff.size) % aff.size, q)
        return aff.dataset_index(self._order()(q))

    def _order(self) -> EpochOrder:
        """The epoch's order of global positions, or with ``shard_affinity`` of this node's positions."""
        if self._affinity is not None:
            if self._cached_order is None or self._cached_order[0] != self.epoch:
                key = mix64(self.seed, self.epoch, _NODE_ORDER, self._affinity.node)
                self._cached_order = (self.epoch, EpochOrder(self._affinity.size, key, shuffle=self.shuffle))
            return self._cached_order[1]
        if self._cached_order is None or self._cached_order[0] != self.epoch:
            shuffle = self.shuffle and (self._ranked is None or self.bucket_size is not None)
            order = EpochOrder(self.n, mix64(self.seed, self.epoch), shuffle=shuffle, ranked=self._ranked,
                               bucket_size=None if self._bounds is not None else self.bucket_size,
                               bucket_bounds=self._bounds)
            self._cached_order = (self.epoch, order)
        return self._cached_order[1]

    def _fingerprint(self) -> dict[str, Any]:
        if self._ranked is not None and self._digest is None:
            self._digest = hashlib.blake2b(memoryview(self._ranked), digest_size=16).hexdigest()
        out: dict[str, Any] = {"shuffle": self.shuffle, "seed": self.seed, "bucket_size": self.bucket_size,
                               "descending": self.descending, "sorted": self._digest}
        if self._bounds is not None:
            out["shards"] = hashlib.blake2b(memoryview(self._bounds), digest_size=8).hexdigest()
        if self._affinity is not None:
            out["affinity"] = self._affinity.fingerprint()
        return out


def rendezvous_assign(num_shards: int, nodes: int, seed: int = 0) -> np.ndarray:
    """The node of every shard by rendezvous (highest-random-weight) hashing.

    Shard ``s`` goes to the node ``k`` in ``[0, nodes)`` with the largest weight
    ``mix64(seed, s, k)`` (splitmix64, the same in every process, Python run and platform; ties, which
    need a 64-bit collision, go to the lower node). A weight does not depend on ``nodes``, so adding
    node ``N`` moves exactly the shards whose weight for ``N`` beats all others (about ``1/(N+1)`` of
    them), all to the new node, and removing a node moves only that node's shards.

    >>> rendezvous_assign(6, 3, seed=1).tolist()
    [0, 2, 2, 1, 1, 0]

    Args:
        num_shards: the number of shards (``>= 0``).
        nodes: the number of nodes (``>= 1``).
        seed: selects an unrelated assignment.

    Returns:
        An int64 array of ``num_shards`` node numbers.

    Raises:
        SamplerError: ``num_shards < 0`` or ``nodes < 1``.
    """
    num_shards, nodes = int(num_shards), int(nodes)
    if num_shards < 0:
        raise SamplerError(f"{num_shards=} must be >= 0")
    if nodes < 1:
        raise SamplerError(f"{nodes=} must be >= 1")
    shards = np.arange(num_shards, dtype=np.uint64)
    best = np.zeros(num_shards, dtype=np.int64)
    best_weight = _mix64_array(seed, shards, 0)
    for k in range(1, nodes):
        weight = _mix64_array(seed, shards, k)
        wins = weight > best_weight
        best[wins] = k
        best_weight = np.where(wins, weight, best_weight)
    return best


def _mix64_array(seed: int, shards: np.ndarray, node: int) -> np.ndarray:
    """``mix64(seed, s, node)`` for every ``s`` of the uint64 array ``shards``, vectorised."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    m1, m2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    h = np.full(shards.shape, mix64(seed), dtype=np.uint64)  # mix64's state after the first word
    for word in (shards, np.uint64(int(node) & ((1 << 64) - 1))):
        h ^= word
        h += golden
        h = (h ^ (h >> s30)) * m1
        h = (h ^ (h >> s27)) * m2
        h ^= h >> s31
    return h


class _Affinity:
    """This rank's place in shard-affinity mode: its node's shards, the node's size and the per-rank count.

    Args:
        dataset_or_len: the sampler's dataset or length (read for shard boundaries).
        n: the number of samples.
        shard_sizes: explicit per-shard sample counts, or None to read the dataset's.
        seed: the rendezvous seed.
        rank, world_size: this rank and the number of ranks.
        local_world_size: ranks per node, or None for ``LOCAL_WORLD_SIZE`` / a single node.
        drop_last: cut every node to the smallest node's count instead of padding to the largest.
        rank_from_env: the rank came from torch.distributed (then ``LOCAL_RANK`` is checked against it).

    Raises:
        SamplerError: no shard boundaries, bad sizes, a bad local world size, a node without samples.
    """

    def __init__(self, dataset_or_len: Any, n: int, shard_sizes: Sequence[int] | np.ndarray | None, seed: int,
                 rank: int, world_size: int, local_world_size: int | None, drop_last: bool,
                 rank_from_env: bool) -> None:
        sizes = _shard_sizes(dataset_or_len, shard_sizes, n)
        local, from_env = _local_world_size(local_world_size, world_size)
        self.local_world_size = local
        self.nodes = world_size // local
        self.node, self.local_rank = divmod(rank, local)
        env_local_rank = os.environ.get("LOCAL_RANK")
        if from_env and rank_from_env and env_local_rank is not None and env_local_rank.strip().isdigit() \
                and int(env_local_rank) != self.local_rank:
            raise SamplerError(f"LOCAL_RANK={env_local_rank} but rank {rank} % LOCAL_WORLD_SIZE {local} is "
                               f"{self.local_rank}: shard_affinity needs ranks numbered node by node")
        shard_node = rendezvous_assign(len(sizes), self.nodes, seed)
        shard_node.setflags(write=False)
        self.shard_node = shard_node
        node_sizes = np.zeros(self.nodes, dtype=np.int64)
        np.add.at(node_sizes, shard_node, sizes)
        empty = np.flatnonzero(node_sizes == 0)
        if empty.size:
            raise SamplerError(f"node {int(empty[0])} of {self.nodes} holds no samples ({len(sizes)} shards over "
                               f"{self.nodes} nodes): shard_affinity needs more, smaller shards or fewer nodes")
        per_rank = int(node_sizes.min()) // local if drop_last else -(-int(node_sizes.max()) // local)
        if per_rank == 0:
            raise SamplerError(f"the smallest node holds {int(node_sizes.min())} samples, fewer than its {local} "
                               "ranks: with drop_last every rank would yield nothing")
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        mine = np.flatnonzero(shard_node == self.node)
        self._starts = starts[mine]
        self._offsets = np.concatenate([[0], np.cumsum(sizes[mine])]).astype(np.int64)
        self.size = int(self._offsets[-1])  # this node's samples
        self.length = per_rank * local  # positions of every node's padded (or cut) order
        self._digest = hashlib.blake2b(memoryview(np.ascontiguousarray(sizes)), digest_size=16).hexdigest()

    def dataset_index(self, node_positions: np.ndarray) -> np.ndarray:
        """Dataset indices of positions ``[0, size)`` of the node's samples (its shards, in index order)."""
        j = np.searchsorted(self._offsets, node_positions, side="right") - 1
        return self._starts[j] + (node_positions - self._offsets[j])

    def fingerprint(self) -> dict[str, Any]:
        """What a saved state must match: the shard sizes and the topology."""
        return {"shards": self._digest, "nodes": self.nodes, "local_world_size": self.local_world_size}

    def check_resume(self, theirs: Any, world_size: Any) -> None:
        """Refuse a state saved at another topology or over other shards.

        Raises:
            SamplerError: the state's world size, nodes, local world size or shards differ.
        """
        mine = self.fingerprint()
        if not isinstance(theirs, dict) or theirs.get("shards") != mine["shards"]:
            raise SamplerError("the state was saved over other shard sizes: resume over the same shards")
        if (theirs.get("nodes"), theirs.get("local_world_size")) != (self.nodes, self.local_world_size) \
                or world_size != self.nodes * self.local_world_size:
            raise SamplerError(f"a shard_affinity state resumes only at the same topology: it was saved at "
                               f"world_size={world_size} ({theirs.get('nodes')} nodes of "
                               f"{theirs.get('local_world_size')} ranks), this sampler has "
                               f"world_size={self.nodes * self.local_world_size} ({self.nodes} nodes of "
                               f"{self.local_world_size} ranks)")

    def check_position(self, position: int) -> None:
        """Raises SamplerError unless ``position`` is a whole number of lockstep rounds of the node's ranks."""
        if position % self.local_world_size:
            raise SamplerError(f"state has {position=}, expected a multiple of local_world_size "
                               f"{self.local_world_size}")


def _local_world_size(local_world_size: int | None, world_size: int) -> tuple[int, bool]:
    """Ranks per node and whether they came from ``LOCAL_WORLD_SIZE``; checked to divide ``world_size``."""
    from_env = local_world_size is None
    if from_env:
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None:
            return world_size, True
        try:
            local_world_size = int(raw)
        except ValueError:
            raise SamplerError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
    local = int(local_world_size)
    name = "LOCAL_WORLD_SIZE" if from_env else "local_world_size"
    if local < 1 or world_size % local:
        raise SamplerError(f"{name}={local} must be >= 1 and divide world_size={world_size} "
                           "(every node runs the same number of ranks)")
    return local, from_env


def _shard_sizes(dataset: Any, shard_sizes: Sequence[int] | np.ndarray | None, n: int,
                 option: str = "shard_affinity") -> np.ndarray:
    """Per-shard sample counts: the explicit ones, else the dataset's; checked to add up to ``n``."""
    source = "shard_sizes"
    if shard_sizes is None:
        shard_sizes, source = dataset_shard_sizes(dataset)
        if shard_sizes is None:
            raise SamplerError(f"{option} needs shard boundaries, and {type(dataset).__name__} has none: "
                               "pass shard_sizes=[samples of each shard, in index order]")
    try:
        sizes = np.asarray(shard_sizes)
        if sizes.ndim != 1 or (sizes.size and sizes.dtype.kind not in "iu"):
            raise ValueError
        sizes = sizes.astype(np.int64)
    except (TypeError, ValueError):
        raise SamplerError(f"{source} must be a flat sequence of integers, got {shard_sizes!r:.200}") from None
    if sizes.size and int(sizes.min()) < 0:
        raise SamplerError(f"{source} must be >= 0, got {int(sizes.min())}")
    if int(sizes.sum()) != n:
        raise SamplerError(f"{source} add up to {int(sizes.sum())} samples but the dataset has {n}")
    return sizes


def dataset_shard_sizes(dataset: Any) -> tuple[Any, str]:
    """The dataset's per-shard counts and where they came from, or ``(None, "")``.

    Read, in order: a ``shard_sizes`` attribute or method, the ``samples`` of MDS ``metas``, the per-shard
    ``_counts`` (JinxDataset) or cumulative ``_ends`` (SafetensorsDataset).
    """
    if isinstance(dataset, (int, np.integer)):
        return None, ""
    sizes = getattr(dataset, "shard_sizes", None)
    if sizes is not None:
        return (sizes() if callable(sizes) else sizes), f"{type(dataset).__name__}.shard_sizes"
    metas = getattr(dataset, "metas", None)
    if isinstance(metas, Sequence) and all(hasattr(m, "samples") for m in metas):
        return [m.samples for m in metas], f"{type(dataset).__name__}.metas"
    counts = getattr(dataset, "_counts", None)
    if isinstance(counts, Sequence):
        return list(counts), f"{type(dataset).__name__} shard counts"
    ends = getattr(dataset, "_ends", None)
    if isinstance(ends, Sequence):
        return np.diff(np.asarray(ends, dtype=np.int64), prepend=0), f"{type(dataset).__name__} shard ends"
    return None, ""


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

    def state_at(self, consumed: int, *, ended: bool = False) -> dict[str, Any]:
        """The sampler state after ``consumed`` samples of this pass came out of the loader (see
        :meth:`GlobalSampler.state_at`)."""
        return self.sampler.state_at(consumed, ended=ended)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler (from :meth:`state_at` or ``GlobalSampler.state_dict``)."""
        self.sampler.load_state_dict(state)

    def check_state(self, state: dict[str, Any]) -> tuple[int, int]:
        """See :meth:`GlobalSampler.check_state`."""
        return self.sampler.check_state(state)

    def worker_positions(self, worker: int, workers: int) -> Iterator[np.ndarray]:
        """The pass positions worker ``worker`` of ``workers`` reads, in order, a few blocks at a time."""
        count, b = self.sampler.pass_length(), self.block_size
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
