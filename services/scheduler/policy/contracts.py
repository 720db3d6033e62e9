"""Per-task contracts: KV quota, TTFT / TPOT ceilings and the fallback path.

NOTE: admission estimates a request's time to first token before it queues,

    ttft_est_ms = (requests ahead of it / in-flight slots) × mean request time (EWMA)
                + new prompt tokens × prefill_ms_per_token   (new: past the longest prefix an
                                                                 executor holds, per the KV index)

(``prefill_ms_per_token``: configured; once placed, the chosen executor's measured rate
when its load reports carry one.)

and its time per output token from what recent requests saw, scaled by how much more
crowded the executors will be,

    tpot_est_ms = mean observed ms per output token (EWMA) × (1 + requests ahead / slots)

and when either passes the contract's ceiling it takes the contract's fallback path:

    FAIL_FAST  refuse now (RESOURCE_EXHAUSTED): the caller can go elsewhere at once
    REROUTE    place on the least-loaded executor instead of the KV-best one
    DEGRADE    serve it on the least degraded rung the contract accepts that a live
               executor pool offers (and say which); with none offered it is served at
               full quality, and says so
    (unset)    interactive → REROUTE, everything else → DEGRADE

New prompt tokens are the prompt less what is expected cached. Admission runs before
placement, so there the whole prompt counts (``choose_fallback``); once placed, the
estimate reported with the response (``SchedulingDecisions.ttft_estimate_ms``) takes off
the chosen executor's expected prefix overlap (``estimate_with_cached``), and the TTFT
the scheduler then observes is checked against the ceiling (met / missed).

The path taken is visible in the response (``fallback_taken``, ``fallback_reason``).
The KV quota per task is enforced by the executor (the request ends with KV_QUOTA at
its quota, never LENGTH: the client must not read it as "ask for more"); here it is
checked against the tenant's quota (a task may not ask more than its tenant has).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.policy.degradation import DegradationContract, Rung
from services.scheduler.errors import InvalidScheduleRequest, OverloadedError


class Fallback(enum.Enum):
    NONE = "none"
    DEGRADE = "degrade"
    REROUTE = "reroute"
    FAIL_FAST = "fail_fast"


@dataclass(frozen=True)
class ContractTerms:
    kv_quota_blocks: int = 0
    ttft_ceiling_ms: int = 0
    tpot_ceiling_ms: int = 0
    fallback: Fallback = Fallback.NONE  # NONE: chosen by class
    degradation: DegradationContract = DegradationContract()  # accepted degradation rungs


@dataclass(frozen=True)
class FallbackChoice:
    path: Fallback
    reason: str = ""
    ttft_estimate_ms: float = 0.0
    rung: Rung = Rung.NONE  # DEGRADE: the rung it is served on (at least)
    queue_estimate_ms: float = 0.0  # the estimate's queueing part (the rest is prefill)


def parse_tenant_quotas(text: str) -> dict[str, int]:
    """``"acme=64,globex=32"`` → most KV blocks each tenant may hold per executor."""
    out: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit():
            raise ValueError(f"tenant quota {item!r}: expected name=blocks")
        out[name.strip()] = int(value)
    return out


class ContractBook:
    """Validates contracts and picks fallbacks. Keeps one EWMA (mean request time);
    ``validate`` and ``choose_fallback`` do not modify it."""

    def __init__(self, tenant_quotas: dict[str, int] | None = None, prefill_ms_per_token: float = 0.2,
                 initial_request_ms: float = 500.0, initial_tpot_ms: float = 20.0) -> None:
        self.tenant_quotas = dict(tenant_quotas or {})
        self.prefill_ms_per_token = prefill_ms_per_token
        self.mean_request_ms = initial_request_ms
        self.mean_tpot_ms = initial_tpot_ms

    def validate(self, terms: ContractTerms, tenant: str, pool_num_blocks: int) -> None:
        """Raises InvalidScheduleRequest naming the field when the contract asks for more
        than the tenant's quota (or, with no tenant quota, than an executor's pool)."""
        quota = self.tenant_quotas.get(tenant) or pool_num_blocks
        if terms.kv_quota_blocks and quota and terms.kv_quota_blocks > quota:
            raise InvalidScheduleRequest(
                "session.contract.kv_quota_blocks",
                f"{terms.kv_quota_blocks} blocks asked, tenant {tenant!r} may hold {quota}")

    def estimate_ttft_ms(self, num_ahead: int, num_slots: int, num_new_tokens: int) -> float:
        return num_ahead / max(1, num_slots) * self.mean_request_ms + num_new_tokens * self.prefill_ms_per_token

    def estimate_tpot_ms(self, num_ahead: int, num_slots: int) -> float:
        return self.mean_tpot_ms * (1.0 + num_ahead / max(1, num_slots))

    def choose_fallback(self, terms: ContractTerms, interactive: bool, num_ahead: int, num_slots: int,
                        num_new_tokens: int, offered: Iterable[Rung] = ()) -> FallbackChoice:
        """The path to take for this request now; raises OverloadedError for FAIL_FAST.
        ``offered``: degradation rungs live executors serve (for DEGRADE)."""
        est = self.estimate_ttft_ms(num_ahead, num_slots, num_new_tokens)
        queue_est = self.estimate_ttft_ms(num_ahead, num_slots, 0)
        if not terms.ttft_ceiling_ms and not terms.tpot_ceiling_ms:
            return FallbackChoice(Fallback.NONE, ttft_estimate_ms=est, queue_estimate_ms=queue_est)
        tpot = self.estimate_tpot_ms(num_ahead, num_slots)
        misses = []
        if terms.ttft_ceiling_ms and est > terms.ttft_ceiling_ms:
            misses.append(f"ttft estimate {est:.0f} ms > ceiling {terms.ttft_ceiling_ms} ms")
        if terms.tpot_ceiling_ms and tpot > terms.tpot_ceiling_ms:
            misses.append(f"tpot estimate {tpot:.1f} ms > ceiling {terms.tpot_ceiling_ms} ms")
        if not misses:
            return FallbackChoice(Fallback.NONE, ttft_estimate_ms=est, queue_estimate_ms=queue_est)
        path = terms.fallback
        if path is Fallback.NONE:
            path = Fallback.REROUTE if interactive else Fallback.DEGRADE
        reason = "; ".join(misses)
        if path is Fallback.FAIL_FAST:
            raise OverloadedError(f"contract cannot be met: {reason}", retry_after_ms=int(est))
        rung = Rung.NONE
        if path is Fallback.DEGRADE:
            lowest = terms.degradation.lowest_offered(offered)
            if lowest is None:
                reason += "; no accepted degradation step offered by the executors: served at full quality"
            else:
                rung = lowest
                reason += f"; served on the {rung.label} rung"
        return FallbackChoice(path, reason, est, rung, queue_est)

    def estimate_with_cached(self, choice: FallbackChoice, num_prompt_tokens: int, num_cached_tokens: int,
                             prefill_ms_per_token: float | None = None) -> float:
        """``choice``'s TTFT estimate with only the tokens not expected cached prefilled, at
        ``prefill_ms_per_token`` (the chosen executor's measured rate; None: the configured
        one). Does not modify anything."""
        per_token = self.prefill_ms_per_token if prefill_ms_per_token is None else prefill_ms_per_token
        return choice.queue_estimate_ms + max(0, num_prompt_tokens - num_cached_tokens) * per_token

    def observe_request_ms(self, ms: float, num_output_tokens: int = 0) -> None:
        """Fold a finished request into the EWMAs (its whole time spread over its tokens
        bounds its time per output token from above)."""
        self.mean_request_ms = 0.9 * self.mean_request_ms + 0.1 * ms
        if num_output_tokens > 0:
            self.mean_tpot_ms = 0.9 * self.mean_tpot_ms + 0.1 * (ms / num_output_tokens)
