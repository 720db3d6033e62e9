"""Dynamic priority: which waiting request gets the next in-flight slot.

Policies are an enum + a small interface + a factory (``--policy weft|fcfs|priority``):

    fcfs      arrival order (vLLM's default: a request is a request)
    priority  static: class first, then the caller's ``priority`` field (what engines
              with "priority scheduling" do: ordering only)
    weft      re-estimated at every hand-off of a slot (each scheduling interval) from

NOTE (weft priority; HIGHER runs first, the one convention of services/shared/vocabulary.py;
every term is in "class levels"):

    priority = − base[class]                                 interactive 0, agentic/deterministic 1, batch 3
               + caller_priority                             the request's own field (higher first too)
               − w_las   · log2(1 + attained_tokens / 1024)  least attained service per *program*:
                                                             a 50-hop program sinks below fifty 2-hop ones
               + w_slack · clamp(waited / ttft_ceiling, 0, 2) deadline slack from the contract
               + w_fresh · [its tool call just returned]     context freshness: its KV is still hot
               − w_ent   · entropy / ln(vocab)               intent entropy: an uncertain agent explores
                                                             (more hops ahead), a confident one is closing
               + waited_s / aging_s                          aging: nothing waits forever

Priorities are compared only among requests waiting at the same instant, so the terms'
scale matters, not their origin. The value goes unchanged to the executor's queue
(``ExecuteRequest.priority``, higher first); only an ascending queue (admission) takes
``queue_order_key`` of it.
"""
from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass

from services.shared.priority_weights import parse_weight_overrides
from services.shared.vocabulary import RequestClass


class SchedulingPolicy(enum.Enum):
    WEFT = "weft"
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class PriorityInputs:
    """What the policy may look at for one waiting request (a snapshot; the policy
    never modifies anything)."""

    arrival_s: float
    request_class: RequestClass
    caller_priority: float = 0.0  # the request's own field: higher runs first
    attained_tokens: int = 0  # of its program so far
    ttft_ceiling_ms: int = 0  # from the contract; 0 = none
    fresh_resume: bool = False  # a session hop arriving while its KV is kept / just returned
    mean_entropy: float = 0.0  # nats, EWMA of the session's recent hops


class Prioritizer(abc.ABC):
    @abc.abstractmethod
    def priority(self, r: PriorityInputs, now_s: float) -> float:
        """Higher runs first. Pure: depends only on its arguments and the weights."""


class FcfsPrioritizer(Prioritizer):
    def priority(self, r: PriorityInputs, now_s: float) -> float:
        return -r.arrival_s  # earlier arrival, higher priority


_BASE = {RequestClass.INTERACTIVE: 0.0, RequestClass.AGENTIC: 1.0,
         RequestClass.DETERMINISTIC: 1.0, RequestClass.BATCH: 3.0}


class StaticPrioritizer(Prioritizer):
    def priority(self, r: PriorityInputs, now_s: float) -> float:
        return -_BASE[r.request_class] * 1e6 + r.caller_priority * 1e3 - r.arrival_s * 1e-6


@dataclass(frozen=True)
class WeftWeights:
    las: float = 1.0
    slack: float = 1.0
    fresh: float = 0.5
    entropy: float = 0.5
    aging_s: float = 30.0
    vocab_entropy_nats: float = math.log(32000)


def parse_priority_weights(text: str) -> WeftWeights:
    """``"las=0.5,aging_s=10"`` over the defaults (``""``: the defaults); ValueError naming
    the item (services/shared/priority_weights.py)."""
    return WeftWeights(**parse_weight_overrides(text))


class WeftPrioritizer(Prioritizer):
    def __init__(self, weights: WeftWeights = WeftWeights()) -> None:
        self.w = weights

    def priority(self, r: PriorityInputs, now_s: float) -> float:
        w = self.w
        waited_s = max(0.0, now_s - r.arrival_s)
        p = -_BASE[r.request_class] + r.caller_priority
        p -= w.las * math.log2(1.0 + r.attained_tokens / 1024.0)
        if r.ttft_ceiling_ms:
            p += w.slack * min(2.0, waited_s * 1000.0 / r.ttft_ceiling_ms)
        if r.fresh_resume:
            p += w.fresh
        p -= w.entropy * min(1.0, r.mean_entropy / w.vocab_entropy_nats)
        p += waited_s / w.aging_s
        return p


def make_prioritizer(policy: SchedulingPolicy | str, weights: WeftWeights = WeftWeights()) -> Prioritizer:
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.WEFT:
        return WeftPrioritizer(weights)
    if policy is SchedulingPolicy.PRIORITY:
        return StaticPrioritizer()
    return FcfsPrioritizer()
