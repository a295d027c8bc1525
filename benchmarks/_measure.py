"""Measurements shared by the benchmarks: this machine's memcpy bandwidth, the yardstick for copies."""
from __future__ import annotations

import time

import numpy as np


def memcpy_gb_s() -> float:
    """One 256 MiB ``np.copyto`` between warm buffers, best of five, in GB/s."""
    src = np.ones(1 << 28, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9
