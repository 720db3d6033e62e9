"""Request ids: what a client may choose, and how the router keeps tenants' ids apart.

A client names its request (HTTP ``x-request-id``, gRPC ``GenerateRequest.request_id``)
so it can find it again (``/v1/weft/requests/{id}/timeline``, logs). Ids are chosen by
clients, so two tenants may pick the same one, by accident or to read the other's
timeline or make its lookups fail. Inside the mesh every id is therefore namespaced by
tenant:

    client id  "job-42"   (what the client sent and what it sees in every answer)
    mesh id    "acme/job-42"   (timeline store, p99 window, scheduler, executor, logs)

Client ids cannot contain ``/`` (``CLIENT_ID``), so the split is unambiguous whatever the
tenant's name. The scheduler and executors need no change: they see one unique id.
"""
from __future__ import annotations

import re
import uuid

from services.router.errors import InvalidRequestError

MAX_CLIENT_ID_CHARS = 64
# A client id may not end like a router resend (``<id>.c<k>``, continuation.py): a resend
# takes over its hop's running-session claim, so a client id of that shape could take over
# another hop of the same session.
CLIENT_ID = re.compile(r"^(?!.*\.c[0-9]+$)[A-Za-z0-9._:-]{1,%d}$" % MAX_CLIENT_ID_CHARS)
_RULE = f"1-{MAX_CLIENT_ID_CHARS} characters of A-Z a-z 0-9 . _ : -, not ending in .c<digits>"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def http_request_id(given: str | None, prefix: str) -> str:
    """HTTP ``x-request-id``: used when well-formed, else replaced by a fresh id (a header
    is advisory in HTTP; the response's ``x-request-id`` says which id was used)."""
    return given if given and CLIENT_ID.match(given) else new_request_id(prefix)


def grpc_request_id(given: str, prefix: str, field: str = "request_id") -> str:
    """gRPC ``request_id``: empty means "choose one"; anything else must be well-formed
    (a field of the message, so a bad one is INVALID_ARGUMENT, never logged whole)."""
    if not given:
        return new_request_id(prefix)
    if not CLIENT_ID.match(given):
        raise InvalidRequestError(field, f"must be {_RULE} (got {len(given)} characters)")
    return given


def mesh_request_id(tenant: str, client_id: str) -> str:
    """The id the request carries inside the mesh: unique across tenants."""
    return f"{tenant}/{client_id}"


def client_request_id(mesh_id: str) -> str:
    """The client's part of a mesh id (the whole id when it has no tenant prefix)."""
    return mesh_id.rsplit("/", 1)[-1]
