"""Regression tests for attacker A2's defects in services/mesh/document_inbox.py (issue 17),
each failing on main at f13d0ee: a junk flood on fresh subjects kept a known router's new
document out, a handler's CancelledError stopped the inbox for good, an offer after close
started a worker nothing cancels, and (stop 26's "own-subject defect", fixed by the v2
signature over the raw bytes, settings_signing.py) junk or a replayed genuine document on a
router's own subject superseded its pending document before its signature was read."""
from __future__ import annotations

import asyncio
import functools

from services.mesh.document_inbox import MAX_PENDING_SUBJECTS, DocumentInbox
from services.mesh.live_settings import BUS_KIND, LiveDocument
from services.mesh.settings_signing import DocumentSeal
from tests import waiting

DEADLINE_S = 10.0


until = functools.partial(waiting.until, deadline_s=DEADLINE_S)  # this file's own bound


def test_a_junk_flood_on_distinct_subjects_does_not_keep_a_known_routers_new_document_out():
    """A publisher allowed on weft.settings.> (any holder of the router role's NATS password;
    with the development fallback passwords, anyone who reaches the NATS port) keeps the 64
    slots full with junk on fresh subjects, faster than the worker empties them (the realistic
    regime: one junk message costs the attacker a publish, the receiver a parse and a 3x pause).
    The real router, whose documents were accepted before the flood, makes a change and
    republishes it every few seconds, i.e. every many handlings: it finds the inbox full every
    time and is dropped as ``overflow`` -- the change never propagates while the flood lasts,
    although the module says 'nothing is lost for good'. The handler says which documents it
    accepted (returns True), which is what the proposed fix needs to keep a slot for them."""
    async def scenario():
        handled: list[str] = []
        inbox: DocumentInbox
        counter = iter(range(10**9))
        flooding = False

        async def handler(data: bytes) -> bool:
            handled.append(data.decode())
            if flooding:  # the flood refills the slot this handling freed
                inbox.offer(f"weft.settings.junk-{next(counter)}", b"junk")
                if len(handled) % 20 == 0:  # the router's periodic republish of its new document
                    inbox.offer("weft.settings.router-1", b"v2")
            await asyncio.sleep(0)
            return data != b"junk"  # accepted: signed by the mesh secret and well formed

        inbox = DocumentInbox("settings-flood", handler, clock=lambda: 0.0)  # no pause: pacing is not the point
        try:
            inbox.offer("weft.settings.router-1", b"v1")
            await until(lambda: handled == ["v1"], "the router's first document handled")
            flooding = True
            for _ in range(MAX_PENDING_SUBJECTS):
                inbox.offer(f"weft.settings.junk-{next(counter)}", b"junk")
            await until(lambda: len(handled) >= 2000, "2,000 documents handled")
            return handled
        finally:
            await inbox.close()

    handled = asyncio.run(scenario())
    assert "v2" in handled, "the router's new document was dropped as overflow on all 100 republishes"


def test_a_handler_cancelled_inside_does_not_stop_the_inbox_for_good():
    """A handler whose await is cancelled from elsewhere (the executor's PartitionTable.apply awaits
    async_engine.call; SettingsFollower.receive catches Exception only) raises CancelledError, a
    BaseException: the worker task ends, ``offer`` only starts a worker when ``_task is None``,
    so every later document waits for ever, silently."""
    async def scenario():
        handled: list[bytes] = []
        tried: list[bytes] = []

        async def handler(data: bytes) -> None:
            tried.append(data)
            if data == b"first":
                raise asyncio.CancelledError()  # what an awaited future cancelled elsewhere raises
            handled.append(data)

        inbox = DocumentInbox("settings-cancel", handler, clock=lambda: 0.0)
        try:
            inbox.offer("weft.settings.router-1", b"first")
            await until(lambda: tried == [b"first"] and not inbox._pending, "the first document tried")
            inbox.offer("weft.settings.router-1", b"second")
            await until(lambda: handled == [b"second"], "the second document handled")
        finally:
            await inbox.close()

    asyncio.run(scenario())


def test_an_offer_after_close_starts_no_worker():
    """close() does not mark the inbox closed: a message delivered after it (NatsBus.close gives
    nc.close() 2 s, then closes the inboxes even if the connection is still delivering) starts a
    fresh worker task that nothing will ever cancel."""
    async def scenario():
        async def handler(data: bytes) -> None:
            await asyncio.Event().wait()  # a handler that is still busy when the process shuts down

        inbox = DocumentInbox("settings-closed", handler)
        inbox.offer("weft.settings.router-1", b"a")
        await asyncio.sleep(0)
        await inbox.close()
        inbox.offer("weft.settings.router-1", b"late")
        task = inbox._task
        if task is not None:
            task.cancel()
        return task

    assert asyncio.run(scenario()) is None, "a worker task was started after close()"


def test_junk_on_a_routers_own_subject_does_not_supersede_its_pending_document():
    """The inbox keeps one slot per subject, and used to keep whatever came last, unread: a
    publisher allowed on weft.settings.> sent junk (or a mis-signed document) on
    weft.settings.<router>'s subject right after the router's change, and the change was
    superseded before its signature was read -- on every republish, for as long as the junk
    followed it. With a secret the inbox now screens each document (an HMAC over its bytes)
    before it takes the slot."""
    seal = DocumentSeal("inbox-secret", "router")
    other_mesh = DocumentSeal("another-secret", "router")
    doc = LiveDocument.parse({"scheduler": {"policy": "fcfs"}}).stamped(3, 1.0, "w", "admin_api").bus_document()
    genuine = seal.seal(BUS_KIND, doc, "router-1")
    replayed_elsewhere = seal.seal(BUS_KIND, {**doc, "version": 9}, "router-2")  # genuine, another router's
    subject = f"weft.{BUS_KIND}.router-1"

    async def scenario():
        handled: list[bytes] = []
        receiver = DocumentSeal("inbox-secret", "scheduler")
        inbox = DocumentInbox(BUS_KIND, lambda data: _append(handled, data), clock=lambda: 0.0,
                              screen=lambda subj, data: receiver.admits(BUS_KIND, subj, data))
        try:
            assert inbox.offer(subject, genuine)
            for junk in (b"junk", genuine[:-1], genuine + b"x", other_mesh.seal(BUS_KIND, doc, "router-1"),
                         replayed_elsewhere, genuine.replace(b"router-1", b"router-3", 1)):
                assert not inbox.offer(subject, junk)  # refused before it touches the slot
            await until(lambda: handled, "the pending document handled")
            return handled, receiver.num_refused
        finally:
            await inbox.close()

    handled, num_refused = asyncio.run(scenario())
    assert handled == [genuine] and num_refused == 6


async def _append(handled: list, data: bytes) -> bool:
    handled.append(data)
    return True


def test_without_a_secret_the_screen_lets_everything_through():
    """Development mode (no WEFT_MESH_SECRET) tells nothing apart: the screen admits all,
    as the handler does (settings_signing.py)."""
    seal = DocumentSeal("", "scheduler")
    assert seal.admits(BUS_KIND, "weft.settings.router-1", b"junk")
    assert seal.num_refused == 0

