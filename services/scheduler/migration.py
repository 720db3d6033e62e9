"""Request migration: a stream whose executor dies or hangs continues on another one.

NOTE: the continuation starts at the stream-resume point of services/shared/stream_resume.py
(the rule the router's continuation uses one level up): a *new* executor request whose
prompt is the original prompt followed by every token already sent to the client, with
``max_tokens`` / ``min_tokens`` reduced by that many and a seeded stream reseeded by
``continuation_seed``. The new executor recomputes (or finds cached) the KV of those
tokens and samples the next one, so the client sees one stream with no token lost or
repeated; usage is counted across attempts.

A hang is the shared ``StallWatch`` rule (``MigrationPolicy`` is a ``StallRule``): no
token for ``stall_factor`` × this stream's mean inter-token gap, never below
``min_stall_s``; ``first_token_timeout_s`` before an attempt's first token. Attempts are bounded:
after ``max_attempts`` executors, or when no other executor turns up within
``replacement_wait_s``, the stream ends with ``MigrationExhausted``, never a hang.
The reads are timed by the shared ``services/shared/stream_watch.py``; a stall check that
raises (a bug) ends the stream with its ``StallCheckFailed`` (INTERNAL), not a hang.

Domain code only: the dispatcher (dispatch/relay.py) adapts executor streams to ``Attempt`` / ``Piece``.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog

from services.scheduler.policy.suspects import SuspectedPoison
from services.shared.stream_resume import StallRule, StallWatch, budget_spent, resume_point
from services.shared.stream_watch import WatchedReads

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MigrationPolicy(StallRule):
    """How hard the scheduler tries to keep a stream alive; its stall fields (stall_factor,
    min_stall_s, first_token_timeout_s) are the shared hang rule's."""

    max_attempts: int = 3  # executors tried in all, the first one included
    replacement_wait_s: float = 5.0  # how long to wait for a placeable executor
    max_engine_failures: int = 2  # engine deaths a request may be aboard; then suspected poison (suspects.py)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        for name in ("stall_factor", "min_stall_s", "first_token_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.replacement_wait_s < 0:
            raise ValueError("replacement_wait_s must be >= 0")
        if self.max_engine_failures < 1:
            raise ValueError("max_engine_failures must be >= 1")


@dataclass(frozen=True)
class Attempt:
    """What one executor is asked to do: continue from ``prompt_token_ids``."""

    index: int  # 0 = the original placement
    prompt_token_ids: tuple[int, ...]  # original prompt + tokens already sent
    max_tokens: int  # 0 = no limit requested (the executor's own cap applies)
    min_tokens: int
    seed: int | None
    exclude: frozenset[str]  # executors that failed this request


@dataclass(frozen=True)
class Piece:
    """One chunk of an attempt's stream, as the migrator needs to see it."""

    token_ids: tuple[int, ...]
    executor: str
    finished: bool
    payload: object = None  # the server's own message for this chunk, passed through untouched

    @property
    def is_placement_marker(self) -> bool:
        """A piece that only names the executor an attempt was placed on (no tokens, no
        payload): it lets a stall before the first token be pinned on that executor."""
        return not self.token_ids and not self.finished and self.payload is None


def placement_marker(executor: str) -> Piece:
    return Piece((), executor, False, None)


class ExecutorFailed(Exception):
    """An attempt's executor died or refused mid-stream (raised by the server's adapter)."""

    def __init__(self, executor: str, message: str, engine_failed: bool = False) -> None:
        super().__init__(message)
        self.executor = executor
        self.engine_failed = engine_failed  # its engine died or wedged (not its process)


class NoReplacement(Exception):
    """No executor can take the attempt right now (raised by the server's adapter)."""


class MigrationExhausted(Exception):
    """The stream could not be continued: attempts used up or no executor left."""


