"""The pause cost model prices with the executor's measured rates (issue 17): the
executor's load report carries its promotion cost model's prefill and transfer rates, the
scheduler's membership keeps the latest per executor, and keep / demote / drop is priced
with them where measured, with the configured PauseCosts where not."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.executor.events import LoadSnapshot
from services.executor.event_codec import encode_event
from services.executor.server import ExecutorServicer
from services.executor.tiers.promotion import CostModel
from services.scheduler.agent_plane import AgentPlane, HopRequest
from services.scheduler.api.convert import executor_load, list_executors_response
from services.scheduler.policy.contracts import ContractBook, FallbackChoice, Fallback
from services.scheduler.policy.pause import PauseCosts, PauseDecision, PauseInputs, make_pause_policy
from services.scheduler.policy.priority import make_prioritizer
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import (
    ExecutorLoad, ExecutorRecord, ExecutorState, MeasuredRates, Membership,
)
from weft.v1 import events_pb2

CONFIGURED = PauseCosts(prefill_ms_per_token=0.2, transfer_ms_per_block=0.5)


def _inputs(**kw) -> PauseInputs:
    # 2048 tokens in 128 blocks, a 60 s tool call on a 95 % full pool: keep is out of the question.
    base = dict(num_context_tokens=2048, num_blocks=128, expected_pause_ms=60_000, pool_used_blocks=950,
                pool_num_blocks=1000, pool_pinned_blocks=0, can_demote=True)
    base.update(kw)
    return PauseInputs(**base)


# -- the policy --------------------------------------------------------------------------
def test_without_measured_rates_the_configured_costs_price_the_pause_as_before():
    plan = make_pause_policy("cost", CONFIGURED).decide(_inputs())
    costs = dict(plan.costs_ms)
    assert plan.decision is PauseDecision.DEMOTE
    assert costs["demote"] == pytest.approx(128 * 2 * 0.5)
    assert costs["drop"] == pytest.approx(0.95 * 2048 * 0.2)
    assert plan.cost_source == "configured" and plan.reason == "cheapest at configured costs"


def test_a_slow_measured_transfer_makes_drop_win_over_a_demote_the_configured_cost_would_choose():
    # 81 ms to promote 16 blocks on a slow box: ~5 ms a block, ten times the configured 0.5.
    plan = make_pause_policy("cost", CONFIGURED).decide(_inputs(
        prefill_ms_per_token=0.2, transfer_ms_per_block=5.0, transfer_overhead_ms=1.0))
    costs = dict(plan.costs_ms)
    assert costs["demote"] == pytest.approx(2 * (1.0 + 128 * 5.0))
    assert plan.decision is PauseDecision.DROP
    assert plan.cost_source == "measured" and "measured" in plan.reason


def test_a_slow_measured_transfer_makes_keep_win_when_prefill_is_slow_too():
    # A 2 s pause on a half-full pool: keep costs 512 ms; at 2 ms a token (500 tokens/s) a
    # drop costs 2 s of recompute; the configured demote (128 ms) would win, the measured one
    # (1.28 s) loses to keep.
    x = dict(expected_pause_ms=2000, pool_used_blocks=500)
    configured = make_pause_policy("cost", CONFIGURED).decide(_inputs(prefill_ms_per_token=2.0, **x))
    assert configured.decision is PauseDecision.DEMOTE and configured.cost_source == "mixed"
    measured = make_pause_policy("cost", CONFIGURED).decide(_inputs(
        prefill_ms_per_token=2.0, transfer_ms_per_block=5.0, transfer_overhead_ms=1.0, **x))
    assert measured.decision is PauseDecision.KEEP and measured.pin_ttl_ms > 2000
    assert dict(measured.costs_ms)["drop"] == pytest.approx(0.5 * 2048 * 2.0)


def test_without_demote_only_the_prefill_rate_decides_the_source():
    plan = make_pause_policy("cost", CONFIGURED).decide(_inputs(can_demote=False, prefill_ms_per_token=0.1,
                                                                transfer_ms_per_block=None))
    assert plan.cost_source == "measured" and "demote" not in dict(plan.costs_ms)


# -- the rates: membership and conversion -------------------------------------------------
def test_measured_rates_convert_to_milliseconds_and_an_unmeasured_rate_is_none():
    rates = MeasuredRates(prefill_tokens_per_s=4000.0, num_prefills=3, transfer_bytes_per_s=1e6,
                          num_transfers=2, block_bytes=4096, transfer_overhead_ms=1.0)
    assert rates.prefill_ms_per_token == pytest.approx(0.25)
    assert rates.transfer_ms_per_block == pytest.approx(4.096)
    seeded = MeasuredRates(prefill_tokens_per_s=2000.0, transfer_bytes_per_s=200e6, block_bytes=4096)
    assert seeded.prefill_ms_per_token is None and seeded.transfer_ms_per_block is None


def _record(name: str = "ex", address: str = "ex:1") -> ExecutorRecord:
    return ExecutorRecord(name=name, address=address, model_id="m", block_size=16, state=ExecutorState.SERVING)


def test_membership_keeps_each_executors_latest_rates_across_heartbeats():
    m = Membership()
    assert m.rates("ex") is None
    m.heartbeat(_record())
    assert m.rates("ex") is None  # no load report yet
    first = MeasuredRates(prefill_tokens_per_s=1000.0, num_prefills=1)
    m.update_load("ex", ExecutorLoad(num_blocks=64, rates=first))
    m.heartbeat(_record())  # a heartbeat keeps the latest load report, rates included
    assert m.rates("ex") == first
    later = MeasuredRates(prefill_tokens_per_s=1500.0, num_prefills=2)
    m.update_load("ex", ExecutorLoad(num_blocks=64, rates=later))
    assert m.rates("ex") == later and m.rates("other") is None


# -- executor to scheduler ----------------------------------------------------------------
class _Engine:
    """AsyncEngine's ``peek`` over an engine with 3 layers of [2, 4 blocks, 16, 2 heads, 8] fp16."""

    def peek(self, fn):
        kv = [torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16) for _ in range(3)]
        return fn(SimpleNamespace(runner=SimpleNamespace(kv_caches=kv)))


