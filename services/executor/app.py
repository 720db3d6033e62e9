"""Process wiring of an executor: config → bus → engine → gRPC server → drain.

Order: the bus starts first and the heartbeat says JOINING while the checkpoint loads;
the gRPC server starts once the engine is ready, then the state turns SERVING. On
SIGTERM: health NOT_SERVING and heartbeat DRAINING (the scheduler stops placing here),
in-flight streams finish up to the grace period, then the engine stops.

A dead or wedged engine thread (engine_watchdog.py) takes the executor out of service:
``engine_dead`` / ``engine_wedged`` is logged, health turns NOT_SERVING, the heartbeat
says FAILED at once (the scheduler stops placing here), every open stream ends with
UNAVAILABLE (the scheduler migrates it), then the process drains and exits with
``EXIT_ENGINE_FAILED`` so its supervisor restarts it. A backstop timer exits the process
even if that drain hangs.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Sequence

import structlog

from services.executor.config import DESCRIPTION, ExecutorConfig
from services.executor.events import ExecutorEvents, ExecutorState, Identity
from services.executor.live_settings import PartitionTable
from services.mesh.env_config import load_config
from services.mesh.grpc_server import GrpcServer
from services.mesh.live_settings import SettingsFollower
from services.mesh.logging import configure_logging
from services.mesh.metrics import MetricsServer
from services.mesh.nats_bus import EventBus

log = structlog.get_logger(__name__)

EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine died or wedged; a supervisor should restart us
PUBLISH_FAILED_TIMEOUT_S = 2.0  # the FAILED heartbeat is best effort: NATS may be down too
BACKSTOP_AFTER_GRACE_S = 10.0  # past grace_s + this, a failed executor exits even mid-drain


def _stats_and_gauges(engine) -> dict:
    """Load report (engine thread); also refreshes the KV gauges, which a step sets
    before its finished requests give their blocks back."""
    if engine.step_trace is not None:
        engine.step_trace.update_gauges(engine)
    return engine.stats()


def promotes_before_prefill(config: ExecutorConfig) -> bool:
    """Whether each prompt is looked up in the cachestore before its prefill: only when
    asked to and the prefix cache is on. Promoted blocks are found only through the prefix
    cache; without it the lookup is a cachestore round trip on the first-token path (about
    1.3 ms on loopback, benchmarks/results/mesh_overhead.md) that can never pay off."""
    return config.promote_before_prefill and config.enable_prefix_caching


async def main(argv: Sequence[str] | None = None) -> None:
    config = load_config(ExecutorConfig, "executor", DESCRIPTION, sys.argv[1:] if argv is None else argv)
    configure_logging("executor", config.log_level, config.log_format)
    name = config.resolved_name
    # Imported here so `--help` stays fast (no torch import).
    from services.executor.engine.async_engine import AsyncEngine
    from services.executor.engine.engine import LLMEngine
    from services.executor.engine.watchdog import EngineVerdict, EngineWatchdog, WatchdogPolicy
    from services.executor.event_codec import encode_event
    from services.executor.server import ENGINE_REQUESTS, ERROR_RULES, ExecutorServicer
    from services.executor.engine.step_trace import StepTrace
    from services.mesh import metric_catalogue as catalogue
    from weft.v1 import executor_pb2_grpc

    grpc_server = GrpcServer("weft.v1.Executor", config.host, config.port, rules=ERROR_RULES,
                             max_message_bytes=config.max_message_bytes, grace_s=config.grace_s)
    grpc_server.install_signal_handlers()
    # SIGHUP: nothing to re-read here (settings come from the router), but never the default: death.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, lambda: log.info("sighup_ignored", detail="live settings come from the router"))
    bus = EventBus(config.nats_url, name)
    identity = Identity(name=name, address=config.address(config.port), model_id=config.resolved_model_id,
                        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                        serves_rung=config.resolved_serves_rung, kv_cache_dtype=config.kv_cache_dtype)
    servicer = None  # load reports carry its measured rates once it exists (encode_event)
    events = ExecutorEvents(lambda kind, item: bus.publish(kind, encode_event(item, servicer)), identity,
                            config.heartbeat_interval_s, config.load_report_interval_s)
    bus.on_connect(events.publish_heartbeat)
    metrics_server = MetricsServer(config.host, config.metrics_port)
    await bus.start()
    try:
        # A refused NATS login or an unloadable model fails every restart alike: the process
        # exits EXIT_CONFIG (services/mesh/service_main.py) after closing what it opened.
        await bus.require_login()
        await events.start()
        await metrics_server.start()
        step_trace = StepTrace(name)
        engine = await asyncio.to_thread(LLMEngine, config.model_dir, config.engine_config, step_trace)
    except BaseException:
        await events.stop()
        await metrics_server.stop()
        await bus.close()
        raise
    catalogue.register("executor")
    step_trace.update_gauges(engine)
    if config.partitions:
        engine.set_partitions(config.partitions)
    async_engine = AsyncEngine(engine, on_kv_events=events.on_kv_events, first_token_yield_s=config.first_token_yield_s)
    # Live settings (docs/live_config.md): the router's document may swap the partition table.
    partitions = PartitionTable(async_engine, config.tenant_partitions)
    await SettingsFollower("executor", "executor", partitions.apply).subscribe(bus)
    audit = None
    if config.credit_audit_period_s:
        audit = asyncio.create_task(partitions.audit_forever(config.credit_audit_period_s), name="credit-audit")
    events.set_load_reader(lambda: async_engine.call(_stats_and_gauges))
    ENGINE_REQUESTS.set_function(lambda: async_engine.num_active)
    tiers, no_tiers_reason = None, "no cachestore configured"
    if config.cachestore_address and config.kv_cache_dtype == "int8":
        # Payloads carry one model-dtype tensor per block; the int8 cache's scales have no
        # place in them (kv_transfer.py), so this executor neither demotes nor promotes.
        no_tiers_reason = "its KV cache is int8 (kv_cache_dtype), which does not transfer"
        log.warning("tier_transfer_disabled", executor=name, kv_cache_dtype=config.kv_cache_dtype)
    elif config.cachestore_address:
        from services.executor.tiers.tier_ops import build_tier_ops

        promote = promotes_before_prefill(config)
        if config.promote_before_prefill and not promote:
            log.info("promotion_disabled", executor=name, reason="prefix caching is off")
        tiers = build_tier_ops(async_engine, config.cachestore_address, engine.model_id, config.block_size,
                               config.demote_on_finish, promote, config.demote_on_finish_min_held)
    servicer = ExecutorServicer(async_engine, name, engine.model_id, config.block_size, tiers=tiers,
                                no_tiers_reason=no_tiers_reason, step_trace=step_trace)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, grpc_server.server)

    async def announce_draining() -> None:
        servicer.draining = True
        if not servicer.failed:  # a failed executor keeps saying FAILED while it drains
            await events.set_state(ExecutorState.DRAINING)

    async def take_out_of_service(verdict: EngineVerdict, stalled_s: float) -> None:
        """The engine is dead or wedged: out of the mesh at once, then exit for a restart."""
        reason = ("engine thread died" if verdict is EngineVerdict.DEAD
                  else f"engine made no progress for {stalled_s:.0f} s")
        servicer.failed = reason  # refuse new streams before anything awaits
        _exit_backstop(config.grace_s + BACKSTOP_AFTER_GRACE_S)
        log.error("engine_dead" if verdict is EngineVerdict.DEAD else "engine_wedged", executor=name,
                  stalled_s=round(stalled_s, 1), engine_stall_s=config.engine_stall_s,
                  num_engine_requests=async_engine.num_active)
        await grpc_server.set_serving(False)
        try:
            await asyncio.wait_for(events.set_state(ExecutorState.FAILED), PUBLISH_FAILED_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("failed_heartbeat_not_sent", executor=name)
        num_failed = servicer.fail_streams(reason)
        log.error("executor_out_of_service", executor=name, reason=reason, num_failed_streams=num_failed,
                  exit_status=EXIT_ENGINE_FAILED)
        grpc_server.request_stop()

    watchdog = EngineWatchdog(async_engine.probe, WatchdogPolicy(config.engine_stall_s), take_out_of_service)
    grpc_server.on_drain(announce_draining)
    port = await grpc_server.start()
    events.set_identity(Identity(
        name=name, address=config.address(port), model_id=engine.model_id, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_model_len=engine.max_model_len, num_blocks=engine.num_blocks,
        serves_rung=config.resolved_serves_rung, kv_cache_dtype=config.kv_cache_dtype,
    ))
    await events.set_state(ExecutorState.SERVING)
    log.info("executor_ready", executor=name, port=port, model_id=engine.model_id, num_kv_blocks=engine.num_blocks,
             serves_rung=config.resolved_serves_rung)
    watchdog.start()
    warm_grammar_import()
    try:
        await grpc_server.serve_until_signal()
    finally:
        await watchdog.stop()
        if audit is not None:
            audit.cancel()
        await events.stop()
        await bus.close()
        await metrics_server.stop()
        async_engine.shutdown(timeout_s=1.0 if servicer.failed else 5.0)  # a wedged thread never joins
        log.info("executor_stopped", executor=name, failed=servicer.failed or None)
    if servicer.failed:
        raise SystemExit(EXIT_ENGINE_FAILED)


def _exit_backstop(after_s: float) -> None:
    """Exit with EXIT_ENGINE_FAILED after ``after_s`` whatever the drain is doing (a daemon
    timer: a prompt clean exit never waits for it)."""
    def hard_exit() -> None:
        log.error("executor_exit_forced", exit_status=EXIT_ENGINE_FAILED, after_s=after_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_ENGINE_FAILED)

    timer = threading.Timer(after_s, hard_exit)
    timer.daemon = True
    timer.start()


def warm_grammar_import() -> threading.Thread:
    """Import the constrained-decoding package (xgrammar, which imports transformers: ~1.1 s
    of CPU) on a daemon thread once the executor serves, instead of before it may: the
    executor is ready that much sooner after a start, a restart or a scale-up, and the first
    constrained request does not pay the import on the engine thread (``grammar_package``
    imports it on first use; a request that comes before the warm-up is done waits on the
    same import lock). A failure is logged once and remembered; constrained requests are
    then refused naming it."""
    from services.executor.engine.grammar_import import grammar_package
    from services.executor.errors import InvalidRequestError

    def run() -> None:
        try:
            grammar_package()
        except InvalidRequestError:
            pass  # grammar_package logged it; requests will say it

    thread = threading.Thread(target=run, name="weft-grammar-warm", daemon=True)
    thread.start()
    return thread
