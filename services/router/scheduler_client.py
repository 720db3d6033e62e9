"""The router's client of ``weft.v1.Scheduler``: the outbound wire boundary.

Like ``server.py`` on the inbound side, this is the only other router module that
touches generated protobuf types; it converts ``TokenRequest`` / ``TokenChunk``
dataclasses and maps gRPC status codes to the router's domain errors. A call that
fails UNAVAILABLE or RESOURCE_EXHAUSTED before its first chunk is retried (tenacity: bounded, jittered): nothing was
generated yet, so a retry is invisible to the client. A call that broke in transport
(no ``weft-error`` origin: the scheduler died or restarted) raises a ``lost`` error, which
``continuation.py`` continues when chunks were already relayed.
"""
from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from tenacity import retry_if_exception
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.grpc_server import channel_options, error_origin_of
from services.mesh.mesh_auth import mesh_channel
from services.mesh.retry import is_retryable, rpc_retrying
from services.mesh.timeline import CURRENT_TRACE, TRACEPARENT_KEY, downstream_spans
from services.router.errors import (InvalidRequestError, OverloadedError, SessionBusyError, SessionExistsError,
                                    SessionNotFoundError, UpstreamError, UpstreamUnavailable)
from services.router.schema import ServingNotes, TokenChunk, TokenRequest
from services.shared.vocabulary import RequestClass
from weft.v1 import common_pb2, events_pb2, router_pb2, scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    # A restarted scheduler is reached within ~1 s, not after gRPC's default backoff (up to
    # 120 s): streams continued across its restart wait on this reconnect.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_KV_QUOTA: "kv_quota",  # final: the contract's KV quota, not max_tokens
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
# Request-class labels (services/shared/vocabulary.py) as their wire enum; "": unspecified.
_CLASSES = {"": common_pb2.REQUEST_CLASS_UNSPECIFIED,
            **{c.value: common_pb2.RequestClass.Value(f"REQUEST_CLASS_{c.name}") for c in RequestClass}}
_FALLBACKS = {
    "": common_pb2.FALLBACK_PATH_UNSPECIFIED,
    "degrade": common_pb2.FALLBACK_PATH_DEGRADE,
    "reroute": common_pb2.FALLBACK_PATH_REROUTE,
    "fail_fast": common_pb2.FALLBACK_PATH_FAIL_FAST,
}
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)
MAX_ATTEMPTS = 3
# A scheduler that is not there at all (connections refused: it died and its supervisor
# restarts it within ~1-2 s) is waited for this long before the first token, beyond
# MAX_ATTEMPTS; a scheduler that answers (overload, draining, no executor) is not.
SCHEDULER_OUTAGE_S = 5.0
# How gRPC core words an UNAVAILABLE whose call never reached a server (pick-first).
CONNECT_FAILED = "failed to connect"

_now = time.monotonic  # the outage window's clock (a test replaces it)

LOST_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN})


def to_proto(req: TokenRequest) -> scheduler_pb2.ScheduleRequest:
    s = req.sampling
    sampling = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
        min_tokens=s.min_tokens, top_logprobs=s.top_logprobs, logit_bias=dict(s.logit_bias), min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        resumed_output_tokens=s.resumed_output_tokens,
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    if s.repetition_penalty != 1.0:
        sampling.repetition_penalty = s.repetition_penalty
    if s.grammar is not None:
        kind, text = s.grammar
        if kind == "json_object":
            sampling.grammar.json_object = True
        else:
            setattr(sampling.grammar, kind, text)
    ses = req.session
    session = common_pb2.SessionInfo(
        session_id=ses.session_id, program_id=ses.program_id, hop_index=ses.hop_index,
        expected_tool_ms=ses.expected_tool_ms, request_class=_CLASSES[ses.request_class],
        stateful=ses.stateful, contract=common_pb2.Contract(
            kv_quota_blocks=ses.contract.kv_quota_blocks, ttft_ceiling_ms=ses.contract.ttft_ceiling_ms,
            tpot_ceiling_ms=ses.contract.tpot_ceiling_ms, fallback=_FALLBACKS[ses.contract.fallback],
            accepted_degrade_steps=[common_pb2.DegradeStep.Value(f"DEGRADE_STEP_{x.upper()}")
                                    for x in ses.contract.accepted_degrade_steps]),
    )
    return scheduler_pb2.ScheduleRequest(
        request_id=req.request_id, model_id=req.model, prompt_token_ids=list(req.prompt_token_ids),
        tenant=req.tenant, sampling=sampling, session=session, deadline_unix_ms=req.deadline_unix_ms,
        fork_id=req.fork_id,
    )


