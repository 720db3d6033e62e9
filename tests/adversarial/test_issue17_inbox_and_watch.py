"""Attacks on this session's document inbox (services/mesh/document_inbox.py) and shared stall
watch (services/shared/stream_watch.py), issue 17: documents at the size limit, odd subject
names, closing with documents queued; many streams whose clients leave at once, and a client's
cancellation racing a stall verdict in the same loop turn. Every wait is on a condition with
a deadline; nothing here depends on how fast the machine is."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from services.mesh import metrics
from services.mesh.document_inbox import DocumentInbox
from services.shared.stream_resume import StallRule, StallWatch
from services.shared.stream_watch import WatchedReads
from tests import waiting
from tests.waiting import GatedSource

DEADLINE_S = 10.0
HOUR_S = 3600.0


until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def dropped(kind: str, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("weft_documents_dropped_total", {"kind": kind, "reason": reason}) or 0.0


def run(coro):
    """Run ``coro`` under an outer bound; also return what reached the loop's exception handler."""
    async def main():
        unhandled: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        return await asyncio.wait_for(coro, DEADLINE_S), unhandled

    return asyncio.run(main())


# -- the document inbox --------------------------------------------------------------------
def test_a_document_exactly_at_the_size_limit_is_kept_and_one_byte_more_is_refused_unread():
    async def scenario():
        handled: list[int] = []

        async def handler(data: bytes) -> None:
            handled.append(len(data))

        inbox = DocumentInbox("a2-limit", handler, max_bytes=1024, clock=lambda: 0.0)
        too_large = dropped("a2-limit", "too_large")
        try:
            assert inbox.offer("weft.a2-limit.r1", b"x" * 1024)
            assert not inbox.offer("weft.a2-limit.r2", b"x" * 1025)
            await until(lambda: handled, "the document at the limit handled")
            return handled, dropped("a2-limit", "too_large") - too_large, dict(inbox._pending)
        finally:
            await inbox.close()

    (handled, refused, pending), unhandled = run(scenario())
    assert handled == [1024] and refused == 1 and pending == {} and unhandled == []


def test_odd_subject_names_each_take_their_own_slot_and_are_handled_in_arrival_order():
    subjects = ["weft.a2-odd.ä-router", "weft.a2-odd." + "r" * 4000, "weft.a2-odd.-", "weft.a2-odd.\u202eevil",
                "weft.a2-odd.ä-router"]  # the last supersedes the first and keeps its place

    async def scenario():
        gate = asyncio.Event()
        handled: list[bytes] = []

        async def handler(data: bytes) -> None:
            await gate.wait()
            handled.append(data)

        inbox = DocumentInbox("a2-odd", handler, clock=lambda: 0.0)
        try:
            assert inbox.offer("weft.a2-odd.first", b"first")
            await until(lambda: not inbox._pending, "the worker to take the first document")
            for i, subject in enumerate(subjects):
                assert inbox.offer(subject, b"%d" % i)
            gate.set()
            await until(lambda: len(handled) == 5, "five documents handled")
            return handled
        finally:
            await inbox.close()

    handled, unhandled = run(scenario())
    assert handled == [b"first", b"4", b"1", b"2", b"3"] and unhandled == []


def test_closing_with_documents_queued_ends_the_worker_and_handles_none_of_them():
    async def scenario():
        entered = asyncio.Event()
        handled: list[bytes] = []

        async def handler(data: bytes) -> None:
            entered.set()
            await asyncio.Event().wait()  # busy when the bus closes
            handled.append(data)

        inbox = DocumentInbox("a2-close", handler)
        for i in range(10):
            inbox.offer(f"weft.a2-close.r{i}", b"%d" % i)
        task = inbox._task
        await entered.wait()
        await inbox.close()
        return task, handled, dict(inbox._pending), inbox._task

    (task, handled, pending, after), unhandled = run(scenario())
    assert task is not None and task.done() and task.cancelled()
    assert handled == [] and pending == {} and after is None and unhandled == []


# -- the stall watch on reads --------------------------------------------------------------


class Lost(Exception):
    pass


def watch(first_s: float, stall_s: float = 0.05, clock=time.monotonic) -> StallWatch:
    return StallWatch(StallRule(stall_factor=1.0, min_stall_s=stall_s, first_token_timeout_s=first_s), clock)


def test_a_thousand_streams_whose_clients_leave_at_once_leave_no_timer_check_or_task():
    """Each stream got one chunk and waits for the next with its timer armed and, for half of
    them, a slow awaited stall check in flight; every client leaves in the same loop turn."""
    num_streams = 1000

    async def scenario():
        before = asyncio.all_tasks()  # the test's own (this one and run's)
        forever = asyncio.Event()
        checks_entered: list[int] = []

        async def slow_check(silent_s: float):
            checks_entered.append(1)
            await forever.wait()

        sources = [GatedSource() for _ in range(num_streams)]
        reads = []
        for i, source in enumerate(sources):
            source.give()
            stalled = slow_check if i % 2 else (lambda silent_s: Lost())
            first_s = 0.0 if i % 2 else HOUR_S  # odd streams stall at once: their check goes out
            reads.append(WatchedReads(source.items(), watch(first_s, stall_s=0.0 if i % 2 else HOUR_S), stalled))
        assert [await r.next() for r in reads] == [0] * num_streams
        readers = [asyncio.ensure_future(r.next()) for r in reads]
        await until(lambda: len(checks_entered) == num_streams // 2, "every odd stream's stall check out")
        for reader in readers:
            reader.cancel()
        outcomes = await asyncio.gather(*readers, return_exceptions=True)
        for r in reads:
            r.close()
            await r.source.aclose()
        await asyncio.sleep(0)  # one loop turn for the cancelled checks to finish
        await until(lambda: all(r._check is None for r in reads), "every check ended")
        others = list(asyncio.all_tasks() - before)
        armed = [r for r in reads if r._timer is not None]
        return outcomes, others, armed

    (outcomes, others, armed), unhandled = run(scenario())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert others == [] and armed == [] and unhandled == []


@pytest.mark.parametrize("order", ["client_first", "verdict_first"])
def test_a_client_leaving_in_the_loop_turn_the_verdict_lands_stays_a_cancellation(order):
    """The timer's verdict and the client's cancellation reach the reader in the same loop turn:
    the reader ends cancelled (the client's intent), not with the verdict."""
    now = [0.0]

    async def scenario():
        source = GatedSource()
        reads = WatchedReads(source.items(), watch(1.0, clock=lambda: now[0]), lambda silent_s: Lost())
        reader = asyncio.ensure_future(reads.next())
        await source.waiting.wait()
        now[0] = 5.0  # past the read's ceiling: the verdict is due
        if order == "client_first":
            reader.cancel()
            reads._due()
        else:
            reads._due()
            reader.cancel()
        outcome = (await asyncio.gather(reader, return_exceptions=True))[0]
        reads.close()
        return outcome

    outcome, unhandled = run(scenario())
    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert unhandled == []
