"""The degradation ladder on the request path: which rung a job is served on. Per job,
before admission:

    load    = max(admission occupancy, KV used over the full-quality executors)
    class   = the ladder's rung for the job's class after observing that load
    offered = rungs the placeable executors serve (membership heartbeats)
    served  = served_rung(class, the contract's accepted rungs, offered), raised to the
              DEGRADE fallback's rung when the contract's ceilings could not be met

``shed`` refuses the job (OverloadedError: RESOURCE_EXHAUSTED + retry hint); any other
served rung limits placement to the executors serving exactly that rung. A
``deterministic`` job is never served on a degraded rung (its output must reproduce): it
runs at full quality, or is shed like any other.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from services.mesh import metric_catalogue as catalogue
from services.scheduler.dispatch.job import Job
from services.scheduler.errors import OverloadedError
from services.scheduler.policy.contracts import FallbackChoice
from services.scheduler.policy.degradation import DegradationLadder, LoadSignal, Rung, served_rung
from services.shared.vocabulary import RequestClass


class DegradeSteps:
    """Owns the ladder (one per scheduler); the dispatcher hands it what it reads."""

    def __init__(self, ladder: DegradationLadder | None = None) -> None:
        self.ladder = ladder or DegradationLadder()

    def serve_rung(self, job: Job, fallback: FallbackChoice | None, load: LoadSignal, offered: Iterable[Rung],
                   retry_after_ms: Callable[[], int]) -> Rung:
        """Observe ``load`` for the job's class and pick the rung it is served on;
        OverloadedError when the ladder sheds it. Mutates the class's ladder only."""
        class_rung = self.ladder.observe(job.class_label, load)
        catalogue.set_degradation_rung(job.class_label, int(class_rung))
        offered = frozenset(offered)
        rung = served_rung(class_rung, job.contract, offered)
        if rung is Rung.SHED:
            raise OverloadedError("shed by the degradation ladder", retry_after_ms=retry_after_ms())
        if job.request_class is RequestClass.DETERMINISTIC:
            return Rung.NONE
        if fallback is not None and fallback.rung in offered:
            rung = max(rung, fallback.rung)  # the contract's DEGRADE fallback asks at least this
        return rung

    def rejection_reason(self, job: Job) -> str:
        """Why admission refused ``job``: the ladder sheds its class, or a queue (the
        tenant's or the scheduler's) is full. Does not modify."""
        return "shed" if self.ladder.rungs().get(job.class_label, Rung.NONE) is Rung.SHED else "queue_full"