def _alternatives(rows) -> tuple[tuple[tuple[int, float], ...], ...]:
    return tuple(tuple(zip(row.token_ids, row.logprobs)) for row in rows)


def from_proto(resp: scheduler_pb2.ScheduleResponse) -> TokenChunk:
    return TokenChunk(
        token_ids=tuple(resp.token_ids_delta),
        logprobs=tuple(resp.logprobs_delta),
        top_logprobs=_alternatives(resp.top_logprobs_delta),
        prompt_logprobs=tuple(resp.prompt_logprobs),
        prompt_top_logprobs=_alternatives(resp.prompt_top_logprobs),
        finish_reason=_FINISH.get(resp.finish_reason),
        num_prompt_tokens=resp.usage.num_prompt_tokens,
        num_cached_tokens=resp.usage.num_cached_tokens,
        num_output_tokens=resp.usage.num_output_tokens,
        executor=resp.executor,
        degradation_rung=common_pb2.DegradationRung.Name(resp.degradation_rung).removeprefix("DEGRADATION_RUNG_").lower()
        if resp.degradation_rung else "",
        num_migrations=resp.num_migrations,
        notes=_notes(resp),
    )


def _notes(resp: scheduler_pb2.ScheduleResponse) -> ServingNotes | None:
    """The chunk's decisions: ``decisions`` when the scheduler sent them, else its flat
    fields (an older scheduler); None when it reports none."""
    d = resp.decisions if resp.HasField("decisions") else None
    if d is None and not (resp.request_class or resp.fallback_taken or resp.pause_decision or resp.degradation_rung):
        return None
    name = lambda enum, value, prefix: enum.Name(value).removeprefix(prefix).lower() if value else ""  # noqa: E731
    flat = ServingNotes(
        request_class=name(common_pb2.RequestClass, resp.request_class, "REQUEST_CLASS_"),
        fallback=name(common_pb2.FallbackPath, resp.fallback_taken, "FALLBACK_PATH_"),
        fallback_reason=resp.fallback_reason,
        pause_decision=name(common_pb2.PauseDecision, resp.pause_decision, "PAUSE_DECISION_"),
        degradation_rung=name(common_pb2.DegradationRung, resp.degradation_rung, "DEGRADATION_RUNG_"),
    )
    if d is None:
        return flat
    first = bool(d.request_class or d.degradation_rung)  # the first chunk's: the pause-only last one has neither
    return flat.merged(ServingNotes(
        request_class=name(common_pb2.RequestClass, d.request_class, "REQUEST_CLASS_"),
        fallback=name(common_pb2.FallbackPath, d.fallback_taken, "FALLBACK_PATH_"),
        fallback_reason=d.fallback_reason,
        pause_decision=name(common_pb2.PauseDecision, d.pause_decision, "PAUSE_DECISION_"),
        degradation_rung=name(common_pb2.DegradationRung, d.degradation_rung, "DEGRADATION_RUNG_"),
        priority=d.priority if first else None, queue_ms=d.queue_ms if first else None,
        intent_shift=d.intent_shift, intent_distance=d.intent_distance, ttft_estimate_ms=d.ttft_estimate_ms,
        ttft_ceiling_ms=d.ttft_ceiling_ms, ttft_achieved_ms=d.ttft_achieved_ms if first else None,
        expected_cached_tokens=d.expected_cached_tokens,
    ))


@dataclass(frozen=True)
class EndedSession:
    """What Scheduler.EndSession did."""

    session_id: str
    ended_now: bool  # False: already ended (the call is idempotent)
    num_executors_released: int
    num_running_hops: int


@dataclass(frozen=True)
class ForkedSession:
    """What Scheduler.ForkSession did."""

    session_id: str
    child_session_ids: tuple[str, ...]
    num_context_tokens: int  # every child starts from this context
    new_sessions: bool = False  # ``or_new`` created them as new sessions (no context to fork)


@dataclass(frozen=True)
class JoinedSession:
    """What Scheduler.JoinSession did."""

    session_id: str
    num_context_tokens: int  # the parent continues from this context
    ended_session_ids: tuple[str, ...]



