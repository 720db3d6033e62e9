"""Fork and join requests, validated the same at both doors (docs/sessions.md).

Each door names its own fields: HTTP ``n`` / ``child_ids[i]`` / ``from`` / ``end_children``,
gRPC ``num_children`` / ``child_session_ids[i]`` / ``from_session_id``. The scheduler checks
the same rules again (a child id in use, a ``from`` that is not a live child), and its field
names are translated back to the door's by ``door_field``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.json_fields import json_type
from services.router.session_fields import MAX_SESSION_KEY_CHARS, parse_session_key

MAX_FORK_CHILDREN = 16  # as the scheduler's sessions.MAX_CHILDREN
# The scheduler's field names -> HTTP's (gRPC's are the scheduler's).
HTTP_FIELDS = {"num_children": "n", "child_session_ids": "child_ids", "from_session_id": "from"}


@dataclass(frozen=True)
class ForkSpec:
    """A validated fork: the parent and its children's ids (defaults already chosen)."""

    session_id: str
    child_ids: tuple[str, ...]


@dataclass(frozen=True)
class JoinSpec:
    session_id: str
    from_id: str  # "": the parent keeps its own context
    end_children: bool


def parent_id(value: Any) -> str:
    session_id = parse_session_key(value, "session_id")
    if not session_id:
        raise InvalidRequestError("session_id", "must not be empty")
    return session_id


def parse_fork(session_id: Any, num_children: Any, child_ids: Any, n_field: str = "n",
               ids_field: str = "child_ids") -> ForkSpec:
    """A fork of ``session_id`` into ``num_children`` children named ``<id>.f<k>`` (k from
    0) or into ``child_ids`` (exactly one of them; None: absent). Default ids must be
    valid session ids themselves: the children's hops will name them."""
    session_id = parent_id(session_id)
    if child_ids is not None:
        if num_children is not None:
            raise InvalidRequestError(n_field, f"send {n_field} or {ids_field}, not both")
        if not isinstance(child_ids, list) or not 1 <= len(child_ids) <= MAX_FORK_CHILDREN:
            raise InvalidRequestError(ids_field, f"must be an array of 1..{MAX_FORK_CHILDREN} session ids")
        ids = []
        for i, cid in enumerate(child_ids):
            field = f"{ids_field}[{i}]"
            if not isinstance(cid, str) or not cid:
                raise InvalidRequestError(field, "must be a non-empty string")
            cid = parse_session_key(cid, field)
            if cid == session_id or cid in ids:
                why = "names the parent" if cid == session_id else "is repeated"
                raise InvalidRequestError(field, f"{cid!r} {why}")
            ids.append(cid)
        return ForkSpec(session_id, tuple(ids))
    if isinstance(num_children, bool) or not isinstance(num_children, int) \
            or not 1 <= num_children <= MAX_FORK_CHILDREN:
        raise InvalidRequestError(n_field, f"must be an integer in 1..{MAX_FORK_CHILDREN} (or send {ids_field}), "
                                  f"got {num_children!r}")
    ids = tuple(f"{session_id}.f{k}" for k in range(num_children))
    if len(ids[-1]) > MAX_SESSION_KEY_CHARS:
        raise InvalidRequestError(n_field, f"the default child ids '<id>.f<k>' would exceed {MAX_SESSION_KEY_CHARS} "
                                  f"characters: send {ids_field}")
    return ForkSpec(session_id, ids)


def parse_join(session_id: Any, from_id: Any, end_children: Any, from_field: str = "from",
               end_field: str = "end_children") -> JoinSpec:
    """A join of ``session_id`` from child ``from_id`` (None or "": its own context)."""
    session_id = parent_id(session_id)
    from_id = parse_session_key(from_id, from_field) if from_id is not None else ""
    if from_id == session_id:
        raise InvalidRequestError(from_field, "names the parent itself: omit it to keep the parent's context")
    if not isinstance(end_children, bool):
        raise InvalidRequestError(end_field, f"must be a boolean, got {json_type(end_children)}")
    return JoinSpec(session_id, from_id, end_children)


def door_field(exc: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """The scheduler's refusal naming the door's field (``child_session_ids[1]`` ->
    ``child_ids[1]`` for HTTP)."""
    head, bracket, rest = exc.field.partition("[")
    if head not in names:
        return exc
    return InvalidRequestError(names[head] + bracket + rest, exc.message)
