"""Agent-native serving through the mesh (real NATS, cachestore, executor and
schedulers as processes, loopback): multi-hop sessions hit the cache as their context
grows, stateful hops, paused sessions resumed after keep / drop / demote, a tenant
flood that leaves another tenant served, tenant isolation, and bad input.

One executor with a small KV pool is shared by three schedulers that differ only in
their pause policy (keep, drop, demote), so each path is exercised on the same engine.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import pytest

from tests.integration.conftest import ProcessGroup, ServiceProcess, wait_for
from weft.v1 import (
    cachestore_pb2, cachestore_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc,
)

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 96
VOCAB = 1000


@dataclass
class AgentMesh:
    schedulers: dict[str, ServiceProcess]
    cachestore: ServiceProcess
    channels: list[grpc.Channel]

    def stub(self, pause: str) -> scheduler_pb2_grpc.SchedulerStub:
        ch = grpc.insecure_channel(self.schedulers[pause].address)
        self.channels.append(ch)
        return scheduler_pb2_grpc.SchedulerStub(ch)

    def host_tier_blocks(self) -> int:
        with grpc.insecure_channel(self.cachestore.address) as ch:
            stats = cachestore_pb2_grpc.CacheStoreStub(ch).Stats(cachestore_pb2.CacheStatsRequest(), timeout=5)
        return sum(t.num_blocks for t in stats.tiers)


@pytest.fixture(scope="module")
def agent_mesh(module_nats, module_processes: ProcessGroup, tiny_model_dir) -> AgentMesh:
    common = ["--nats-url", module_nats.url]
    cachestore = module_processes.start(
        "cachestore", "--disk-dir", str(module_processes.log_dir / "blocks"), "--no-disk-fsync",
        "--host-capacity-bytes", str(8 << 20), "--grace-s", "1", name="cachestore", wait=False)
    executor = module_processes.start(
        "executor", *common, "--model-dir", str(tiny_model_dir), "--name", "ex-agent",
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--num-threads", "1",
        "--tenant-partitions", "acme=32:8", "--preemption-policy", "priority",
        # Only the schedulers decide what moves to the cachestore here (no demote-on-finish).
        "--cachestore-address", cachestore.address, "--demote-on-finish", "never", "--no-promote-before-prefill",
        "--heartbeat-interval-s", "0.3", "--grace-s", "1",
        name="ex-agent", wait=False)
    schedulers = {
        pause: module_processes.start("scheduler", *common, "--policy", "weft", "--pause-policy", pause,
                                      "--tenant-quotas", "acme=40", "--grace-s", "1",
                                      name=f"scheduler-{pause}", wait=False)
        for pause in ("keep", "drop", "demote")
    }
    for proc in (cachestore, executor, *schedulers.values()):
        proc.wait_healthy(60)
    mesh = AgentMesh(schedulers, cachestore, [])

    def all_see_executor():
        for pause in schedulers:
            reply = mesh.stub(pause).ListExecutors(scheduler_pb2.ListExecutorsRequest(), timeout=2)
            if not any(e.heartbeat.state == 2 for e in reply.executors):  # SERVING
                return False
        return True

    wait_for(all_see_executor, 30, "every scheduler to see the executor SERVING")
    try:
        yield mesh
    finally:
        for ch in mesh.channels:
            ch.close()


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 7 * i) % VOCAB for i in range(n)]


def _generate(stub, rid: str, prompt: list[int], tenant: str = "acme", max_tokens: int = 4, **session):
    req = scheduler_pb2.ScheduleRequest(
        request_id=rid, prompt_token_ids=prompt, tenant=tenant,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        session=common_pb2.SessionInfo(**session))
    chunks = list(stub.Generate(req, timeout=60))
    out = [t for c in chunks for t in c.token_ids_delta]
    return chunks[0], chunks[-1], out


def _flood(stub, tenant: str, n: int, seed: int) -> None:
    for i in range(n):
        _generate(stub, f"flood-{tenant}-{seed}-{i}", _prompt(120, seed + i), tenant=tenant, max_tokens=2)


def test_multi_hop_session_hits_the_cache_more_as_its_context_grows(agent_mesh):
    stub = agent_mesh.stub("keep")
    context, cached = _prompt(22, 1), []
    for hop in range(4):
        first, last, out = _generate(stub, f"mh-{hop}", context, session_id="mh", program_id="p-mh", hop_index=hop,
                                     expected_tool_ms=500)
        cached.append(last.usage.num_cached_tokens)
        assert first.request_class == common_pb2.REQUEST_CLASS_AGENTIC
        assert last.pause_decision == common_pb2.PAUSE_DECISION_KEEP
        context = context + out + _prompt(9, 50 + hop)  # the tool result
    assert cached[0] == 0 and cached == sorted(cached) and len(set(cached)) == 4, cached


def test_stateful_hops_send_only_new_tokens_and_still_hit_the_cache(agent_mesh):
    stub = agent_mesh.stub("keep")
    _, last0, _ = _generate(stub, "sf-0", _prompt(30, 2), session_id="sf", hop_index=0, expected_tool_ms=500)
    _, last1, _ = _generate(stub, "sf-1", _prompt(6, 60), session_id="sf", hop_index=1, stateful=True)
    assert last1.usage.num_prompt_tokens == 30 + 4 + 6
    assert last1.usage.num_cached_tokens >= 32


def test_kept_session_resumes_from_cache_after_a_flood_a_dropped_one_recomputes(agent_mesh):
    results = {}
    for pause in ("keep", "drop"):
        stub = agent_mesh.stub(pause)
        ctx = _prompt(60, 3 if pause == "keep" else 4)
        _, last, out = _generate(stub, f"p-{pause}-0", ctx, session_id=f"p-{pause}", hop_index=0,
                                 expected_tool_ms=3000)
        assert last.pause_decision == (common_pb2.PAUSE_DECISION_KEEP if pause == "keep"
                                       else common_pb2.PAUSE_DECISION_DROP)
        _flood(stub, "globex", 6, seed=100 + len(results) * 10)  # cycles the unreserved pool
        _, resumed, _ = _generate(stub, f"p-{pause}-1", ctx + out + _prompt(8, 70), session_id=f"p-{pause}",
                                  hop_index=1)
        results[pause] = resumed.usage.num_cached_tokens
    assert results["keep"] >= 60 and results["drop"] < results["keep"], results


def test_demoted_session_resumes_from_the_host_tier(agent_mesh):
    stub = agent_mesh.stub("demote")
    ctx = _prompt(64, 5)
    before = agent_mesh.host_tier_blocks()
    _, last, out = _generate(stub, "dm-0", ctx, session_id="dm", hop_index=0, expected_tool_ms=60_000)
    assert last.pause_decision == common_pb2.PAUSE_DECISION_DEMOTE
    wait_for(lambda: agent_mesh.host_tier_blocks() >= before + 16, 20, "the session's blocks in the host tier")
    _flood(stub, "globex", 6, seed=300)  # whatever stayed local is gone
    _, resumed, _ = _generate(stub, "dm-1", ctx + out + _prompt(8, 80), session_id="dm", hop_index=1)
    assert resumed.usage.num_cached_tokens >= 64  # promoted back before the prefill


def test_tenant_flood_leaves_the_reserved_tenant_served(agent_mesh):
    stub = agent_mesh.stub("drop")
    errors: list[BaseException] = []

    def flood(k):
        try:
            _flood(agent_mesh.stub("drop"), "globex", 4, seed=500 + 10 * k)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        served = [_generate(stub, f"calm-{i}", _prompt(40, 900 + i), tenant="acme", max_tokens=8) for i in range(3)]
    finally:
        for t in threads:
            t.join(120)
    assert not errors, errors
    for _, last, out in served:
        assert len(out) == 8 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_tenants_never_hit_each_others_prefixes(agent_mesh):
    stub = agent_mesh.stub("drop")
    prompt = _prompt(40, 7)
    _generate(stub, "iso-a", prompt, tenant="acme")
    _, other, _ = _generate(stub, "iso-b", prompt, tenant="globex")
    _, again, _ = _generate(stub, "iso-a2", prompt, tenant="acme")
    assert other.usage.num_cached_tokens == 0
    assert again.usage.num_cached_tokens >= 36


@pytest.mark.parametrize("session,field", [
    (dict(session_id="never-seen", hop_index=1, stateful=True), "session.session_id"),
    (dict(session_id="mh", hop_index=9), "session.hop_index"),
    (dict(contract=common_pb2.Contract(kv_quota_blocks=41)), "session.contract.kv_quota_blocks"),
])
def test_bad_session_input_is_refused_naming_the_field(agent_mesh, session, field):
    with pytest.raises(grpc.RpcError) as err:
        _generate(agent_mesh.stub("keep"), "bad", _prompt(8, 1), **session)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
