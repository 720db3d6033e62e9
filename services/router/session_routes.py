"""The HTTP session routes (docs/sessions.md): end, fork and join an agent session.

    DELETE /v1/weft/sessions/{id}        end it: pins and plans go at once
    POST   /v1/weft/sessions/{id}/fork   {"n": 1..16} | {"child_ids": [...]}: children that
                                         start from its context and run in parallel
    POST   /v1/weft/sessions/{id}/join   {"from": "<child id>" | omitted, "end_children": true}:
                                         it continues from that child's (or its own) context

Every route takes the caller's API key and touches only the caller's tenant's sessions
(another tenant's id answers 404 as an unknown one does). The scheduler does the work
(``SchedulerClient.end_session`` / ``fork_session`` / ``join_session``); this module parses,
answers and names the door's own fields in refusals.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from services.router.errors import InvalidRequestError
from services.router.scheduler_client import EndedSession, ForkedSession, JoinedSession
from services.router.session_specs import HTTP_FIELDS, door_field, parse_fork, parse_join
from services.router.session_fields import parse_session_key


class SessionControl(Protocol):
    """What the routes need of the scheduler (``SchedulerClient`` is one)."""

    async def end_session(self, tenant: str, session_id: str) -> EndedSession: ...

    async def fork_session(self, tenant: str, session_id: str, child_ids: list[str]) -> ForkedSession: ...

    async def join_session(self, tenant: str, session_id: str, from_id: str, end_children: bool) -> JoinedSession: ...


class SessionRoutes:
    def __init__(self, tenant_of: Callable[[web.Request], str],
                 json_of: Callable[[web.Request], Awaitable[Any]],
                 sessions: SessionControl | None = None, end_session=None) -> None:
        """``tenant_of``: the caller's tenant (401 / draining refusals); ``json_of``: the
        request's JSON body (400 when malformed). ``end_session`` alone (no ``sessions``):
        a router that can end sessions but not fork them (fork / join answer 501)."""
        self.tenant_of = tenant_of
        self.json_of = json_of
        self.sessions = sessions
        self._end = end_session or (sessions.end_session if sessions is not None else None)

    def add_to(self, app: web.Application) -> None:
        app.router.add_delete("/v1/weft/sessions/{session_id}", self.end)
        app.router.add_post("/v1/weft/sessions/{session_id}/fork", self.fork)
        app.router.add_post("/v1/weft/sessions/{session_id}/join", self.join)

    async def end(self, request: web.Request) -> web.Response:
        """End one of the caller's sessions (idempotent)."""
        tenant = self.tenant_of(request)
        if self._end is None:
            raise web.HTTPNotImplemented(text="this router has no scheduler to end sessions")
        session_id = parse_session_key(request.match_info["session_id"], "session_id")
        end = await self._end(tenant, session_id)
        return web.json_response({"id": session_id, "object": "weft.session", "ended": True,
                                  "ended_now": end.ended_now, "num_executors_released": end.num_executors_released,
                                  "num_running_hops": end.num_running_hops})

    async def fork(self, request: web.Request) -> web.Response:
        """Fork an idle session with a completed hop into 1..16 children."""
        tenant = self.tenant_of(request)
        body = await self._body(request)
        spec = parse_fork(request.match_info["session_id"], body.get("n"), body.get("child_ids"))
        try:
            forked = await self._control().fork_session(tenant, spec.session_id, list(spec.child_ids))
        except InvalidRequestError as exc:
            raise door_field(exc, HTTP_FIELDS) from None
        return web.json_response({"id": forked.session_id, "object": "weft.session.fork",
                                  "children": list(forked.child_session_ids),
                                  "num_context_tokens": forked.num_context_tokens})

    async def join(self, request: web.Request) -> web.Response:
        """The session continues from one child's context (or its own); by default its
        other children end."""
        tenant = self.tenant_of(request)
        body = await self._body(request)
        spec = parse_join(request.match_info["session_id"], body.get("from"), body.get("end_children", True))
        try:
            joined = await self._control().join_session(tenant, spec.session_id, spec.from_id, spec.end_children)
        except InvalidRequestError as exc:
            raise door_field(exc, HTTP_FIELDS) from None
        return web.json_response({"id": joined.session_id, "object": "weft.session.join",
                                  "from": spec.from_id or None, "num_context_tokens": joined.num_context_tokens,
                                  "ended_children": list(joined.ended_session_ids)})

    def _control(self) -> SessionControl:
        if self.sessions is None:
            raise web.HTTPNotImplemented(text="this router has no scheduler to fork or join sessions")
        return self.sessions

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object body; an empty body reads as ``{}``."""
        if not request.can_read_body:
            return {}
        body = await self.json_of(request)
        if not isinstance(body, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        return body
