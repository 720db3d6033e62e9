"""``n > 1`` on a session hop: the ``n`` completions run as ``n`` branches of the session.

NOTE: a session runs one hop at a time (the scheduler refuses a second with 409), so ``n``
completions cannot all be hops of the session itself. Completion 0 is: it runs on the
session, which continues from it as from any hop. Completion i >= 1 runs the same hop on a
*branch* session ``<session_id>.h<hop_index>.n<i>`` (``session_fields.branch_session_id``):

    hop 3 of "s" with n = 3      choice 0 -> session "s"        (hop 3, as with n = 1)
                                 choice 1 -> session "s.h3.n1"  (hop 3, a fork of "s")
                                 choice 2 -> session "s.h3.n2"  (hop 3, a fork of "s")

- After hop 0 the branches are a fork of the session taken just before the hop
  (``Scheduler.ForkSession``, all or nothing): each has the session's context (a stateful
  hop's new tokens continue it), its program, its next hop index and its executor, and
  shares its KV blocks by reference (docs/sessions.md, "Fork and join"). The client
  continues on whichever branch it picks, or joins the session from it
  (``POST /v1/weft/sessions/{id}/join {"from": "<branch>"}``, which ends the other branches).
- On hop 0 there is nothing to fork: the branches are new sessions of the same program
  (attained service accrues to one program) whose shared prompt KV comes from the prefix
  cache, as for any ``n``. They are not children of the session, so join does not apply:
  the client continues on the branch it picks and ends the others.
- A session the scheduler holds no context for (a stateless hop after a scheduler restart)
  forks nothing: its branches start as on hop 0, and a stateful hop is refused as with n = 1.
- Either way the branches are created first, all or nothing (``ForkSession`` with
  ``or_new``: new sessions that expect this hop when there is no context to fork), so a
  branch id the tenant already uses is refused before any choice runs.

The branches follow completion 0 (``delta_streams.merge``): they start once it has a token,
so the hop's new tokens are computed once. Every choice names its session: the gRPC
response's ``session_id`` (first chunk of each index) and HTTP's ``choices[i].weft.session_id``.
A branch id already in use is 409 / ALREADY_EXISTS naming it: the client's own session
(end it and ask again), or a failed attempt's branch whose end is under way (ask again).

A branch fails on its own (``isolate_branch_failures``): an error in choice i >= 1 ends
that choice with finish_reason "error" and the error it would have failed the call with
(gRPC ``GenerateResponse.error``, HTTP ``choices[i].weft.error``), and the other choices go
on. Failing the whole call instead (as a plain ``n > 1`` does, like vLLM and OpenAI) would
report a hop as failed whose choice 0 may have finished: the session has moved on, and
asking the hop again is refused as the wrong hop. Choice 0 is the session's hop itself: its
failure still fails the call (the session did not move; asking again is right).

A created branch lives only if its hop and the session's hop both complete. When the
request ends first (choice 0 refused, e.g. a wrong hop index, busy, a grammar the executor
cannot compile; the client left) or the branch's own choice failed,
``end_unfinished_branches`` ends every forked branch whose hop did not finish; when choice 0
did not finish, it ends every branch, finished or not: the session did not move, the call
failed, and asking the same hop again (the documented retry) must find no branch of it.
Else a refused hop would leave branches the client never saw, and asking the same hop again
would be 409 for each of them in turn. The fork itself may fail after the scheduler created
the branches (its answer lost to a deadline or a reset; the client cancelled while the
router awaited it): ``branch_requests`` then ends them before raising.

Every such end names the fork (``fork_id``, fresh per request, recorded by the scheduler on
each branch it creates): the scheduler ends a branch only if that fork created it, so a
same-named session the client made, or a fork that was refused because of it, is never
ended by a failed request.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from services.router.errors import (InvalidRequestError, RouterError, SessionBusyError, SessionExistsError,
                                    SessionNotFoundError)
from services.router.schema import Delta, TokenRequest, Usage
from services.router.session_fields import branch_session_id

log = structlog.get_logger(__name__)


class Forks(Protocol):
    async def fork_session(self, tenant: str, session_id: str, child_ids: list[str],
                           or_new: tuple[str, int] | None = None, *, fork_id: str = ""): ...

    async def end_session(self, tenant: str, session_id: str, *, fork_id: str = ""): ...


@dataclass(frozen=True)
class Branches:
    """A prompt's ``n`` requests, and which of them run on a branch forked for them."""

    requests: list[TokenRequest]
    forked: bool = False  # requests[1:] run on branches created for them (forks or new sessions)
    fork_id: str = ""  # the fork that created them: only it ends them (the module NOTE)


