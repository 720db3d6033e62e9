"""The public gRPC ``weft.v1.Router`` servicer: the only router module that converts
between ``router_pb2`` messages and domain types (``scheduler_client.py`` is its
outbound twin). Sampling fields are validated by the same code as the HTTP API, so both
reject the same inputs naming the same fields.

Authentication: ``authorization: Bearer <key>`` (or ``x-api-key``) call metadata.
Cancellation: a client that cancels its call cancels this generator, which closes the
scheduler stream and frees the request's KV downstream.
"""
from __future__ import annotations

from dataclasses import replace

import grpc
import structlog

from services.mesh.grpc_server import ErrorRule
from services.mesh.logging import request_context
from services.router import metrics as m
from services.router.auth import KeyStore, bearer_token
from services.router.errors import (AuthenticationError, InvalidRequestError, OverloadedError, UpstreamError,
                                    UpstreamUnavailable)
from services.router.generation import Generator, new_request_id
from services.router.schema import ContractSpec, Delta, Sampling, Session
from services.router.validation import parse_sampling, parse_stop
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger(__name__)

ROUTER_ERROR_RULES = (
    ErrorRule(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    ErrorRule(OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorRule(UpstreamUnavailable, grpc.StatusCode.UNAVAILABLE),
    ErrorRule(UpstreamError, grpc.StatusCode.UNAVAILABLE),
)
_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
           "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT,
           "error": common_pb2.FINISH_REASON_ERROR}
_CLASSES = {common_pb2.REQUEST_CLASS_UNSPECIFIED: "", common_pb2.REQUEST_CLASS_INTERACTIVE: "interactive",
            common_pb2.REQUEST_CLASS_DETERMINISTIC: "deterministic", common_pb2.REQUEST_CLASS_BATCH: "batch",
            common_pb2.REQUEST_CLASS_AGENTIC: "agentic"}


def _api_key(context: grpc.aio.ServicerContext) -> str | None:
    metadata = dict(context.invocation_metadata() or ())
    return bearer_token(metadata.get("authorization")) or metadata.get("x-api-key")


def sampling_from_proto(s: common_pb2.SamplingParams, return_logprobs: bool, limits) -> Sampling:
    """Proto defaults read as OpenAI's: max_tokens 0 = room left, top_p 0 = 1."""
    body = {
        "max_tokens": s.max_tokens or None, "temperature": s.temperature, "top_p": s.top_p or 1.0,
        "top_k": s.top_k, "seed": s.seed if s.HasField("seed") else None,
        "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos, "min_tokens": s.min_tokens,
    }
    sampling = parse_sampling(body, limits, body["max_tokens"], "sampling.max_tokens", default_max_tokens=None)
    return replace(sampling, logprobs=s.logprobs or return_logprobs)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, generator: Generator, keys: KeyStore, model_name: str, list_executors=None) -> None:
        self.generator = generator
        self.keys = keys
        self.model_name = model_name
        self.list_executors = list_executors

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        tenant = self.keys.authenticate(_api_key(context))
        rid = request.request_id or new_request_id("grpc")
        if request.model and request.model not in self.generator.limits.served_models:
            raise InvalidRequestError("model", f"model {request.model!r} does not exist; served: {self.model_name!r}")
        with request_context(rid, tenant=tenant):
            sampling = sampling_from_proto(request.sampling, request.return_logprobs, self.generator.limits)
            sampling = replace(sampling, semantic_cache=request.semantic_cache)
            stop = parse_stop(list(request.stop) or None, self.generator.limits)
            session = _session(request.session)
            form = request.WhichOneof("prompt")
            if form == "text":
                ids = await self.generator.text_prompt_ids_async(request.text)
            elif form == "token_ids":
                ids = list(request.token_ids.ids)
            elif form == "chat":
                if not request.chat.messages:
                    raise InvalidRequestError("chat.messages", "must not be empty")
                messages = [_message(msg) for msg in request.chat.messages]
                ids = self.generator.chat_prompt_ids(messages, None, request.chat.add_generation_prompt)
            else:
                raise InvalidRequestError("prompt", "one of text, chat or token_ids is required")
            field = "chat.messages" if form == "chat" else form
            token_req = self.generator.token_request(ids, sampling, tenant, session, field, rid)
            m.IN_FLIGHT.labels("grpc").inc()
            deltas = self.generator.stream(token_req, stop)
            code = "OK"
            try:
                async for delta in deltas:
                    yield _response(rid, delta, sampling.logprobs)
            except BaseException as exc:
                code = type(exc).__name__
                raise
            finally:
                m.IN_FLIGHT.labels("grpc").dec()
                m.REQUESTS.labels("grpc", "Generate", code).inc()
                await deltas.aclose()

    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        self.keys.authenticate(_api_key(context))
        num_executors = 0
        if self.list_executors is not None:
            try:
                num_executors = len(await self.list_executors())
            except (grpc.aio.AioRpcError, UpstreamUnavailable):
                num_executors = 0
        model = router_pb2.ModelInfo(id=self.model_name, max_model_len=self.generator.limits.max_model_len,
                                     num_executors=num_executors)
        return router_pb2.ListModelsResponse(models=[model])


