"""Relay: a placed job's token stream, from one executor after another.

One request = one executor stream relayed chunk by chunk: no per-token round trips. The
executor call inherits the job's deadline; when the client goes away the relay is
cancelled and cancels the executor call, which aborts the request there.

    attempt  = the ranked executors, tried in order while one is unreachable before its
               first token (at most ``placement_attempts``)
    stream   = attempts wrapped in migration (migration.py): an executor that dies or
               stalls mid-stream is replaced by another serving the same rung (else a
               full-quality one, never the reverse), continuing from the shared resume
               point; usage is counted across attempts

Decisions: the job's ``Decisions`` (filled at placement) are completed here with the
queue time, rung, expected cached prefix and the TTFT observed at the first token chunk,
stamped on the stream (first chunk: all but the pause; last chunk: the pause), recorded
as ``scheduler.decision.*`` timeline events (``Trace.decision``) and counted in the metric catalogue.

Bounded: after the migration policy's attempts, ExecutorLostError (UNAVAILABLE); a job
aboard too many engine deaths ends SuspectedPoisonError (ABORTED) and is remembered.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import structlog

from services.mesh import metric_catalogue as catalogue
from services.mesh import metrics
from services.mesh.timeline import Trace
from services.scheduler.dispatch.job import Chunk, Decisions, ExecutorCall, ExecutorCallError, ExecutorPort, Job
from services.scheduler.errors import DeadlineError, ExecutorLostError, SuspectedPoisonError
from services.scheduler.migration import (
    Attempt, ExecutorFailed, MigrationExhausted, MigrationPolicy, NoReplacement, Piece, StreamProgress,
    migrating_stream, placement_marker,
)
from services.shared.vocabulary import Rung
from services.scheduler.policy.contracts import Fallback
from services.scheduler.policy.pause import PauseDecision
from services.scheduler.policy.placement import InflightTracker, Placement
from services.scheduler.policy.suspects import SuspectedPoison, SuspectRegistry
from services.scheduler.state.blocks import num_blocks_spanned, num_full_blocks
from services.scheduler.state.membership import Membership
from services.scheduler.state.sessions import executor_session_id

log = structlog.get_logger(__name__)

PLACED = metrics.counter("weft_scheduler_placements_total", "Requests placed per executor.", ["executor"])
MATCHED_BLOCKS = metrics.counter("weft_scheduler_prefix_blocks_matched_total", "Prompt blocks found on the chosen executor.")
PROMPT_BLOCKS = metrics.counter("weft_scheduler_prompt_blocks_total", "Full prompt blocks of placed requests.")

Rank = Callable[[str, str, list[int], Rung], list[Placement]]  # (model, tenant, prompt, rung) -> best first


class Relay:
    def __init__(self, membership: Membership, port: ExecutorPort, inflight: InflightTracker, rank: Rank,
                 placement_attempts: int = 2, migration: MigrationPolicy | None = None,
                 suspects: SuspectRegistry | None = None) -> None:
        self.membership = membership
        self.port = port
        self.inflight = inflight
        self.rank = rank
        self.placement_attempts = placement_attempts
        self.migration = migration or MigrationPolicy()
        self.suspects = suspects or SuspectRegistry()  # ids that rode too many engine deaths (suspects.py)

    async def stream(self, job: Job, prompt: list[int], ranked: list[Placement], queue_ms: int, trace: Trace,
                     rung: Rung, exec_fields: dict) -> AsyncIterator[Chunk]:
        """The job's stream over migrating attempts; stamps the served rung and the
        decisions on the first chunk, the pause on the last and, after a migration, usage
        counted across attempts."""
        progress = StreamProgress(tuple(prompt), job.max_tokens, job.min_tokens, job.seed)
        cached: list[int] = []
        decisions = self._decided(job, prompt, ranked, queue_ms, rung, trace)

        def open_attempt(attempt: Attempt) -> AsyncIterator[Piece]:
            placements = ranked
            if attempt.index:
                for pool in (rung, Rung.NONE):  # a degraded request whose pool is gone ends at full quality
                    placements = [p for p in self.rank(job.model_id, job.tenant, list(attempt.prompt_token_ids), pool)
                                  if p.name not in attempt.exclude]
                    if placements:
                        break
                if not placements:
                    raise NoReplacement(f"every placeable executor failed: {sorted(attempt.exclude)}")
            call = ExecutorCall(
                request_id=job.request_id, prompt_token_ids=attempt.prompt_token_ids, tenant=job.tenant,
                priority=job.priority, session_id=executor_session_id(job.tenant, job.session_id),
                max_tokens=attempt.max_tokens, min_tokens=attempt.min_tokens, seed=attempt.seed,
                wire=job.wire, resumed_output_tokens=len(attempt.prompt_token_ids) - len(prompt), **exec_fields)
            return pieces(call, placements, 0 if attempt.index else queue_ms)

        async def pieces(call: ExecutorCall, placements: list[Placement], attempt_queue_ms: int):
            executor = placements[0].name
            yield placement_marker(executor)  # a stall before the first token is pinned on it
            chunks = self._attempt(job, call, placements, attempt_queue_ms, trace)
            try:
                async for chunk in chunks:
                    executor = chunk.executor or executor
                    yield Piece(chunk.token_ids, chunk.executor, chunk.finished, chunk)
            except (ExecutorLostError, ExecutorCallError) as exc:
                raise ExecutorFailed(executor, str(exc), _engine_failed(exc)) from exc
            finally:
                await chunks.aclose()  # reads the executor's spans now, before this trace finishes

        def only_live(executor: str, exclude: frozenset[str]) -> bool:
            names = {p.name for pool in {rung, Rung.NONE} for p in self.rank(job.model_id, job.tenant, prompt, pool)}
            return executor in names and not (names - exclude - {executor})

        first = True
        num_migrations_seen, last_piece_ns = 0, time.time_ns()
        try:
            async for piece in migrating_stream(progress, self.migration, open_attempt, only_live):
                chunk = piece.payload
                if progress.num_migrations != num_migrations_seen:
                    # What the move cost this request: the gap since the last piece before it.
                    catalogue.count_migration("executor_failed", progress.num_migrations - num_migrations_seen)
                    trace.span("scheduler.migration", last_piece_ns, time.time_ns(),
                               num_migrations=progress.num_migrations, executor=piece.executor)
                    num_migrations_seen = progress.num_migrations
                last_piece_ns = time.time_ns()
                if first:
                    cached.append(chunk.num_cached_tokens)
                    chunk.rung = rung
                    _first_token(decisions, trace)
                    chunk.decisions = replace(decisions) if chunk.finished else replace(
                        decisions, pause=None, pause_reason="", pin_ttl_ms=0)
                    first = False
                elif chunk.finished:
                    chunk.decisions = Decisions(pause=decisions.pause, pause_reason=decisions.pause_reason,
                                                pin_ttl_ms=decisions.pin_ttl_ms)
                if chunk.finished and decisions.pause not in (None, PauseDecision.NONE):
                    trace.decision("pause", decision=decisions.pause.value, reason=decisions.pause_reason,
                                   pin_ttl_ms=decisions.pin_ttl_ms)
                if progress.num_migrations:
                    if hasattr(chunk.payload, "ClearField"):  # the prompt's logprobs went out with the first attempt
                        chunk.payload.ClearField("prompt_logprobs")
                        chunk.payload.ClearField("prompt_top_logprobs")
                    chunk.num_prompt_tokens = len(prompt)
                    chunk.num_cached_tokens = cached[0]
                    chunk.num_output_tokens = len(progress.output_token_ids)
                    if chunk.finished:
                        chunk.num_migrations = progress.num_migrations
                yield chunk
        except MigrationExhausted as exc:
            raise ExecutorLostError(str(exc)) from exc
        except SuspectedPoison as exc:
            self.suspects.add(job.request_id, str(exc))
            log.error("request_suspected_poison", request_id=job.request_id, reason=str(exc))
            raise SuspectedPoisonError(str(exc)) from exc

    def _decided(self, job: Job, prompt: list[int], ranked: list[Placement], queue_ms: int, rung: Rung,
                 trace: Trace) -> Decisions:
        """Complete ``job.decisions`` with what is known at placement, and record each
        decision once: a timeline event and its metric. Modifies ``job.decisions``."""
        d = job.decisions
        d.queue_ms, d.rung, d.priority = queue_ms, rung, job.priority
        if d.request_class is None:  # no agent plane: the caller's class
            d.request_class = job.request_class
        if not d.expected_cached_tokens and ranked:
            rec = self.membership.get(ranked[0].name)
            d.expected_cached_tokens = min(len(prompt), ranked[0].num_matched_blocks * (rec.block_size if rec else 16))
        label = d.request_class.value if d.request_class is not None else ""
        catalogue.observe_priority(label, d.priority)
        trace.decision("admission", request_class=label or "unspecified", priority=round(d.priority, 4),
                       queue_ms=queue_ms)
        if d.fallback is not None and d.fallback.path is not Fallback.NONE:
            catalogue.count_fallback(d.fallback.path.value)
            trace.decision("fallback", path=d.fallback.path.value, reason=d.fallback.reason,
                           ttft_estimate_ms=round(d.fallback.ttft_estimate_ms, 1))
        trace.decision("rung", rung=rung.label)
        if d.intent_checked:
            outcome = "shifted" if d.intent_shift else "unavailable" if d.intent_signal == "none" else "kept"
            catalogue.count_intent_shift(outcome)
            trace.decision("intent_shift", decision=outcome, distance=round(d.intent_distance, 4),
                           signal=d.intent_signal)
        return d

    async def _attempt(self, job: Job, call: ExecutorCall, ranked: list[Placement], queue_ms: int,
                       trace: Trace) -> AsyncIterator[Chunk]:
        """One attempt: the ranked executors in turn while one is unreachable before its
        first token; a stream broken after it raises ExecutorLostError."""
        attempts = ranked[: self.placement_attempts]
        prompt_len = len(call.prompt_token_ids)
        for i, placement in enumerate(attempts):
            rec = self.membership.get(placement.name)
            block_size = rec.block_size if rec else 16
            call_ns = time.time_ns()
            stream = self.port.generate(placement.address, call, _timeout_s(job), trace.context().traceparent())
            # Blocks the executor already holds (a fork's shared prefix) are used by reference, not anew.
            shared = placement.num_matched_blocks
            self.inflight.start(placement.name, job.request_id, num_blocks_spanned(prompt_len, block_size) - shared)
            sent_any = handed_on = counted = False
            trailer_spans = None  # the executor's spans, read after its last chunk went on
            try:
                async for chunk in stream:
                    self.inflight.update(placement.name, job.request_id,
                                         num_blocks_spanned(prompt_len + chunk.num_output_tokens, block_size) - shared)
                    if chunk.finished and chunk.trailer_spans is not None:
                        trace.span("scheduler.executor_call", call_ns, time.time_ns(), executor=placement.name,
                                   attempt=i, num_matched_blocks=placement.num_matched_blocks)
                        trailer_spans = chunk.trailer_spans
                    chunk.executor = chunk.executor or placement.name
                    chunk.queue_ms = queue_ms if not sent_any else 0
                    handed_on = True
                    yield chunk
                    sent_any = True
                    if not counted:  # after the first chunk went on: its log line and metrics are not on its path
                        counted = _count_placement(placement, prompt_len, block_size, queue_ms)
                return
            except ExecutorCallError as exc:
                if not sent_any and exc.unavailable and i + 1 < len(attempts):
                    log.warning("executor_unreachable", executor=placement.name, details=exc.details)
                    continue
                if sent_any and exc.unavailable:
                    raise ExecutorLostError(f"executor {placement.name} failed mid-stream: {exc.details}") from exc
                raise
            finally:
                try:
                    if trailer_spans is not None:
                        # The executor's spans are in the trailers right after its last message:
                        # read once that message went on (a one-chunk reply's first token does not
                        # wait for them), when the consumer closes us or asks for more.
                        trace.add_downstream(await trailer_spans())
                finally:
                    stream.cancel()  # no-op when the call finished; aborts the executor's request otherwise
                    self.inflight.finish(placement.name, job.request_id)
                    if handed_on and not counted:  # the consumer stopped at the first chunk
                        _count_placement(placement, prompt_len, block_size, queue_ms)


def _count_placement(placement: Placement, prompt_len: int, block_size: int, queue_ms: int) -> bool:
    """Count a request its executor answered (metrics and the ``request_placed`` line),
    once, after its first chunk was handed on. Returns True (counted)."""
    PLACED.labels(placement.name).inc()
    PROMPT_BLOCKS.inc(num_full_blocks(prompt_len, block_size))
    MATCHED_BLOCKS.inc(placement.num_matched_blocks)
    log.info("request_placed", executor=placement.name, num_matched_blocks=placement.num_matched_blocks,
             queue_ms=queue_ms)
    return True


def _first_token(d: Decisions, trace: Trace) -> None:
    """The first token chunk: the TTFT the scheduler observed (its arrival to now),
    checked against the contract's ceiling. Modifies ``d``."""
    d.ttft_achieved_ms = (time.time_ns() - trace.start_ns) / 1e6
    attrs = dict(estimate_ms=d.ttft_estimate_ms, achieved_ms=round(d.ttft_achieved_ms, 1),
                 expected_cached_tokens=d.expected_cached_tokens)
    if d.ttft_met is not None:
        label = d.request_class.value if d.request_class is not None else ""
        catalogue.observe_ttft_ceiling(label, d.ttft_met, d.ttft_achieved_ms / d.ttft_ceiling_ms)
        attrs.update(ceiling_ms=d.ttft_ceiling_ms, outcome="met" if d.ttft_met else "missed")
    trace.decision("ttft", **attrs)


def _timeout_s(job: Job) -> float | None:
    """Seconds left of the job: the tighter of the caller's deadline and its own."""
    timeouts = []
    remaining = job.time_remaining_s()
    if remaining is not None:
        timeouts.append(remaining)
    if job.deadline_unix_ms:
        timeouts.append(job.deadline_unix_ms / 1000.0 - time.time())
    if not timeouts:
        return None
    timeout = min(timeouts)
    if timeout <= 0:
        raise DeadlineError("deadline passed before the request was placed")
    return timeout


def _engine_failed(error: BaseException | None) -> bool:
    """Whether the executor call behind ``error`` (through ``raise ... from`` chains) ended
    with its engine's death (the port tells: ExecutorCallError.engine_failed)."""
    while error is not None and not isinstance(error, ExecutorCallError):
        error = error.__cause__
    return error is not None and error.engine_failed
