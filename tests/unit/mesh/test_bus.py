import asyncio

from services.mesh.nats_bus import Delivery, EventBus, SequenceTracker
from services.mesh.subjects import subject
from services.mesh.nats_server import free_port
from weft.v1 import events_pb2


def test_in_order_duplicate_gap_and_restart_are_told_apart():
    t = SequenceTracker()
    assert t.observe("kv.a", "e1", 5) is Delivery.FIRST
    assert t.observe("kv.a", "e1", 6) is Delivery.IN_ORDER
    assert t.observe("kv.a", "e1", 6) is Delivery.DUPLICATE
    assert t.observe("kv.a", "e1", 3) is Delivery.DUPLICATE
    assert t.observe("kv.a", "e1", 9) is Delivery.GAP
    assert t.observe("kv.a", "e1", 10) is Delivery.IN_ORDER
    assert t.observe("kv.a", "e2", 1) is Delivery.RESTARTED
    assert t.observe("kv.b", "e1", 1) is Delivery.FIRST  # streams are independent
    assert Delivery.GAP.needs_resync and Delivery.RESTARTED.needs_resync and not Delivery.IN_ORDER.needs_resync


def test_subject_names_are_validated():
    assert subject("kv", "ex-1") == "weft.kv.ex-1"
    for bad in ("a.b", "a*", "", "a b"):
        try:
            subject("kv", bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def _event(source: str, epoch: str, seq: int) -> events_pb2.KvEvent:
    ev = events_pb2.KvEvent(kind=events_pb2.KV_EVENT_KIND_STORED, block_hashes=[seq])
    ev.header.source, ev.header.epoch, ev.header.sequence = source, epoch, seq
    return ev


def test_deliver_drops_duplicates_and_flags_gaps_to_the_handler():
    async def scenario():
        bus = EventBus("nats://127.0.0.1:1", "consumer")
        seen = []
        handler = lambda ev, d: seen.append((ev.header.sequence, d))  # noqa: E731
        for seq in (1, 2, 2, 5, 4):
            await bus.deliver("kv", _event("ex", "e", seq), handler)
        assert seen == [(1, Delivery.FIRST), (2, Delivery.IN_ORDER), (5, Delivery.GAP)]

    asyncio.run(scenario())


def test_publish_while_nats_is_unreachable_drops_and_counts_without_raising():
    async def scenario():
        bus = EventBus(f"nats://127.0.0.1:{free_port()}", "ex-1", reconnect_wait_s=0.05)
        await bus.start()  # nothing listens there: keeps retrying in the background
        try:
            hb = events_pb2.ExecutorHeartbeat(name="ex-1")
            assert await bus.publish("heartbeat", hb) is False
            assert await bus.publish("heartbeat", hb) is False
            assert bus.num_dropped == 2 and bus.num_published == 0
            assert hb.header.sequence == 2  # dropped events still advance the sequence: consumers see a gap
            assert hb.header.source == "ex-1" and hb.header.epoch == bus.epoch
        finally:
            await bus.close()

    asyncio.run(scenario())
