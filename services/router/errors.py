"""Domain errors of the router. ``server.py`` maps them to gRPC status codes and
``http_api.py`` to HTTP statuses in OpenAI's error shape:

    InvalidRequestError  -> INVALID_ARGUMENT   / 400 invalid_request_error (names the field)
    AuthenticationError  -> UNAUTHENTICATED    / 401 authentication_error
    OverloadedError      -> RESOURCE_EXHAUSTED / 429 (retry hint)
    SessionBusyError     -> ABORTED            / 409 (a hop of the session is running)
    SessionNotFoundError -> NOT_FOUND          / 404
    SessionExistsError   -> ALREADY_EXISTS     / 409 session_exists (a fork's child id is in use)
    UpstreamUnavailable  -> UNAVAILABLE        / 503
    anything else        -> INTERNAL           / 500
"""
from __future__ import annotations


class RouterError(Exception):
    """Base class of the router's domain errors."""


class InvalidRequestError(RouterError, ValueError):
    """The request is malformed or cannot be served; ``field`` names the offending field
    (dotted path, e.g. ``messages[2].role``), never retried."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this deployment does not serve (HTTP 404 in OpenAI's API;
    we answer 400 with ``param: model`` as the request is invalid for this deployment)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__("model", f"model {model!r} does not exist; served models: {served}")


class AuthenticationError(RouterError):
    """Missing or unknown API key."""


class OverloadedError(RouterError):
    """The mesh cannot take the request now; retry after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class SessionBusyError(RouterError):
    """A hop arrived while another hop of its session runs; the message names both."""


class SessionNotFoundError(RouterError):
    """The caller's tenant has no such session (another tenant's id reads the same)."""


class SessionExistsError(RouterError):
    """A fork named a child id the caller's tenant already uses (the scheduler's
    ALREADY_EXISTS); the message names the id. ``field``: the request field that chose it
    (the fork route's ``child_ids``; ``n`` for a session hop's branch)."""

    def __init__(self, message: str, field: str = "child_ids") -> None:
        super().__init__(message)
        self.field = field


class UpstreamUnavailable(RouterError):
    """The scheduler (or every executor behind it) is unreachable or draining.

    ``lost``: the call broke without the scheduler choosing to end it (its process died
    or restarted, the connection reset, it shut down mid-stream, or it stopped answering):
    a stream that already relayed tokens is continued (``continuation.py``)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


class UpstreamError(RouterError):
    """The scheduler failed the request for a reason that is not the caller's fault;
    ``lost`` as for ``UpstreamUnavailable`` (INTERNAL / UNKNOWN / CANCELLED in transport)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost
