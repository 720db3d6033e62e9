"""Scheduler continuation: a stream survives the death, restart or stall of its scheduler.

NOTE: this is the scheduler's executor migration one level up, by the same rule: the
stream-resume point of ``services/shared/stream_resume.py``. When the scheduler stream
breaks after chunks were relayed, the router re-issues the request with prompt = original
prompt + every token already relayed and ``max_tokens`` / ``min_tokens`` reduced by that
many (``resume_point``), and keeps relaying:

    attempt 0:   prompt p0..pn            → t0 t1 t2 ✗ (scheduler killed)
    attempt 1:   prompt p0..pn t0 t1 t2   → t3 t4 …  (id "<id>.c1", max_tokens - 3)
    client sees: t0 t1 t2 t3 t4 …         usage: the first attempt's prompt and cached
                                          tokens, output counted across attempts

``Generator.stream`` sees one chunk stream, so its incremental detokenizer and
stop-string holdback just keep running over the relayed tokens.

Continued: a call that broke without the scheduler choosing to end it (``lost``: the
process died or restarted, the connection reset, it shut down mid-stream; UNAVAILABLE /
CANCELLED / INTERNAL / UNKNOWN without a Weft error origin), or a stall: no chunk for
max(``min_stall_s``, ``stall_factor`` × the stream's mean gap) (``first_chunk_probe_s``
before an attempt's first chunk) *and* the scheduler shows no sign of life
(``SchedulerLiveness``). A scheduler that answers (busy migrating the request between
executors, prefilling, draining, relaying hundreds of other streams) is waited on; the
request's deadline still bounds it.

Liveness, shared by every stream of the router (issue 12: 10-15 % of 200 concurrent
streams got 503 from a healthy scheduler: they all reached the first-chunk ceiling at
once, each sent its own health probe, and the herd of probes on a scheduler busy relaying
the other streams took longer than one ``probe_timeout_s`` to answer). The verdict is
"dead" only when, during this stream's silence, *no* stream got a chunk, no probe was
answered, and a round of ``probe_attempts`` probes, each unanswered for
``probe_timeout_s`` × ``probe_backoff``^k, also goes unanswered; a slow answer is an
answer. One round at a time: every stalled stream waits on the same one. A transport
that knows the scheduler is unreachable (the gRPC channel in TRANSIENT_FAILURE) is
"dead" at once. A SIGSTOPped scheduler sends nothing and answers nothing, so it is still
given up on, after the ceiling plus one round (1 + 2 + 4 = 7 s at the defaults).
Not continued: anything before the first chunk of the first attempt (nothing was
generated: ``scheduler_client`` retries that itself), a status the scheduler chose (its
own migration gave up, a bad request, the deadline), nor a liveness check that raised (a
bug: the read fails with ``StallCheckFailed``, INTERNAL, instead of hanging unwatched).
The reads are timed by the shared ``services/shared/stream_watch.py``.

Bounded: at most ``max_attempts`` continuations. Each waits for the scheduler at most
``reconnect_wait_s``, retrying with jittered backoff (tenacity) while it is down, refuses
(UNAVAILABLE / RESOURCE_EXHAUSTED) or does not answer; then UNAVAILABLE naming how many
tokens were sent. A fresh request id per continuation: a stalled scheduler that wakes up
may still hold the old one.

Sessions: the continuation keeps the hop's session fields, so whichever scheduler
finishes it records the hop exactly once. A stateful hop stays stateful (prompt = the
hop's new tokens + the tokens relayed; the scheduler prepends the session context once).
A scheduler that lost the session (restarted) or already closed the hop refuses it
(INVALID_ARGUMENT on ``session.*``): the stream then ends UNAVAILABLE, telling the
client to resend the hop with its full prompt; it never runs on a partial context.

The continuation sets ``resumed_output_tokens`` to the number of relayed tokens: the
executor treats that tail of its prompt as output already generated, so a grammar
(structured output, forced tool calls) is advanced over it and continues where it was.

A finish is final whatever its reason; ``kv_quota`` (the task contract's KV quota ran
out) never invites a continuation. A continuation the executor refuses because the
replayed prompt alone fills the quota (``session.contract.kv_quota_blocks``) ends the
stream with ``kv_quota`` instead of an error: the quota, not the scheduler, ended it.

Seeded sampling follows the shared rule: the continuation is seeded with
``continuation_seed(seed, num_sent)``, reproducible per failure point only.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import structlog

from services.mesh.retry import outage_retrying
from services.router.errors import InvalidRequestError, OverloadedError, UpstreamError, UpstreamUnavailable
from services.router.schema import TokenChunk, TokenRequest
from services.shared.stream_resume import StallRule, StallWatch, budget_spent, resume_point
from services.shared.stream_watch import WatchedReads

log = structlog.get_logger(__name__)

Probe = Callable[[float], Awaitable[bool]]  # probe(timeout_s): does the scheduler answer?
Unreachable = Callable[[], bool]  # does the transport already know the scheduler is down?


@dataclass(frozen=True)
class ContinuationPolicy:
    """How hard the router tries to keep a stream alive across scheduler failures."""

    max_attempts: int = 3  # continuations per stream; 0: a lost scheduler ends the stream
    reconnect_wait_s: float = 10.0  # how long one continuation waits for the scheduler
    stall_factor: float = 20.0  # no chunk for stall_factor × mean gap → probe the scheduler
    min_stall_s: float = 2.0  # floor of that wait
    first_chunk_probe_s: float = 5.0  # before an attempt's first chunk: probe this often
    probe_timeout_s: float = 1.0  # the first probe of a round unanswered this long: probe again
    probe_attempts: int = 3  # probes per round, all unanswered (and no chunk anywhere): stalled
    probe_backoff: float = 2.0  # each further probe of a round waits this many times longer

    def __post_init__(self) -> None:
        if self.max_attempts < 0:
            raise ValueError("max_attempts must be >= 0")
        if self.probe_attempts < 1:
            raise ValueError("probe_attempts must be >= 1")
        if self.probe_backoff < 1:
            raise ValueError("probe_backoff must be >= 1")
        for name in ("stall_factor", "min_stall_s", "first_chunk_probe_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.reconnect_wait_s < 0:
            raise ValueError("reconnect_wait_s must be >= 0")

    def stall_watch(self, clock: Callable[[], float] = time.monotonic) -> StallWatch:
        return StallWatch(StallRule(stall_factor=self.stall_factor, min_stall_s=self.min_stall_s,
                                    first_token_timeout_s=self.first_chunk_probe_s), clock)


def is_lost(exc: BaseException) -> bool:
    return isinstance(exc, (UpstreamUnavailable, UpstreamError)) and exc.lost


@dataclass
class _Progress:
    """What the client has been sent; mutated by ``relay``."""

    request: TokenRequest
    sent_token_ids: list[int] = field(default_factory=list)
    num_chunks: int = 0
    num_continuations: int = 0
    num_prompt_tokens: int = 0  # as the first attempt reported them
    num_cached_tokens: int = 0

    @property
    def budget_spent(self) -> bool:
        """Every requested token was sent: only the finish marker was lost."""
        return budget_spent(self.request.sampling.max_tokens or 0, len(self.sent_token_ids))

    def continuation(self) -> TokenRequest:
        """The request resumed after the tokens sent (``resume_point``), under a fresh id."""
        r, s = self.request, self.request.sampling
        point = resume_point(r.prompt_token_ids, self.sent_token_ids, s.max_tokens or 0, s.min_tokens, s.seed)
        # resumed_output_tokens: the sent tokens are output, not prompt, so a grammar replays
        # them and continues (not restarts) and penalties still count them; prompt
        # logprobs were sent with the first attempt's first chunk and are not asked again.
        sampling = replace(s, max_tokens=point.max_tokens if s.max_tokens else s.max_tokens,
                           min_tokens=point.min_tokens, seed=point.seed, prompt_logprobs=None,
                           resumed_output_tokens=s.resumed_output_tokens + len(self.sent_token_ids))
        return replace(r, request_id=f"{r.request_id}.c{self.num_continuations}",
                       prompt_token_ids=point.prompt_token_ids, sampling=sampling)

    def relay(self, chunk: TokenChunk) -> TokenChunk:
        """Record a chunk; after a continuation, rewrite it as part of the first stream."""
        self.num_chunks += 1
        self.sent_token_ids.extend(chunk.token_ids)
        if not self.num_continuations:
            self.num_prompt_tokens, self.num_cached_tokens = chunk.num_prompt_tokens, chunk.num_cached_tokens
            return chunk
        finished = chunk.finish_reason is not None
        return replace(chunk, num_prompt_tokens=self.num_prompt_tokens or len(self.request.prompt_token_ids),
                       num_cached_tokens=self.num_cached_tokens, num_output_tokens=len(self.sent_token_ids),
                       degradation_rung="",  # named once, on the stream's first chunk
                       num_migrations=chunk.num_migrations + self.num_continuations if finished else 0,
                       notes=chunk.notes if finished else None)

    def finish(self, reason: str = "length") -> TokenChunk:
        """The finish marker the lost stream did not deliver."""
        n = len(self.sent_token_ids)
        return TokenChunk((), (), reason, self.num_prompt_tokens or len(self.request.prompt_token_ids),
                          self.num_cached_tokens, n, "", num_migrations=self.num_continuations)


KV_QUOTA_FIELD = "session.contract.kv_quota_blocks"


class _QuotaSpent(Exception):
    """The continuation's prompt alone fills the task's KV quota: the stream is done."""


class SchedulerLiveness:
    """One verdict, shared by every stream of a router, on whether the scheduler is alive.

    Signs of life: a chunk on any stream (``note_alive``) or an answered health probe.
    ``alive(after)`` is True when there was one after ``after`` (the start of the asking
    stream's silence window); otherwise it joins the round of probes in flight or starts
    one (single flight: N stalled streams cost one probe at a time, not N). Mutates only
    its own sign-of-life time and round."""

    def __init__(self, policy: ContinuationPolicy, probe: Probe | None, unreachable: Unreachable | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.probe = probe
        self.unreachable = unreachable
        self.clock = clock
        self.last_sign_s = float("-inf")
        self._sign = asyncio.Event()  # set by every sign of life; a round clears it per probe
        self._round: asyncio.Task | None = None

    def note_alive(self, at_s: float) -> None:
        self.last_sign_s = max(self.last_sign_s, at_s)
        self._sign.set()

    async def alive(self, after_s: float) -> bool:
        if self.unreachable is not None and self.unreachable():
            return False  # the transport already knows: no need to wait out a probe
        if self.last_sign_s > after_s:
            return True
        if self.probe is None:
            return False
        if self._round is None:
            self._round = asyncio.ensure_future(self._probe_round())
            self._round.add_done_callback(self._round_done)
        # shield: a stream cancelled while waiting (its client left) must not cancel the
        # round the other streams wait on.
        return await asyncio.shield(self._round)

    def _round_done(self, task: asyncio.Task) -> None:
        if self._round is task:
            self._round = None

    async def _probe_round(self) -> bool:
        """Probe until an answer or a chunk anywhere (True), or ``probe_attempts`` probes
        went unanswered, each given ``probe_backoff`` times longer than the last (False)."""
        timeout_s = self.policy.probe_timeout_s
        for attempt in range(1, self.policy.probe_attempts + 1):
            if self.unreachable is not None and self.unreachable():
                return False
            self._sign.clear()
            if await self._probe_once(timeout_s):
                return True
            log.warning("scheduler_probe_unanswered", attempt=attempt, of=self.policy.probe_attempts,
                        timeout_s=round(timeout_s, 3))
            timeout_s *= self.policy.probe_backoff
        return False

    async def _probe_once(self, timeout_s: float) -> bool:
        """One probe given ``timeout_s``; True as soon as it answers or any stream gets a
        chunk. A probe refused early still waits out ``timeout_s`` for a chunk."""
        assert self.probe is not None
        started_s = self.clock()
        sign = asyncio.ensure_future(self._sign.wait())
        probe = asyncio.ensure_future(self.probe(timeout_s))
        try:
            done, _ = await asyncio.wait({sign, probe}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if probe in done and probe.exception() is None and probe.result():
                self.note_alive(self.clock())
                return True
            if sign not in done and probe in done:  # refused at once: a chunk may still come
                done, _ = await asyncio.wait({sign}, timeout=max(0.0, started_s + timeout_s - self.clock()))
            return sign in done
        finally:
            for task in (sign, probe):
                task.cancel()
            await asyncio.wait({sign, probe})
            if not probe.cancelled():
                probe.exception()  # retrieved: a failed probe is an unanswered one, not an error


class _WatchedStream:
    """A chunk stream under the shared stall watch (``WatchedReads``): past the stall
    ceiling the router-wide ``SchedulerLiveness`` is asked (a task, only then); no sign of
    life fails the read with a lost ``UpstreamUnavailable``, any sign of life keeps waiting.
    Every chunk is a sign of life for the other streams too."""

    def __init__(self, chunks: AsyncIterator[TokenChunk], policy: ContinuationPolicy,
                 liveness: SchedulerLiveness) -> None:
        self.chunks = chunks
        self.policy = policy
        self.liveness = liveness
        self.watch = policy.stall_watch(liveness.clock)
        self.quiet_since_s = liveness.clock()  # this stream's start or its last chunk
        self.reads = WatchedReads(chunks, self.watch, self._stalled)

    async def next(self) -> TokenChunk | None:
        """The next chunk; None at the end of the stream."""
        try:
            chunk = await self.reads.next()
        except StopAsyncIteration:
            return None
        self.watch.observe()
        self.quiet_since_s = self.liveness.clock()
        self.liveness.note_alive(self.quiet_since_s)
        return chunk

    async def _stalled(self, silent_s: float) -> UpstreamUnavailable | None:
        """A read passed its ceiling: None (wait on) if the scheduler shows life, else the lost verdict."""
        window_start_s = max(self.quiet_since_s, self.liveness.clock() - silent_s)
        if await self.liveness.alive(window_start_s):
            log.info("scheduler_slow_but_alive", silent_s=round(silent_s, 2))
            return None
        return UpstreamUnavailable(
            f"scheduler: no chunk for {silent_s:.1f}s, none on any other stream, and no answer to "
            f"{self.policy.probe_attempts} health probe(s)", lost=True)

    async def aclose(self) -> None:
        self.reads.close()
        await self.chunks.aclose()


class ContinuingStreamer:
    """A ``TokenStreamer`` that continues streams across scheduler failures."""

    def __init__(self, downstream, policy: ContinuationPolicy | None = None, probe: Probe | None = None,
                 unreachable: Unreachable | None = None) -> None:
        self.downstream = downstream  # TokenStreamer: the scheduler client
        self.policy = policy or ContinuationPolicy()
        self.liveness = SchedulerLiveness(self.policy, probe, unreachable)

    async def generate(self, request: TokenRequest, timeout_s: float) -> AsyncIterator[TokenChunk]:
        """Stream the request's chunks as one stream. Closing this generator cancels the call."""
        deadline = time.monotonic() + timeout_s
        progress = _Progress(request)
        stream = self._watched(request, timeout_s)
        try:
            while True:
                try:
                    chunk = await stream.next()
                except (UpstreamUnavailable, UpstreamError) as exc:
                    if not (exc.lost and progress.num_chunks):
                        raise
                    await stream.aclose()
                    if progress.budget_spent:
                        yield progress.finish("length")
                        return
                    try:
                        stream, chunk = await self._continue(progress, exc, deadline)
                    except _QuotaSpent:
                        yield progress.finish("kv_quota")
                        return
                if chunk is None:
                    return  # ended without a finish reason: Generator.stream reports it
                yield progress.relay(chunk)
                if chunk.finish_reason is not None:
                    return
        finally:
            await stream.aclose()

    def _watched(self, request: TokenRequest, timeout_s: float) -> _WatchedStream:
        return _WatchedStream(self.downstream.generate(request, timeout_s), self.policy, self.liveness)

    async def _continue(self, progress: _Progress, error: Exception,
                        deadline: float) -> tuple[_WatchedStream, TokenChunk | None]:
        """Re-issue the request from the tokens sent; (stream, its first chunk)."""
        num_sent = len(progress.sent_token_ids)
        log.warning("scheduler_lost_mid_stream", num_sent_tokens=num_sent, attempt=progress.num_continuations,
                    reason=str(error))
        if progress.num_continuations >= self.policy.max_attempts:
            raise UpstreamUnavailable(
                f"stream lost with the scheduler after {num_sent} tokens were sent "
                f"({progress.num_continuations} continuation(s) tried): {error}") from error
        progress.num_continuations += 1
        request = progress.continuation()
        log.info("stream_continuing", attempt=progress.num_continuations, num_replayed_tokens=num_sent,
                 continuation_id=request.request_id)
        try:
            return await self._open(request, deadline)
        except (UpstreamUnavailable, UpstreamError, OverloadedError, InvalidRequestError) as exc:
            if isinstance(exc, InvalidRequestError) and exc.field == KV_QUOTA_FIELD:
                raise _QuotaSpent() from exc
            hint = ""
            if isinstance(exc, InvalidRequestError) and exc.field.startswith("session"):
                hint = (f"; the scheduler no longer holds session {request.session.session_id!r} at this hop "
                        "(restarted?): resend the hop with its full prompt")
            raise UpstreamUnavailable(
                f"stream lost with the scheduler after {num_sent} tokens were sent; continuation "
                f"{progress.num_continuations} of {self.policy.max_attempts} failed: {exc}{hint}") from exc

    async def _open(self, request: TokenRequest, deadline: float) -> tuple[_WatchedStream, TokenChunk | None]:
        """Start the continuation and wait for its first chunk, riding out the scheduler's
        outage (down, refusing, or silent) for at most ``reconnect_wait_s``."""

        def scheduler_down(exc: BaseException) -> bool:
            if time.monotonic() >= deadline:
                return False
            return is_lost(exc) or isinstance(exc, (UpstreamUnavailable, OverloadedError))

        async for attempt in outage_retrying(self.policy.reconnect_wait_s, scheduler_down):
            with attempt:
                stream = self._watched(request, max(0.001, deadline - time.monotonic()))
                try:
                    return stream, await stream.next()
                except BaseException:
                    await stream.aclose()
                    raise
        raise AssertionError("unreachable: outage_retrying reraises")  # pragma: no cover
