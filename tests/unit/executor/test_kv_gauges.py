"""Per-tenant KV gauges follow the pool (issue 12: `weft top` showed 610/805 blocks used
by a tenant while the pool was empty). The pool lists a tenant's partition only while it
holds blocks, so when its last request ended the partition vanished from the usage
snapshot and its gauges kept their last value. Driven through a real engine with the
executor's StepTrace; ``update_gauges`` is what the executor's heartbeat calls."""
from __future__ import annotations

import pytest

from services.executor.kv.block_pool import PartitionSpec
from services.executor.engine.config import EngineConfig
from services.executor.engine.engine import LLMEngine
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.step_trace import StepTrace
from services.mesh import metric_catalogue as catalogue
from weft.testing.tiny_model import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), preset="tiny", arch="llama")


def gauge(executor: str, partition: str, state: str) -> float:
    return catalogue.metric("weft_kv_blocks").labels(executor, partition, state)._value.get()


def exported(executor: str) -> dict[tuple[str, str], float]:
    """Every weft_kv_blocks sample of ``executor``: (partition, state) -> value."""
    out = {}
    for family in catalogue.metric("weft_kv_blocks").collect():
        for s in family.samples:
            if s.labels["executor"] == executor:
                out[(s.labels["partition"], s.labels["state"])] = s.value
    return out


def run_tenants(engine: LLMEngine, tenants: dict[str, int], max_tokens: int = 6) -> dict[str, int]:
    """Start requests per tenant partition, step until every tenant holds blocks, then to
    the end; returns the most blocks each tenant's partition held (as the gauge saw it)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for tenant, n in tenants.items():
        for i in range(n):
            engine.add_request(f"{tenant}-{i}", list(range(10 + i, 60 + i)), params, partition=tenant)
    peak = dict.fromkeys(tenants, 0.0)
    for _ in range(500):
        if not engine.has_unfinished_requests:
            return peak
        engine.step()
        for tenant in tenants:
            peak[tenant] = max(peak[tenant], gauge(engine.step_trace.executor, tenant, "used"))
    raise AssertionError("engine still busy")


def engine_with_trace(checkpoint, name: str, partitions=()) -> LLMEngine:
    engine = LLMEngine(checkpoint, EngineConfig(num_kv_blocks=64, block_size=16), step_trace=StepTrace(name))
    if partitions:
        engine.pool.set_partitions(partitions)
    return engine


def test_a_tenants_gauges_drop_to_zero_when_its_requests_end(checkpoint):
    name = "executor-kv-gauge-drop"
    engine = engine_with_trace(checkpoint, name)
    peak = run_tenants(engine, {"acme": 3, "globex": 2})
    assert peak["acme"] >= 3 and peak["globex"] >= 2  # the gauges moved while they ran
    engine.step_trace.update_gauges(engine)  # the heartbeat's refresh, the pool now idle
    assert {u.name for u in engine.pool.usage()}.isdisjoint({"acme", "globex"})  # the pool forgot them
    for tenant in ("acme", "globex"):
        for state in ("used", "reserved", "borrowed"):
            assert gauge(name, tenant, state) == 0, (tenant, state)
    used = sum(v for (p, state), v in exported(name).items() if state == "used")
    assert used == sum(u.used_blocks for u in engine.pool.usage()) == 0


def test_a_tenant_that_comes_back_is_counted_again(checkpoint):
    name = "executor-kv-gauge-return"
    engine = engine_with_trace(checkpoint, name)
    run_tenants(engine, {"acme": 1})
    engine.step_trace.update_gauges(engine)
    assert gauge(name, "acme", "used") == 0
    peak = run_tenants(engine, {"acme": 2})
    assert peak["acme"] >= 2


def test_a_partition_whose_quota_is_removed_drops_to_zero(checkpoint):
    name = "executor-kv-gauge-quota"
    engine = engine_with_trace(checkpoint, name, [PartitionSpec("default", 0, 64), PartitionSpec("gold", 8, 8)])
    engine.step_trace.update_gauges(engine)
    assert gauge(name, "gold", "reserved") == 8
    engine.pool.set_partitions([PartitionSpec("default", 0, 64)])  # the quota table no longer has gold
    engine.step_trace.update_gauges(engine)
    assert gauge(name, "gold", "reserved") == 0 and gauge(name, "gold", "used") == 0


def _step_sample(name: str, executor: str, kind: str) -> float:
    for family in catalogue.metric(name).collect():
        for s in family.samples:
            if s.labels.get("executor") == executor and s.labels.get("kind") == kind and (
                    s.name.endswith("_count") or s.name.endswith("_total")):
                return s.value
    return 0.0


def test_step_metrics_count_each_step_by_kind_and_every_token_it_computed(checkpoint):
    engine = engine_with_trace(checkpoint, "ex-steps")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(10, 40)), params)  # 30 prompt tokens
    engine.step()  # a prefills alone and samples its first token
    engine.add_request("b", list(range(50, 70)), params)  # 20 more
    engine.step()  # a decodes while b prefills: mixed
    while engine.has_unfinished_requests:
        engine.step()  # both decode, then the last one alone
    steps = {kind: _step_sample("weft_executor_step_seconds", "ex-steps", kind) for kind in catalogue.STEP_KINDS}
    tokens = {kind: _step_sample("weft_executor_step_tokens_total", "ex-steps", kind) for kind in ("decode", "prefill")}
    assert steps == {"prefill": 1, "mixed": 1, "decode": engine.num_steps - 2}
    assert tokens == {"prefill": 50, "decode": 2 * 3}  # each request: 4 tokens, the first from its prefill
