"""The public gRPC ``weft.v1.Router`` servicer: with ``grpc_tools.py`` (tools in, tool
calls out), the only router code that converts between ``router_pb2`` messages and domain
types (``scheduler_client.py`` is its outbound twin). Everything past the conversion is
the HTTP API's code too.

Issue 15's fields (docs/grpc.md "Agent I/O"): ``sampling.grammar`` (any kind),
``top_logprobs``, ``prompt_logprobs``, ``logit_bias``, ``min_p``, the penalties and ``n``
map onto ``Sampling`` with HTTP's validators and defaults, refusals naming
``sampling.<field>``; ``n`` completions stream interleaved, each chunk tagged ``index``;
``echo`` repeats a text prompt; tools enforce and parse as HTTP's chat does.

Validation is shared with the HTTP API, so both doors reject the same inputs naming the
same fields: sampling (``validation.parse_sampling``), session and contract
(``validation.parse_session``: an undefined enum number such as ``request_class=99`` is
INVALID_ARGUMENT), chat messages (``chat_messages.parse_message``: a tool message needs
``tool_call_id``), the prompt's size and tokenization (``prepare.py``, the same async step as
HTTP's: large prompts are rendered and encoded off the event loop), and ``request_id``
(``request_ids.py``: at most 64 characters of ``[A-Za-z0-9._:-]``, scoped by tenant).

Health: ``grpc.health.v1`` on this port is liveness (SERVING until SIGTERM drains the
router); readiness, "an executor serves", is HTTP ``GET /health/ready`` (``readiness.py``).

Authentication: ``authorization: Bearer <key>`` (or ``x-api-key``) call metadata.
Cancellation: a client that cancels its call cancels this generator, which closes the
scheduler stream and frees the request's KV downstream.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import structlog
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from services.mesh.grpc_server import ErrorRule
from services.mesh.logging import request_context
from services.router import metrics as m
from services.router.auth import KeyStore, bearer_token
from services.router.errors import (AuthenticationError, InvalidRequestError, OverloadedError, SessionBusyError,
                                    SessionExistsError, SessionNotFoundError, UpstreamError, UpstreamUnavailable)
from services.router.chat_messages import parse_message
from services.router.delta_streams import merge
from services.router.generation import Generator, fan_out
from services.router.grpc_response import response_chunk
from services.router.grpc_tools import (ToolCallRelay, assistant_tool_calls, tool_choice_from_proto, tools_from_proto,
                                        with_tool_grammar)
from services.router.prepare import ChatPrompt, Prompt, TextPrompt, TokenIdsPrompt
from services.router.request_ids import grpc_request_id
from services.router.schema import Sampling
from services.router.session_branches import branch_requests, end_unfinished_branches
from services.router.session_specs import parse_fork, parse_join
from services.router.structured_output import check_enforceable
from services.router.tool_parsers import ToolCallFormat, select_format
from services.router.validation import (Limits, check_session_choices, deterministic_sampling, parse_sampling,
                                        parse_session, parse_stop)
from weft.v1 import common_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger(__name__)

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


# What server reflection lists on the public port (grpcurl, Postman): the API, its
# liveness check and reflection itself. Schema only: every call still needs a key.
REFLECTED_SERVICES = (router_pb2.DESCRIPTOR.services_by_name["Router"].full_name, health.SERVICE_NAME,
                      reflection.SERVICE_NAME)


def status_label(exc: BaseException) -> str:
    """The gRPC status name a failed call ends with (the label, not a Python class name:
    it was ``CancelledError`` / ``GeneratorExit`` for a client that cancelled)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    for rule in ROUTER_ERROR_RULES:
        if isinstance(exc, rule.error):
            return rule.code.name
    return grpc.StatusCode.INTERNAL.name


def _api_key(context: grpc.aio.ServicerContext) -> str | None:
    metadata = dict(context.invocation_metadata() or ())
    return bearer_token(metadata.get("authorization")) or metadata.get("x-api-key")


# HTTP's /v1/completions default (validation.parse_completion_request): a text or token-ids prompt
# is that door's request, so an unset max_tokens is 16 there and here.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


