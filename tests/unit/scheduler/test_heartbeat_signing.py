"""The scheduler believes only signed heartbeats when it has a mesh secret
(services/scheduler/api/events.py), and an unverified heartbeat never changes a verified
executor (membership.py's address-change rule)."""
import asyncio

import pytest
from structlog.testing import capture_logs

from services.mesh.heartbeat_signing import HeartbeatSigner
from services.mesh.mesh_auth import MeshSecurity
from services.mesh.nats_bus import Delivery, EventBus, _Subscription
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorRecord, ExecutorState, Membership
from services.scheduler.api.events import MeshView
from weft.v1 import events_pb2

SECRET = "mesh-s3cret"


def heartbeat(name="executor-0", address="127.0.0.1:5001", seq=1, epoch="e1", sign_with=SECRET):
    msg = events_pb2.ExecutorHeartbeat(name=name, address=address, model_id="m", block_size=16,
                                       state=events_pb2.EXECUTOR_STATE_SERVING, interval_ms=500)
    msg.header.source, msg.header.sequence, msg.header.epoch = name, seq, epoch
    if sign_with:
        HeartbeatSigner(sign_with).sign(msg)
    return msg


def secured_view(clock=lambda: 0.0) -> MeshView:
    return MeshView(Membership(), KvIndex(), security=MeshSecurity(secret=SECRET), clock=clock)


def test_with_a_secret_unsigned_and_badly_signed_heartbeats_are_dropped_and_logged_with_the_reason():
    view = secured_view()
    with capture_logs() as logs:
        view.on_heartbeat(heartbeat(sign_with=""), Delivery.FIRST)
        view.on_heartbeat(heartbeat(sign_with="guessed"), Delivery.FIRST)
    assert len(view.membership) == 0
    assert [(e["event"], e["reason"]) for e in logs] == [("heartbeat_rejected", "unsigned"),
                                                          ("heartbeat_rejected", "bad_signature")]
    view.on_heartbeat(heartbeat(), Delivery.FIRST)
    assert view.membership.get("executor-0").verified


def test_an_impostor_cannot_move_a_known_executor_but_its_own_signed_restart_can():
    view = secured_view()
    view.on_heartbeat(heartbeat(), Delivery.FIRST)
    forged = heartbeat(address="127.0.0.1:6666", seq=2, sign_with="")
    view.on_heartbeat(forged, Delivery.IN_ORDER)
    assert view.membership.get("executor-0").address == "127.0.0.1:5001"
    view.on_heartbeat(heartbeat(address="127.0.0.1:5002", epoch="e2"), Delivery.RESTARTED)
    assert view.membership.get("executor-0").address == "127.0.0.1:5002"


def test_rejections_are_logged_at_most_once_per_interval_per_reason_with_the_count_held_back():
    now = [0.0]
    view = secured_view(clock=lambda: now[0])
    with capture_logs() as logs:
        for _ in range(50):
            view.on_heartbeat(heartbeat(sign_with=""), Delivery.FIRST)
        now[0] = 11.0
        view.on_heartbeat(heartbeat(sign_with=""), Delivery.FIRST)
    assert [e["num_suppressed"] for e in logs] == [0, 49]


def test_a_refused_heartbeat_never_reaches_sequence_tracking():
    # A forged heartbeat with a huge sequence must not make the real ones duplicates.
    view = secured_view()
    seen = []

    def handler(msg, delivery):
        seen.append(delivery)
        view.on_heartbeat(msg, delivery)

    async def scenario():
        bus = EventBus("nats://127.0.0.1:1", "scheduler", auth=None, sealers={})
        sub = _Subscription("heartbeat", "*", events_pb2.ExecutorHeartbeat, handler, view.accept_heartbeat)
        subj = "weft.heartbeat.executor-0"
        await bus._receive(sub, subj, heartbeat(seq=1).SerializeToString())
        await bus._receive(sub, subj, heartbeat(seq=10**12, sign_with="").SerializeToString())
        await bus._receive(sub, subj, heartbeat(seq=2).SerializeToString())

    asyncio.run(scenario())
    assert seen == [Delivery.FIRST, Delivery.IN_ORDER]


def test_an_event_claiming_a_source_other_than_its_subjects_is_dropped():
    seen = []

    async def scenario():
        bus = EventBus("nats://127.0.0.1:1", "scheduler", sealers={})
        sub = _Subscription("heartbeat", "*", events_pb2.ExecutorHeartbeat, lambda m, d: seen.append(m.name))
        await bus._receive(sub, "weft.heartbeat.cachestore", heartbeat().SerializeToString())
        await bus._receive(sub, "weft.heartbeat.executor-0", heartbeat().SerializeToString())

    asyncio.run(scenario())
    assert seen == ["executor-0"]


def test_without_a_secret_heartbeats_are_taken_unverified_with_one_warning():
    view = MeshView(Membership(), KvIndex(), security=MeshSecurity())
    with capture_logs() as logs:
        view.on_heartbeat(heartbeat(sign_with=""), Delivery.FIRST)
        view.on_heartbeat(heartbeat(address="127.0.0.1:5002", seq=2, sign_with=""), Delivery.IN_ORDER)
    rec = view.membership.get("executor-0")
    assert rec.address == "127.0.0.1:5002" and not rec.verified  # a restart on a new port still works
    assert [e["event"] for e in logs].count("heartbeats_unverified") == 1


def record(address: str, verified: bool) -> ExecutorRecord:
    return ExecutorRecord("executor-0", address, "m", 16, ExecutorState.SERVING, verified=verified)


def test_membership_never_lets_an_unverified_heartbeat_change_a_verified_executor():
    m = Membership()
    m.heartbeat(record("h:1", verified=True))
    for change in (record("evil:1", verified=False), record("h:1", verified=False)):
        assert not m.admits(change)
        with pytest.raises(ValueError, match="unverified"):
            m.heartbeat(change)
    assert m.get("executor-0").address == "h:1"
    assert m.admits(record("h:2", verified=True))


def test_a_view_refuses_an_unverified_change_to_a_verified_record_it_shares():
    membership = Membership()
    membership.heartbeat(record("h:1", verified=True))
    view = MeshView(membership, KvIndex(), security=MeshSecurity())  # a view that cannot verify
    with capture_logs() as logs:
        view.on_heartbeat(heartbeat(address="evil:1", sign_with=""), Delivery.IN_ORDER)
    assert membership.get("executor-0").address == "h:1"
    assert ("heartbeat_rejected", "unverified_change") in [(e["event"], e.get("reason")) for e in logs]
