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

Fork and join (docs/sessions.md)::

    parent P (context c, next hop k)
      fork ─▶ P.f0, P.f1, …   each a new session: a copy of c (token ids; the KV is shared
                              by the executor's prefix cache), P's program, next hop k
      join(from=P.f1) ─▶ P continues from P.f1's context and hop index; P.f1 is absorbed
                              (forgotten, its pins left to their TTL: P's next hop reads
                              them); with end_children the other children end

Both refuse while P (or the child joined from) runs a hop (SessionBusyError), and only
touch the calling tenant's sessions (another tenant's id: SessionNotFoundError).
"""
from __future__ import annotations

import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.errors import (InvalidScheduleRequest, SessionBusyError, SessionExistsError,
                                       SessionNotFoundError)
from services.scheduler.state.session_ids import continues_attempt, executor_session_id

__all__ = ["SessionBusyError", "SessionTable", "SessionState", "HopContext", "ProgramState", "Forked", "Joined",
           "executor_session_id", "MAX_CHILDREN"]

MAX_CHILDREN = 16  # children one fork may create


@dataclass
class SessionState:
    tenant: str
    session_id: str
    program_id: str
    last_hop: int = -1  # last completed hop
    # Prompt + output of the last completed hop; 4 bytes a token (10k sessions of 4k tokens: 160 MB).
    # Never changed in place: a fork's children share their parent's array (one copy however
    # many children), and ``end_hop`` / ``join`` assign a new one.
    context_token_ids: array = field(default_factory=lambda: array("I"))
    executor: str = ""  # where its KV lives
    pause_started_s: float | None = None  # when the last hop ended (its tool call began)
    expected_pause_ms: int = 0  # the hint given with the last hop
    pinned_until_s: float = 0.0  # keep decision in force until then
    pinned_blocks: int = 0
    demoted: bool = False  # blocks sent to the cachestore's host tier
    mean_entropy: float = 0.0  # EWMA of the hops' mean token entropy (nats)
    observed_pause_ms: float = 0.0  # EWMA of real tool-call lengths (0: none seen yet)
    parent_id: str = ""  # the session this one was forked from ("" for none)
    child_ids: list[str] = field(default_factory=list)  # live children forked from this one
    absorbed_ids: list[str] = field(default_factory=list)  # children joined from: their pins hold this context
    fork_id: str = ""  # the id of the fork that created it (the caller's; "" for none): ``created_by``
    pins_hold_context: bool = True  # its own pins can hold its whole context (False after a fork or a join)


@dataclass(frozen=True)
class Forked:
    """What ``fork`` created."""

    parent: SessionState | None  # None: ``fork_or_new`` created new sessions (no context to copy)
    children: tuple[SessionState, ...]


@dataclass(frozen=True)
class Joined:
    """What ``join`` did: the parent's new state, the child it absorbed ("" when it kept its
    own context) and the children it ended (the caller releases their pins)."""

    parent: SessionState
    absorbed: SessionState | None
    ended: tuple[SessionState, ...]
    superseded: tuple[str, ...] = ()  # ids joined from earlier whose pins the absorbed child's now cover

    @property
    def ended_ids(self) -> tuple[str, ...]:
        return tuple(s.session_id for s in self.ended)


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

    def _trim_sessions(self) -> None:
        _trim_fairly(self._sessions, self.max_sessions)

    def get(self, tenant: str, session_id: str) -> SessionState | None:
        return self._sessions.get((tenant, session_id))

    def program(self, tenant: str, program_id: str) -> ProgramState | None:
        return self._programs.get((tenant, program_id))

    def begin_hop(self, tenant: str, session_id: str, program_id: str, hop_index: int, stateful: bool,
                  prompt_token_ids: Sequence[int]) -> HopContext:
        """Validate a hop and resolve its full prompt. Creates nothing yet (a refused or
        failed hop leaves no trace); raises InvalidScheduleRequest naming the field."""
        pid = program_id or self._program_of(tenant, session_id)
        program = self._programs.get((tenant, pid)) if pid else None
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
        pid = program_id or self._program_of(tenant, session_id)
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
        ses.pins_hold_context = True
        ses.executor = executor
        ses.pause_started_s = now
        ses.expected_pause_ms = expected_pause_ms
        ses.demoted = False
        if mean_entropy > 0:
            ses.mean_entropy = mean_entropy if not ses.mean_entropy else 0.5 * ses.mean_entropy + 0.5 * mean_entropy
        self._sessions[key] = ses
        self._sessions.move_to_end(key)
        self._trim_sessions()
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
        if running is not None and not continues_attempt(request_id, running):
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

    def end(self, tenant: str, session_id: str, running: bool = False) -> SessionState | None:
        """Forget the session and remember that it ended (bounded), only when this tenant
        had it (a recorded context, or ``running``: a hop of it runs): an id it never had
        leaves no trace, so a repeat is still unknown and a storm of made-up ids cannot push
        real ends out. Returns its state, None when there is no recorded context."""
        key = (tenant, session_id)
        ses = self._sessions.pop(key, None)
        parent = self._sessions.get((tenant, ses.parent_id)) if ses is not None and ses.parent_id else None
        if parent is not None and session_id in parent.child_ids:
            parent.child_ids.remove(session_id)  # a parent lists live children only
        if ses is not None or running:
            self._ended[key] = None
            self._ended.move_to_end(key)
            _trim(self._ended, self.max_sessions)
        return ses

    # -- fork and join ----------------------------------------------------------------
    def fork(self, tenant: str, session_id: str, child_ids: Sequence[str], fork_id: str = "") -> Forked:
        """Create ``child_ids`` as copies of the session (context, program, next hop,
        executor), each recording ``fork_id`` (``created_by``). Raises SessionBusyError while
        it runs a hop, SessionNotFoundError when the tenant has no recorded context for it,
        SessionExistsError for a child id in use, InvalidScheduleRequest for bad ids
        (``child_session_ids[i]``). All or nothing."""
        parent = self._checked(tenant, session_id)
        self._check_child_ids(tenant, session_id, child_ids)
        children = []
        for cid in child_ids:
            child = SessionState(
                tenant, cid, parent.program_id, last_hop=parent.last_hop,
                context_token_ids=parent.context_token_ids, executor=parent.executor,
                pause_started_s=parent.pause_started_s, expected_pause_ms=parent.expected_pause_ms,
                demoted=parent.demoted, mean_entropy=parent.mean_entropy,
                observed_pause_ms=parent.observed_pause_ms, parent_id=session_id, fork_id=fork_id,
                pins_hold_context=False)
            # Not pinned_until_s: the pins are the parent's; a child's intent shift must not
            # release (or evict) the prefix its siblings share.
            self._sessions[(tenant, cid)] = child
            self._ended.pop((tenant, cid), None)
            children.append(child)
        # Only live children stay listed (an n > 1 hop forks each time: the list must not grow).
        parent.child_ids = [c for c in parent.child_ids if (tenant, c) in self._sessions]
        parent.child_ids.extend(child_ids)
        self._sessions.move_to_end((tenant, session_id))
        self._trim_sessions()
        return Forked(parent, tuple(children))

    def fork_or_new(self, tenant: str, session_id: str, child_ids: Sequence[str], program_id: str,
                    next_hop: int, fork_id: str = "") -> Forked:
        """``fork``, or, when the tenant holds no context for the session (hop 0 of a new
        session, a scheduler that restarted), create ``child_ids`` as new sessions of
        ``program_id`` that expect hop ``next_hop`` (``Forked.parent`` None). Either way all or
        nothing: a child id in use is SessionExistsError before anything is created, so
        ``n > 1`` on a session hop can never run a branch on a session the tenant already has."""
        running = self._running.get((tenant, session_id))
        if running is not None or (tenant, session_id) in self._sessions:
            return self.fork(tenant, session_id, child_ids, fork_id)
        self._check_child_ids(tenant, session_id, child_ids)
        children = []
        for cid in child_ids:
            child = SessionState(tenant, cid, program_id or session_id, last_hop=next_hop - 1, fork_id=fork_id)
            self._sessions[(tenant, cid)] = child
            self._ended.pop((tenant, cid), None)
            children.append(child)
        self._trim_sessions()
        return Forked(None, tuple(children))

    def created_by(self, tenant: str, session_id: str, fork_id: str) -> bool:
        """The tenant's session ``session_id`` is recorded and the fork ``fork_id`` created it
        (a same-named session the client made, or another fork's, is not), and no hop but the
        fork's own has begun on it (the client continued on it: it is the client's now;
        ``AgentPlane.begin`` clears ``fork_id`` for a hop that does not name the fork)."""
        ses = self._sessions.get((tenant, session_id))
        return bool(fork_id) and ses is not None and ses.fork_id == fork_id

    def _check_child_ids(self, tenant: str, session_id: str, child_ids: Sequence[str]) -> None:
        if not 1 <= len(child_ids) <= MAX_CHILDREN:
            raise InvalidScheduleRequest("num_children", f"must be 1..{MAX_CHILDREN}, got {len(child_ids)}")
        for i, cid in enumerate(child_ids):
            if not cid or cid == session_id or cid in child_ids[:i]:
                why = "is empty" if not cid else "names the parent" if cid == session_id else "is repeated"
                raise InvalidScheduleRequest(f"child_session_ids[{i}]", f"{cid!r} {why}")
            if (tenant, cid) in self._sessions or (tenant, cid) in self._running:
                raise SessionExistsError(cid)

    def join(self, tenant: str, session_id: str, from_id: str, end_children: bool) -> Joined:
        """The parent continues from child ``from_id``'s context and hop index ("": its
        own); that child is forgotten, and with ``end_children`` every other child ends
        (``end``). The context is then the absorbed child's; when the child completed a hop
        since it was forked or joined, its own pins hold all of it and the ids joined from
        before (the parent's and the child's) are ``Joined.superseded`` (the caller releases
        their pins), so a session joined from a branch every hop keeps one; else they are kept.
        Raises as ``fork`` does, SessionBusyError when the child runs a hop, and
        InvalidScheduleRequest naming ``from_session_id`` for an id that is not a live child."""
        parent = self._checked(tenant, session_id)
        absorbed, superseded = None, ()
        if from_id:
            child = self._sessions.get((tenant, from_id))
            if from_id not in parent.child_ids or child is None or child.parent_id != session_id:
                raise InvalidScheduleRequest("from_session_id",
                                             f"{from_id!r} is not a live child of session {session_id!r}")
            running = self._running.get((tenant, from_id))
            if running is not None:
                raise SessionBusyError(from_id, running)
            absorbed = self.end(tenant, from_id)  # (off the parent's child list)
            earlier = [a for a in dict.fromkeys([*parent.absorbed_ids, *child.absorbed_ids]) if a != from_id]
            if child.pins_hold_context:
                superseded, earlier = tuple(earlier), []
            parent.absorbed_ids = [*earlier, from_id]  # released when the parent ends
            parent.pins_hold_context = False
            parent.context_token_ids = child.context_token_ids
            parent.last_hop = child.last_hop
            parent.executor, parent.demoted = child.executor, child.demoted
            parent.pause_started_s, parent.expected_pause_ms = child.pause_started_s, child.expected_pause_ms
            parent.mean_entropy, parent.observed_pause_ms = child.mean_entropy, child.observed_pause_ms
            parent.pinned_until_s, parent.pinned_blocks = 0.0, 0  # its old pins no longer hold its context
        ended: list[SessionState] = []
        if end_children:
            for cid in list(parent.child_ids):
                recorded = self._sessions.get((tenant, cid))
                if recorded is not None and recorded.parent_id != session_id:
                    continue  # the id outlived its branch (evicted) and is another session's now
                child = self.end(tenant, cid)
                if child is not None:
                    ended.append(child)
            parent.child_ids.clear()
        return Joined(parent, absorbed, tuple(ended), superseded)

    def absorbed_pins(self, ses: SessionState) -> list[str]:
        """The ids of the children ``ses`` joined from whose pins still hold its context:
        those no live session has taken since (a later fork's default ids reuse them)."""
        return [a for a in ses.absorbed_ids
                if (ses.tenant, a) not in self._sessions and (ses.tenant, a) not in self._running]

    def _program_of(self, tenant: str, session_id: str) -> str:
        """A hop that names no program belongs to its session's (a fork's children share
        their parent's), else to a program named like the session."""
        ses = self._sessions.get((tenant, session_id)) if session_id else None
        return ses.program_id if ses is not None and ses.program_id else session_id

    def _checked(self, tenant: str, session_id: str) -> SessionState:
        """The tenant's session, idle and with a recorded context, for a fork or join."""
        running = self._running.get((tenant, session_id))
        if running is not None:
            raise SessionBusyError(session_id, running)
        ses = self._sessions.get((tenant, session_id))
        if ses is None:
            raise SessionNotFoundError(session_id, ": a fork or join needs a session with a completed hop")
        return ses


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trim_fairly(table: OrderedDict, limit: int) -> None:
    """Bound ``table`` (keyed (tenant, id), oldest first) by evicting the oldest entry of
    the tenant that holds the most: one tenant's burst of new sessions (a fork costs no
    compute) evicts its own sessions before anyone else's."""
    while len(table) > limit:
        counts = Counter(tenant for tenant, _ in table)
        heaviest = max(counts, key=counts.__getitem__)
        del table[next(k for k in table if k[0] == heaviest)]


def _trim(table: OrderedDict, limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)
