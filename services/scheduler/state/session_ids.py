"""Session ids as the mesh's parts see them: the id an executor pins a tenant's session under,
and which request id is a later attempt of a hop (the router's continuations)."""
from __future__ import annotations

__all__ = ["executor_session_id", "continues_attempt"]


def executor_session_id(tenant: str, session_id: str) -> str:
    """The id an executor pins and releases a session's blocks under. Executors key pins
    by this id alone, and two tenants may choose the same session id: scoped by tenant, B's
    hop or release can never replace or free A's pinned blocks. Empty stays empty. Session
    ids may hold "/", tenant names too (the keys file): a "/" or "%" in the tenant is
    escaped so the first "/" always ends it (tenants "acme" with session "x/y" and
    "acme/x" with "y" were both "acme/x/y")."""
    scope = tenant.replace("%", "%25").replace("/", "%2F")
    return f"{scope}/{session_id}" if session_id else ""


def continues_attempt(request_id: str, running: str) -> bool:
    """Whether ``request_id`` is a later attempt of the running hop: the router resends a
    hop whose scheduler stream was lost as ``<id>.c<k>`` (services/router/continuation.py),
    possibly before this scheduler saw the old stream end; that continuation takes the
    claim over instead of being refused. The same id again is not one (clients choose ids:
    a client sending two hops under one id ran both at once)."""
    base, k = _attempt(request_id)
    running_base, running_k = _attempt(running)
    return base == running_base and k > running_k


def _attempt(request_id: str) -> tuple[str, int]:
    """(the hop's id, its attempt): ``<id>.c<k>`` is attempt k of ``<id>``, attempt 0."""
    base, sep, k = request_id.rpartition(".c")
    return (base, int(k)) if sep and base and k.isdigit() else (request_id, 0)
