"""Executor domain events -> their protobuf messages for the bus (events.proto).

``encode_event`` is what app.py hands the bus: heartbeats, load reports (with the
servicer's measured cost-model rates) and kv events. The domain side lives in
``events.py``; the header is stamped by the bus.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.executor.events import ExecutorState, Heartbeat, KvChange, LoadSnapshot
from services.executor.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from weft.v1 import common_pb2, events_pb2

if TYPE_CHECKING:
    from services.executor.server import ExecutorServicer

_STATES = {
    ExecutorState.JOINING: events_pb2.EXECUTOR_STATE_JOINING,
    ExecutorState.SERVING: events_pb2.EXECUTOR_STATE_SERVING,
    ExecutorState.DRAINING: events_pb2.EXECUTOR_STATE_DRAINING,
    ExecutorState.FAILED: events_pb2.EXECUTOR_STATE_FAILED,
}


def kv_event_to_proto(change: KvChange) -> events_pb2.KvEvent:
    event = change.event
    msg = events_pb2.KvEvent(tier=events_pb2.TIER_ACTIVE, model_id=change.model_id, block_size=change.block_size)
    if isinstance(event, BlockStored):
        msg.kind = events_pb2.KV_EVENT_KIND_STORED
        msg.block_hashes.extend(event.block_hashes)
        if event.parent_hash is not None:
            msg.parent_hash = event.parent_hash
        msg.partition = event.partition
    elif isinstance(event, BlockRemoved):
        msg.kind = events_pb2.KV_EVENT_KIND_REMOVED
        msg.block_hashes.extend(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        msg.kind = events_pb2.KV_EVENT_KIND_CLEARED
    else:
        raise TypeError(f"unknown kv event {event!r}")
    return msg


def encode_event(item: Heartbeat | LoadSnapshot | KvChange, servicer: ExecutorServicer | None = None):
    """Domain event → its protobuf message (header left for the bus to stamp). A load
    report carries ``servicer``'s measured cost-model rates (none without a servicer)."""
    if isinstance(item, KvChange):
        return kv_event_to_proto(item)
    if isinstance(item, Heartbeat):
        i = item.identity
        return events_pb2.ExecutorHeartbeat(
            name=i.name, address=i.address, model_id=i.model_id, block_size=i.block_size,
            state=_STATES[item.state], max_num_seqs=i.max_num_seqs, num_blocks=i.num_blocks,
            interval_ms=int(item.interval_s * 1000), max_model_len=i.max_model_len,
            serves_rung=common_pb2.DegradationRung.Value(f"DEGRADATION_RUNG_{i.serves_rung.upper()}"),
            kv_cache_dtype=i.kv_cache_dtype,
        )
    if isinstance(item, LoadSnapshot):
        return events_pb2.LoadReport(num_running=item.num_running, num_waiting=item.num_waiting,
                                     num_free_blocks=item.num_free_blocks, num_blocks=item.num_blocks,
                                     **(servicer.measured_rates() if servicer is not None else {}))
    raise TypeError(f"unknown event {item!r}")