MAX_TOP_LOGPROBS = 20  # OpenAI's cap, as HTTP's (validation.py)
MAX_GRAMMAR_CHARS = 65_536  # as HTTP's structured output (structured_output.py)
_TEXT_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def sampling_from_proto(request: router_pb2.GenerateRequest, limits: Limits) -> Sampling:
    """``request.sampling`` with HTTP's defaults for what the caller did not set, so one
    request means the same at both doors: temperature 1.0, top_p 1.0, n 1, no penalties or
    bias, and max_tokens as the HTTP endpoint of the prompt's form (a chat prompt: the room
    the context leaves, as ``/v1/chat/completions``; text or token ids: 16, as
    ``/v1/completions``). Validation is HTTP's (``parse_sampling``), so a set value is
    checked, never replaced: max_tokens or top_p set to 0 is refused naming the field (the
    fields are proto3 ``optional``, so "unset" is told from 0). Refusals name
    ``sampling.<field>``."""
    s = request.sampling  # an absent message reads as one with nothing set
    body: dict = {"top_k": s.top_k, "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
                  "min_tokens": s.min_tokens, "min_p": s.min_p, "presence_penalty": s.presence_penalty,
                  "frequency_penalty": s.frequency_penalty}
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):  # absent: HTTP's default
        if s.HasField(name):
            body[name] = getattr(s, name)
    if s.n:  # 0 is proto3's unset: one completion
        body["n"] = s.n
    if s.logit_bias:  # HTTP's shape: decimal token-id keys
        body["logit_bias"] = {str(token): bias for token, bias in sorted(s.logit_bias.items())}
    if s.HasField("max_tokens"):
        max_tokens, default = s.max_tokens, None
    else:
        max_tokens = None
        default = None if request.WhichOneof("prompt") == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
    try:
        sampling = parse_sampling(body, limits, max_tokens, "sampling.max_tokens", default_max_tokens=default)
    except InvalidRequestError as exc:  # HTTP names the body's top-level field
        raise _in_sampling(exc) from None
    logprobs = s.logprobs or request.return_logprobs
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
    if s.top_logprobs and not logprobs:
        raise InvalidRequestError("sampling.top_logprobs", "needs sampling.logprobs (or return_logprobs)")
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError("sampling.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    return replace(sampling, logprobs=logprobs, top_logprobs=s.top_logprobs, prompt_logprobs=prompt_logprobs,
                   grammar=grammar_from_proto(s))


def _in_sampling(exc: InvalidRequestError) -> InvalidRequestError:
    field = exc.field if exc.field.startswith("sampling.") else f"sampling.{exc.field}"
    return InvalidRequestError(field, exc.message)


