"""SchedulerConfig: everything a scheduler process is told, from flags / WEFT_ env.

The options every service takes (host, grace, message size, metrics port, mesh secret
file, logging) are declared once in ``services/mesh/service_options.py``; this adds only
the scheduler's own."""
from __future__ import annotations

from dataclasses import dataclass

from services.mesh.env_config import option
from services.mesh.subjects import subject
from services.mesh.service_options import ServiceOptions, check_port
from services.scheduler.migration import MigrationPolicy
from services.scheduler.policy.degradation import LadderConfig, parse_thresholds
from services.scheduler.policy.placement import PlacementPolicy
from services.scheduler.policy.priority import SchedulingPolicy
from services.shared.vocabulary import RUNG_LABELS, Rung

DESCRIPTION = (
    "Weft scheduler: admits token-level requests (bounded in-flight and queue, "
    "RESOURCE_EXHAUSTED with a retry hint when full), places each on an executor "
    "learned from NATS heartbeats (by KV prefix overlap and load), and relays the "
    "executor's token stream with deadline and cancellation propagated."
)


@dataclass(frozen=True)
class SchedulerConfig(ServiceOptions):
    name: str = option("Name of this scheduler on the bus.", default="scheduler")
    port: int = option("gRPC port.", default=50052)
    nats_url: str = option("NATS server URL for events.", default="nats://127.0.0.1:4222", shared=True)
    placement: str = option("Placement policy.", default="kv", choices=tuple(p.value for p in PlacementPolicy))
    kv_overlap_weight: float = option(
        "kv policy: cost of one prompt block to compute, relative to one KV block in use on the executor.",
        default=1.0)
    max_in_flight: int = option("Requests streaming at once through this scheduler.", default=256)
    max_queue: int = option("Requests waiting for an in-flight slot; beyond it: RESOURCE_EXHAUSTED.", default=1024)
    executor_overcommit: float = option(
        "In-flight requests allowed per executor batch slot (max_num_seqs); the rest wait in the "
        "scheduler's scored queue. 0: no cap by slots (requests queue at the executors).", default=1.25)
    retry_after_ms: int = option("Retry hint sent with RESOURCE_EXHAUSTED.", default=200)
    missed_heartbeats: int = option("Heartbeats an executor may miss before it is dropped.", default=3)
    placement_attempts: int = option("Executors tried when one is unreachable before the first token.", default=2)
    max_in_flight_per_tenant: int = option(
        "Requests of one tenant streaming at once; while other tenants wait, slots are shared equally among "
        "waiting tenants anyway (one scored queue, fair across tenants).",
        default=128)
    max_queue_per_tenant: int = option(
        "Requests of one tenant that may wait beyond its in-flight cap (it holds at most both caps' sum in "
        "flight or waiting in the scored queue); beyond it that tenant gets RESOURCE_EXHAUSTED. The default lets "
        "a lone tenant fill the queue, so the ladder's shed rung is reachable with one tenant; lower it to keep "
        "queue space for other tenants (slots are shared fairly either way).", default=1024)
    migration_attempts: int = option(
        "Executors a stream may use in all when executors die or stall mid-stream (1 = no migration).", default=3)
    migration_stall_factor: float = option(
        "An executor is hung after this many expected step times (mean inter-token gap) without a token.",
        default=20.0)
    migration_min_stall_s: float = option("Floor of the hang-detection ceiling, seconds.", default=2.0)
    migration_first_token_timeout_s: float = option(
        "Hang-detection ceiling before an attempt's first token (prefill, queueing), seconds.", default=60.0)
    degradation_rungs: str = option(
        f"Comma-separated degradation-ladder rungs to use ({', '.join(RUNG_LABELS)}); "
        "a degraded rung acts only while a live executor serves it (executor --serves-rung).",
        default=",".join(RUNG_LABELS))
    degradation_thresholds: str = option(
        "Ladder thresholds on the load (0..1), rung=enter:exit comma-separated over the defaults "
        "(kv_int8=0.6:0.45, kv_compress=0.7:0.55, smaller_model=0.8:0.65, shed=0.95:0.75); "
        "enter 0 with exit 0 pins a class on that rung.", default="")
    degradation_min_dwell_s: float = option("Seconds a class stays on a rung before it may step down.", default=2.0)
    policy: str = option(
        "Scheduling policy: weft (dynamic per-program priority, cost-based tool-call pauses), fcfs (arrival "
        "order, KV left to LRU: the vLLM-like baseline) or priority (static class + caller priority).",
        default="weft", choices=tuple(p.value for p in SchedulingPolicy))
    pause_policy: str = option(
        "What a session's KV does during a tool call: cost (keep / demote / drop by cost), keep, drop; "
        "auto: cost under --policy weft, drop otherwise.", default="auto",
        choices=("auto", "cost", "keep", "demote", "drop"))
    tenant_quotas: str = option(
        "Most KV blocks per executor a tenant may hold, name=blocks comma-separated; a contract asking more "
        "is refused. Tenants not listed: an executor's pool.", default="")
    prefill_ms_per_token: float = option("Cost model: prefill time per prompt token, ms.", default=0.2)
    block_second_ms: float = option("Cost model: price of holding one KV block idle for a second on a "
                                    "half-full pool, in ms of compute.", default=2.0)
    transfer_ms_per_block: float = option("Cost model: moving one KV block to or from the host tier, ms.",
                                          default=0.5)
    default_tool_ms: float = option("Expected tool-call pause when neither the caller nor the session's "
                                    "history says, ms.", default=2000.0)
    max_pinned_fraction: float = option("Most of an executor's pool that kept sessions may pin.", default=0.5)
    priority_interval_s: float = option("Seconds between re-estimations of running requests' priority "
                                        "(--policy weft).", default=0.5)
    priority_weights: str = option(
        "--policy weft: weights of the priority terms over the defaults, name=value comma-separated: las "
        "(least attained service per program, 1), slack (contract deadline, 1), fresh (a resumed session's hot "
        "KV, 0.5), entropy (0.5), aging_s (seconds of waiting worth one class level, 30).", default="")
    demote: bool = option("Let the pause policy demote paused sessions to the cachestore's host tier "
                          "(executor DemoteBlocks / PromoteBlocks).", default=True)
    intent_shift_threshold: float = option("Distance (0..1) of a new turn from its session's context above "
                                           "which kept KV is released early.", default=0.9)
    max_sessions: int = option("Sessions (and programs) remembered, least recently used dropped.", default=10000)
    kv_index_max_store_blocks: int = option(
        "Most cachestore-tier block hashes the placement index mirrors (~0.4 KB each); beyond it the longest "
        "unseen are forgotten (a placement hint only: the cachestore still serves them); 0: unbounded.",
        default=262144)
    cachestore_address: str = option(
        "host:port of the cachestore: its embeddings drive the intent check (with --model-dir) and released "
        "KV is archived there; empty: bigram intent signal, released KV only forgotten on the executor.",
        default="")
    model_dir: str = option(
        "Checkpoint directory of the served model (the router's): its tokenizer detokenises a session's "
        "context and new turn for the embedding intent check; empty: bigram intent signal.", default="")
    tenant_weights: str = option(
        "Fair-share weights of tenants in the scored queue, name=weight comma-separated (positive; tenants not "
        "listed weigh 1): while tenants wait, each holds slots in proportion to its weight.", default="")

    def __post_init__(self) -> None:
        super().__post_init__()
        from services.scheduler.policy.tenant_limits import parse_tenant_weights

        parse_tenant_weights(self.tenant_weights)  # ValueError naming the item
        subject("x", self.name)  # subject-safe, or ValueError
        check_port("port", self.port)
        for name in ("max_in_flight", "missed_heartbeats", "placement_attempts",
                     "max_in_flight_per_tenant", "migration_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.executor_overcommit != 0 and not 1 <= self.executor_overcommit < float("inf"):
            raise ValueError(f"executor_overcommit must be 0 or >= 1, got {self.executor_overcommit}")
        for name in ("max_queue", "retry_after_ms", "kv_overlap_weight", "max_queue_per_tenant",
                     "degradation_min_dwell_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

        self.ladder_config  # validates the rung list and thresholds
        if self.kv_index_max_store_blocks < 0:
            raise ValueError(f"kv_index_max_store_blocks must be >= 0, got {self.kv_index_max_store_blocks}")
        self.pause_costs  # validates the cost model
        from services.scheduler.policy.contracts import parse_tenant_quotas

        parse_tenant_quotas(self.tenant_quotas)
        self.weft_weights  # validates priority_weights
        if self.priority_interval_s <= 0:
            raise ValueError(f"priority_interval_s must be > 0, got {self.priority_interval_s}")
        if not 0 < self.intent_shift_threshold <= 1 or self.max_sessions < 1:
            raise ValueError("intent_shift_threshold must be in (0, 1] and max_sessions >= 1")
        self.migration_policy  # validates the migration settings

    @property
    def migration_policy(self) -> MigrationPolicy:
        return MigrationPolicy(
            max_attempts=self.migration_attempts, stall_factor=self.migration_stall_factor,
            min_stall_s=self.migration_min_stall_s, first_token_timeout_s=self.migration_first_token_timeout_s)

    @property
    def ladder_config(self) -> LadderConfig:
        rungs = frozenset(Rung.parse(r) for r in self.degradation_rungs.split(",") if r.strip())
        return LadderConfig(enabled=rungs | {Rung.NONE}, thresholds=parse_thresholds(self.degradation_thresholds),
                            min_dwell_s=self.degradation_min_dwell_s)

    @property
    def pause_costs(self):
        from services.scheduler.policy.pause import PauseCosts

        return PauseCosts(prefill_ms_per_token=self.prefill_ms_per_token, block_second_ms=self.block_second_ms,
                          transfer_ms_per_block=self.transfer_ms_per_block, default_pause_ms=self.default_tool_ms,
                          max_pinned_fraction=self.max_pinned_fraction)

    @property
    def weft_weights(self):
        from services.scheduler.policy.priority import parse_priority_weights

        return parse_priority_weights(self.priority_weights)

    @property
    def resolved_pause_policy(self) -> str:
        if self.pause_policy != "auto":
            return self.pause_policy
        return "cost" if self.policy == "weft" else "drop"

    @property
    def placement_policy(self) -> PlacementPolicy:
        return PlacementPolicy(self.placement)
