"""Process wiring of a scheduler: config → collaborators (built once, handed to their
users' constructors) → bus listeners → gRPC server → drain.

    MeshView (api/events.py) ──▶ Dispatcher ◀── AgentSteps, DegradeSteps, Admission
    ChannelPool (api/executor_port.py) = the dispatcher's ExecutorPort
    SchedulerServicer (api/servicer.py) ──▶ Dispatcher
"""
from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from services.mesh import metric_catalogue as catalogue
from services.mesh.env_config import load_config
from services.mesh.grpc_server import GrpcServer
from services.mesh.live_settings import SettingsFollower
from services.mesh.logging import configure_logging
from services.mesh.metrics import MetricsServer
from services.mesh.nats_bus import EventBus
from services.scheduler.agent_plane import AgentPlane
from services.scheduler.api.cachestore_port import CachestorePort, intent_detector
from services.scheduler.api.events import MeshView
from services.scheduler.api.executor_port import ChannelPool
from services.scheduler.api.servicer import SchedulerServicer, add_to_server
from services.scheduler.config import DESCRIPTION, SchedulerConfig
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.dispatcher import Dispatcher
from services.scheduler.errors import ERROR_RULES
from services.scheduler.live_settings import SchedulerLiveSettings
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.contracts import ContractBook, parse_tenant_quotas
from services.scheduler.policy.degradation import DegradationLadder
from services.scheduler.policy.pause import make_pause_policy
from services.scheduler.policy.placement import InflightTracker, make_placer
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.policy.tenant_limits import TenantAdmission, parse_tenant_weights
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import Membership
from services.scheduler.state.sessions import SessionTable

log = structlog.get_logger(__name__)


def build_dispatcher(config: SchedulerConfig, view: MeshView, channels: ChannelPool,
                     cachestore: CachestorePort | None = None) -> Dispatcher:
    """The request path with every collaborator the config asks for; ``cachestore``:
    the intent check's embeddings and the archive tier of released KV (None: bigrams)."""
    admission = Admission(config.max_in_flight, config.max_queue, config.retry_after_ms)
    inflight = InflightTracker()
    plane = AgentPlane(
        make_prioritizer(config.policy, config.weft_weights), make_pause_policy(config.resolved_pause_policy, config.pause_costs),
        ContractBook(parse_tenant_quotas(config.tenant_quotas), config.prefill_ms_per_token),
        intent_detector(cachestore, config.model_dir, config.intent_shift_threshold), SessionTable(config.max_sessions),
        block_size_of=lambda name: getattr(view.membership.get(name), "block_size", 16), can_demote=config.demote,
        kv_archive=cachestore, rates_of=view.membership.rates)
    return Dispatcher(
        view, make_placer(config.placement_policy, config.kv_overlap_weight), admission, channels,
        tenant_admission=TenantAdmission(admission, config.max_in_flight_per_tenant, config.max_queue_per_tenant,
                                         parse_tenant_weights(config.tenant_weights)),
        degrade=DegradeSteps(DegradationLadder(config.ladder_config)),
        agent=AgentSteps(plane, view.membership, channels, admission, inflight), inflight=inflight,
        placement_attempts=config.placement_attempts, migration=config.migration_policy,
        executor_overcommit=config.executor_overcommit)


async def main(argv: Sequence[str] | None = None) -> None:
    config = load_config(SchedulerConfig, "scheduler", DESCRIPTION, sys.argv[1:] if argv is None else argv)
    configure_logging("scheduler", config.log_level, config.log_format)
    view = MeshView(Membership(config.missed_heartbeats), KvIndex(config.kv_index_max_store_blocks))
    channels = ChannelPool(config.max_message_bytes)
    cachestore = CachestorePort(config.cachestore_address) if config.cachestore_address else None
    dispatcher = build_dispatcher(config, view, channels, cachestore)
    servicer = SchedulerServicer(dispatcher)
    catalogue.register("scheduler")
    catalogue.metric("weft_queue_depth").labels("scheduler").set_function(lambda: dispatcher.admission.num_queued)
    # Live settings (docs/live_config.md): the router's document swaps the policy objects.
    live = SchedulerLiveSettings(config, dispatcher, lambda period_s: asyncio.create_task(
        dispatcher.agent.reprioritize_forever(period_s), name="reprioritize"))
    settings = SettingsFollower("scheduler", "scheduler", live.apply)
    grpc_server = GrpcServer("weft.v1.Scheduler", config.host, config.port, rules=ERROR_RULES,
                             max_message_bytes=config.max_message_bytes, grace_s=config.grace_s)
    add_to_server(servicer, grpc_server.server)

    async def stop_taking_work() -> None:
        servicer.draining = True

    grpc_server.on_drain(stop_taking_work)
    # SIGHUP: nothing to re-read here (settings come from the router), but never the default: death.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, lambda: log.info("sighup_ignored", detail="live settings come from the router"))
    bus = EventBus(config.nats_url, config.name)
    await view.subscribe(bus)
    await settings.subscribe(bus)
    await bus.start()
    try:
        await bus.require_login()  # a refused login is a config error (exit 78), not an outage
    except BaseException:
        await bus.close()
        raise
    expiry = asyncio.create_task(view.expire_forever(bus, channels.serving), name="membership-expiry")
    metrics_server = MetricsServer(config.host, config.metrics_port)
    await metrics_server.start()
    port = await grpc_server.start()
    log.info("scheduler_ready", port=port, policy=config.policy, placement=config.placement)
    try:
        await grpc_server.serve_until_signal()
    finally:
        live.stop()
        expiry.cancel()
        await bus.close()
        await channels.close()
        if cachestore is not None:
            await cachestore.close()
        await metrics_server.stop()
        log.info("scheduler_stopped")