@dataclass
class StreamProgress:
    """What the client has been sent so far; mutated by ``record``."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    seed: int | None
    output_token_ids: list[int] = field(default_factory=list)
    failed_executors: set[str] = field(default_factory=set)
    num_migrations: int = 0
    engine_failures: list[str] = field(default_factory=list)  # executors whose engine failed with it aboard

    def record(self, token_ids: tuple[int, ...]) -> None:
        self.output_token_ids.extend(token_ids)

    @property
    def budget_spent(self) -> bool:
        """All requested tokens were sent: nothing left to migrate."""
        return budget_spent(self.max_tokens, len(self.output_token_ids))

    def attempt(self, index: int) -> Attempt:
        """Attempt ``index``: the shared resume point after the tokens sent so far."""
        at = resume_point(self.prompt_token_ids, self.output_token_ids, self.max_tokens, self.min_tokens, self.seed)
        return Attempt(index=index, prompt_token_ids=at.prompt_token_ids, max_tokens=at.max_tokens,
                       min_tokens=at.min_tokens, seed=at.seed, exclude=frozenset(self.failed_executors))


OpenAttempt = Callable[[Attempt], AsyncIterator[Piece]]


async def migrating_stream(progress: StreamProgress, policy: MigrationPolicy, open_attempt: OpenAttempt,
                           only_live: Callable[[str, frozenset[str]], bool] | None = None) -> AsyncIterator[Piece]:
    """Yield the pieces of successive attempts as one stream.

    ``open_attempt`` places an attempt on an executor not in ``attempt.exclude`` and
    returns its stream; it raises ``NoReplacement`` (at once, not from the stream) when
    none can be placed; the stream raises ``ExecutorFailed`` when its executor fails. Anything else it raises passes through untouched (bad input, deadline).
    Records every yielded piece in ``progress``.

    ``only_live(executor, exclude)``: whether a *stalled* stream's executor is still live
    (heartbeating) and no executor outside ``exclude`` could take the stream over. Then
    the stall is a slow executor (every core busy prefilling), not a dead one, and leaving
    it would end the request with nowhere to go: the stream keeps waiting on it, one stall
    period at a time, until it moves, breaks, leaves the membership or another executor
    becomes placeable (the request's deadline bounds the wait).
    """
    watch = StallWatch(policy)
    index = 0

    def stalled(silent_s: float) -> ExecutorFailed | None:
        """A read passed the stall ceiling: None waits on (the only live executor is slow,
        not dead), an error fails the attempt. Runs in the timer callback: an exception
        here fails the read with ``StallCheckFailed`` (stream_watch.py)."""
        if executor and only_live is not None and only_live(executor, attempt.exclude):
            log.warning("stalled_on_the_only_live_executor", executor=executor, attempt=index,
                        waited_s=round(silent_s, 2))
            watch.restart()
            return None
        return ExecutorFailed(executor, f"no token for {silent_s:.1f}s")

    while True:
        attempt = progress.attempt(index)
        watch.restart()
        stream = await _open_with_wait(open_attempt, attempt, policy)
        executor = ""
        reads: WatchedReads[Piece] = WatchedReads(stream, watch, stalled)
        try:
            while True:
                try:
                    piece = await reads.next()
                except StopAsyncIteration:
                    return
                executor = piece.executor or executor
                if piece.is_placement_marker:
                    continue
                watch.observe()
                progress.record(piece.token_ids)
                yield piece
                if piece.finished:
                    return
        except ExecutorFailed as exc:
            failed = exc.executor or executor
            if failed:
                progress.failed_executors.add(failed)
            log.warning("executor_failed_mid_stream", executor=failed, attempt=index,
                        num_sent_tokens=len(progress.output_token_ids), reason=str(exc))
            if progress.budget_spent:
                return  # every token was sent; only the finish marker was lost
            if exc.engine_failed:
                progress.engine_failures.append(failed)
                if len(progress.engine_failures) >= policy.max_engine_failures:
                    raise SuspectedPoison(
                        f"the engine of {len(progress.engine_failures)} executors failed with this request "
                        f"aboard ({', '.join(progress.engine_failures)}); not retried, as it may be the "
                        f"cause") from exc
            index += 1
            if index >= policy.max_attempts:
                raise MigrationExhausted(
                    f"stream lost after {index} executor(s) failed "
                    f"({len(progress.output_token_ids)} tokens sent): {exc}") from exc
            progress.num_migrations += 1
            log.info("request_migrating", attempt=index, num_replayed_tokens=len(progress.output_token_ids))
        finally:
            reads.close()
            await stream.aclose()


async def _open_with_wait(open_attempt: OpenAttempt, attempt: Attempt,
                          policy: MigrationPolicy) -> AsyncIterator[Piece]:
    """``open_attempt`` retried while no executor is placeable, up to replacement_wait_s."""
    deadline = time.monotonic() + policy.replacement_wait_s
    while True:
        try:
            return open_attempt(attempt)
        except NoReplacement as exc:
            if attempt.index == 0 or time.monotonic() >= deadline:
                raise MigrationExhausted(f"no executor to continue on: {exc}") from exc
            await asyncio.sleep(0.1)  # poll membership for a joining executor
