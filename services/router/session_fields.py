"""The agent-session fields of a request: who the hop belongs to and what it was promised.

``session_id``, ``program_id``, ``hop_index``, ``expected_tool_ms``, ``request_class``,
``session_stateful`` and the ``contract`` object, parsed once for both public doors (HTTP's
top-level fields, gRPC's ``SessionInfo`` as a dict with the prefix "session."), so both
accept and refuse the same values naming the same field; and the rules a session puts on
the rest of the request: ``deterministic`` means greedy unless seeded, and a session hop
runs one prompt, its ``n`` completions as branches (services/router/session_branches.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.router.errors import InvalidRequestError
from services.router.json_fields import json_object, json_type, optional_field
from services.router.schema import ContractSpec, Sampling, Session
from services.shared.vocabulary import REQUEST_CLASS_LABELS, RUNG_LABELS

_FALLBACKS = ("", "degrade", "reroute", "fail_fast")
MAX_SESSION_KEY_CHARS = 128


def deterministic_sampling(sampling: Sampling, session: Session, temperature_set: bool,
                           field: str = "temperature") -> Sampling:
    """What ``request_class: deterministic`` means: greedy decoding (temperature 0) unless a
    ``seed`` makes sampling reproducible. An unset temperature becomes 0; a temperature
    above 0 without a seed is refused naming ``field`` (it would silently sample)."""
    if session.request_class != "deterministic" or sampling.seed is not None:
        return sampling
    if temperature_set and sampling.temperature > 0:
        raise InvalidRequestError(field, f"request_class deterministic needs temperature 0 or a seed, "
                                  f"got temperature {sampling.temperature} and no seed")
    return replace(sampling, temperature=0.0)


MAX_SESSION_BRANCHES = 16  # n of one session hop: the hop on the session + up to 15 branches (a fork's cap)


def branch_session_id(session_id: str, hop_index: int, choice: int) -> str:
    """The session completion ``choice`` (>= 1) of hop ``hop_index`` runs on when a session
    hop asks several (services/router/session_branches.py)."""
    return f"{session_id}.h{hop_index}.n{choice}"


def check_session_choices(session: Session, num_prompts: int, n: int, field: str) -> None:
    """A session runs one hop at a time (a second is refused 409), so a session hop of
    several prompts is refused naming ``prompt``; its ``n`` completions run as ``n``
    branches of the session, at most ``MAX_SESSION_BRANCHES`` and with branch ids that fit
    a session id, else refused naming ``field``."""
    if not session.session_id:
        return
    if num_prompts > 1:
        raise InvalidRequestError("prompt", f"a hop of session {session.session_id!r} takes one prompt, got "
                                  f"{num_prompts} (fork the session for parallel branches: "
                                  f"POST /v1/weft/sessions/{{id}}/fork, or Router.ForkSession)")
    if n > MAX_SESSION_BRANCHES:
        raise InvalidRequestError(field, f"a hop of session {session.session_id!r} runs at most "
                                  f"{MAX_SESSION_BRANCHES} completions (one branch each), got {n}")
    if n > 1 and len(branch_session_id(session.session_id, session.hop_index, n - 1)) > MAX_SESSION_KEY_CHARS:
        raise InvalidRequestError(field, f"the completions of a session hop run on branch sessions "
                                  f"'<session_id>.h<hop_index>.n<i>', which would exceed {MAX_SESSION_KEY_CHARS} "
                                  f"characters for session {session.session_id[:40]!r}...: use a shorter session id")


def parse_session(body: Mapping[str, Any], prefix: str = "") -> Session:
    """The agent-session fields (``request_class``, ``contract``, ...) of a request body.
    Shared by HTTP (top-level fields) and gRPC (``SessionInfo`` as a dict, ``prefix``
    "session."), so both doors accept and refuse the same values naming the same field."""
    request_class = optional_field(body, "request_class", str, "")
    if request_class and request_class not in REQUEST_CLASS_LABELS:  # "": intent.py decides
        raise InvalidRequestError(f"{prefix}request_class",
                                  f"must be one of {list(REQUEST_CLASS_LABELS)}, got {request_class!r}")
    hop_index = optional_field(body, "hop_index", int, 0)
    expected_tool_ms = optional_field(body, "expected_tool_ms", int, 0)
    for name, value in (("hop_index", hop_index), ("expected_tool_ms", expected_tool_ms)):
        if not 0 <= value < 2**32:
            raise InvalidRequestError(f"{prefix}{name}", f"must be in [0, 2^32), got {value}")
    session_id = _session_key(body, "session_id", prefix)
    stateful = optional_field(body, "session_stateful", bool, False)
    if stateful and not session_id:
        raise InvalidRequestError(f"{prefix}session_stateful", "needs session_id")
    return Session(
        session_id=session_id, program_id=_session_key(body, "program_id", prefix),
        hop_index=hop_index, expected_tool_ms=expected_tool_ms, request_class=request_class,
        stateful=stateful, contract=_contract(body.get("contract"), f"{prefix}contract"),
    )


def parse_session_key(value: Any, field: str) -> str:
    """One session id given on its own (a URL's, a fork's child, a join's ``from``): the
    rules of ``session_id``, naming ``field``."""
    return _session_key({field: value}, field, "")


def _session_key(body: Mapping[str, Any], name: str, prefix: str) -> str:
    """``session_id`` / ``program_id``: short printable text. Both travel to the scheduler,
    which logs them and echoes them in errors: a 4 MB id grew its log by 10 MB a request and
    overflowed the error's gRPC metadata (the client got a bogus 429)."""
    value = optional_field(body, name, str, "")
    if len(value) > MAX_SESSION_KEY_CHARS or not value.isprintable():
        raise InvalidRequestError(f"{prefix}{name}", f"must be at most {MAX_SESSION_KEY_CHARS} printable characters "
                                  f"(got {len(value)} characters)")
    if value in (".", ".."):  # URLs normalise these away: DELETE /v1/weft/sessions/{id} could never end it
        raise InvalidRequestError(f"{prefix}{name}", f"must not be {value!r}")
    return value


def _contract(value: Any, field: str = "contract") -> ContractSpec:
    """The ``contract`` extension object: kv_quota_blocks, ttft_ceiling_ms, tpot_ceiling_ms, fallback,
    accepted_degrade_steps."""
    if value is None:
        return ContractSpec()
    obj = json_object(value, field)
    numbers = {}
    for name in ("kv_quota_blocks", "ttft_ceiling_ms", "tpot_ceiling_ms"):
        v = optional_field(obj, name, int, 0)
        if not 0 <= v < 2**32:
            raise InvalidRequestError(f"{field}.{name}", f"must be in [0, 2^32), got {v}")
        numbers[name] = v
    fallback = optional_field(obj, "fallback", str, "")
    if fallback not in _FALLBACKS:
        raise InvalidRequestError(f"{field}.fallback", f"must be one of {list(_FALLBACKS[1:])}, got {fallback!r}")
    steps = _degrade_steps(obj.get("accepted_degrade_steps"), f"{field}.accepted_degrade_steps")
    return ContractSpec(fallback=fallback, accepted_degrade_steps=steps, **numbers)


def _degrade_steps(value: Any, name: str = "contract.accepted_degrade_steps") -> tuple[str, ...]:
    """``contract.accepted_degrade_steps``: an array of rung names (duplicates dropped)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError(name, f"must be an array of rung names, got {json_type(value)}")
    steps: list[str] = []
    for i, step in enumerate(value):
        if not isinstance(step, str):
            raise InvalidRequestError(f"{name}[{i}]", f"must be a string, got {json_type(step)}")
        if step not in RUNG_LABELS:
            raise InvalidRequestError(f"{name}[{i}]", f"unknown rung {step!r}; must be one of {list(RUNG_LABELS)}")
        if step not in steps:
            steps.append(step)
    return tuple(steps)
