"""The internal plane as real processes: nats-server, two executors, a scheduler and a
cachestore on free ports, driven over gRPC.

One mesh is shared by the module (process start-up dominates the run time); tests that
disturb it (NATS outage) restore it before returning and run last.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import grpc
import pytest

from services.mesh.nats_server import NatsServer
from tests.integration.conftest import ProcessGroup, ServiceProcess, wait_for
from weft.v1 import (
    cachestore_pb2, cachestore_pb2_grpc, common_pb2, events_pb2, executor_pb2, executor_pb2_grpc,
    scheduler_pb2, scheduler_pb2_grpc,
)

NUM_KV_BLOCKS = 256
BLOCK_SIZE = 16
HEARTBEAT_S = 0.2


@dataclass
class Mesh:
    nats: NatsServer
    executors: dict[str, ServiceProcess]
    scheduler: ServiceProcess
    cachestore: ServiceProcess
    channels: list[grpc.Channel]

    def channel(self, address: str) -> grpc.Channel:
        ch = grpc.insecure_channel(address)
        self.channels.append(ch)
        return ch

    def scheduler_stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self.channel(self.scheduler.address))

    def executor_stub(self, name: str) -> executor_pb2_grpc.ExecutorStub:
        return executor_pb2_grpc.ExecutorStub(self.channel(self.executors[name].address))

    def serving_executors(self) -> dict[str, scheduler_pb2.ExecutorInfo]:
        reply = self.scheduler_stub().ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=2)
        return {e.heartbeat.name: e for e in reply.executors
                if e.heartbeat.state == events_pb2.EXECUTOR_STATE_SERVING}


@pytest.fixture(scope="module")
def mesh(module_nats, module_processes: ProcessGroup, tiny_model_dir) -> Mesh:
    common = ["--nats-url", module_nats.url]
    executors = {
        name: module_processes.start(
            "executor", *common, "--model-dir", str(tiny_model_dir), "--name", name,
            "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--num-threads", "1",
            "--heartbeat-interval-s", str(HEARTBEAT_S), "--grace-s", "2", name=name, wait=False)
        for name in ("ex-a", "ex-b")
    }
    scheduler = module_processes.start("scheduler", *common, "--missed-heartbeats", "3", "--grace-s", "2",
                                       name="scheduler", wait=False)
    cachestore = module_processes.start(
        "cachestore", "--disk-dir", str(module_processes.log_dir / "blocks"), "--no-disk-fsync",
        "--host-capacity-bytes", str(8 << 20), "--grace-s", "2", name="cachestore", wait=False)
    for proc in (scheduler, cachestore, *executors.values()):
        proc.wait_healthy(60)
    m = Mesh(module_nats, executors, scheduler, cachestore, [])
    wait_for(lambda: set(m.serving_executors()) == set(executors), 30, "the scheduler to see both executors SERVING")
    try:
        yield m
    finally:
        for ch in m.channels:
            ch.close()


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def collect(stream) -> tuple[list[int], list]:
    chunks = list(stream)
    return [t for c in chunks for t in c.token_ids_delta], chunks


def test_scheduler_stream_matches_in_process_llm_under_greedy(mesh, tiny_model_dir):
    from weft import LLM, SamplingParams

    prompt = [(7 * i + 3) % 1000 + 1 for i in range(40)]
    expected = LLM(tiny_model_dir).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    tokens, chunks = collect(mesh.scheduler_stub().Generate(
        scheduler_pb2.ScheduleRequest(request_id="parity-1", tenant="t-parity", prompt_token_ids=prompt,
                                      sampling=greedy(24)), timeout=30))
    assert tokens == expected.token_ids
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.num_output_tokens == 24
    assert all(c.executor in mesh.executors for c in chunks)


def test_request_sharing_a_long_prefix_goes_to_the_executor_holding_it(mesh):
    prefix = [(13 * i + 5) % 1000 + 1 for i in range(8 * BLOCK_SIZE)]  # 8 full blocks
    tenant = "t-prefix"
    # Warm the prefix on ex-b directly; name order alone would pick ex-a.
    warm = executor_pb2.ExecuteRequest(request_id="warm-b", prompt_token_ids=prefix + [11, 12, 13],
                                       sampling=greedy(2), tenant_salt=tenant)
    collect(mesh.executor_stub("ex-b").Generate(warm, timeout=30))
    wait_for(lambda: mesh.serving_executors()["ex-b"].num_indexed_blocks >= 8, 10,
             "the scheduler to index ex-b's prefix blocks")
    # ...and to see ex-b idle again: a load report taken while the warm-up still held
    # its blocks would count them as work in progress there and tip the choice to ex-a.
    wait_for(lambda: (lambda load: load.num_running == 0 and load.num_free_blocks == load.num_blocks)(
        mesh.serving_executors()["ex-b"].load), 10, "ex-b's load report to show it idle")

    tokens, chunks = collect(mesh.scheduler_stub().Generate(scheduler_pb2.ScheduleRequest(
        request_id="prefix-2", tenant=tenant, prompt_token_ids=prefix + [21, 22, 23, 24], sampling=greedy(4)),
        timeout=30))
    assert {c.executor for c in chunks} == {"ex-b"}
    assert chunks[-1].usage.num_cached_tokens >= 8 * BLOCK_SIZE

    # Another tenant's identical prompt shares nothing: its salt changes every hash.
    _, other = collect(mesh.scheduler_stub().Generate(scheduler_pb2.ScheduleRequest(
        request_id="prefix-3", tenant="t-other", prompt_token_ids=prefix + [21, 22, 23, 24], sampling=greedy(2)),
        timeout=30))
    assert other[-1].usage.num_cached_tokens == 0


def _stats(mesh: Mesh, name: str) -> executor_pb2.GetStatsResponse:
    return mesh.executor_stub(name).GetStats(executor_pb2.GetStatsRequest(), timeout=2)


def test_cancelling_a_stream_frees_the_executors_blocks(mesh):
    idle = {name: _stats(mesh, name).num_free_blocks for name in mesh.executors}
    assert all(v == NUM_KV_BLOCKS for v in idle.values())  # cached blocks count as free
    prompt = [(17 * i + 1) % 1000 + 1 for i in range(6 * BLOCK_SIZE + 3)]
    call = mesh.scheduler_stub().Generate(scheduler_pb2.ScheduleRequest(
        request_id="cancel-1", tenant="t-cancel", prompt_token_ids=prompt,
        sampling=greedy(1500, ignore_eos=True)), timeout=60)
    first = next(call)
    next(call)
    name = first.executor
    busy = _stats(mesh, name)
    assert busy.num_running == 1 and busy.num_free_blocks < NUM_KV_BLOCKS
    call.cancel()
    wait_for(lambda: (s := _stats(mesh, name)).num_running == 0 and s.num_free_blocks == idle[name], 5,
             "the executor to free the cancelled request's blocks")


def test_abort_rpc_ends_the_stream_with_abort_and_frees_blocks(mesh):
    stub = mesh.executor_stub("ex-a")
    call = stub.Generate(executor_pb2.ExecuteRequest(
        request_id="abort-1", prompt_token_ids=list(range(1, 50)), sampling=greedy(1500, ignore_eos=True)),
        timeout=60)
    assert next(call).executor == "ex-a"
    assert stub.Abort(executor_pb2.AbortRequest(request_id="abort-1"), timeout=5).aborted
    last = list(call)[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not stub.Abort(executor_pb2.AbortRequest(request_id="abort-1"), timeout=5).aborted
    wait_for(lambda: (s := _stats(mesh, "ex-a")).num_running == 0 and s.num_free_blocks == NUM_KV_BLOCKS, 5,
             "ex-a to free the aborted request's blocks")


def test_scheduler_deadline_propagates_to_the_executor(mesh):
    # The deadline must pass while the request still runs: 2000 tokens (nearly the tiny
    # model's whole context) take far longer than 0.1 s even on the native decode step
    # (1500 tokens in 0.5 s did not: the request finished first).
    prompt = [(19 * i + 2) % 1000 + 1 for i in range(20)]
    with pytest.raises(grpc.RpcError) as err:
        collect(mesh.scheduler_stub().Generate(scheduler_pb2.ScheduleRequest(
            request_id="deadline-1", tenant="t-deadline", prompt_token_ids=prompt,
            sampling=greedy(2000, ignore_eos=True)), timeout=0.1))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: all(_stats(mesh, n).num_running == 0 for n in mesh.executors), 5,
             "the executors to drop the expired request")


def test_invalid_sampling_is_invalid_argument_naming_the_field(mesh):
    with pytest.raises(grpc.RpcError) as err:
        collect(mesh.scheduler_stub().Generate(scheduler_pb2.ScheduleRequest(
            request_id="bad-1", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=0)),
            timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in err.value.details()


def _put_stream(blocks: list[tuple[cachestore_pb2.BlockHeader, bytes]], chunk_bytes: int):
    for header, payload in blocks:
        yield cachestore_pb2.PutBlocksChunk(header=header)
        for start in range(0, len(payload), chunk_bytes):
            yield cachestore_pb2.PutBlocksChunk(data=payload[start:start + chunk_bytes])


def _block(block_hash: int, payload: bytes, shape: list[int], dtype: str = "float16"):
    from services.cachestore.blocks import checksum

    return cachestore_pb2.BlockHeader(block_hash=block_hash, dtype=dtype, shape=shape, size_bytes=len(payload),
                                      checksum=checksum(payload), model_id="tiny", block_size=BLOCK_SIZE), payload


def test_cachestore_round_trip_of_multi_megabyte_blocks_is_byte_identical(mesh):
    stub = cachestore_pb2_grpc.CacheStoreStub(mesh.channel(mesh.cachestore.address))
    shape = [2, 2, BLOCK_SIZE, 8, 4096]  # 2 × 2 × 16 × 8 × 4096 float16 = 4 MiB
    blocks = [_block(0xABC0 + i, os.urandom(4 << 20), shape) for i in range(3)]  # 12 MiB > the 8 MiB RAM tier
    reply = stub.PutBlocks(_put_stream(blocks, 1 << 20), timeout=30)
    assert reply.num_stored == 3 and reply.stored_bytes == 12 << 20

    got: dict[int, bytearray] = {}
    current = None
    missing = []
    for chunk in stub.GetBlocks(cachestore_pb2.GetBlocksRequest(block_hashes=[0xABC0, 0xABC1, 0xABC2, 0x999]),
                                timeout=30):
        which = chunk.WhichOneof("chunk")
        if which == "header":
            current = chunk.header.block_hash
            got[current] = bytearray()
        elif which == "data":
            got[current] += chunk.data
        else:
            missing.append(chunk.missing_block_hash)
    assert missing == [0x999]
    assert {h: bytes(b) for h, b in got.items()} == {h.block_hash: p for h, p in blocks}
    tiers = stub.Contains(cachestore_pb2.ContainsRequest(block_hashes=[0xABC0, 0xABC2, 0x999]), timeout=5).tiers
    assert tiers[2] == events_pb2.TIER_UNSPECIFIED and set(tiers[:2]) <= {events_pb2.TIER_SLEEPING,
                                                                          events_pb2.TIER_ARCHIVED}

    header, payload = _block(0xBAD, os.urandom(4096), [2048])
    header.checksum ^= 1
    with pytest.raises(grpc.RpcError) as err:
        stub.PutBlocks(_put_stream([(header, payload)], 1024), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in err.value.details()


def test_serving_continues_while_nats_is_down_and_resumes_events_after(mesh):
    """Runs last: it stops and restarts the module's NATS on the same port."""
    stub = mesh.scheduler_stub()
    prompt = [(23 * i + 4) % 1000 + 1 for i in range(24)]

    def generate(i: int) -> list:
        return collect(stub.Generate(scheduler_pb2.ScheduleRequest(
            request_id=f"outage-{i}", tenant="t-outage", prompt_token_ids=prompt, sampling=greedy(4)),
            timeout=30))[1]

    mesh.nats.stop()
    try:
        # Serve for well past the heartbeat expiry window (3 missed beats = 0.6 s).
        outage_start = time.monotonic()
        i = 0
        while time.monotonic() - outage_start < 6 * HEARTBEAT_S * 3:
            chunks = generate(i)
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            i += 1
        assert all(p.running for p in (*mesh.executors.values(), mesh.scheduler))
    finally:
        mesh.nats.start()
    seen = {n: e.heartbeat.header.sequence for n, e in mesh.serving_executors().items()}
    assert set(seen) == set(mesh.executors)  # nobody was expired during the outage
    wait_for(lambda: all(e.heartbeat.header.sequence > seen[n] for n, e in mesh.serving_executors().items()),
             15, "heartbeats to reach the scheduler again after NATS returns")
    assert generate(999)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_sigterm_drains_an_executor_in_flight_streams_finish_and_new_work_is_refused(
        nats_server, processes: ProcessGroup, tiny_model_dir):
    """Own processes (function-scoped fixtures): the shared mesh stays untouched."""
    common = ["--nats-url", nats_server.url]
    executor = processes.start("executor", *common, "--model-dir", str(tiny_model_dir), "--name", "ex-drain",
                               "--num-kv-blocks", "128", "--num-threads", "1", "--heartbeat-interval-s", "0.2",
                               "--grace-s", "20", name="ex-drain", wait=False)
    scheduler = processes.start("scheduler", *common, name="scheduler-drain")
    executor.wait_healthy(60)
    with grpc.insecure_channel(scheduler.address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)

        def states() -> dict[str, int]:
            reply = stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=2)
            return {e.heartbeat.name: e.heartbeat.state for e in reply.executors}

        wait_for(lambda: states().get("ex-drain") == events_pb2.EXECUTOR_STATE_SERVING, 20, "ex-drain SERVING")
        call = stub.Generate(scheduler_pb2.ScheduleRequest(
            request_id="drain-1", prompt_token_ids=list(range(1, 30)), sampling=greedy(1000, ignore_eos=True)),
            timeout=60)
        first = next(call)
        executor.process.terminate()  # SIGTERM: drain
        rest = list(call)
        tokens = [t for c in (first, *rest) for t in c.token_ids_delta]
        assert len(tokens) == 1000 and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        wait_for(lambda: states().get("ex-drain") in (None, events_pb2.EXECUTOR_STATE_DRAINING), 10,
                 "the scheduler to stop considering ex-drain placeable")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(scheduler_pb2.ScheduleRequest(
                request_id="drain-2", prompt_token_ids=[1, 2, 3], sampling=greedy(2)), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert executor.process.wait(20) == 0


def test_executors_join_and_leave_while_the_scheduler_runs(nats_server, processes: ProcessGroup, tiny_model_dir):
    """A new executor gets work within seconds; a killed one is skipped at once and
    expires after its missed heartbeats; the scheduler is never restarted."""
    common = ["--nats-url", nats_server.url]
    ex_flags = ["--model-dir", str(tiny_model_dir), "--num-kv-blocks", "64", "--num-threads", "1",
                "--heartbeat-interval-s", "0.2"]
    scheduler = processes.start("scheduler", *common, name="scheduler-churn", wait=False)
    processes.start("executor", *common, *ex_flags, "--name", "ex-1", name="ex-1")
    scheduler.wait_healthy(30)
    with grpc.insecure_channel(scheduler.address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)

        def known() -> dict[str, scheduler_pb2.ExecutorInfo]:
            return {e.heartbeat.name: e for e in stub.ListExecutors(scheduler_pb2.ListExecutorsRequest(),
                                                                   timeout=2).executors}

        def generate(rid: str, prompt: list[int]) -> str:
            chunks = list(stub.Generate(scheduler_pb2.ScheduleRequest(
                request_id=rid, tenant="t-churn", prompt_token_ids=prompt, sampling=greedy(2)), timeout=30))
            return chunks[-1].executor

        wait_for(lambda: "ex-1" in known(), 20, "ex-1 to join")
        ex2 = processes.start("executor", *common, *ex_flags, "--name", "ex-2", name="ex-2")
        wait_for(lambda: known().get("ex-2") and known()["ex-2"].heartbeat.state == events_pb2.EXECUTOR_STATE_SERVING,
                 10, "ex-2 to join the running scheduler")
        prefix = [(29 * i + 6) % 1000 + 1 for i in range(6 * BLOCK_SIZE)]
        with grpc.insecure_channel(ex2.address) as ch2:
            list(executor_pb2_grpc.ExecutorStub(ch2).Generate(executor_pb2.ExecuteRequest(
                request_id="warm-2", prompt_token_ids=prefix + [1], sampling=greedy(1), tenant_salt="t-churn"),
                timeout=30))
        wait_for(lambda: known()["ex-2"].num_indexed_blocks >= 6, 10, "ex-2's blocks in the index")
        assert generate("churn-1", prefix + [2, 3]) == "ex-2"

        ex2.kill()  # SIGKILL: no DRAINING goodbye
        assert generate("churn-2", prefix + [4, 5]) == "ex-1"  # the dead holder is skipped at once
        wait_for(lambda: "ex-2" not in known(), 5, "ex-2 to expire after missed heartbeats")