async def branch_requests(requests: list[TokenRequest], sessions: Forks | None) -> Branches:
    """``generation.fan_out``'s requests of one prompt, each on its own session when they are
    a session hop's ``n`` completions (see the module NOTE); otherwise unchanged. Raises the
    fork's errors: SessionBusyError (a hop of the session runs), SessionExistsError (a
    branch id is in use)."""
    session = requests[0].session
    if len(requests) == 1 or not session.session_id:
        return Branches(requests)
    ids = [branch_session_id(session.session_id, session.hop_index, i) for i in range(1, len(requests))]
    forked, fork_id = False, uuid.uuid4().hex
    program_id = session.program_id or session.session_id
    if sessions is not None:
        # A stateless hop's branches are created even with no context to fork (new sessions
        # of the program at this hop): created first, all or nothing, a branch id the tenant
        # uses already is refused before anything runs. A stateful hop with no context is
        # refused by choice 0 anyway (an unknown session), so its branches are not created.
        or_new = None if session.stateful else (program_id, session.hop_index)
        tenant = requests[0].tenant
        try:
            await sessions.fork_session(tenant, session.session_id, ids, or_new, fork_id=fork_id)
            forked = True
        except SessionNotFoundError:
            pass  # no context to copy and none created: the branches start as new sessions (the NOTE)
        except SessionExistsError as exc:  # named for this request, not for the fork route
            raise SessionExistsError(_in_use_message(str(exc), tenant, ids), "n") from None
        except (SessionBusyError, InvalidRequestError):
            raise  # refused: the fork created nothing
        except BaseException:
            # The fork may have created the branches with its answer lost (a deadline, a
            # reset), or the client left while it was awaited: end what it created, if anything.
            await _end_shielded(sessions, tenant, ids, fork_id)
            raise
    # Created branches belong to the program the scheduler recorded for them (a fork's: the
    # session's, whatever the session's own program is): a hop naming none reads it there.
    if forked:
        program_id = session.program_id
    fork_id = fork_id if forked else ""
    return Branches([requests[0]] + [replace(r, session=replace(r.session, session_id=sid, program_id=program_id),
                                             fork_id=fork_id)
                                     for r, sid in zip(requests[1:], ids)], forked, fork_id)


def isolate_branch_failures(streams: list[AsyncIterator[Delta]], branches: Branches) -> list[AsyncIterator[Delta]]:
    """``streams`` (one per request of ``branches``), each branch's (choice i >= 1 of a
    session hop) made to end in an "error" delta instead of raising (the module NOTE);
    unchanged for anything but a session hop's ``n`` completions."""
    requests = branches.requests
    if len(requests) == 1 or not requests[0].session.session_id:
        return streams
    return [streams[0]] + [_failure_as_finish(s, r) for s, r in zip(streams[1:], requests[1:])]


async def _failure_as_finish(deltas: AsyncIterator[Delta], request: TokenRequest) -> AsyncIterator[Delta]:
    last: Delta | None = None
    try:
        async for delta in deltas:
            last = delta
            yield delta
    except RouterError as exc:
        log.info("session_branch_failed", branch_session_id=request.session.session_id,
                 error_type=type(exc).__name__, error=str(exc)[:300])
        yield Delta("", (), (), "error", last.usage if last is not None else Usage(0, 0, 0),
                    last.executor if last is not None else "", error=exc)
    finally:
        await deltas.aclose()


_ENDING: set[asyncio.Task] = set()  # ends under way, held until done (the loop keeps tasks by weak reference)
_BEING_ENDED: dict[tuple[str, str], int] = {}  # (tenant, branch id) -> ends of it under way


def _in_use_message(refusal: str, tenant: str, ids: list[str]) -> str:
    """The 409 for a branch id in use, said for ``n`` (the client chose no id): transient
    when a failed attempt's ends of it are under way, else the client's own session."""
    pending = [sid for sid in ids if (tenant, sid) in _BEING_ENDED]
    if pending:
        return (f"branch session {pending[0]!r} of this hop is still being ended after a failed attempt "
                f"of the same hop: ask again")
    named = next((sid for sid in ids if repr(sid) in refusal), ids[0])  # the scheduler names the one in use
    return (f"branch session {named!r} of this hop's n completions ('<session_id>.h<hop_index>.n<i>') "
            f"is a session you use: end it (DELETE /v1/weft/sessions/{{id}}, EndSession) and ask again")


async def end_unfinished_branches(merged: AsyncIterator[tuple[int, Delta]], branches: Branches,
                                  sessions: Forks | None) -> AsyncIterator[tuple[int, Delta]]:
    """``merged`` (the choices' (index, delta) stream) passed through; once it ends, every
    forked branch whose hop did not finish is ended, and every branch when choice 0's did not
    (the module NOTE). The ends run in a task of their own, awaited shielded: a client that
    left cancels its request, not them."""
    finished: set[int] = set()
    try:
        async for i, delta in merged:
            if delta.finish_reason is not None and delta.error is None:  # a failed branch did not finish its hop
                finished.add(i)
            yield i, delta
    finally:
        await merged.aclose()
        unfinished = [r for i, r in enumerate(branches.requests) if i > 0 and (i not in finished or 0 not in finished)]
        if branches.forked and unfinished and sessions is not None:
            await _end_shielded(sessions, unfinished[0].tenant, [r.session.session_id for r in unfinished],
                                branches.fork_id)


async def _end_shielded(sessions: Forks, tenant: str, ids: list[str], fork_id: str) -> None:
    """``_end_branches`` in a task of its own, awaited shielded (a cancelled request does
    not cancel the ends; the task is held until done)."""
    task = asyncio.ensure_future(_end_branches(sessions, tenant, ids, fork_id))
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)
    await asyncio.shield(task)


async def _end_branches(sessions: Forks, tenant: str, ids: list[str], fork_id: str) -> None:
    """End each branch the fork ``fork_id`` created; a failure is logged, not raised (the
    request's own outcome stands, and a branch not ended expires with its pins)."""
    keys = [(tenant, sid) for sid in ids]
    for key in keys:
        _BEING_ENDED[key] = _BEING_ENDED.get(key, 0) + 1
    try:
        results = await asyncio.gather(*(sessions.end_session(tenant, sid, fork_id=fork_id) for sid in ids),
                                       return_exceptions=True)
    finally:
        for key in keys:
            _BEING_ENDED[key] -= 1
            if not _BEING_ENDED[key]:
                del _BEING_ENDED[key]
    errors = {sid: str(res) for sid, res in zip(ids, results) if isinstance(res, BaseException)}
    log.info("session_branches_ended", branch_session_ids=[s for s in ids if s not in errors], errors=errors)
