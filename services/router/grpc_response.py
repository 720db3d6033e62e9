"""Router.Generate's response side: one domain ``Delta`` of completion ``index`` as a
``GenerateResponse`` chunk (text without tool-call markup and the calls it completed,
logprobs as asked, usage, rung, migrations and the scheduler's ``decisions``). The
request side is ``grpc_request.py``; ``scheduler_client.py`` is the outbound twin."""
from __future__ import annotations

import grpc

from services.mesh.grpc_server import ErrorMappingInterceptor, ErrorRule, bounded_details
from services.router.errors import (AuthenticationError, InvalidRequestError, OverloadedError, SessionBusyError,
                                    SessionExistsError, SessionNotFoundError, UpstreamError, UpstreamUnavailable)
from services.router.grpc_tools import ToolCallRelay, to_proto
from services.router.schema import Delta, Sampling
from weft.v1 import common_pb2, router_pb2

ROUTER_ERROR_RULES = (
    ErrorRule(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    ErrorRule(OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorRule(SessionBusyError, grpc.StatusCode.ABORTED),
    ErrorRule(SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    ErrorRule(SessionExistsError, grpc.StatusCode.ALREADY_EXISTS),
    ErrorRule(UpstreamUnavailable, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(UpstreamError, grpc.StatusCode.UNAVAILABLE),
)
_STATUS = ErrorMappingInterceptor(ROUTER_ERROR_RULES)  # its status_for: the mapping, nothing served

FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
          "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT,
          "error": common_pb2.FINISH_REASON_ERROR, "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
          "kv_quota": common_pb2.FINISH_REASON_KV_QUOTA}


def response_chunk(rid: str, index: int, delta: Delta, sampling: Sampling, relay: ToolCallRelay | None,
              echo: str) -> router_pb2.GenerateResponse:
    """One chunk of completion ``index``: with tools, the text without call markup and the
    calls completed by this delta; logprobs as asked; ``echo`` before the first text."""
    text, calls = delta.text, []
    if relay is not None:
        text, calls = relay.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = relay.flush()
            text, calls = text + rest, calls + more
    usage = common_pb2.Usage(num_prompt_tokens=delta.usage.prompt_tokens, num_cached_tokens=delta.usage.cached_tokens,
                             num_output_tokens=delta.usage.completion_tokens)
    reason = delta.finish_reason
    if reason not in (None, "length", "kv_quota", "error") and relay is not None and relay.num_calls:
        reason = "tool_calls"  # as HTTP's finish_reason; a cut or failed reply keeps its reason
    finish = FINISH.get(reason, 0)
    return router_pb2.GenerateResponse(
        request_id=rid, index=index, text_delta=echo + text, token_ids_delta=list(delta.token_ids),
        logprobs_delta=list(delta.logprobs) if sampling.logprobs else [],
        top_logprobs_delta=_alternatives(delta.top_logprobs) if sampling.top_logprobs else [],
        prompt_logprobs=list(delta.prompt_logprobs) if sampling.prompt_logprobs is not None else [],
        prompt_top_logprobs=_alternatives(delta.prompt_top_logprobs) if sampling.prompt_logprobs else [],
        tool_calls=to_proto(calls), finish_reason=finish,
        usage=usage, executor=delta.executor,
        degradation_rung=common_pb2.DegradationRung.Value(f"DEGRADATION_RUNG_{delta.degradation_rung.upper()}")
        if delta.degradation_rung else 0,
        num_migrations=delta.num_migrations, decisions=_decisions(delta), error=choice_error(delta.error),
    )


def choice_error(exc: Exception | None) -> router_pb2.ChoiceError | None:
    """A completion that failed on its own (a session hop's branch): the status the call
    would have ended with (``ROUTER_ERROR_RULES``), by name, and its details."""
    if exc is None:
        return None
    code, details, retry_after_ms = _STATUS.status_for(exc)
    return router_pb2.ChoiceError(code=code.name, message=bounded_details(details), retry_after_ms=retry_after_ms or 0)


def _decisions(delta: Delta) -> common_pb2.SchedulingDecisions | None:
    """The scheduler's decisions as they came (first chunk: all but the pause; last: the pause)."""
    n = delta.notes
    value = lambda enum, prefix, label: enum.Value(prefix + label.upper()) if label else 0  # noqa: E731
    return None if n is None else common_pb2.SchedulingDecisions(
        request_class=value(common_pb2.RequestClass, "REQUEST_CLASS_", n.request_class), priority=n.priority or 0.0,
        queue_ms=n.queue_ms or 0, fallback_taken=value(common_pb2.FallbackPath, "FALLBACK_PATH_", n.fallback),
        fallback_reason=n.fallback_reason, intent_shift=n.intent_shift, intent_distance=n.intent_distance,
        degradation_rung=value(common_pb2.DegradationRung, "DEGRADATION_RUNG_", n.degradation_rung),
        ttft_estimate_ms=n.ttft_estimate_ms, ttft_ceiling_ms=n.ttft_ceiling_ms,
        ttft_achieved_ms=n.ttft_achieved_ms or 0, expected_cached_tokens=n.expected_cached_tokens,
        pause_decision=value(common_pb2.PauseDecision, "PAUSE_DECISION_", n.pause_decision))


def _alternatives(positions) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(token_ids=[t for t, _ in alts], logprobs=[lp for _, lp in alts])
            for alts in positions]
