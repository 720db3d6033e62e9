"""Sessions and programs: what the scheduler remembers between the hops of an agent.

A *session* is one conversation (its context grows every hop); a *program* is one
agent run that may own several sessions. The scheduler keeps, per session, the
context it last saw (prompt + output of the last completed hop) so that a stateful
hop may send only its new tokens, the executor that holds its KV, and when its tool
call started; per program, the service it has attained (for least-attained-service
priority). Both tables are bounded (least recently used entries go first) and keyed by
tenant, so one tenant can never name another's session.

Validation (bad input names the field):

    stateful hop, unknown session   → session.session_id
    hop_index not last + 1          → session.hop_index
    stateful hop_index 0            → session.stateful

One hop at a time: ``claim`` marks a session's hop running until ``release_claim``; a
second hop meanwhile is refused (SessionBusyError, names the session and the running
hop), so two branches can never race to overwrite one context. ``end`` forgets a
session at once and remembers, bounded, that it was ended (a repeated end is a no-op).
"""
from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.errors import InvalidScheduleRequest, SchedulerError


class SessionBusyError(SchedulerError):
    """A hop arrived while another hop of the same session runs (gRPC ABORTED, HTTP 409)."""

    def __init__(self, session_id: str, running_request_id: str) -> None:
        super().__init__(f"session {session_id!r} already has a running hop (request {running_request_id!r}); "
                         "send the next hop after it ends")
        self.session_id = session_id
        self.running_request_id = running_request_id


@dataclass
class SessionState:
    tenant: str
    session_id: str
    program_id: str
    last_hop: int = -1  # last completed hop
    # Prompt + output of the last completed hop; 4 bytes a token (10k sessions of 4k tokens: 160 MB).
    context_token_ids: array = field(default_factory=lambda: array("I"))
    executor: str = ""  # where its KV lives
    pause_started_s: float | None = None  # when the last hop ended (its tool call began)
    expected_pause_ms: int = 0  # the hint given with the last hop
    pinned_until_s: float = 0.0  # keep decision in force until then
    pinned_blocks: int = 0
    demoted: bool = False  # blocks sent to the cachestore's host tier
    mean_entropy: float = 0.0  # EWMA of the hops' mean token entropy (nats)
    observed_pause_ms: float = 0.0  # EWMA of real tool-call lengths (0: none seen yet)


@dataclass
class ProgramState:
    program_id: str
    first_arrival_s: float
    attained_tokens: int = 0  # prompt tokens computed + tokens generated, all hops
    num_hops: int = 0


@dataclass(frozen=True)
class HopContext:
    """A validated hop: its full prompt and the state it continues (None: a new session)."""

    prompt_token_ids: list[int]
    session: SessionState | None
    program: ProgramState | None
    num_new_tokens: int  # tokens beyond the session's known context


