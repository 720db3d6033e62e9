"""Request migration: a stream whose executor dies or hangs continues on another one.

NOTE: the continuation is a *new* executor request whose prompt is the original prompt
followed by every token already sent to the client, with ``max_tokens`` / ``min_tokens``
reduced by that many. The new executor recomputes (or finds cached) the KV of those
tokens and samples the next one, so the client sees one stream with no token lost or
repeated:

    original:      prompt p0..pn   → t0 t1 t2 ✗ (executor lost after t2)
    continuation:  prompt p0..pn t0 t1 t2 → t3 t4 ...  (max_tokens - 3 left)
    client sees:   t0 t1 t2 t3 t4 ...   usage: prompt n+1, output counted across both

Greedy decoding gives the same tokens an undisturbed run would (the argmax of the same
context). Seeded sampling cannot: the original executor's generator state is lost with
it. The continuation is seeded with ``continuation_seed(seed, num_generated)``, so a
migrated seeded stream is reproducible *for the same failure point*, but differs from
the undisturbed run after it.

A hang is "no token for ``stall_factor`` × the expected step time" (the running mean of
this stream's inter-token gaps, never below ``min_stall_s``); before the first token the
ceiling is ``first_token_timeout_s`` (prefill and queueing count). Attempts are bounded:
after ``max_attempts`` executors, or when no other executor turns up within
``replacement_wait_s``, the stream ends with ``MigrationExhausted``, never a hang.

Domain code only: the server adapts its protos to ``Attempt`` / ``Piece``.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog

from services.scheduler.policy.suspects import SuspectedPoison

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MigrationPolicy:
    """How hard the scheduler tries to keep a stream alive."""

    max_attempts: int = 3  # executors tried in all, the first one included
    stall_factor: float = 20.0  # no token for stall_factor × expected step time → hung
    min_stall_s: float = 2.0  # floor of the stall ceiling (scheduling jitter, GC, shared cores)
    first_token_timeout_s: float = 60.0  # ceiling before the first token of an attempt
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


def continuation_seed(seed: int, num_generated: int) -> int:
    """A deterministic, well-mixed seed for the continuation after ``num_generated`` tokens."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class StallWatch:
    """The ceiling on the wait for the next token: stall_factor × mean gap so far."""

    def __init__(self, policy: MigrationPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._last_s: float | None = None
        self._mean_gap_s: float | None = None
        self._num_gaps = 0

    def restart(self) -> None:
        """A new attempt: the first token may take a prefill again."""
        self._last_s = None

    def observe(self) -> None:
        now = self.clock()
        if self._last_s is not None:
            gap = now - self._last_s
            self._num_gaps += 1
            prev = self._mean_gap_s or 0.0
            self._mean_gap_s = prev + (gap - prev) / self._num_gaps
        self._last_s = now

    def timeout_s(self) -> float:
        if self._last_s is None:
            return self.policy.first_token_timeout_s
        if self._mean_gap_s is None:
            return max(self.policy.min_stall_s, self.policy.first_token_timeout_s / 4)
        return max(self.policy.min_stall_s, self.policy.stall_factor * self._mean_gap_s)


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
        return self.max_tokens > 0 and len(self.output_token_ids) >= self.max_tokens

    def attempt(self, index: int) -> Attempt:
        n = len(self.output_token_ids)
        seed = self.seed
        if seed is not None and n:
            seed = continuation_seed(seed, n)
        return Attempt(
            index=index, prompt_token_ids=self.prompt_token_ids + tuple(self.output_token_ids),
            max_tokens=self.max_tokens - n if self.max_tokens else 0,
            min_tokens=max(0, self.min_tokens - n), seed=seed,
            exclude=frozenset(self.failed_executors),
        )


OpenAttempt = Callable[[Attempt], AsyncIterator[Piece]]


async def migrating_stream(progress: StreamProgress, policy: MigrationPolicy,
                           open_attempt: OpenAttempt) -> AsyncIterator[Piece]:
    """Yield the pieces of successive attempts as one stream.

    ``open_attempt`` places an attempt on an executor not in ``attempt.exclude`` and
    returns its stream; it raises ``NoReplacement`` (at once, not from the stream) when
    none can be placed; the stream raises ``ExecutorFailed`` when its executor fails. Anything else it raises passes through untouched (bad input, deadline).
    Records every yielded piece in ``progress``.
    """
    watch = StallWatch(policy)
    index = 0
    while True:
        attempt = progress.attempt(index)
        watch.restart()
        stream = await _open_with_wait(open_attempt, attempt, policy)
        executor = ""
        try:
            while True:
                try:
                    piece = await asyncio.wait_for(anext(stream), watch.timeout_s())
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise ExecutorFailed(executor, f"no token for {watch.timeout_s():.1f}s") from None
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