def grammar_from_proto(s: common_pb2.SamplingParams) -> tuple[str, str] | None:
    """``sampling.grammar`` as ``Sampling.grammar``; shapes and sizes are checked here,
    compiling is the executor's (its refusal comes back naming ``sampling.grammar.<kind>``)."""
    if not s.HasField("grammar"):
        return None
    kind = s.grammar.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling.grammar", "set one of json_schema, json_object, regex, ebnf or "
                                  "structural_tag (leave grammar unset for free text)")
    field = f"sampling.grammar.{kind}"
    if kind == "json_object":
        if not s.grammar.json_object:
            raise InvalidRequestError(field, "must be true when set (leave grammar unset for free text)")
        return "json_object", ""
    text = getattr(s.grammar, kind)
    if not text.strip():
        raise InvalidRequestError(field, "must not be empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(field, f"longer than {MAX_GRAMMAR_CHARS} characters ({len(text)})")
    if kind in ("json_schema", "structural_tag"):
        try:
            doc = json.loads(text, parse_constant=_no_constant)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequestError(field, f"must be JSON text: {exc}") from None
        except ValueError:
            raise InvalidRequestError(field, "holds NaN or Infinity, which JSON does not allow") from None
        if kind == "json_schema":  # the same keyword refusals as HTTP's response_format
            check_enforceable(doc, field)
    return kind, text


def _no_constant(name: str) -> None:
    raise ValueError(name)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, generator: Generator, keys: KeyStore, model_name: str, list_executors=None,
                 tool_format: ToolCallFormat | None = None, end_session=None, sessions=None) -> None:
        """``sessions``: what ends, forks and joins sessions (the scheduler client;
        ``session_routes.SessionControl``); ``end_session`` alone: async (tenant,
        session_id) -> EndedSession. None: those RPCs are UNIMPLEMENTED."""
        self.generator = generator
        self.sessions = sessions
        self.end_session = end_session or (sessions.end_session if sessions is not None else None)
        self.keys = keys
        self.model_name = model_name
        self.list_executors = list_executors
        # How the served model writes tool calls (RouterConfig's --tool-call-parser, else its template's).
        self.tool_format = tool_format or select_format(generator.tokenizer.chat_template)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Counts every call in ``weft_router_requests_total`` under its gRPC status name
        (refused ones too; a client that cancelled is ``CANCELLED``, as HTTP's is 499)."""
        code = "OK"
        responses = self._generate(request, context)
        try:
            async for response in responses:
                yield response
        except BaseException as exc:
            code = status_label(exc)
            raise
        finally:
            await responses.aclose()
            m.REQUESTS.labels("grpc", "Generate", code).inc()

    async def _generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        tenant = self.keys.authenticate(_api_key(context))
        rid = grpc_request_id(request.request_id, "grpc")  # bounded before anything logs it
        if request.model and request.model not in self.generator.limits.served_models:
            raise InvalidRequestError("model", f"model {request.model!r} does not exist; served: {self.model_name!r}")
        with request_context(rid, tenant=tenant):
            sampling = sampling_from_proto(request, self.generator.limits)
            sampling = replace(sampling, semantic_cache=request.semantic_cache)
            stop = parse_stop(list(request.stop) or None, self.generator.limits)
            session = _session(request.session)
            sampling = deterministic_sampling(sampling, session, request.sampling.HasField("temperature"),
                                              "sampling.temperature")
            check_session_choices(session, 1, sampling.n, "sampling.n")
            tools = tools_from_proto(request)
            choice = tool_choice_from_proto(request, tools)
            parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
            sampling, grammar_field = with_tool_grammar(sampling, self.tool_format, tools, choice, parallel)
            prompt = prompt_from_proto(request, self.generator.limits, tools)
            echo = self._echo(request)
            token_req = await self.generator.prepare(prompt, sampling, tenant, session, rid)
            relays = [ToolCallRelay(self.tool_format) if tools and choice.mode != "none" else None
                      for _ in range(sampling.n)]
            # a session hop's n completions: n branches of the session (session_branches.py)
            branches = await branch_requests(fan_out(token_req, sampling.n), self.sessions)
            choices = branches.requests
            m.IN_FLIGHT.labels("grpc").inc()
            # The n completions follow the first: its prompt KV is then shared through the prefix cache.
            merged = merge([self.generator.stream(r, stop) for r in choices], follows=[None] + [0] * (sampling.n - 1))
            if branches.forked:  # a branch forked for this hop ends unless its hop finishes
                merged = end_unfinished_branches(merged, branches, self.sessions)
            started = [False] * sampling.n
            try:
                async for i, delta in merged:
                    chunk = response_chunk(rid, i, delta, sampling, relays[i], "" if started[i] else echo)
                    if not started[i]:
                        chunk.session_id = choices[i].session.session_id
                    yield chunk
                    started[i] = True
            except InvalidRequestError as exc:  # the executor's compiler names "grammar.<kind>"
                if not exc.field.startswith("grammar"):
                    raise
                raise InvalidRequestError(grammar_field, f"cannot be enforced: {exc.message}") from None
            finally:
                m.IN_FLIGHT.labels("grpc").dec()
                await merged.aclose()

    def _echo(self, request: router_pb2.GenerateRequest) -> str:
        """The prompt text each completion's first chunk repeats (``echo``), or ""."""
        if not request.echo:
            return ""
        form = request.WhichOneof("prompt")
        if form == "text":
            return request.text
        if form == "token_ids":  # as /v1/completions: the ids decoded
            return self.generator.tokenizer.decode(request.token_ids.ids)
        raise InvalidRequestError("echo", "needs a text or token_ids prompt")

    async def EndSession(self, request: router_pb2.EndSessionRequest, context: grpc.aio.ServicerContext):
        """End one of the caller's sessions (docs/sessions.md); NOT_FOUND for an id its
        tenant never used, another tenant's included."""
        tenant = self.keys.authenticate(_api_key(context))
        if self.end_session is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no scheduler to end sessions")
        session_id = parse_session({"session_id": request.session_id}).session_id
        if not session_id:
            raise InvalidRequestError("session_id", "must not be empty")
        end = await self.end_session(tenant, session_id)
        m.REQUESTS.labels("grpc", "EndSession", "OK").inc()
        return router_pb2.EndSessionResponse(session_id=session_id, ended_now=end.ended_now,
                                             num_executors_released=end.num_executors_released,
                                             num_running_hops=end.num_running_hops)

    async def ForkSession(self, request: router_pb2.ForkSessionRequest, context: grpc.aio.ServicerContext):
        """Fork one of the caller's idle sessions (docs/sessions.md); a child id in use is
        ALREADY_EXISTS, another tenant's session NOT_FOUND."""
        tenant = self.keys.authenticate(_api_key(context))
        if self.sessions is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no scheduler to fork sessions")
        # proto3's 0 is "not sent": a count sent with ids is refused as HTTP's n with child_ids is.
        num_children = request.num_children if request.num_children or not request.child_session_ids else None
        spec = parse_fork(request.session_id, num_children,
                          list(request.child_session_ids) or None, "num_children", "child_session_ids")
        forked = await self.sessions.fork_session(tenant, spec.session_id, list(spec.child_ids))
        m.REQUESTS.labels("grpc", "ForkSession", "OK").inc()
        return router_pb2.ForkSessionResponse(session_id=forked.session_id,
                                              child_session_ids=list(forked.child_session_ids),
                                              num_context_tokens=forked.num_context_tokens)

    async def JoinSession(self, request: router_pb2.JoinSessionRequest, context: grpc.aio.ServicerContext):
        """Join one of the caller's sessions from a child (or keep its context)."""
        tenant = self.keys.authenticate(_api_key(context))
        if self.sessions is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router has no scheduler to join sessions")
        spec = parse_join(request.session_id, request.from_session_id, request.end_children, "from_session_id")
        joined = await self.sessions.join_session(tenant, spec.session_id, spec.from_id, spec.end_children)
        m.REQUESTS.labels("grpc", "JoinSession", "OK").inc()
        return router_pb2.JoinSessionResponse(session_id=joined.session_id,
                                              num_context_tokens=joined.num_context_tokens,
                                              ended_session_ids=list(joined.ended_session_ids))

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


def add_router_to_server(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Serve ``weft.v1.Router`` and server reflection on ``server``: a client with no
    ``.proto`` in hand can list the services and describe every message."""
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    reflection.enable_server_reflection(REFLECTED_SERVICES, server)


def prompt_from_proto(request: router_pb2.GenerateRequest, limits: Limits,
                      tools: tuple[dict, ...] | None = None) -> Prompt:
    """The request's prompt form; its field names are the proto's (``text``, ``token_ids``,
    ``chat.messages``), as every refusal of the prompt names them."""
    form = request.WhichOneof("prompt")
    if form == "text":
        return TextPrompt(request.text, "text")
    if form == "token_ids":
        return TokenIdsPrompt(tuple(request.token_ids.ids), "token_ids")
    if form == "chat":
        if not request.chat.messages:
            raise InvalidRequestError("chat.messages", "must not be empty")
        if len(request.chat.messages) > limits.max_messages:  # as HTTP's cap
            raise InvalidRequestError("chat.messages", f"at most {limits.max_messages} "
                                      f"messages, got {len(request.chat.messages)}")
        messages = tuple(parse_message(_message(msg), f"chat.messages[{i}]")
                         for i, msg in enumerate(request.chat.messages))
        return ChatPrompt(messages, tools, request.chat.add_generation_prompt, "chat.messages")
    raise InvalidRequestError("prompt", "one of text, chat or token_ids is required")


def _message(msg: router_pb2.ChatMessage) -> dict:
    """A proto message as the JSON object HTTP would carry (empty strings read as absent),
    for ``chat_messages.parse_message``: one validation for both doors."""
    out = {"role": msg.role, "content": msg.content}
    if msg.name:
        out["name"] = msg.name
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:  # rendered by the chat template; refused on a role other than assistant
        out["tool_calls"] = assistant_tool_calls(msg)
    return out


def _session(s: common_pb2.SessionInfo):
    """``SessionInfo`` as the JSON fields HTTP would carry, validated by the same
    ``parse_session``: an enum number the proto does not define (``request_class=99``)
    is refused naming the field, as an unknown name is over HTTP."""
    c = s.contract
    body = {
        "session_id": s.session_id, "program_id": s.program_id, "hop_index": s.hop_index,
        "expected_tool_ms": s.expected_tool_ms, "session_stateful": s.stateful,
        "request_class": _enum_name(common_pb2.RequestClass, s.request_class, "REQUEST_CLASS_"),
        "contract": {
            "kv_quota_blocks": c.kv_quota_blocks, "ttft_ceiling_ms": c.ttft_ceiling_ms,
            "tpot_ceiling_ms": c.tpot_ceiling_ms,
            "fallback": _enum_name(common_pb2.FallbackPath, c.fallback, "FALLBACK_PATH_"),
            "accepted_degrade_steps": [_enum_name(common_pb2.DegradeStep, step, "DEGRADE_STEP_") or str(step)
                                       for step in c.accepted_degrade_steps],
        },
    }
    return parse_session(body, prefix="session.")


def _enum_name(enum, value: int, prefix: str) -> str:
    """``REQUEST_CLASS_BATCH`` -> "batch"; 0 (unspecified) -> ""; an undefined number -> its
    digits, which no validator accepts."""
    if value == 0:
        return ""
    if value not in enum.values():
        return str(value)
    return enum.Name(value).removeprefix(prefix).lower()
