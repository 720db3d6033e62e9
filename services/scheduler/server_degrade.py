"""Degradation-ladder hooks of the Scheduler servicer: protos in, degradation.py's
decisions out. Per request, before admission:

    load    = max(admission occupancy, KV used over the full-quality executors)
    class   = the ladder's rung for the request's class after observing that load
    offered = rungs the placeable executors serve (membership heartbeats)
    served  = served_rung(class, the contract's accepted rungs, offered), raised to the
              DEGRADE fallback's rung when the contract's ceilings could not be met

``shed`` refuses the request (RESOURCE_EXHAUSTED + retry hint); any other served rung
limits placement to the executors serving exactly that rung.
"""
from __future__ import annotations

from services.mesh import metric_catalogue as catalogue
from services.scheduler.policy.degradation import DegradationContract, LoadSignal, Rung, served_rung
from services.scheduler.errors import InvalidScheduleRequest, OverloadedError
from weft.v1 import common_pb2, scheduler_pb2


def degradation_contract(contract: common_pb2.Contract) -> DegradationContract:
    """The accepted rungs of a ``weft.v1.Contract`` (none listed: every rung); raises
    InvalidScheduleRequest naming the field on an unset step."""
    labels = []
    for step in contract.accepted_degrade_steps:
        if step == common_pb2.DEGRADE_STEP_UNSPECIFIED or step not in common_pb2.DegradeStep.values():
            raise InvalidScheduleRequest("session.contract.accepted_degrade_steps",
                                         f"unknown degradation step {step}")
        labels.append(common_pb2.DegradeStep.Name(step).removeprefix("DEGRADE_STEP_").lower())
    return DegradationContract.from_labels(labels)


def _class_name(request: scheduler_pb2.ScheduleRequest) -> str:
    return common_pb2.RequestClass.Name(request.session.request_class)


class DegradeHooks:
    """Mixed into SchedulerServicer; uses its ``ladder``, ``view``, ``tenant_admission``,
    ``admission`` and ``_agent_plans`` attributes."""

    def load_signal(self, model_id: str = "") -> LoadSignal:
        """What the ladder reads now. Does not modify anything."""
        return LoadSignal(admission_fraction=self.tenant_admission.load_fraction(),
                          kv_used_fraction=self.view.membership.kv_used_fraction(model_id))

    def _serve_rung(self, request: scheduler_pb2.ScheduleRequest) -> Rung:
        """Observe load for the request's class and pick the rung it is served on;
        OverloadedError when the ladder sheds it. Mutates the class's ladder only."""
        plan = self._agent_plans.get(request.request_id)
        contract = (plan.request.terms.degradation if plan is not None
                    else degradation_contract(request.session.contract))  # validated before the ladder moves
        label = _class_name(request).removeprefix("REQUEST_CLASS_").lower().replace("unspecified", "")
        class_rung = self.ladder.observe(_class_name(request), self.load_signal(request.model_id))
        catalogue.set_degradation_rung(label, int(class_rung))
        offered = self.view.membership.offered_rungs(request.model_id)
        rung = served_rung(class_rung, contract, offered)
        if rung is Rung.SHED:
            raise OverloadedError("shed by the degradation ladder", retry_after_ms=self.admission.retry_after_ms())
        if plan is not None and plan.fallback.rung in offered:
            rung = max(rung, plan.fallback.rung)  # the contract's DEGRADE fallback asks at least this
        return rung

    def _rejection_reason(self, request: scheduler_pb2.ScheduleRequest) -> str:
        """Why admission refused ``request``: the ladder sheds its class, or a queue (the
        tenant's or the scheduler's) is full."""
        return "shed" if self.ladder.rungs().get(_class_name(request), Rung.NONE) is Rung.SHED else "queue_full"