def domain_error(err: grpc.aio.AioRpcError) -> Exception:
    """The router error for a failed scheduler call."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.ABORTED and error_origin_of(err) in ("SessionBusyError", "session_busy"):
        return SessionBusyError(details)  # the scheduler's ERROR_RULES ("session_busy": before issue 17's fork)
    if code == grpc.StatusCode.NOT_FOUND:
        return SessionNotFoundError(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        m = _FIELD_PREFIX.match(details)
        return InvalidRequestError(m.group(1), m.group(2)) if m else InvalidRequestError("prompt", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_ms = 1000
        for key, value in err.trailing_metadata() or ():
            if key in ("retry-after-ms", "weft-retry-after-ms"):
                retry_ms = int(value) if str(value).isdigit() else retry_ms
        return OverloadedError(details or "overloaded", retry_ms)
    # Lost: no Weft server chose this status (the scheduler died, reset, shut down mid-call),
    # or it is a bug's INTERNAL / UNKNOWN; the request's own deadline is never "lost".
    lost = code in LOST_CODES and (error_origin_of(err) is None or code in (grpc.StatusCode.INTERNAL,
                                                                            grpc.StatusCode.UNKNOWN))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UpstreamUnavailable(f"scheduler: {code.name}: {details}", lost=lost)
    return UpstreamError(f"scheduler: {code.name}: {details}", lost=lost)


def retry_opening(exc: BaseException) -> bool:
    """Retry a call that failed before its first message: UNAVAILABLE / RESOURCE_EXHAUSTED,
    and a CANCELLED that no Weft server chose (the transport reset the stream; our own
    cancel raises asyncio's CancelledError, never this). Under 2,500 concurrent requests
    about 5 % failed so, before any token, and reached clients as 503."""
    if is_retryable(exc):
        return True
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
            and error_origin_of(exc) is None)


class SchedulerClient:
    """One channel to the scheduler, shared by every request of this router."""

    def __init__(self, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self._channel = mesh_channel(address, options=[*channel_options(max_message_bytes), *CHANNEL_OPTIONS])
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]:
        """Stream the request's chunks. Closing this generator cancels the call."""
        message = to_proto(request)
        trace = CURRENT_TRACE.get()
        metadata = ((TRACEPARENT_KEY, trace.context().traceparent()),) if trace is not None else None
        try:
            call, resp = await self._open(message, timeout_s, metadata, request.request_id)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err) from None
        finished = False
        try:
            while resp is not grpc.aio.EOF:
                finished = finished or bool(resp.finish_reason)
                yield from_proto(resp)
                resp = await call.read()
        except grpc.aio.AioRpcError as err:
            raise domain_error(err) from None
        finally:
            try:
                if finished and trace is not None:
                    # The scheduler's and executor's spans come in the trailers right after the
                    # last message: read once that message went on (a one-chunk reply's first
                    # token does not wait for them), before the call is cancelled.
                    trace.add_downstream(await downstream_spans(call))
            finally:
                call.cancel()

    async def _open(self, message, timeout_s: float, metadata, request_id: str):
        """Start the call and read its first message: (call, first message or EOF).
        Retried with tenacity (bounded, jittered, at least the server's retry-after hint,
        capped at 0.5 s) only on UNAVAILABLE / RESOURCE_EXHAUSTED, and only here, before
        anything was generated, so a retry is invisible to the client; also on a CANCELLED no
        Weft server chose (``retry_opening``). A scheduler that cannot be reached at all is
        retried past MAX_ATTEMPTS for up to ``SCHEDULER_OUTAGE_S`` (a supervised restart)."""
        # The first attempt runs outside tenacity: setting up its retry loop costs ~0.14 ms
        # per request on the first-token path (2 CPUs), and almost every call succeeds. A
        # failure worth retrying replays through the policy as its attempt 1 (so its
        # waits, retry hint and attempt bound are unchanged). The outage window counts from
        # before the first attempt, as it did when tenacity ran it (its own clock starts
        # only at the replay: a first attempt that hung would extend the window).
        started_s = _now()
        try:
            return await self._open_once(message, timeout_s, metadata)
        except Exception as exc:
            if not retry_opening(exc):
                raise
            first_error = exc
        outage_s = min(SCHEDULER_OUTAGE_S, timeout_s / 2)

        def stop(state) -> bool:
            if state.attempt_number < MAX_ATTEMPTS:
                return False
            return not (self._not_connected(state.outcome.exception()) and _now() - started_s < outage_s)

        policy = rpc_retrying(max_attempts=MAX_ATTEMPTS, initial_s=0.05, max_wait_s=0.5)
        async for attempt in policy.copy(retry=retry_if_exception(retry_opening), stop=stop):
            with attempt:
                if attempt.retry_state.attempt_number == 1:
                    raise first_error
                log.warning("scheduler_retry", request_id=request_id, attempt=attempt.retry_state.attempt_number)
                return await self._open_once(message, timeout_s, metadata)
        raise AssertionError("unreachable: rpc_retrying reraises")  # pragma: no cover

    async def _open_once(self, message, timeout_s: float, metadata):
        call = self._stub.Generate(message, timeout=timeout_s, metadata=metadata)
        try:
            return call, await call.read()
        except BaseException:
            call.cancel()
            raise

    async def probe(self, timeout_s: float) -> bool:
        """Does the scheduler answer at all (health: SERVING or NOT_SERVING, i.e. draining)?
        False when it is down or stopped (no answer within ``timeout_s``)."""
        try:
            await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return True
        except grpc.aio.AioRpcError as err:
            return err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    async def end_session(self, tenant: str, session_id: str, timeout_s: float = 5.0,
                          fork_id: str = "") -> EndedSession:
        """End ``tenant``'s session (Scheduler.EndSession); SessionNotFoundError when the
        tenant has no such session. With ``fork_id``: only if that fork created it."""
        req = scheduler_pb2.SchedulerEndSessionRequest(tenant=tenant, session_id=session_id, fork_id=fork_id)
        try:
            resp = await self._stub.EndSession(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err) from None
        return EndedSession(session_id, resp.ended_now, resp.num_executors_released, resp.num_running_hops)

    async def fork_session(self, tenant: str, session_id: str, child_ids: list[str],
                           or_new: tuple[str, int] | None = None, timeout_s: float = 5.0,
                           fork_id: str = "") -> ForkedSession:
        """Fork ``tenant``'s session into ``child_ids`` (Scheduler.ForkSession):
        SessionNotFoundError, SessionBusyError, SessionExistsError or InvalidRequestError
        naming the scheduler's field. ``or_new`` = (program id, next hop): with no context
        to fork, create the children as new sessions instead of SessionNotFoundError.
        ``fork_id``: recorded on each child (``end_session(..., fork_id=)`` ends only those)."""
        fork = router_pb2.ForkSessionRequest(session_id=session_id, child_session_ids=child_ids)
        req = scheduler_pb2.SchedulerForkSessionRequest(tenant=tenant, fork=fork, fork_id=fork_id)
        if or_new is not None:
            req.or_new, (req.program_id, req.next_hop) = True, or_new
        try:
            resp = await self._stub.ForkSession(req, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                raise SessionExistsError(err.details() or "session exists") from None
            raise domain_error(err) from None
        return ForkedSession(session_id, tuple(resp.fork.child_session_ids), resp.fork.num_context_tokens,
                             resp.new_sessions)

    async def join_session(self, tenant: str, session_id: str, from_id: str, end_children: bool,
                           timeout_s: float = 5.0) -> JoinedSession:
        """Join ``tenant``'s session from child ``from_id`` ("": its own context)."""
        join = router_pb2.JoinSessionRequest(session_id=session_id, from_session_id=from_id, end_children=end_children)
        try:
            resp = await self._stub.JoinSession(scheduler_pb2.SchedulerJoinSessionRequest(tenant=tenant, join=join),
                                                timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err) from None
        return JoinedSession(session_id, resp.join.num_context_tokens, tuple(resp.join.ended_session_ids))

    async def list_executors(self, timeout_s: float = 2.0) -> list[dict]:
        resp = await self._stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=timeout_s)
        return [{"name": e.heartbeat.name, "address": e.heartbeat.address, "model_id": e.heartbeat.model_id,
                 "max_model_len": e.heartbeat.max_model_len, "state": _state_name(e.heartbeat.state)}
                for e in resp.executors]

    def _not_connected(self, exc: BaseException | None) -> bool:
        """``exc`` is the transport failing to reach the scheduler (no server chose it): the
        scheduler is down or restarting, not busy. gRPC core words a failed connect as
        "failed to connect to all addresses"; that is read from the error itself, because
        the channel may already be READY again when this is asked (the scheduler came back
        between the failed attempt and the stop decision: CI saw exactly that race). An
        error worded otherwise counts while the channel is still not connected."""
        if not (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                and error_origin_of(exc) is None):
            return False
        return (CONNECT_FAILED in (exc.details() or "").lower()
                or self._channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY)

    def unreachable(self) -> bool:
        """The channel already knows the scheduler is down (a connect failed; it is backing off)."""
        return self._channel.get_state(try_to_connect=False) in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)

    async def close(self) -> None:
        await self._channel.close()


def _state_name(state: int) -> str:
    """``EXECUTOR_STATE_SERVING`` -> "serving" (readiness counts those)."""
    try:
        return events_pb2.ExecutorState.Name(state).removeprefix("EXECUTOR_STATE_").lower()
    except ValueError:  # a newer scheduler's state this router does not know
        return "unspecified"
