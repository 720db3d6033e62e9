"""HTTP error and decision responses of the OpenAI-compatible API (``http_api.py``).

``error_response`` maps the router's domain errors to OpenAI-shaped bodies and statuses
(400 naming the field, 401, 404 / 409 for sessions, 429 with ``Retry-After`` and
``retry-after-ms``, 503), ``choice_error_body`` the same for one choice that failed on its
own (a session hop's branch: ``choices[i].weft.error``); ``notes_headers`` turns the
scheduler's decisions into ``x-weft-*`` response headers.
"""
from __future__ import annotations

from aiohttp import web

from services.router.errors import (AuthenticationError, InvalidRequestError, OverloadedError, SessionBusyError,
                                    SessionExistsError, SessionNotFoundError, UpstreamError, UpstreamUnavailable)
from services.router.openai_format import error_body
from services.router.schema import ServingNotes


def error_response(exc: BaseException) -> web.Response:
    """OpenAI-shaped error for a domain error or an aiohttp HTTP exception."""
    status, body, headers = error_status(exc)
    return web.json_response(body, status=status, headers=headers)


def error_status(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """``error_response``'s status, body and headers."""
    headers: dict[str, str] = {}
    if isinstance(exc, InvalidRequestError):
        status, body = 400, error_body(400, str(exc), exc.field, "model_not_found" if exc.field == "model" else None)
    elif isinstance(exc, AuthenticationError):
        status, body = 401, error_body(401, str(exc), None, "invalid_api_key")
    elif isinstance(exc, SessionBusyError):
        status, body = 409, error_body(409, str(exc), "session_id", "session_busy")
    elif isinstance(exc, SessionExistsError):
        status, body = 409, error_body(409, str(exc), exc.field, "session_exists")
    elif isinstance(exc, SessionNotFoundError):
        status, body = 404, error_body(404, str(exc), "session_id", "session_not_found")
    elif isinstance(exc, OverloadedError):
        status, body = 429, error_body(429, str(exc))
        headers["Retry-After"] = str(max(1, round(exc.retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(exc.retry_after_ms)
    elif isinstance(exc, (UpstreamUnavailable, UpstreamError)):
        status, body = 503, error_body(503, str(exc))
    elif isinstance(exc, web.HTTPException):
        status, body = exc.status, error_body(exc.status, exc.reason if exc.text is None else exc.text)
    else:
        status, body = 500, error_body(500, f"internal error ({type(exc).__name__})")
    return status, body, headers


def choice_error_body(exc: BaseException) -> dict:
    """A choice that failed on its own (``choices[i].weft.error``): the error object the
    request would have answered with, its HTTP status, and the retry hint of a 429."""
    status, body, _ = error_status(exc)
    retry = {"retry_after_ms": exc.retry_after_ms} if isinstance(exc, OverloadedError) else {}
    return {**body["error"], "status": status, **retry}


def notes_headers(first: ServingNotes | None, last: ServingNotes | None) -> dict[str, str]:
    """The scheduler's decisions as response headers: ``x-weft-request-class``,
    ``x-weft-fallback`` (+ ``-reason``) and ``x-weft-degradation-rung`` from the first chunk,
    ``x-weft-pause`` from the last (non-streaming responses only: a stream's headers leave
    before it ends)."""
    out = {}
    if first is not None and first.request_class:
        out["x-weft-request-class"] = first.request_class
    if first is not None and first.fallback:
        out["x-weft-fallback"] = first.fallback
        out["x-weft-fallback-reason"] = first.fallback_reason
    if first is not None and first.degradation_rung:  # the ladder rung it was served on
        out["x-weft-degradation-rung"] = first.degradation_rung
    if last is not None and last.pause_decision:
        out["x-weft-pause"] = last.pause_decision
    return out
