"""The OpenAI-compatible HTTP API (aiohttp).

    POST /v1/chat/completions   chat, SSE streaming or not; tools and tool messages
    POST /v1/completions        text or token-id prompts; ``return_token_ids`` extension
    POST /v1/embeddings         the cachestore's embedding model (``embeddings.py``); 404 without one
    GET  /v1/models             the served model
    GET  /v1/models/{id}        one served model's card (404 naming the id otherwise)
    GET  /health                liveness: 200 while serving, 503 while draining
    GET  /health/ready          readiness: 200 once an executor serves, else 503 (``readiness.py``)
    GET  /v1/weft/verdict       the rolling p99 attribution of the caller's tenant (``attribution.py``)
    GET  /v1/weft/requests/{id}/timeline   a recent request's spans across the mesh (own tenant only)
    DELETE /v1/weft/sessions/{id}         end an agent session: its pins and plans go at once (docs/sessions.md)
    POST /v1/weft/sessions/{id}/fork      fork it into children that share its KV; ``/join`` joins one back
                                          (``session_routes.py``)

Prometheus ``/metrics`` is not served here: its series carry per-tenant labels, so it
has its own listener (``--metrics-port``, loopback by default; ``services/mesh/metrics.py``)
like every other service's; its ``weft_p99_*`` gauges are the operator's all-tenant p99
view. Every method above but ``/health`` and ``/health/ready`` takes the API key.

Request ids (``x-request-id``, ``request_ids.py``) are the client's, scoped by tenant
inside the mesh: two tenants using the same id never see or disturb each other's request.

``weft_router_requests_total{code}`` counts HTTP statuses, plus ``499`` (nginx's "client
closed request") for a client that hung up before its response was complete: a
disconnect is not a server error.

Every generation response carries ``x-weft-executor`` (the executor serving it) and
``x-request-id``. Streaming responses send headers only once the first chunk arrived,
so errors before it (bad prompt, overload) are still plain HTTP errors. A client that
disconnects cancels its handler (``handler_cancellation``), which cancels the scheduler
stream and frees the request's KV blocks downstream.
"""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from services.mesh.logging import request_context
from services.mesh.timeline import STORE, timeline_json
from services.router import metrics as m
from services.router.attribution import ATTRIBUTION
from services.router.auth import KeyStore, bearer_token
from services.router.embeddings import EmbeddingsApi
from services.router.errors import InvalidRequestError, RouterError, UpstreamUnavailable
from services.router.http_responses import error_response, notes_headers
from services.router.choice_streams import ChatChoice, CompletionChoice
from services.router.delta_streams import merge, name_grammar_errors, timed
from services.router.generation import Generator, fan_out
from services.router.json_body import parse_json_body
from services.router.readiness import Readiness
from services.router.request_ids import client_request_id, http_request_id, mesh_request_id
from services.router.logprobs_format import CompletionLogprobs, TokenText
from services.router.openai_format import ChatFormatter, CompletionFormatter, choices_usage, error_body, sse
from services.router.prepare import ChatPrompt, completion_prompt
from services.router.schema import TokenRequest
from services.router.session_branches import branch_requests, end_unfinished_branches, isolate_branch_failures
from services.router.session_routes import SessionControl, SessionRoutes
from services.router.tool_grammar import with_tool_grammar
from services.router.tool_parsers import ToolCallFormat, select_format
from services.router.validation import parse_chat_request, parse_completion_request

log = structlog.get_logger(__name__)

