"""Measures the machine's memory read bandwidth the way a decode step reads weights."""
from __future__ import annotations

import time

import torch


def measure_read_bandwidth(threads: int, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (``torch.sum`` over a buffer far larger than any cache)."""
    torch.set_num_threads(threads)
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return size_bytes / best