class SessionTable:
    """Bounded LRU tables of sessions and programs. Mutated only by ``begin_hop`` /
    ``end_hop`` / ``forget``; lookups do not modify."""

    def __init__(self, max_sessions: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()
        self._programs: OrderedDict[tuple[str, str], ProgramState] = OrderedDict()
        self._running: dict[tuple[str, str], str] = {}  # (tenant, session) -> request id of its running hop
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()  # recently ended, for idempotent ends

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, tenant: str, session_id: str) -> SessionState | None:
        return self._sessions.get((tenant, session_id))

    def program(self, tenant: str, program_id: str) -> ProgramState | None:
        return self._programs.get((tenant, program_id))

    def begin_hop(self, tenant: str, session_id: str, program_id: str, hop_index: int, stateful: bool,
                  prompt_token_ids: Sequence[int]) -> HopContext:
        """Validate a hop and resolve its full prompt. Creates nothing yet (a refused or
        failed hop leaves no trace); raises InvalidScheduleRequest naming the field."""
        program = self._programs.get((tenant, program_id or session_id)) if (program_id or session_id) else None
        if not session_id:
            if stateful:
                raise InvalidScheduleRequest("session.session_id", "a stateful hop needs a session_id")
            return HopContext(list(prompt_token_ids), None, program, len(prompt_token_ids))
        ses = self._sessions.get((tenant, session_id))
        if stateful and hop_index == 0:
            raise InvalidScheduleRequest("session.stateful", "hop 0 starts the session: send its full prompt")
        if ses is None:
            if stateful:
                raise InvalidScheduleRequest(
                    "session.session_id", f"unknown session {session_id!r}: a stateful hop continues a known session")
            return HopContext(list(prompt_token_ids), None, program, len(prompt_token_ids))
        if hop_index != ses.last_hop + 1:
            raise InvalidScheduleRequest(
                "session.hop_index", f"session {session_id!r} expects hop {ses.last_hop + 1}, got {hop_index}")
        if stateful:
            prompt = ses.context_token_ids.tolist() + list(prompt_token_ids)
            return HopContext(prompt, ses, program, len(prompt_token_ids))
        shared = _common_prefix(ses.context_token_ids, prompt_token_ids)
        return HopContext(list(prompt_token_ids), ses, program, len(prompt_token_ids) - shared)

    def end_hop(self, tenant: str, session_id: str, program_id: str, hop_index: int,
                prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], executor: str,
                num_computed_tokens: int, expected_pause_ms: int, mean_entropy: float) -> SessionState | None:
        """Record a completed hop; returns the session (None for one-shot requests)."""
        now = self.clock()
        pid = program_id or session_id
        if pid:
            key = (tenant, pid)
            prog = self._programs.get(key) or ProgramState(pid, now)
            prog.attained_tokens += num_computed_tokens + len(output_token_ids)
            prog.num_hops += 1
            self._programs[key] = prog
            self._programs.move_to_end(key)
            _trim(self._programs, self.max_sessions)
        if not session_id:
            return None
        key = (tenant, session_id)
        ses = self._sessions.get(key) or SessionState(tenant, session_id, pid)
        ses.last_hop = max(ses.last_hop, hop_index)
        ses.context_token_ids = array("I", prompt_token_ids)
        ses.context_token_ids.extend(output_token_ids)
        ses.executor = executor
        ses.pause_started_s = now
        ses.expected_pause_ms = expected_pause_ms
        ses.demoted = False
        if mean_entropy > 0:
            ses.mean_entropy = mean_entropy if not ses.mean_entropy else 0.5 * ses.mean_entropy + 0.5 * mean_entropy
        self._sessions[key] = ses
        self._sessions.move_to_end(key)
        _trim(self._sessions, self.max_sessions)
        return ses

    def resumed(self, ses: SessionState) -> float | None:
        """A session's next hop arrived: learn the real pause length; returns it in ms."""
        if ses.pause_started_s is None:
            return None
        pause_ms = (self.clock() - ses.pause_started_s) * 1000.0
        ses.observed_pause_ms = pause_ms if not ses.observed_pause_ms else 0.7 * ses.observed_pause_ms + 0.3 * pause_ms
        ses.pause_started_s = None
        return pause_ms

    def forget(self, tenant: str, session_id: str) -> SessionState | None:
        return self._sessions.pop((tenant, session_id), None)

    # -- one hop at a time ------------------------------------------------------------
    def claim(self, tenant: str, session_id: str, request_id: str) -> None:
        """Mark ``request_id`` as the session's running hop; raises SessionBusyError when
        another hop runs. A session-less request claims nothing. A new hop of an ended
        session id starts a new session (the id is no longer "ended")."""
        if not session_id:
            return
        key = (tenant, session_id)
        running = self._running.get(key)
        if running is not None and not _continues(request_id, running):
            raise SessionBusyError(session_id, running)
        self._running[key] = request_id
        self._ended.pop(key, None)

    def release_claim(self, tenant: str, session_id: str, request_id: str) -> None:
        """The hop ended (finished, failed or refused); a no-op unless it holds the claim."""
        key = (tenant, session_id)
        if self._running.get(key) == request_id:
            del self._running[key]

    def running_hop(self, tenant: str, session_id: str) -> str | None:
        return self._running.get((tenant, session_id))

    # -- end of a session -------------------------------------------------------------
    def was_ended(self, tenant: str, session_id: str) -> bool:
        return (tenant, session_id) in self._ended

    def end(self, tenant: str, session_id: str) -> SessionState | None:
        """Forget the session and remember that it ended (bounded). Returns its state,
        None when this tenant has no recorded context for it."""
        key = (tenant, session_id)
        self._ended[key] = None
        self._ended.move_to_end(key)
        _trim(self._ended, self.max_sessions)
        return self._sessions.pop(key, None)


def executor_session_id(tenant: str, session_id: str) -> str:
    """The id an executor pins and releases a session's blocks under. Executors key pins
    by this id alone, and two tenants may choose the same session id: scoped by tenant, B's
    hop or release can never replace or free A's pinned blocks. Empty stays empty. Session
    ids may hold "/", tenant names too (the keys file): a "/" or "%" in the tenant is
    escaped so the first "/" always ends it (tenants "acme" with session "x/y" and
    "acme/x" with "y" were both "acme/x/y")."""
    scope = tenant.replace("%", "%25").replace("/", "%2F")
    return f"{scope}/{session_id}" if session_id else ""


def _continues(request_id: str, running: str) -> bool:
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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trim(table: OrderedDict, limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
