"""Which executor gets a request: policy objects behind one interface.

NOTE (kv policy): a request's cost on an executor is counted in KV blocks of work,

    cost = overlap_weight × (prompt blocks it must compute there)     # prefill saved by a prefix hit
         + KV blocks in use there − the prompt blocks it holds        # work already running, less what
                                                                      # this request reads by reference
         + num_blocks × [it is full: no free sequence slot or no room for the new blocks]

and the cheapest wins (ties: fewer active requests, then name). Blocks in use that the
request's prefix hits are shared, not added (a fork's children on their parent's pinned
blocks, a session resuming its own): counted as load, the pins of a session made its own
executor look busiest for its next hop. (overlap_weight 0 ignores the prefix in both
terms.) So the executor holding
the prompt's prefix wins unless it carries more extra load than the prefix saves, or is
full. This is the same trade Dynamo's KV router makes (prefill blocks vs active blocks).

Load is the larger of the executor's last report and what this scheduler itself has
in flight there, so a burst placed between two reports still spreads.
"""
from __future__ import annotations

import abc
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


# Loading a block from the cachestore costs about this fraction of recomputing it (the
# executor's cost model decides for real; see docs/architecture.md, "Cachestore and tiers").
STORE_LOAD_FRACTION = 0.5


class PlacementPolicy(enum.Enum):
    KV = "kv"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class Candidate:
    """One placeable executor as seen for one request."""

    name: str
    address: str
    num_prompt_blocks: int  # full blocks of the prompt at this executor's block size
    num_matched_blocks: int  # leading prompt blocks it already holds
    num_used_blocks: int  # KV blocks in use (estimate)
    num_blocks: int  # KV pool size (0: unknown)
    num_active_requests: int  # running + waiting (estimate)
    max_num_seqs: int  # 0: unknown
    num_store_blocks: int = 0  # prompt blocks right after the matched ones that a cachestore tier holds

    @property
    def num_compute_blocks(self) -> float:
        """Prefill work in blocks: a block loadable from the cachestore counts as
        ``STORE_LOAD_FRACTION`` of one computed."""
        return self.num_new_blocks - (1.0 - STORE_LOAD_FRACTION) * self.num_store_blocks

    @property
    def num_new_blocks(self) -> int:
        return self.num_prompt_blocks - self.num_matched_blocks

    @property
    def is_full(self) -> bool:
        no_slot = self.max_num_seqs > 0 and self.num_active_requests >= self.max_num_seqs
        no_room = self.num_blocks > 0 and self.num_blocks - self.num_used_blocks < self.num_new_blocks + 1
        return no_slot or no_room


@dataclass(frozen=True)
class Placement:
    """A ranked choice: where, how much prefix it reuses, and its cost under the policy."""

    name: str
    address: str
    num_matched_blocks: int
    cost: float


class Placer(abc.ABC):
    """Ranks candidates best first. Implementations may keep state (round robin) but
    never modify the candidates."""

    @abc.abstractmethod
    def rank(self, candidates: Sequence[Candidate]) -> list[Placement]: ...


class KvAwarePlacer(Placer):
    def __init__(self, overlap_weight: float = 1.0) -> None:
        if overlap_weight < 0:
            raise ValueError("overlap_weight must be >= 0")
        self.overlap_weight = overlap_weight

    def cost(self, c: Candidate) -> float:
        shared = c.num_matched_blocks if self.overlap_weight > 0 else 0
        cost = self.overlap_weight * c.num_compute_blocks + max(0, c.num_used_blocks - shared)
        if c.is_full:
            cost += max(c.num_blocks, c.num_prompt_blocks + 1)
        return cost

    def rank(self, candidates: Sequence[Candidate]) -> list[Placement]:
        scored = sorted(candidates, key=lambda c: (self.cost(c), c.num_active_requests, c.name))
        return [Placement(c.name, c.address, c.num_matched_blocks, self.cost(c)) for c in scored]


class LeastLoadedPlacer(Placer):
    def rank(self, candidates: Sequence[Candidate]) -> list[Placement]:
        def load(c: Candidate) -> tuple:
            slots = c.num_active_requests / c.max_num_seqs if c.max_num_seqs else c.num_active_requests
            blocks = c.num_used_blocks / c.num_blocks if c.num_blocks else 0.0
            return (slots, blocks, c.name)

        return [Placement(c.name, c.address, c.num_matched_blocks, load(c)[0]) for c in sorted(candidates, key=load)]


class RoundRobinPlacer(Placer):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, candidates: Sequence[Candidate]) -> list[Placement]:
        ordered = sorted(candidates, key=lambda c: c.name)
        if not ordered:
            return []
        start = next(self._counter) % len(ordered)
        ordered = ordered[start:] + ordered[:start]
        return [Placement(c.name, c.address, c.num_matched_blocks, float(i)) for i, c in enumerate(ordered)]


def make_placer(policy: PlacementPolicy, overlap_weight: float = 1.0) -> Placer:
    if policy is PlacementPolicy.KV:
        return KvAwarePlacer(overlap_weight)
    if policy is PlacementPolicy.LEAST_LOADED:
        return LeastLoadedPlacer()
    if policy is PlacementPolicy.ROUND_ROBIN:
        return RoundRobinPlacer()
    raise ValueError(f"unknown placement policy {policy!r}")


class InflightTracker:
    """What this scheduler has streaming on each executor: request → KV blocks it holds
    (prompt + output so far, rounded up to blocks)."""

    def __init__(self) -> None:
        self._blocks: dict[str, dict[str, int]] = {}

    def start(self, executor: str, request_id: str, num_blocks: int) -> None:
        self._blocks.setdefault(executor, {})[request_id] = num_blocks

    def update(self, executor: str, request_id: str, num_blocks: int) -> None:
        reqs = self._blocks.get(executor)
        if reqs is not None and request_id in reqs:
            reqs[request_id] = num_blocks

    def finish(self, executor: str, request_id: str) -> None:
        reqs = self._blocks.get(executor)
        if reqs is not None:
            reqs.pop(request_id, None)
            if not reqs:
                del self._blocks[executor]

    def num_requests(self, executor: str) -> int:
        return len(self._blocks.get(executor, ()))

    def num_blocks(self, executor: str) -> int:
        return sum(self._blocks.get(executor, {}).values())
