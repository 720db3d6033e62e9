"""A silent executor is asked before it is dropped (api/events.MeshView.expire_silent):
a frozen NATS silences every heartbeat while the bus still counts as connected, and
the old expiry dropped every serving executor (tests/adversarial/test_operator_nats_frozen.py
on a real mesh)."""
import asyncio

from services.mesh.nats_bus import Delivery
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import Membership
from services.scheduler.api.events import MeshView
from weft.v1 import events_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def heartbeat(name: str) -> events_pb2.ExecutorHeartbeat:
    msg = events_pb2.ExecutorHeartbeat(name=name, address=f"{name}:1", model_id="m", block_size=16,
                                       state=events_pb2.EXECUTOR_STATE_SERVING, interval_ms=500)
    msg.header.source = name
    return msg


def _view(*names: str) -> tuple[MeshView, Clock]:
    clock = Clock()
    view = MeshView(Membership(clock=clock), KvIndex())
    for name in names:
        view.on_heartbeat(heartbeat(name), Delivery.FIRST)
    return view, clock


def test_a_silent_executor_that_answers_its_probe_stays_and_one_that_does_not_goes():
    view, clock = _view("alive", "dead")
    clock.now += 10  # both silent for 20 intervals

    async def probe(rec):
        return rec.name == "alive"

    dropped = asyncio.run(view.expire_silent(probe))
    assert [r.name for r in dropped] == ["dead"]
    assert [r.name for r in view.membership.placeable()] == ["alive"]
    assert view.membership.silent() == []  # vouched for: the expiry clock starts again


def test_a_probe_that_raises_or_times_out_counts_as_no_answer():
    view, clock = _view("ex")
    clock.now += 10

    async def probe(rec):
        raise TimeoutError

    assert [r.name for r in asyncio.run(view.expire_silent(probe))] == ["ex"]
    assert view.membership.all() == []


def test_a_heartbeat_during_the_probe_wins_over_a_failed_probe():
    view, clock = _view("ex")
    clock.now += 10

    async def probe(rec):  # the executor restarted at a new address meanwhile
        moved = heartbeat("ex")
        moved.address = "ex:2"
        view.on_heartbeat(moved, Delivery.RESTARTED)
        return False

    assert asyncio.run(view.expire_silent(probe)) == []
    assert view.membership.get("ex").address == "ex:2"


def test_without_a_prober_silence_still_expires():
    view, clock = _view("ex")
    clock.now += 10
    assert [r.name for r in asyncio.run(view.expire_silent(None))] == ["ex"]