def _message(msg: router_pb2.ChatMessage) -> dict:
    if msg.role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidRequestError("chat.messages.role", f"unknown role {msg.role!r}")
    out = {"role": "system" if msg.role == "developer" else msg.role, "content": msg.content}
    if msg.name:
        out["name"] = msg.name
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _session(s: common_pb2.SessionInfo):
    c = s.contract
    contract = ContractSpec(kv_quota_blocks=c.kv_quota_blocks, ttft_ceiling_ms=c.ttft_ceiling_ms,
                            tpot_ceiling_ms=c.tpot_ceiling_ms, fallback=_FALLBACK_NAMES.get(c.fallback, ""),
                            accepted_degrade_steps=_degrade_step_names(c.accepted_degrade_steps))
    return Session(session_id=s.session_id, program_id=s.program_id, hop_index=s.hop_index,
                   expected_tool_ms=s.expected_tool_ms, request_class=_CLASSES.get(s.request_class, ""),
                   stateful=s.stateful, contract=contract)


def _degrade_step_names(steps) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for step in steps:
        if step == common_pb2.DEGRADE_STEP_UNSPECIFIED or step not in common_pb2.DegradeStep.values():
            raise InvalidRequestError("session.contract.accepted_degrade_steps", f"unknown degradation step {step}")
        names[common_pb2.DegradeStep.Name(step).removeprefix("DEGRADE_STEP_").lower()] = None
    return tuple(names)


_FALLBACK_NAMES = {common_pb2.FALLBACK_PATH_DEGRADE: "degrade", common_pb2.FALLBACK_PATH_REROUTE: "reroute",
                   common_pb2.FALLBACK_PATH_FAIL_FAST: "fail_fast"}


def _response(rid: str, delta: Delta, logprobs: bool) -> router_pb2.GenerateResponse:
    usage = common_pb2.Usage(num_prompt_tokens=delta.usage.prompt_tokens, num_cached_tokens=delta.usage.cached_tokens,
                             num_output_tokens=delta.usage.completion_tokens)
    return router_pb2.GenerateResponse(
        request_id=rid, text_delta=delta.text, token_ids_delta=list(delta.token_ids),
        logprobs_delta=list(delta.logprobs) if logprobs else [], finish_reason=_FINISH.get(delta.finish_reason, 0),
        usage=usage, executor=delta.executor,
        degradation_rung=common_pb2.DegradationRung.Value(f"DEGRADATION_RUNG_{delta.degradation_rung.upper()}")
        if delta.degradation_rung else 0,
        num_migrations=delta.num_migrations,
    )
