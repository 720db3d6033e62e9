"""What each engine step did to each request, for timelines and KV metrics.

``LLMEngine.step`` calls ``StepTrace.on_step`` after a step ran (on the engine thread; the
engine is handed its ``StepTrace`` at construction);
the gRPC servicer ``pop``s a request's record when its stream ends and turns it into
spans with ``add_executor_spans``. Records are plain objects touched by one thread at a
time: the engine thread writes while the request runs, and the servicer reads only
after the request's last output, which is delivered after the step that produced it.

Records are bounded (``max_records``, oldest dropped): a cancelled request's record is
popped when its stream ends, but a step already running on the engine thread may touch
the request once more before the abort lands and so create a record nobody pops.

NOTE: why a request waited. A waiting request accrues each step's duration either as
*KV-blocked* (the pool's free blocks could not hold its next chunk) or as plain
queueing (a slot or the token budget was the limit). That split is what lets the p99
verdict tell KV contention from queueing at the executor.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from services.mesh import metric_catalogue as catalogue
from services.mesh.timeline import Trace

MAX_CHUNKS = 16  # prefill chunks kept per request (later ones are merged into the last)
MAX_RECORDS = 4096  # far above any batch plus queue; beyond it the oldest (orphans) go


@dataclass
class RequestSteps:
    first_scheduled_ns: int | None = None
    chunks: list[list[int]] = field(default_factory=list)  # [start_ns, end_ns, num_tokens]
    preempted: list[list[int]] = field(default_factory=list)  # [preempted_ns, rescheduled_ns or 0]
    kv_blocked_ns: int = 0
    queued_ns: int = 0


class StepTrace:
    def __init__(self, executor: str, update_gauges_every: int = 1, max_records: int = MAX_RECORDS) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self.executor = executor
        self.update_gauges_every = max(1, update_gauges_every)
        self.max_records = max_records
        self._records: dict[str, RequestSteps] = {}
        self._lock = threading.Lock()
        self._num_steps = 0

    def _rec(self, request_id: str) -> RequestSteps:
        rec = self._records.get(request_id)
        if rec is None:
            with self._lock:
                rec = self._records.setdefault(request_id, RequestSteps())
                while len(self._records) > self.max_records:  # dicts keep insertion order
                    del self._records[next(iter(self._records))]
        return rec

    def __len__(self) -> int:
        return len(self._records)

    def on_step(self, engine, plan, start_ns: int, end_ns: int) -> None:
        """Record one step (engine thread). ``plan`` is the step's ``StepPlan``."""
        for item in plan.decodes + plan.prefills:
            rec = self._rec(item.seq.request_id)
            if rec.first_scheduled_ns is None:
                rec.first_scheduled_ns = start_ns
            if rec.preempted and rec.preempted[-1][1] == 0:
                rec.preempted[-1][1] = start_ns
        for item in plan.prefills:
            rec = self._rec(item.seq.request_id)
            if len(rec.chunks) < MAX_CHUNKS:
                rec.chunks.append([start_ns, end_ns, item.num_new_tokens])
            else:
                rec.chunks[-1][1] = end_ns
                rec.chunks[-1][2] += item.num_new_tokens
        for seq in plan.preempted:
            self._rec(seq.request_id).preempted.append([end_ns, 0])
        pool = engine.pool
        free = pool.num_free_blocks
        step_ns = end_ns - start_ns
        for seq in engine.scheduler.waiting:
            rec = self._rec(seq.request_id)
            remaining = max(1, seq.num_tokens - seq.num_computed_tokens)
            need = engine.kv.num_blocks_for(min(remaining, engine.config.max_prefill_chunk or remaining))
            if free < need:
                rec.kv_blocked_ns += step_ns
            else:
                rec.queued_ns += step_ns
        catalogue.count_preemptions(self.executor, len(plan.preempted))
        catalogue.observe_step(self.executor, len(plan.decodes), sum(i.num_new_tokens for i in plan.prefills),
                               step_ns / 1e9)
        self._num_steps += 1
        if self._num_steps % self.update_gauges_every == 0 or plan.preempted:
            self.update_gauges(engine)

    def update_gauges(self, engine) -> None:
        catalogue.set_kv_usage(self.executor, engine.pool.usage(), engine.num_blocks, engine.pool.num_free_blocks)
        catalogue.set_executor_queue_depth(self.executor, len(engine.scheduler.waiting))

    def pop(self, request_id: str) -> RequestSteps:
        with self._lock:
            return self._records.pop(request_id, None) or RequestSteps()


def add_executor_spans(trace: Trace, rec: RequestSteps, received_ns: int, first_token_ns: int | None,
                       end_ns: int, num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> None:
    """Turn one request's step record into executor spans on ``trace``."""
    scheduled = rec.first_scheduled_ns
    if scheduled is not None:
        trace.span("executor.wait", received_ns, max(received_ns, scheduled),
                   kv_blocked_ms=round(rec.kv_blocked_ns / 1e6, 3), queued_ms=round(rec.queued_ns / 1e6, 3))
    for i, (start, stop, num_tokens) in enumerate(rec.chunks):
        trace.span("executor.prefill_chunk", start, stop, index=i, num_tokens=num_tokens)
    for start, stop in rec.preempted:
        trace.span("executor.preempted", start, stop or end_ns)
    if scheduled is not None and first_token_ns is not None:
        trace.span("executor.prefill", scheduled, first_token_ns, num_prompt_tokens=num_prompt_tokens,
                   num_cached_tokens=num_cached_tokens)
        trace.span("executor.first_token", first_token_ns)
        trace.span("executor.decode", first_token_ns, end_ns, num_output_tokens=num_output_tokens)