EXECUTOR_HEADER = "x-weft-executor"
CLIENT_CLOSED = "499"  # nginx's status for a client that closed the connection first
# aiohttp >= 3.12 wants typed request-storage keys; older ones take a string.
_CLIENT_CLOSED_KEY = (web.RequestKey("weft_client_closed", bool) if hasattr(web, "RequestKey")
                      else "weft_client_closed")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class HttpApi:
    def __init__(self, generator: Generator, keys: KeyStore, model_name: str,
                 list_executors: Callable[[], Awaitable[list[dict]]] | None = None,
                 body_read_timeout_s: float = 30.0, tool_format: ToolCallFormat | None = None,
                 embeddings: EmbeddingsApi | None = None, end_session=None,
                 sessions: SessionControl | None = None) -> None:
        """``sessions``: what ends, forks and joins sessions (the scheduler client);
        ``end_session`` alone: async (tenant, session_id) -> scheduler_client.EndedSession."""
        self.generator = generator
        self.session_routes = SessionRoutes(self._tenant, self._json, sessions, end_session)
        # How the served model writes tool calls: by default the format its chat template teaches.
        self.tool_format = tool_format or select_format(getattr(generator.tokenizer, "chat_template", None))
        self.embeddings = embeddings  # None: no cachestore, no embedding model
        self.token_text = TokenText(generator.tokenizer) if generator.tokenizer is not None else None
        self.body_read_timeout_s = body_read_timeout_s
        self.keys = keys
        self.model_name = model_name
        self.list_executors = list_executors
        self.readiness = Readiness(list_executors)
        self.draining = False

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embed)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)  # ".+": ids may hold a "/" (org/name)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health/ready", self.ready)
        app.router.add_get("/v1/weft/verdict", self.verdict)
        app.router.add_get("/v1/weft/requests/{request_id}/timeline", self.timeline)
        self.session_routes.add_to(app)
        return app

    # -- plumbing -------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        try:
            resp = await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):  # the client hung up (handler_cancellation)
            if endpoint.startswith("/v1/"):
                m.REQUESTS.labels("http", endpoint, CLIENT_CLOSED).inc()
            raise
        except (RouterError, web.HTTPException) as exc:
            resp = error_response(exc)
            log.info("http_request_rejected", path=request.path, status=resp.status, error=str(exc))
        except Exception as exc:  # a bug: answer 500, keep serving
            log.exception("http_request_failed", path=request.path)
            resp = error_response(exc)
        if endpoint.startswith("/v1/"):
            code = CLIENT_CLOSED if request.get(_CLIENT_CLOSED_KEY) else str(resp.status)
            m.REQUESTS.labels("http", endpoint, code).inc()
        return resp

    def _tenant(self, request: web.Request) -> str:
        """The caller's tenant; also refuses new work while the router drains."""
        if self.draining:
            raise UpstreamUnavailable("router is draining")
        key = bearer_token(request.headers.get("Authorization")) or request.headers.get("x-api-key")
        return self.keys.authenticate(key)

    async def _json(self, request: web.Request) -> object:
        """The decoded body. One that does not arrive in ``body_read_timeout_s`` (a
        trickle, a chunked body with no last chunk) is 408: the connection closes, its fd
        and handler are freed."""
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise web.HTTPRequestTimeout(
                text=f"body: not received within {self.body_read_timeout_s:g} s") from None
        return parse_json_body(raw)

    @staticmethod
    def _request_id(request: web.Request, prefix: str) -> str:
        """The client's ``x-request-id`` when well-formed (``request_ids.CLIENT_ID``, which
        also refuses the shape of the router's own resends), else a fresh id."""
        return http_request_id(request.headers.get("x-request-id"), prefix)

    @staticmethod
    def _client_closed(request: web.Request, rid: str) -> None:
        """A stream's client went away mid-response: counted as 499, not as an error."""
        request[_CLIENT_CLOSED_KEY] = True
        m.DISCONNECTS.labels("http").inc()
        log.info("client_disconnected", request_id=rid)

    # -- endpoints ------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        """Liveness: the router answers (see ``ready`` for readiness)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        """Readiness: 200 ``{"status": "ready", "num_serving_executors": N}`` when the
        scheduler reports a SERVING executor, else 503 ``{"status": "not_ready", "reason"}``."""
        if self.draining:
            return web.json_response({"status": "not_ready", "reason": "router is draining"}, status=503)
        report = await self.readiness.check()
        return web.json_response(report.to_json(), status=200 if report.ready else 503)

    async def verdict(self, request: web.Request) -> web.Response:
        """The p99 verdict over the caller's own requests; ``?window_s=N`` narrows it to
        requests finished in the last N s. (The all-tenant view is the metrics port's.)"""
        tenant = self._tenant(request)
        raw = request.query.get("window_s")
        try:
            window_s = float(raw) if raw is not None else None
        except ValueError:
            window_s = -1.0
        if window_s is not None and not 0 < window_s < math.inf:  # nan, inf, negative: not a window
            raise InvalidRequestError("window_s", f"must be a positive number of seconds, got {raw[:40]!r}")
        return web.json_response(ATTRIBUTION.verdict(max_age_s=window_s, tenant=tenant).to_json())

    async def timeline(self, request: web.Request) -> web.Response:
        """A recent request's timeline; only its own tenant may read it (404 otherwise)."""
        tenant = self._tenant(request)
        rid = request.match_info["request_id"]
        spans = STORE.get(mesh_request_id(tenant, rid))  # ids are scoped by tenant (request_ids.py)
        owner = next((s.attrs.get("tenant") for s in spans or () if s.name == "router.request"), None)
        if not spans or owner != tenant:
            raise web.HTTPNotFound(text=f"no recent timeline for request {rid!r}")
        return web.json_response(timeline_json(client_request_id(rid), spans))

    def _model_cards(self) -> list[dict]:
        cards = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "weft",
                  "max_model_len": self.generator.limits.max_model_len}]
        if self.embeddings is not None:
            cards.append(self.embeddings.model_card())
        return cards

    async def embed(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``: 404 naming the reason where no embedding model is served
        (the router runs without a cachestore)."""
        tenant = self._tenant(request)
        if self.embeddings is None:
            message = "no embedding model is served here (the router has no --cachestore-address)"
            return web.json_response(error_body(404, message, "model", "model_not_found"), status=404)
        return await self.embeddings.handle(await self._json(request), tenant)

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        return web.json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        """One entry of ``/v1/models`` (what ``client.models.retrieve(id)`` reads); an id not
        served is 404 with OpenAI's ``model_not_found`` code, never another model's card."""
        self._tenant(request)
        model_id = request.match_info["model_id"]
        card = next((c for c in self._model_cards() if c["id"] == model_id), None)
        if card is None:
            message = f"model {model_id[:200]!r} does not exist; served models: {[self.model_name]}"
            return web.json_response(error_body(404, message, "model", "model_not_found"), status=404)
        return web.json_response(card)

    async def _streams(self, token_reqs: list[TokenRequest], n: int, stop, grammar_field: str):
        """The merged (choice index, delta) stream of every prompt's ``n`` completions, and
        their requests; each prompt's later completions start once its first has a token
        (``merge``). A session hop's completions run as branches (session_branches.py)."""
        sessions = self.session_routes.sessions
        branched = [await branch_requests(fan_out(t, n), sessions) for t in token_reqs]
        choices = [c for b in branched for c in b.requests]
        streams = [name_grammar_errors(timed(self.generator.stream(c, stop), "http"), grammar_field)
                   for c in choices]
        if len(branched) == 1:  # a session hop's branch fails on its own, as its choice's "error" finish
            streams = isolate_branch_failures(streams, branched[0])
        merged = merge(streams, follows=[None if i % n == 0 else i - i % n for i in range(len(choices))])
        if len(branched) == 1 and branched[0].forked:  # a branch forked for this hop ends unless its hop finishes
            merged = end_unfinished_branches(merged, branched[0], sessions)
        return merged, choices

    async def chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        req = parse_chat_request(await self._json(request), self.generator.limits)
        rid = self._request_id(request, "chatcmpl")
        with request_context(rid, tenant=tenant):
            req = with_tool_grammar(req, self.tool_format)
            token_req = await self.generator.prepare(ChatPrompt(req.messages, req.tools), req.sampling, tenant,
                                                     req.session, rid)
            fmt = ChatFormatter(rid, req.model, req.include_usage)
            merged, sent = await self._streams([token_req], req.sampling.n, req.stop, req.grammar_field)
            tools = self.tool_format if req.parse_tool_calls else None
            text = self.token_text if req.sampling.logprobs else None
            choices = [ChatChoice(i, tools, text, req.return_token_ids, c.session.session_id)
                       for i, c in enumerate(sent)]
            try:
                if req.stream:
                    return await self._stream_chat(request, req, fmt, merged, choices, rid)
                return await self._collect_chat(fmt, merged, choices, rid)
            finally:
                await merged.aclose()

    async def _collect_chat(self, fmt: ChatFormatter, merged, choices: list[ChatChoice], rid: str) -> web.Response:
        first_notes = None
        async for i, delta in merged:
            choices[i].add(delta)
            first_notes = first_notes or (delta.notes if i == 0 else None)
        usage = choices_usage([c.last.usage for c in choices], len(choices))
        body = fmt.response([c.body(fmt) for c in choices], usage)
        return web.json_response(body, headers={EXECUTOR_HEADER: _executors(choices), "x-request-id": rid,
                                                **notes_headers(first_notes, choices[0].last.notes)})

    async def _stream_chat(self, request: web.Request, req, fmt: ChatFormatter, merged,
                           choices: list[ChatChoice], rid: str) -> web.StreamResponse:
        i, delta = await anext(merged)  # errors before the first token stay plain HTTP errors
        resp = web.StreamResponse(headers={**_SSE_HEADERS, EXECUTOR_HEADER: delta.executor, "x-request-id": rid,
                                           **notes_headers(delta.notes, None)})
        await resp.prepare(request)
        try:
            while True:
                for chunk in choices[i].chunks(fmt, delta):
                    await resp.write(sse(chunk))
                nxt = await anext(merged, None)
                if nxt is None:
                    break
                i, delta = nxt
            if req.include_usage:
                await resp.write(sse(fmt.usage_chunk(choices_usage([c.last.usage for c in choices], len(choices)))))
            await resp.write(sse("[DONE]"))
        except RouterError as exc:
            await resp.write(sse(json.loads(error_response(exc).text)))
        except ConnectionResetError:  # a write found the client gone
            self._client_closed(request, rid)
        except asyncio.CancelledError:  # the client hung up (handler_cancellation)
            self._client_closed(request, rid)
            raise
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        req = parse_completion_request(await self._json(request), self.generator.limits)
        rid = self._request_id(request, "cmpl")
        with request_context(rid, tenant=tenant):
            multi = len(req.prompts) > 1
            field = lambda i: f"prompt[{i}]" if multi else "prompt"  # noqa: E731
            token_reqs = [
                await self.generator.prepare(completion_prompt(p, field(i)), req.sampling, tenant, req.session,
                                             f"{rid}-{i}" if multi else rid)
                for i, p in enumerate(req.prompts)
            ]
            fmt = CompletionFormatter(rid, req.model, req.include_usage)
            merged, sent = await self._streams(token_reqs, req.sampling.n, req.stop, req.grammar_field)
            choices = [self._completion_choice(req, i, c) for i, c in enumerate(sent)]
            try:
                if req.stream:
                    return await self._stream_completions(request, req, fmt, merged, choices, rid)
                return await self._collect_completions(fmt, merged, choices, req.sampling.n, rid)
            finally:
                await merged.aclose()

    def _completion_choice(self, req, index: int, sent: TokenRequest) -> CompletionChoice:
        echo = None
        if req.echo:  # the prompt as the client wrote it; token ids decoded
            prompt = req.prompts[index // req.sampling.n]
            echo = prompt if isinstance(prompt, str) else self.generator.tokenizer.decode(prompt)
        logprobs = CompletionLogprobs(self.token_text) if req.sampling.logprobs else None
        return CompletionChoice(index, echo, sent.prompt_token_ids, logprobs, req.score_only, req.return_token_ids,
                                sent.session.session_id)

    async def _collect_completions(self, fmt, merged, choices: list[CompletionChoice], n: int,
                                   rid: str) -> web.Response:
        first_notes = None
        async for i, delta in merged:
            choices[i].add(delta)
            first_notes = first_notes or (delta.notes if i == 0 else None)
        usage = choices_usage([c.usage() for c in choices], n)
        return web.json_response(fmt.response([c.body() for c in choices], usage),
                                 headers={EXECUTOR_HEADER: _executors(choices), "x-request-id": rid,
                                          **notes_headers(first_notes, choices[0].last.notes)})

    async def _stream_completions(self, request, req, fmt, merged, choices: list[CompletionChoice],
                                  rid: str) -> web.StreamResponse:
        i, delta = await anext(merged)
        resp = web.StreamResponse(headers={**_SSE_HEADERS, EXECUTOR_HEADER: delta.executor, "x-request-id": rid,
                                           **notes_headers(delta.notes, None)})
        await resp.prepare(request)
        try:
            while True:
                choice = choices[i].chunk_choice(delta)
                if choice is not None:
                    await resp.write(sse(fmt.chunk(choice)))
                nxt = await anext(merged, None)
                if nxt is None:
                    break
                i, delta = nxt
            if req.include_usage:
                await resp.write(sse(fmt.usage_chunk(choices_usage([c.usage() for c in choices], req.sampling.n))))
            await resp.write(sse("[DONE]"))
        except RouterError as exc:
            await resp.write(sse(json.loads(error_response(exc).text)))
        except ConnectionResetError:  # a write found the client gone
            self._client_closed(request, rid)
        except asyncio.CancelledError:  # the client hung up (handler_cancellation)
            self._client_closed(request, rid)
            raise
        return resp


def _executors(choices) -> str:
    """Every executor that served a choice, in order, once each."""
    return ",".join(dict.fromkeys(c.last.executor for c in choices))
