"""Events → membership and kv index, including resync on gaps and restarts."""
from services.executor.kv.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from services.executor.events import KvChange
from services.executor.event_codec import kv_event_to_proto
from services.mesh.nats_bus import Delivery
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorState, Membership
from services.scheduler.api.events import MeshView
from weft.v1 import events_pb2


def kv(event, source="ex", seq=1):
    msg = kv_event_to_proto(KvChange(event, "m", 16))
    msg.header.source, msg.header.sequence = source, seq
    return msg


def heartbeat(name="ex", state=events_pb2.EXECUTOR_STATE_SERVING):
    msg = events_pb2.ExecutorHeartbeat(name=name, address=f"{name}:1", model_id="m", block_size=16, state=state,
                                       interval_ms=500)
    msg.header.source = name
    return msg


def test_kv_events_update_the_index_and_a_gap_drops_the_sources_stale_entries():
    view = MeshView(Membership(), KvIndex())
    view.on_kv(kv(BlockStored((1, 2, 3), None, "default")), Delivery.FIRST)
    view.on_kv(kv(BlockRemoved((3,))), Delivery.IN_ORDER)
    assert view.kv_index.match_prefix([1, 2, 3]) == {"ex": 2}
    view.on_kv(kv(BlockStored((9,), None, "default")), Delivery.GAP)  # we may have missed removals
    assert view.kv_index.match_prefix([1]) == {} and view.kv_index.match_prefix([9]) == {"ex": 1}
    view.on_kv(kv(AllBlocksCleared()), Delivery.IN_ORDER)
    assert view.kv_index.num_blocks("ex") == 0


def test_non_active_tiers_do_not_make_a_prefix_holder():
    view = MeshView(Membership(), KvIndex())
    msg = kv(BlockStored((1,), None, "default"), source="cachestore")
    msg.tier = events_pb2.TIER_SLEEPING
    view.on_kv(msg, Delivery.FIRST)
    assert view.kv_index.match_prefix([1]) == {}


def test_heartbeats_drive_membership_and_removal_forgets_kv_entries():
    view = MeshView(Membership(), KvIndex())
    view.on_heartbeat(heartbeat(), Delivery.FIRST)
    assert view.membership.get("ex").state is ExecutorState.SERVING
    assert view.membership.get("ex").interval_s == 0.5
    view.on_kv(kv(BlockStored((1,), None, "default")), Delivery.FIRST)
    view.on_heartbeat(heartbeat(state=events_pb2.EXECUTOR_STATE_DRAINING), Delivery.IN_ORDER)
    assert view.membership.placeable() == []
    view.on_heartbeat(heartbeat(), Delivery.RESTARTED)  # a restarted process has an empty cache
    assert view.kv_index.num_blocks("ex") == 0
    view.on_kv(kv(BlockStored((1,), None, "default"), seq=2), Delivery.IN_ORDER)
    view.membership.remove("ex")
    assert view.kv_index.num_blocks("ex") == 0


def test_kv_event_proto_carries_chain_order_parent_and_tier():
    msg = kv_event_to_proto(KvChange(BlockStored((5, 6), 4, "tenant-a"), "m", 16))
    assert list(msg.block_hashes) == [5, 6] and msg.parent_hash == 4 and msg.partition == "tenant-a"
    assert msg.tier == events_pb2.TIER_ACTIVE and msg.kind == events_pb2.KV_EVENT_KIND_STORED
    assert not kv_event_to_proto(KvChange(BlockStored((5,), None, "p"), "m", 16)).HasField("parent_hash")
