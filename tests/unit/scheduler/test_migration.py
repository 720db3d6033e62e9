"""Migration as domain code: fake executors that fail, hang or finish; no processes."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.scheduler.migration import (
    Attempt, ExecutorFailed, MigrationExhausted, MigrationPolicy, NoReplacement, Piece, StreamProgress,
    migrating_stream,
)
from services.shared.stream_resume import StallWatch, continuation_seed

# Every test runs under run()'s 10 s bound. The fakes emit a token every 1 ms, so a short
# stall ceiling also fires on any event-loop pause as long (GC, two starved cores on a loaded
# CI box): a spurious migration. So:
#   CALM  ceilings (30 s) no test lives to reach: a stall is never declared. For every test
#         whose executors fail, finish or pause of their own accord and must not be judged hung.
#   FAST  the stall ceiling 50 ms, for the tests where a fake hangs for ever and the hang must
#         be noticed. A spurious stall there can only land on the hanging executor itself (it
#         is failed either way) or on its replacement, which is therefore `instant`: it never
#         hands the event loop a turn, so the stall timer cannot run while it streams. The
#         first-token ceiling stays 30 s: a stall judged before an executor's first piece is
#         pinned on no executor ("" is not excluded) and would retry the same one.
CALM = MigrationPolicy(max_attempts=3, stall_factor=5, min_stall_s=30, first_token_timeout_s=30,
                       replacement_wait_s=0.3)
FAST = dataclasses.replace(CALM, min_stall_s=0.05)


def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    """A 'greedy model': the next token is a function of the whole context."""
    ctx = list(prompt)
    for _ in range(n):
        ctx.append((sum(ctx) * 31 + len(ctx)) % 1000)
    return ctx[len(prompt):]


def executor(name: str, fail_after: int | None = None, hang_after: int | None = None, calls=None,
             instant: bool = False):
    """``instant``: every token at once, never suspending, so no stall timer runs meanwhile."""
    async def stream(attempt: Attempt):
        if calls is not None:
            calls.append((name, attempt))
        out = reference(attempt.prompt_token_ids, attempt.max_tokens)
        for i, tok in enumerate(out):
            if fail_after is not None and i == fail_after:
                raise ExecutorFailed(name, "connection reset")
            if hang_after is not None and i == hang_after:
                await asyncio.sleep(3600)
            if not instant:
                await asyncio.sleep(0.001)
            yield Piece((tok,), name, i == len(out) - 1)
    return stream


def run(progress: StreamProgress, policy: MigrationPolicy, pick) -> list[Piece]:
    async def main():
        return [p async for p in migrating_stream(progress, policy, pick)]
    return asyncio.run(asyncio.wait_for(main(), 10))


def chooser(executors: dict, calls=None):
    def pick(attempt: Attempt):
        for name, make in executors.items():
            if name not in attempt.exclude:
                return make(attempt)
        raise NoReplacement("all excluded")
    return pick


def test_undisturbed_stream_passes_through_unchanged():
    prompt = (1, 2, 3)
    progress = StreamProgress(prompt, max_tokens=12, min_tokens=0, seed=None)
    pieces = run(progress, CALM, chooser({"a": executor("a")}))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 12)
    assert progress.num_migrations == 0


def test_executor_dying_mid_stream_continues_elsewhere_without_loss_or_repeat():
    prompt = (5, 6, 7, 8)
    calls = []
    progress = StreamProgress(prompt, max_tokens=20, min_tokens=15, seed=None)
    pieces = run(progress, CALM, chooser({"a": executor("a", fail_after=7, calls=calls), "b": executor("b", calls=calls)}))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 20)
    assert progress.num_migrations == 1 and progress.failed_executors == {"a"}
    (_, first), (_, second) = calls
    assert second.prompt_token_ids == prompt + tuple(reference(prompt, 7))
    assert (second.max_tokens, second.min_tokens, second.exclude) == (13, 8, frozenset({"a"}))


def test_hung_executor_is_detected_by_the_stall_ceiling_and_replaced():
    prompt = (9,)
    progress = StreamProgress(prompt, max_tokens=10, min_tokens=0, seed=None)
    pieces = run(progress, FAST, chooser({"a": executor("a", hang_after=4), "b": executor("b", instant=True)}))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 10)
    assert progress.failed_executors == {"a"}


def test_attempts_are_bounded_then_a_clear_error():
    progress = StreamProgress((1,), max_tokens=50, min_tokens=0, seed=None)
    bad = {n: executor(n, fail_after=2) for n in ("a", "b", "c", "d")}
    with pytest.raises(MigrationExhausted, match="3 executor"):
        run(progress, CALM, chooser(bad))
    assert len(progress.output_token_ids) == 6  # what was sent stays sent, nothing repeated


def slow(name: str, pause_at: int, until: asyncio.Event):
    """Silent before token ``pause_at`` until ``until`` is set (by the stall check that judged
    the silence): a pause that outlasts the stall ceiling by construction, not by a timed one."""
    async def stream(attempt: Attempt):
        out = reference(attempt.prompt_token_ids, attempt.max_tokens)
        for i, tok in enumerate(out):
            if i == pause_at:
                await until.wait()
            await asyncio.sleep(0.001)
            yield Piece((tok,), name, i == len(out) - 1)
    return stream


def test_a_stall_on_the_only_live_executor_waits_for_it_instead_of_failing_the_request():
    """Eight prefills at once on two cores: no token for longer than the stall ceiling
    from the only executor, which is alive (heartbeating). Abandoning it ended the request
    UNAVAILABLE 'no executor to continue on'; waiting delivers every token."""
    prompt = (4, 2)
    progress = StreamProgress(prompt, max_tokens=10, min_tokens=0, seed=None)
    asked = []

    async def main():
        judged = asyncio.Event()  # "a" stays silent until the stall is judged (run's 10 s bound if never)

        def only_live(executor, exclude):
            asked.append((executor, exclude))
            judged.set()
            return True

        return [p async for p in migrating_stream(progress, FAST, chooser({"a": slow("a", 5, judged)}), only_live)]
    pieces = asyncio.run(asyncio.wait_for(main(), 10))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 10)
    assert progress.num_migrations == 0 and progress.failed_executors == set()
    assert asked and asked[0] == ("a", frozenset())


def test_a_stall_migrates_when_another_executor_could_take_over():
    prompt = (4, 2)
    progress = StreamProgress(prompt, max_tokens=10, min_tokens=0, seed=None)

    async def main():
        pick = chooser({"a": executor("a", hang_after=4), "b": executor("b", instant=True)})
        return [p async for p in migrating_stream(progress, FAST, pick, lambda e, x: False)]
    pieces = asyncio.run(asyncio.wait_for(main(), 10))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 10)
    assert progress.failed_executors == {"a"}


def test_no_replacement_within_the_wait_is_a_clear_error_not_a_hang():
    progress = StreamProgress((1,), max_tokens=50, min_tokens=0, seed=None)
    with pytest.raises(MigrationExhausted, match="no executor"):
        run(progress, CALM, chooser({"a": executor("a", fail_after=3)}))


def test_failure_after_the_last_token_ends_the_stream_without_a_new_attempt():
    progress = StreamProgress((1,), max_tokens=4, min_tokens=0, seed=None)

    async def lose_finish(attempt):
        for tok in reference(attempt.prompt_token_ids, 4):
            yield Piece((tok,), "a", False)
        raise ExecutorFailed("a", "reset before the finish chunk")

    pieces = run(progress, CALM, lambda a: lose_finish(a))
    assert len(pieces) == 4 and progress.num_migrations == 0


def test_seeded_continuation_is_reproducible_for_the_same_failure_point():
    assert continuation_seed(7, 10) == continuation_seed(7, 10)
    assert continuation_seed(7, 10) != continuation_seed(7, 11) != continuation_seed(8, 10)
    progress = StreamProgress((1,), max_tokens=8, min_tokens=0, seed=7)
    assert progress.attempt(0).seed == 7
    progress.record((3, 4))
    assert progress.attempt(1).seed == continuation_seed(7, 2)


def test_stall_ceiling_scales_with_the_observed_step_time():
    now = [0.0]
    watch = StallWatch(MigrationPolicy(stall_factor=10, min_stall_s=0.5, first_token_timeout_s=30), lambda: now[0])
    assert watch.timeout_s() == 30
    for _ in range(5):
        watch.observe()
        now[0] += 0.2
    assert watch.timeout_s() == pytest.approx(2.0)
    watch.restart()
    assert watch.timeout_s() == 30


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        MigrationPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        MigrationPolicy(stall_factor=0)


def test_an_executor_stalled_before_its_first_token_is_excluded_from_the_retry():
    from services.scheduler.migration import placement_marker

    calls = []

    def stalls_before_first_token(name):
        async def stream(attempt: Attempt):
            calls.append(name)
            yield placement_marker(name)
            await asyncio.sleep(3600)
            yield Piece((1,), name, True)  # never reached
        return stream

    prompt = (4, 5)
    progress = StreamProgress(prompt, max_tokens=6, min_tokens=0, seed=None)
    # "a" ranks first every time unless it is excluded. Its hang is before the first token:
    # the first-token ceiling is what notices it (a spurious stall there is on "a" too, and
    # its placement marker pins it on "a"); "b" is instant, so no stall can land on it.
    policy = dataclasses.replace(FAST, first_token_timeout_s=0.5)
    pieces = run(progress, policy, chooser({"a": stalls_before_first_token("a"), "b": executor("b", instant=True)}))
    assert [t for p in pieces for t in p.token_ids] == reference(prompt, 6)
    assert progress.failed_executors == {"a"}
    assert calls == ["a"]
