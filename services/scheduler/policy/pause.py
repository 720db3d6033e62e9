"""Tool-call pause policy: keep, demote or drop a session's KV while its tool runs.

NOTE (cost model; every option is priced in milliseconds of engine time):

    drop    P(evicted during the pause) × recompute_ms        recompute_ms = tokens × prefill_ms_per_token
            P(evicted) = pool pressure (used / total blocks): under no pressure LRU keeps it anyway
    keep    blocks × pause_s × block_second_ms × pressure / (1 − pressure)
            memory held idle costs nothing on an idle pool and without bound on a full one
    demote  blocks × 2 × transfer_ms_per_block                down now, up (prefetched) on resume
            only when the executor can demote (the cachestore RPCs exist)

The two rates are the executor's measured ones when its load reports carry them
(``PauseInputs``: prefill_ms_per_token = 1000 / prefill tokens per s, transfer_ms_per_block
= 1000 × block bytes / transfer bytes per s, and then a demote also pays the executor's
per-transfer overhead twice), else the configured ``PauseCosts``. The plan says which
priced it (``cost_source``: measured / configured / mixed) and so does its reason.

The cheapest wins; ties prefer keep, then demote. A keep is refused when the
executor's pinned blocks would pass ``max_pinned_fraction`` of its pool, so pins can
never take a whole pool hostage. A kept session is pinned for ``ttl_factor`` × the
expected pause (the caller's hint, else what this session's pauses have been, else
``default_pause_ms``), capped at ``max_pin_ttl_ms``.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass


class PauseDecision(enum.Enum):
    NONE = "none"  # no pause follows
    KEEP = "keep"
    DEMOTE = "demote"
    DROP = "drop"


class PausePolicyName(enum.Enum):
    COST = "cost"  # the cost model above (weft)
    ALWAYS_KEEP = "keep"
    ALWAYS_DEMOTE = "demote"  # when the executor can demote, else drop (tests, ablations)
    NEVER_KEEP = "drop"  # LRU only (what request-level engines do)


@dataclass(frozen=True)
class PauseInputs:
    num_context_tokens: int
    num_blocks: int  # full blocks of the context
    expected_pause_ms: float
    pool_used_blocks: int  # on the executor holding the session
    pool_num_blocks: int
    pool_pinned_blocks: int  # already pinned there (by this scheduler's decisions)
    can_demote: bool
    # Measured on the executor holding the session (its load reports); None: not measured
    # yet, the configured PauseCosts rate prices it.
    prefill_ms_per_token: float | None = None
    transfer_ms_per_block: float | None = None
    transfer_overhead_ms: float = 0.0  # per transfer; only with a measured transfer rate


@dataclass(frozen=True)
class PausePlan:
    decision: PauseDecision
    pin_ttl_ms: int = 0
    costs_ms: tuple[tuple[str, float], ...] = ()  # (option, cost) for logs and tests
    reason: str = ""
    cost_source: str = ""  # measured / configured / mixed (one of the two rates); "": not priced


@dataclass(frozen=True)
class PauseCosts:
    prefill_ms_per_token: float = 0.2
    block_second_ms: float = 2.0
    transfer_ms_per_block: float = 0.5
    default_pause_ms: float = 2000.0
    ttl_factor: float = 2.0
    max_pin_ttl_ms: int = 60_000
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        if min(self.prefill_ms_per_token, self.block_second_ms, self.transfer_ms_per_block,
               self.default_pause_ms) < 0:
            raise ValueError("costs and default_pause_ms must be >= 0")
        if not 0 < self.max_pinned_fraction <= 1 or self.ttl_factor < 1:
            raise ValueError("max_pinned_fraction must be in (0, 1] and ttl_factor >= 1")


class PausePolicy(abc.ABC):
    @abc.abstractmethod
    def decide(self, x: PauseInputs) -> PausePlan:
        """Choose what happens to the session's blocks. Pure: modifies nothing."""


class CostPausePolicy(PausePolicy):
    def __init__(self, costs: PauseCosts = PauseCosts()) -> None:
        self.c = costs

    def ttl_ms(self, x: PauseInputs) -> int:
        return int(min(self.c.max_pin_ttl_ms, x.expected_pause_ms * self.c.ttl_factor + 500))

    def decide(self, x: PauseInputs) -> PausePlan:
        c = self.c
        if x.num_blocks == 0:
            return PausePlan(PauseDecision.DROP, reason="no full block to keep")
        total = max(1, x.pool_num_blocks)
        pressure = min(0.99, x.pool_used_blocks / total)
        pause_s = x.expected_pause_ms / 1000.0
        measured = [x.prefill_ms_per_token is not None]
        prefill_ms = c.prefill_ms_per_token if x.prefill_ms_per_token is None else x.prefill_ms_per_token
        costs = {
            "drop": pressure * x.num_context_tokens * prefill_ms,
            "keep": x.num_blocks * pause_s * c.block_second_ms * pressure / (1.0 - pressure),
        }
        if x.can_demote:
            measured.append(x.transfer_ms_per_block is not None)
            if x.transfer_ms_per_block is None:
                costs["demote"] = x.num_blocks * 2 * c.transfer_ms_per_block
            else:
                costs["demote"] = 2 * (x.transfer_overhead_ms + x.num_blocks * x.transfer_ms_per_block)
        source = "measured" if all(measured) else "configured" if not any(measured) else "mixed"
        pin_room = c.max_pinned_fraction * total - x.pool_pinned_blocks
        reason = "cheapest"
        if x.num_blocks > pin_room:
            costs.pop("keep")
            reason = "pin budget exhausted"
        reason += f" at {source} costs"
        order = {"keep": 0, "demote": 1, "drop": 2}
        best = min(costs, key=lambda k: (costs[k], order[k]))
        table = tuple(sorted(costs.items()))
        ttl = self.ttl_ms(x) if best == "keep" else 0
        return PausePlan(PauseDecision(best), ttl, table, reason, source)


class AlwaysKeepPolicy(CostPausePolicy):
    def decide(self, x: PauseInputs) -> PausePlan:
        return PausePlan(PauseDecision.KEEP, self.ttl_ms(x), reason="always keep")


class AlwaysDemotePolicy(PausePolicy):
    def decide(self, x: PauseInputs) -> PausePlan:
        if x.can_demote:
            return PausePlan(PauseDecision.DEMOTE, reason="always demote")
        return PausePlan(PauseDecision.DROP, reason="cannot demote")


class NeverKeepPolicy(PausePolicy):
    def decide(self, x: PauseInputs) -> PausePlan:
        return PausePlan(PauseDecision.DROP, reason="LRU only")


def make_pause_policy(name: PausePolicyName | str, costs: PauseCosts = PauseCosts()) -> PausePolicy:
    name = PausePolicyName(name)
    if name is PausePolicyName.COST:
        return CostPausePolicy(costs)
    if name is PausePolicyName.ALWAYS_KEEP:
        return AlwaysKeepPolicy(costs)
    if name is PausePolicyName.ALWAYS_DEMOTE:
        return AlwaysDemotePolicy()
    return NeverKeepPolicy()
