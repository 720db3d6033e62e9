"""The public gRPC ``weft.v1.Router`` servicer: with ``grpc_request.py`` (a request's
fields in), ``grpc_response.py`` (chunks out) and ``grpc_tools.py`` (tools in, tool calls
out), the only router code that converts between ``router_pb2`` messages and domain types
(``scheduler_client.py`` is its outbound twin). Everything past the conversion is
the HTTP API's code too.

Issue 15's fields (docs/grpc.md "Agent I/O"): ``sampling.grammar`` (any kind),
``top_logprobs``, ``prompt_logprobs``, ``logit_bias``, ``min_p``, the penalties and ``n``
map onto ``Sampling`` with HTTP's validators and defaults, refusals naming
``sampling.<field>``; ``n`` completions stream interleaved, each chunk tagged ``index``;
``echo`` repeats a text prompt; tools enforce and parse as HTTP's chat does.

Validation is shared with the HTTP API, so both doors reject the same inputs naming the
same fields: sampling (``validation.parse_sampling``), session and contract
(``session_fields.parse_session``: an undefined enum number such as ``request_class=99`` is
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
from dataclasses import replace

import grpc
import structlog
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from services.mesh.logging import request_context
from services.router import metrics as m
from services.router.auth import KeyStore, bearer_token
from services.router.errors import InvalidRequestError, UpstreamUnavailable
from services.router.delta_streams import merge, name_grammar_errors
from services.router.generation import Generator, fan_out
from services.router.grpc_request import prompt_from_proto, sampling_from_proto, session_from_proto
from services.router.grpc_response import ROUTER_ERROR_RULES, response_chunk
from services.router.grpc_tools import ToolCallRelay, tool_choice_from_proto, tools_from_proto, with_tool_grammar
from services.router.request_ids import grpc_request_id
from services.router.session_branches import branch_requests, end_unfinished_branches, isolate_branch_failures
from services.router.session_specs import parse_fork, parse_join
from services.router.tool_parsers import ToolCallFormat, select_format
from services.router.session_fields import check_session_choices, deterministic_sampling, parse_session
from services.router.validation import parse_stop
from weft.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger(__name__)


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
            session = session_from_proto(request.session)
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
            # A refused grammar names the request's field (the executor's compiler names
            # "grammar.<kind>"); a session hop's branch fails on its own, as its choice's "error" finish.
            streams = isolate_branch_failures([name_grammar_errors(self.generator.stream(r, stop), grammar_field)
                                               for r in choices], branches)
            merged = merge(streams, follows=[None] + [0] * (sampling.n - 1))
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
