"""Heartbeat signatures (services/mesh/heartbeat_signing.py) and the bus that applies them
after stamping the header (nats_bus.py sealers)."""
import asyncio

import pytest

from services.mesh import heartbeat_signing as hs
from services.mesh import mesh_auth
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import free_port
from weft.v1 import common_pb2, events_pb2


def heartbeat(name="executor-0", address="127.0.0.1:5001") -> events_pb2.ExecutorHeartbeat:
    msg = events_pb2.ExecutorHeartbeat(
        name=name, address=address, model_id="m", block_size=16, state=events_pb2.EXECUTOR_STATE_SERVING,
        max_num_seqs=8, num_blocks=64, interval_ms=500, max_model_len=256,
        serves_rung=common_pb2.DEGRADATION_RUNG_NONE, kv_cache_dtype="auto")
    msg.header.source, msg.header.epoch, msg.header.sequence, msg.header.timestamp_ms = name, "e1", 7, 1234
    msg.header.event_id = "id-1"
    return msg


def test_a_signed_heartbeat_verifies_and_one_under_another_secret_does_not():
    msg = heartbeat()
    hs.HeartbeatSigner("s3cret").sign(msg)
    assert len(msg.signature) == 32
    assert hs.HeartbeatSigner("s3cret").verify(msg) is hs.Verdict.VALID
    assert hs.HeartbeatSigner("other").verify(msg) is hs.Verdict.BAD_SIGNATURE
    assert hs.HeartbeatSigner("s3cret").verify(heartbeat()) is hs.Verdict.UNSIGNED


@pytest.mark.parametrize("field", [f"header.{f}" for f in hs.SIGNED_HEADER_FIELDS] + list(hs.SIGNED_FIELDS))
def test_changing_any_signed_field_breaks_the_signature(field):
    signer = hs.HeartbeatSigner("s3cret")
    msg = heartbeat()
    signer.sign(msg)
    target, name = (msg.header, field.split(".")[1]) if field.startswith("header.") else (msg, field)
    value = getattr(target, name)
    setattr(target, name, value + "x" if isinstance(value, str) else value + 1)
    assert signer.verify(msg) is hs.Verdict.BAD_SIGNATURE


def test_every_heartbeat_field_is_either_signed_or_deliberately_not():
    # A field added to the proto without a decision here would travel unsigned.
    fields = {f.name for f in events_pb2.ExecutorHeartbeat.DESCRIPTOR.fields}
    assert fields == set(hs.SIGNED_FIELDS) | set(hs.UNSIGNED_FIELDS)
    header = {f.name for f in events_pb2.EventHeader.DESCRIPTOR.fields}
    assert header == set(hs.SIGNED_HEADER_FIELDS) | set(hs.UNSIGNED_HEADER_FIELDS)


def test_the_signing_key_is_not_the_secret_and_an_empty_secret_is_refused():
    assert hs.signing_key("s3cret") != b"s3cret" and len(hs.signing_key("s3cret")) == 32
    with pytest.raises(ValueError):
        hs.HeartbeatSigner("")


def test_a_bus_with_a_mesh_secret_signs_the_heartbeats_it_publishes_over_the_stamped_header():
    mesh_auth.configure(environ={"WEFT_MESH_SECRET": "s3cret"})
    try:
        async def scenario():
            bus = EventBus(f"nats://127.0.0.1:{free_port()}", "executor-0")  # default sealers
            first, second = heartbeat(), heartbeat()
            await bus.publish("heartbeat", first)  # dropped (no NATS), but stamped and sealed
            await bus.publish("heartbeat", second)
            load = events_pb2.LoadReport()
            await bus.publish("load", load)
            return first, second

        first, second = asyncio.run(scenario())
    finally:
        mesh_auth._current = None  # leave no process-wide secret behind
    signer = hs.HeartbeatSigner("s3cret")
    assert first.header.sequence == 1 and second.header.sequence == 2
    assert signer.verify(first).ok and signer.verify(second).ok and first.signature != second.signature


def test_without_a_mesh_secret_nothing_is_signed():
    mesh_auth.configure(environ={})
    try:
        assert hs.default_sealers() == {}
    finally:
        mesh_auth._current = None
