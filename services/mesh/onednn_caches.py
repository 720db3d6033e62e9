"""Bound the per-shape kernel caches of PyTorch's CPU back end (oneDNN) in a process.

NOTE: why. On CPU, torch runs matmuls through oneDNN, which caches one compiled
primitive per input *shape* (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024), and
PyTorch's ideep layer keeps a second per-shape LRU of prepared weights
(``LRU_CACHE_CAPACITY``, default 1024). Continuous batching gives every step a different
number of tokens, so both fill up entry by entry: measured on the tiny model with random
batch sizes, RSS rose ~100 MiB per 600 requests with the defaults (the soak's executor
"creep") and stayed flat with both capped at 64 — at the same step time, since a step
only sees a handful of recurring shapes at a time.

Call ``bound_onednn_caches`` before torch is imported (the executor's and cachestore's
``__main__`` do). An operator's own setting of either variable wins.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_CAPACITY = 64
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(environ: MutableMapping[str, str] | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
    """Set both cache capacities to ``capacity`` unless already set (modifies ``environ``,
    the process environment by default)."""
    env = os.environ if environ is None else environ
    for name in CACHE_VARIABLES:
        env.setdefault(name, str(capacity))