def _servicer(cost: CostModel | None) -> ExecutorServicer:
    tiers = SimpleNamespace(promoter=SimpleNamespace(cost=cost)) if cost is not None else None
    return ExecutorServicer(_Engine(), "ex", "m", 16, tiers=tiers)


def _wire(servicer: ExecutorServicer | None) -> events_pb2.LoadReport:
    msg = encode_event(LoadSnapshot(num_running=1, num_waiting=0, num_free_blocks=3, num_blocks=4), servicer)
    return events_pb2.LoadReport.FromString(msg.SerializeToString())


def test_a_load_report_carries_the_promoters_measured_rates_to_the_scheduler():
    cost = CostModel()
    cost.observe_prefill(600, 1.5)  # 400 tokens/s
    cost.observe_transfer(3072 * 16, 0.081)  # 16 blocks in 81 ms
    load = executor_load(_wire(_servicer(cost)))
    rates = load.rates
    assert (rates.num_prefills, rates.num_transfers, rates.block_bytes) == (1, 1, 3 * 2 * 16 * 2 * 8 * 2)
    assert rates.prefill_ms_per_token == pytest.approx(2.5)
    assert rates.transfer_ms_per_block == pytest.approx(81 / 16)
    assert rates.transfer_overhead_ms == pytest.approx(1.0)
    m = Membership()
    m.heartbeat(_record())
    m.update_load("ex", load)
    shown = list_executors_response(m, KvIndex()).executors[0].load  # what `weft ps` reads
    assert shown.num_transfers == 1 and shown.transfer_bytes_per_s == pytest.approx(cost.transfer_bytes_per_s)


def test_the_reported_block_bytes_are_the_transfer_payloads_size():
    from services.executor.tiers.kv_transfer import block_layout

    dtype, shape = _Engine().peek(block_layout)  # what the Promoter prices a load by
    assert dtype == "float16"
    assert executor_load(_wire(_servicer(CostModel()))).rates.block_bytes == torch.Size(shape).numel() * 2


def test_an_executor_without_a_cachestore_tier_reports_no_rates_and_the_configured_costs_stay():
    for servicer in (None, _servicer(None)):
        rates = executor_load(_wire(servicer)).rates
        assert rates == MeasuredRates()
        assert rates.prefill_ms_per_token is None and rates.transfer_ms_per_block is None
    unmeasured = executor_load(_wire(_servicer(CostModel()))).rates  # seeded, never observed
    assert unmeasured.prefill_ms_per_token is None and unmeasured.transfer_ms_per_block is None


def test_the_agent_plane_prices_a_hops_pause_with_its_executors_measured_rates():
    m = Membership()
    m.heartbeat(_record())
    slow = MeasuredRates(prefill_tokens_per_s=5000.0, num_prefills=4, transfer_bytes_per_s=3072 / 0.005,
                         num_transfers=4, block_bytes=3072, transfer_overhead_ms=1.0)  # 5 ms a block
    m.update_load("ex", ExecutorLoad(num_blocks=1000, num_free_blocks=50, rates=slow))
    policy = make_pause_policy("cost", CONFIGURED)
    hop = HopRequest("r0", "t", list(range(2048)), session_id="s", expected_tool_ms=60_000)

    def decide(rates_of):
        plane = AgentPlane(make_prioritizer("weft"), policy, ContractBook(), rates_of=rates_of)
        return plane.pause(plane.begin(hop, 1000), "ex", 950, 1000)

    assert decide(lambda _: None).decision is PauseDecision.DEMOTE  # configured: 0.5 ms a block
    measured = decide(m.rates)
    assert measured.decision is PauseDecision.DROP and measured.cost_source == "measured"
    assert dict(measured.costs_ms)["demote"] == pytest.approx(2 * (1.0 + 128 * 5.0))


def test_the_contract_ttft_estimate_uses_the_measured_prefill_rate_when_given():
    book = ContractBook(prefill_ms_per_token=0.2)
    choice = FallbackChoice(Fallback.NONE, queue_estimate_ms=10.0)
    assert book.estimate_with_cached(choice, 1000, 200) == pytest.approx(10.0 + 800 * 0.2)
    assert book.estimate_with_cached(choice, 1000, 200, prefill_ms_per_token=2.5) == pytest.approx(10.0 + 800 * 2.5)
