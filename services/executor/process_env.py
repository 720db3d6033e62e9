"""The executor's process environment for torch's CPU runtime, set before torch loads.

Three settings, each measured on the 2-core machines (docs/architecture.md, "Engine speed"):

- ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP workers sleep instead of spinning. Executors
  share cores with the router, scheduler and each other; spinning workers starved their
  event loops (40 ms stalls in token streams on 2 cores).
- ``GOMP_SPINCOUNT=10000``: but a worker that sleeps the moment a parallel region ends pays
  a futex wake-up at the next one, and a SmolLM2 decode step has ~120 of them (a linear
  each) with tens of microseconds between: pure PASSIVE made a batch-1 step 25-27 ms
  instead of 15-17. A bounded spin (~tens of microseconds on these cores, libgomp counts
  it even under PASSIVE) bridges the gaps inside a step and still sleeps soon after the
  step ends.
- ``THP_MEM_ALLOC_ENABLE=1``: torch's allocator puts tensors of 2 MiB and more on
  transparent huge pages (madvise). A decode step streams every weight once; fewer TLB
  misses gave the oneDNN linears +5-10 % read bandwidth in isolation (~3 % per step).

Values already in the environment win (an operator may set their own).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

EXECUTOR_ENV: dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "GOMP_SPINCOUNT": "10000",
    "THP_MEM_ALLOC_ENABLE": "1",
}


def apply_executor_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set every ``EXECUTOR_ENV`` entry the environment does not set already. Takes effect
    only before torch loads OpenMP and allocates (so: before ``import torch``)."""
    for key, value in EXECUTOR_ENV.items():
        environ.setdefault(key, value)
