"""The scheduler's view of the cachestore tiers: reachable by every executor, never a
prefix holder; placement still prefers the executor with GPU hits."""
from services.mesh.nats_bus import Delivery
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import Membership
from services.scheduler.policy.placement import Candidate, KvAwarePlacer
from services.scheduler.api.events import MeshView
from weft.v1 import events_pb2


def store_event(kind, hashes, tier=events_pb2.TIER_SLEEPING, seq=1):
    msg = events_pb2.KvEvent(kind=kind, block_hashes=hashes, tier=tier)
    msg.header.source, msg.header.sequence = "cachestore", seq
    return msg


def test_cachestore_events_make_blocks_reachable_for_every_executor_but_no_holder():
    view = MeshView(Membership(), KvIndex())
    view.on_kv(store_event(events_pb2.KV_EVENT_KIND_STORED, [1, 2, 3]), Delivery.FIRST)
    view.on_kv(store_event(events_pb2.KV_EVENT_KIND_STORED, [3], events_pb2.TIER_ARCHIVED, 2), Delivery.IN_ORDER)
    view.on_kv(store_event(events_pb2.KV_EVENT_KIND_REMOVED, [3], seq=3), Delivery.IN_ORDER)
    idx = view.kv_index
    assert idx.match_prefix([1, 2, 3]) == {}
    assert idx.num_store_blocks([1, 2, 3, 4]) == 3 and idx.num_store_blocks([1, 2, 3], start=1) == 2
    assert idx.store_tiers(3) == {"TIER_ARCHIVED"} and idx.store_tiers(1) == {"TIER_SLEEPING"}
    view.on_kv(store_event(events_pb2.KV_EVENT_KIND_STORED, [9], seq=9), Delivery.GAP)  # missed events: resync
    assert idx.num_store_blocks([1]) == 0 and idx.num_store_blocks([9]) == 1


def candidate(name, matched, store, used=0):
    return Candidate(name, f"{name}:1", num_prompt_blocks=10, num_matched_blocks=matched, num_used_blocks=used,
                     num_blocks=100, num_active_requests=0, max_num_seqs=8, num_store_blocks=store)


def test_placement_prefers_gpu_hits_and_counts_store_blocks_as_cheaper_work():
    placer = KvAwarePlacer()
    # ex-a holds 6 blocks on GPU; the cachestore holds all 10 for anyone.
    ranked = placer.rank([candidate("ex-b", 0, 10), candidate("ex-a", 6, 4)])
    assert [p.name for p in ranked] == ["ex-a", "ex-b"]
    assert placer.cost(candidate("ex-c", 0, 10)) < placer.cost(candidate("ex-c", 0, 0))
    # Store reach lets a lightly loaded executor win over a busier one with a small GPU hit.
    ranked = placer.rank([candidate("busy", 2, 0, used=20), candidate("idle", 0, 10)])
    assert ranked[0].name == "idle"
