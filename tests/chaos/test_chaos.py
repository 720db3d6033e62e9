"""Chaos per service: under bounded load, `weft chaos` SIGKILLs / SIGSTOPs / restarts each
of executor, scheduler, router, cachestore and NATS of a `weft up` mesh in turn.

Asserted every time: each accepted request reaches exactly one terminal state (completed
with the undisturbed greedy tokens, or a clear gRPC error, never a hang: every call has a
deadline); streams that migrated equal their undisturbed run token for token (an executor
lost: the scheduler migrates them; the scheduler killed, restarted or paused: the router
continues them, services/router/continuation.py); after the service is back the mesh
serves normally. Only a router death ends streams with an error (the client's connection
is to the router). Recovery times (restart until healthy, until the
first request completes again) go to ``$WEFT_CHAOS_RESULTS`` (JSON lines) when set, for
benchmarks/results/reliability.md.

One mesh for the module (start-up dominates); tests run in file order and each leaves the
mesh whole.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from services.mesh.nats_auth import derive_passwords
from tests.chaos.chaos_mesh import (
    CALL_TIMEOUT_S, CHAOS_ENV, MAX_TOKENS, MESH_SECRET, NATS_SECRET, NUM_STREAMS, PROMPTS, ROOT, Mesh, Outcome,
    assert_all_completed_as_undisturbed, busiest_executor, generate, record, serves_normally, under_load,
)
from tests.integration.conftest import wait_for
from tests.integration.launched_mesh import launched_mesh
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


def freeze_mid_stream(mesh: Mesh, outcomes: list[Outcome], name: str | None = None) -> str:
    """SIGSTOP a service that still has a stream to serve, at once, and return its name.

    ``under_load`` disturbs once every stream has 5 tokens, but the six clients start at
    different times (each opens its own channel), so on a loaded box the early streams can be
    far along or done by then; the launcher's chaos action (an HTTP round trip) lands later
    still. A direct SIGSTOP right after checking for an unfinished stream stops the service
    with that stream mid-generation, whatever the chaos action then takes to arrive. ``name``
    None: the executor serving the most unfinished streams (a scheduler serves them all)."""
    pids = {i.name: i.pid for i in mesh.state.instances}  # read first: the freeze follows the check at once
    unfinished = [o for o in outcomes if not o.num_terminal_states and o.executors]
    if not unfinished:
        pytest.fail(f"every stream ended before the disturbance: {[(len(o.tokens), o.error) for o in outcomes]}")
    name = name or busiest_executor(unfinished)  # no migration yet: executors[0] serves it now
    os.kill(pids[name], signal.SIGSTOP)
    return name


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir) -> Mesh:
    state_dir = tmp_path_factory.mktemp("chaos-mesh")
    with launched_mesh(state_dir, tiny_model_dir, 2, CHAOS_ENV, check_orphans=False) as (process, _):
        m = Mesh(state_dir, process)
        for i in range(NUM_STREAMS):  # the undisturbed greedy outputs
            o = generate(m, i, Outcome())
            assert o.completed and len(o.tokens) == MAX_TOKENS, o
            assert o.degradation_rung == common_pb2.DEGRADATION_RUNG_NONE  # the response names its rung
            m.reference[i] = o.tokens
        yield m


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_executor_lost_mid_stream_streams_migrate_with_identical_greedy_output(mesh, how):
    victim: list[str] = []
    t_disturb = [0.0]

    def disturb(outcomes):
        # Frozen first, so that its streams are still unfinished when it is killed or paused;
        # then the chaos action under test: a kill SIGKILLs the stopped process (the launcher
        # reaps it, as before), a pause SIGSTOPs it again (no change); resumed below.
        victim.append(freeze_mid_stream(mesh, outcomes))
        t_disturb[0] = time.monotonic()
        mesh.chaos_now(how, victim[0])

    outcomes = under_load(mesh, disturb)
    migrated = [o for o in outcomes if o.num_migrations]
    assert_all_completed_as_undisturbed(mesh, outcomes)
    assert migrated, "no stream was on the disturbed executor"
    assert all(victim[0] in o.executors and len(o.executors) >= 2 for o in migrated)
    streams_done_s = time.monotonic() - t_disturb[0]
    if how == "pause":
        mesh.weft("chaos", "resume", victim[0])
        wait_for(lambda: victim[0] in mesh.serving_executors(), 30, "the resumed executor to serve again")
        restart_s = 0.0
    else:
        out = mesh.weft("chaos", "restart", victim[0])
        restart_s = float(out.rsplit(" in ", 1)[1].rstrip("s\n"))
    assert mesh.serving_executors() == {"executor-0", "executor-1"}
    record(service="executor", action=how, num_streams=NUM_STREAMS, num_migrated=len(migrated),
           num_failed=0, all_streams_done_s=round(streams_done_s, 2),
           migration_gap_s=round(max(o.max_gap_s for o in migrated), 2), restart_s=restart_s,
           serving_again_s=round(serves_normally(mesh), 2))


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_scheduler_lost_mid_stream_streams_continue_with_identical_greedy_output(mesh, how):
    """Killed then restarted, or paused then resumed: the router continues every stream
    from prompt + tokens so far, so each completes with its undisturbed greedy tokens."""
    before = mesh.num_router_continuations()
    timings: dict[str, float] = {}

    def disturb(outcomes):
        t0 = time.monotonic()
        try:
            # Frozen first, so that streams are still unfinished when it is killed or paused
            # (freeze_mid_stream); then the chaos action under test: a kill SIGKILLs the
            # stopped process (the launcher reaps it and restarts it below), a pause SIGSTOPs
            # it again (no change; resumed below). Inside the try: it is brought back whatever fails.
            freeze_mid_stream(mesh, outcomes, "scheduler")
            mesh.chaos_now(how, "scheduler")
            # The router notices (the call broke, or the scheduler went silent and failed its
            # health probe) and re-issues streams while the scheduler is still away.
            wait_for(lambda: mesh.num_router_continuations() > before, 30, "the router to continue a stream")
            timings["noticed_s"] = time.monotonic() - t0
        except pytest.fail.Exception as exc:  # say what the streams and the router were doing
            progress = [(len(o.tokens), o.finish_reason, o.error) for o in outcomes]
            log = mesh.state_dir / "logs" / "router.log"
            tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
            pytest.fail(f"{exc}; streams (tokens, finish, error): {progress}; router log tail:\n" + "\n".join(tail))
        finally:  # bring it back even when the wait failed: a stopped scheduler poisons the next tests
            result = mesh.chaos_now("restart" if how == "kill" else "resume", "scheduler")
        timings["restart_s"] = result.get("recovery_s", 0.0)
        timings["t_back"] = time.monotonic()

    outcomes = under_load(mesh, disturb)
    assert_all_completed_as_undisturbed(mesh, outcomes)
    continued = [o for o in outcomes if o.num_migrations]
    assert continued, "no stream reports the continuation on its last chunk"
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "executors known again")
    record(service="scheduler", action=how, num_streams=NUM_STREAMS, num_migrated=len(continued), num_failed=0,
           continuation_noticed_s=round(timings["noticed_s"], 2),
           all_streams_done_s=round(time.monotonic() - timings["t_back"], 2),
           migration_gap_s=round(max(o.max_gap_s for o in continued), 2),
           restart_s=round(timings["restart_s"], 2), serving_again_s=round(serves_normally(mesh), 2))


def test_stateful_hop_lost_with_a_restarted_scheduler_ends_with_a_clear_error(mesh):
    """A restarted scheduler no longer holds the session context a stateful hop continues:
    the router's continuation is refused, never run on a partial context, and the client is
    told to resend the hop with its full prompt."""
    session = dict(session_id=f"chaos-s-{time.monotonic_ns()}", request_class=common_pb2.REQUEST_CLASS_AGENTIC)
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(mesh.state.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        hop0 = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=PROMPTS[0]), session=common_pb2.SessionInfo(hop_index=0, **session),
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert list(stub.Generate(hop0, timeout=CALL_TIMEOUT_S))[-1].finish_reason
        hop1 = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPTS[1]), sampling=sampling,
                                          session=common_pb2.SessionInfo(hop_index=1, stateful=True, **session))
        before = mesh.num_router_continuations()
        num_tokens = 0
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stub.Generate(hop1, timeout=CALL_TIMEOUT_S):
                num_tokens += len(chunk.token_ids_delta)
                if num_tokens >= 5 and before is not None:
                    mesh.chaos_now("kill", "scheduler")
                    wait_for(lambda: mesh.num_router_continuations() > before, 30, "the router to continue")
                    mesh.chaos_now("restart", "scheduler")
                    before = None
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "resend the hop with its full prompt" in info.value.details()
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "executors known again")


def test_router_killed_mid_stream_every_request_ends_once_and_the_mesh_recovers(mesh):
    """The client's connection is to the router: its death is a clear terminal error the
    client must retry (or a completion, for streams that finished first)."""
    def disturb(outcomes):
        mesh.chaos_now("kill", "router")

    outcomes = under_load(mesh, disturb)
    for i, o in enumerate(outcomes):  # completed as undisturbed, or a clear error: never both, never neither
        assert (o.completed and o.tokens == mesh.reference[i]) or o.error in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED), o
    out = mesh.weft("chaos", "restart", "router")
    restart_s = float(out.rsplit(" in ", 1)[1].rstrip("s\n"))
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "executors known again")
    record(service="router", action="kill", num_streams=NUM_STREAMS, num_migrated=0,
           num_failed=sum(1 for o in outcomes if not o.completed), all_streams_done_s=None,
           restart_s=restart_s, serving_again_s=round(serves_normally(mesh), 2))


@pytest.mark.parametrize("service", ["cachestore", "nats"])
def test_side_services_killed_serving_continues_and_restart_restores_them(mesh, service):
    def disturb(outcomes):
        mesh.chaos_now("kill", service)

    outcomes = under_load(mesh, disturb)
    assert_all_completed_as_undisturbed(mesh, outcomes)
    during = generate(mesh, 1, Outcome())  # a new request while it is down is still served
    assert during.completed and during.tokens == mesh.reference[1]
    out = mesh.weft("chaos", "restart", service)
    restart_s = float(out.rsplit(" in ", 1)[1].rstrip("s\n"))
    # Events flow again: heartbeats keep both executors known after the outage.
    wait_for(lambda: mesh.serving_executors() == {"executor-0", "executor-1"}, 30, "executors known after restart")
    record(service=service, action="kill", num_streams=NUM_STREAMS, num_migrated=0, num_failed=0,
           all_streams_done_s=None, restart_s=restart_s, serving_again_s=round(serves_normally(mesh), 2))


def test_a_redelivered_kv_event_is_not_acted_on_twice(mesh):
    """Replays a real kv event (same source, epoch and sequence) with its hashes swapped
    for 1,000 fresh ones: acting on it would index them. The index must end at exactly
    what it held plus the blocks of the genuine events around the replay."""
    import asyncio
    import random

    import nats

    from weft.v1 import events_pb2

    active = (events_pb2.TIER_ACTIVE, events_pb2.TIER_UNSPECIFIED)

    def indexed() -> dict[str, int]:
        with grpc.insecure_channel(f"127.0.0.1:{mesh.state.instance('scheduler').ports['scheduler_port']}") as ch:
            reply = scheduler_pb2_grpc.SchedulerStub(ch).ListExecutors(
                scheduler_pb2.ListExecutorsRequest(), timeout=2, metadata=(("x-weft-mesh-secret", MESH_SECRET),))
        return {e.heartbeat.name: e.num_indexed_blocks for e in reply.executors}

    def long_prompt_request(seed: int) -> None:
        rng = random.Random(seed)
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[rng.randrange(20, 900) for _ in range(80)]),
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
        with grpc.insecure_channel(mesh.state.grpc_address) as channel:
            list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S))

    async def main():
        # NATS wants a login per role: the scheduler's to read kv events, the executors' to
        # publish one (the only role allowed to: services/mesh/nats_auth.py).
        passwords = derive_passwords(NATS_SECRET)
        nc = await nats.connect(mesh.state.nats_url, user="scheduler", password=passwords["scheduler"])
        publisher = await nats.connect(mesh.state.nats_url, user="executor", password=passwords["executor"])
        events: list[events_pb2.KvEvent] = []
        raw_stored: list[bytes] = []

        async def on_kv(msg):
            event = events_pb2.KvEvent.FromString(msg.data)
            if event.tier in active:
                events.append(event)
                if event.kind == events_pb2.KV_EVENT_KIND_STORED:
                    raw_stored.append(msg.data)

        await nc.subscribe("weft.kv.*", cb=on_kv)
        await nc.flush()
        try:
            # A warm-up request first: an earlier test's events (or a resync after its NATS
            # restart) settle on this one's stored event, not in the middle of the count.
            await asyncio.to_thread(long_prompt_request, 0)
            await asyncio.to_thread(wait_for, lambda: raw_stored, 20, "the warm-up's kv stored event")
            events.clear()
            raw_stored.clear()
            start = await asyncio.to_thread(indexed)
            await asyncio.to_thread(long_prompt_request, 1)
            await asyncio.to_thread(wait_for, lambda: raw_stored, 20, "a kv stored event")
            replay = events_pb2.KvEvent.FromString(raw_stored[-1])
            source = replay.header.source
            del replay.block_hashes[:]
            rng = random.Random(7)
            replay.block_hashes.extend(rng.getrandbits(63) for _ in range(1000))
            replayed = list(replay.block_hashes)
            await publisher.publish(f"weft.kv.{source}", replay.SerializeToString())
            await publisher.flush()
            for seed in range(2, 12):  # genuine events from the same executor after the replay
                await asyncio.to_thread(long_prompt_request, seed)
                if sum(e.header.source == source for e in events) >= 2:
                    break

            def expected() -> int:
                held = set()
                for e in (e for e in events if e.header.source == source and list(e.block_hashes) != replayed):
                    if e.kind == events_pb2.KV_EVENT_KIND_STORED:
                        held |= set(e.block_hashes)
                    elif e.kind == events_pb2.KV_EVENT_KIND_REMOVED:
                        held -= set(e.block_hashes)
                return start[source] + len(held)

            # Equality is reachable only if the replay was dropped: acting on it adds
            # 1,000 blocks before the later genuine events arrive, and nothing removes them.
            await asyncio.to_thread(wait_for, lambda: indexed()[source] == expected(), 20,
                                    "the index to equal the genuine events alone")
        finally:
            await nc.close()
            await publisher.close()

    asyncio.run(main())


def test_chaos_rejects_unknown_names_and_actions(mesh):
    out = subprocess.run([sys.executable, "-m", "weft", "chaos", "kill", "executor-9", "--state-dir",
                          str(mesh.state_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "executor-9" in out.stderr
    assert {i.name for i in mesh.state.instances} >= {"router", "scheduler", "executor-0", "executor-1"}


def test_internal_services_refuse_calls_without_the_mesh_secret(mesh):
    state = mesh.state
    calls = {
        "scheduler": lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).ListExecutors(
            scheduler_pb2.ListExecutorsRequest(), timeout=5),
        "executor-0": lambda ch: executor_pb2_grpc.ExecutorStub(ch).GetStats(executor_pb2.GetStatsRequest(), timeout=5),
    }
    for name, call in calls.items():
        port_key = "scheduler_port" if name == "scheduler" else "executor_port"
        with grpc.insecure_channel(f"127.0.0.1:{state.instance(name).ports[port_key]}") as ch:
            with pytest.raises(grpc.RpcError) as info:
                call(ch)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    assert mesh.serving_executors() == {"executor-0", "executor-1"}  # with the secret: answered
