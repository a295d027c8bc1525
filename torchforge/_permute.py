"""A seeded bijection of ``[0, n)``, evaluated on numpy arrays: the memory-free random permutation.

:class:`Permutation` maps positions to indices with an unbalanced Feistel network over the smallest
power of two ``2**k >= n`` and cycle-walking back into ``[0, n)``: a value that lands outside the
range is permuted again until it lands inside. Because the network is a bijection of ``[0, 2**k)``,
cycle-walking yields a bijection of ``[0, n)`` (each cycle of the big permutation, restricted to the
small range, is still a cycle). Since ``2**k < 2 * n``, fewer than half of the values walk again.

Any position is computed directly, the state is the key, and a chunk of positions costs a few dozen
vectorised integer operations per element. An optional per-element *tweak* (any integer) selects one
of a family of independent permutations, so that e.g. every bucket of a bucketed order gets its own
shuffle in one vectorised call.

The round function is a multiply-xorshift hash (the murmur3 / splitmix finaliser family), keyed per
round from the seed with splitmix64. It is a good statistical mixer, not a cryptographic one.
"""
from __future__ import annotations

import numpy as np

__all__ = ["EpochOrder", "Permutation", "mix64"]

_M64 = (1 << 64) - 1
_ROUNDS = 6


def mix64(*words: int) -> int:
    """Hash integers into one 64-bit word (splitmix64 chained), e.g. ``mix64(seed, epoch, purpose)``."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (int(w) & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


class Permutation:
    """A pseudo-random permutation of ``range(n)`` selected by ``key``.

    >>> p = Permutation(10, key=42)
    >>> sorted(p(np.arange(10)).tolist()) == list(range(10))
    True

    Args:
        n: the size of the permuted range (``n >= 0``).
        key: any integer; different keys give unrelated permutations.
    """

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"{n=} must be >= 0")
        self.n = int(n)
        self.key = int(key) & _M64
        # 2**bits >= n; at least 64 values: tiny ranges walk more but get near-uniform permutations
        bits = max(6, (self.n - 1).bit_length())
        self._wide = bits > 32
        self._dtype = np.uint64 if self._wide else np.uint32
        self._word = 64 if self._wide else 32
        self._left = bits // 2
        self._right = bits - self._left
        mask = (1 << self._word) - 1
        self._round_keys = [self._dtype(mix64(self.key, r) & mask) for r in range(_ROUNDS)]
        if self._wide:
            self._mul = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
            self._tweak_mul = np.uint64(0xD6E8FEB86659FD93)
            self._shift = np.uint64(31)
        else:
            self._mul = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))
            self._tweak_mul = np.uint32(0x9E3779B1)
            self._shift = np.uint32(15)

    def __call__(self, positions: np.ndarray, tweak: np.ndarray | int | None = None) -> np.ndarray:
        """Map positions in ``[0, n)`` to their permuted values (int64 array of the same shape).

        Args:
            positions: integers in ``[0, n)``; not checked (the caller owns its ranges).
            tweak: optional integers broadcastable to ``positions``; each distinct value selects an
                independent permutation for the elements it goes with.
        """
        x = np.asarray(positions)
        if self.n <= 1:
            return np.zeros(x.shape, dtype=np.int64)
        t = None
        if tweak is not None:
            t = np.broadcast_to(np.asarray(tweak, dtype=np.int64), x.shape).astype(self._dtype)
            t *= self._tweak_mul
        y = self._network(x.astype(self._dtype), t)
        out = np.flatnonzero(y >= self.n)
        while out.size:  # cycle-walk the values that left [0, n)
            z = self._network(y[out], None if t is None else t[out])
            y[out] = z
            out = out[z >= self.n]
        return y.astype(np.int64)

    def _network(self, x: np.ndarray, tweak: np.ndarray | None) -> np.ndarray:
        dt = self._dtype
        lbits, rbits = self._left, self._right
        left = x >> dt(rbits)
        right = x & dt((1 << rbits) - 1)
        m1, m2 = self._mul
        h = np.empty_like(x)
        for rk in self._round_keys:
            # left ^= F(right) truncated to left's width, then swap halves (widths swap too)
            np.bitwise_xor(right, rk, out=h)
            if tweak is not None:
                h += tweak
            h *= m1
            h ^= h >> self._shift
            h *= m2
            h >>= dt(self._word - lbits)
            left ^= h
            left, right = right, left
            lbits, rbits = rbits, lbits
        # an even number of rounds puts the halves back to their original widths
        left <<= dt(rbits)
        left |= right
        return left


class EpochOrder:
    """The global order of one epoch: maps positions ``[0, n)`` to dataset indices, vectorised.

    Args:
        n: number of samples.
        key: the epoch's key (``mix64(seed, epoch)``); unused when ``shuffle`` is false.
        shuffle: permute (the whole range, or the buckets and their contents).
        ranked: optional int64 array of length ``n``, the dataset indices in sorted order; positions
            index into it after the (optional) bucket shuffle.
        bucket_size: cut the (sorted) order into consecutive buckets of this many positions; with
            ``shuffle`` the full buckets are permuted among themselves and each bucket's contents are
            permuted, while the last, partial bucket (``n % bucket_size`` positions) stays at the end
            with its contents permuted.
        bucket_bounds: instead of ``bucket_size``, buckets of any sizes: the sorted starts of the
            buckets followed by ``n`` (e.g. the first index of every shard); with ``shuffle`` the buckets
            are permuted among themselves and each one's contents are permuted.
    """

    def __init__(self, n: int, key: int, *, shuffle: bool, ranked: np.ndarray | None = None,
                 bucket_size: int | None = None, bucket_bounds: np.ndarray | None = None) -> None:
        self.n = n
        self.ranked = ranked
        self.bucket_size = bucket_size
        self._whole = self._buckets = self._within = self._tail = None
        self._slots: np.ndarray | None = None
        if not shuffle:
            return
        if bucket_bounds is not None:
            bounds = np.asarray(bucket_bounds, dtype=np.int64)
            self._starts, self._sizes = bounds[:-1], np.diff(bounds)
            self._slots = Permutation(len(self._sizes), mix64(key, 2))(np.arange(len(self._sizes), dtype=np.int64))
            self._slot_starts = np.concatenate([[0], np.cumsum(self._sizes[self._slots])[:-1]]).astype(np.int64)
            self._within_of: dict[int, Permutation] = {}  # bucket size -> the permutation of its contents
            self._key = key
        elif bucket_size is None:
            self._whole = Permutation(n, mix64(key, 1))
        else:
            self._full = (n // bucket_size) * bucket_size
            self._buckets = Permutation(n // bucket_size, mix64(key, 2))
            self._within = Permutation(bucket_size, mix64(key, 3))
            self._tail = Permutation(n - self._full, mix64(key, 4))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) at global ``positions`` (int64, each in ``[0, n)``)."""
        q = np.asarray(positions, dtype=np.int64)
        if self._whole is not None:
            q = self._whole(q)
        elif self._buckets is not None:
            q = self._bucketed(q)
        elif self._slots is not None:
            q = self._bucketed_by_bounds(q)
        return q if self.ranked is None else self.ranked[q]

    def _bucketed_by_bounds(self, q: np.ndarray) -> np.ndarray:
        slot = np.searchsorted(self._slot_starts, q, side="right") - 1
        bucket = self._slots[slot]
        offset = q - self._slot_starts[slot]
        sizes = self._sizes[bucket]
        out = np.empty_like(q)
        for size in np.unique(sizes).tolist():
            m = sizes == size
            perm = self._within_of.get(size)
            if perm is None:
                perm = self._within_of[size] = Permutation(size, mix64(self._key, 3))
            out[m] = self._starts[bucket[m]] + perm(offset[m], tweak=bucket[m])
        return out

    def _bucketed(self, q: np.ndarray) -> np.ndarray:
        b = self.bucket_size
        assert b is not None and self._buckets is not None and self._within is not None
        out = np.empty_like(q)
        head = q < self._full
        if head.all():
            bucket, offset = np.divmod(q, b)
            return self._buckets(bucket) * b + self._within(offset, tweak=bucket)
        bucket, offset = np.divmod(q[head], b)
        out[head] = self._buckets(bucket) * b + self._within(offset, tweak=bucket)
        tail = ~head
        out[tail] = self._full + self._tail(q[tail] - self._full)
        return out
