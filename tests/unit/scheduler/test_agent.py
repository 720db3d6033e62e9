"""Scheduler agent policies without processes: sessions and hop validation, priority
ordering (least attained service per program, slack, class), the pause decision, the
contract check and fallbacks, intent shift, and priority-ordered admission."""
from __future__ import annotations

import asyncio

import pytest

from services.scheduler.policy.admission import Admission
from services.scheduler.agent_plane import AgentPlane, HopRequest
from services.scheduler.policy.contracts import ContractBook, ContractTerms, Fallback, parse_tenant_quotas
from services.scheduler.errors import InvalidScheduleRequest, OverloadedError
from services.scheduler.policy.intent_shift import HashedBowDistance, IntentShiftDetector
from services.scheduler.policy.pause import (
    PauseCosts, PauseDecision, PauseInputs, PausePolicyName, make_pause_policy,
)
from services.scheduler.policy.priority import PriorityInputs, Prioritizer, SchedulingPolicy, make_prioritizer
from services.scheduler.state.sessions import SessionTable
from services.shared.vocabulary import RequestClass, queue_order_key


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- sessions --------------------------------------------------------------------------
def test_stateful_hop_appends_to_the_session_context():
    table = SessionTable()
    table.end_hop("t", "s", "p", 0, [1, 2, 3], [4, 5], "ex", 3, 1000, 0.0)
    hop = table.begin_hop("t", "s", "p", 1, True, [6, 7])
    assert hop.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7] and hop.num_new_tokens == 2


@pytest.mark.parametrize("args,field", [
    (("t", "nope", "", 1, True, [1]), "session.session_id"),  # unknown session, stateful
    (("t", "s", "", 3, False, [1]), "session.hop_index"),  # out of order
    (("t", "s", "", 0, True, [1]), "session.stateful"),  # stateful hop 0
    (("other", "s", "", 1, True, [1]), "session.session_id"),  # another tenant's session
])
def test_bad_hops_are_refused_naming_the_field(args, field):
    table = SessionTable()
    table.end_hop("t", "s", "", 0, [1], [2], "ex", 1, 0, 0.0)
    with pytest.raises(InvalidScheduleRequest) as err:
        table.begin_hop(*args)
    assert err.value.field == field


def test_stateless_clients_and_unknown_stateless_sessions_keep_working():
    table = SessionTable()
    assert table.begin_hop("t", "", "", 0, False, [1, 2]).session is None
    assert table.begin_hop("t", "new", "", 4, False, [1, 2]).prompt_token_ids == [1, 2]


def test_program_attained_service_accumulates_over_hops_and_tables_stay_bounded():
    table = SessionTable(max_sessions=2)
    for hop in range(3):
        table.end_hop("t", "s", "prog", hop, [1] * 10, [2] * 5, "ex", 10, 0, 0.0)
    assert table.program("t", "prog").attained_tokens == 45
    table.end_hop("t", "a", "", 0, [1], [], "ex", 1, 0, 0.0)
    table.end_hop("t", "b", "", 0, [1], [], "ex", 1, 0, 0.0)
    assert len(table) == 2 and table.get("t", "s") is None


# -- priority --------------------------------------------------------------------------
def _inputs(**kw) -> PriorityInputs:
    kw.setdefault("arrival_s", 0.0)
    kw.setdefault("request_class", RequestClass.AGENTIC)
    return PriorityInputs(**kw)


class QueueOrder:
    """A prioritizer (higher runs first) read as the admission queue reads it: ``score`` is
    its ascending sort key, ``queue_order_key(priority)``, so lower runs first."""

    def __init__(self, policy: Prioritizer) -> None:
        self.policy = policy

    def score(self, r: PriorityInputs, now_s: float) -> float:
        return queue_order_key(self.policy.priority(r, now_s))


def test_weft_priority_puts_a_long_program_behind_short_ones_and_interactive_first():
    weft = QueueOrder(make_prioritizer(SchedulingPolicy.WEFT))
    long_prog = weft.score(_inputs(attained_tokens=50 * 2000), 1.0)
    short_prog = weft.score(_inputs(attained_tokens=2000), 1.0)
    chat = weft.score(_inputs(request_class=RequestClass.INTERACTIVE), 1.0)
    batch = weft.score(_inputs(request_class=RequestClass.BATCH), 1.0)
    assert chat < short_prog < long_prog
    assert short_prog < batch


def test_weft_priority_rises_as_a_deadline_nears_and_with_age():
    weft = QueueOrder(make_prioritizer("weft"))
    r = _inputs(ttft_ceiling_ms=1000)
    assert weft.score(r, 1.0) < weft.score(r, 0.1)
    plain = _inputs()
    assert weft.score(plain, 60.0) < weft.score(plain, 0.0)
    assert weft.score(_inputs(fresh_resume=True), 0) < weft.score(plain, 0)
    assert weft.score(_inputs(mean_entropy=5.0), 0) > weft.score(plain, 0)


def test_fcfs_is_arrival_order_and_static_priority_is_class_then_caller_field():
    fcfs = QueueOrder(make_prioritizer("fcfs"))
    assert fcfs.score(_inputs(arrival_s=1.0, attained_tokens=10**6), 5) < fcfs.score(_inputs(arrival_s=2.0), 5)
    static = QueueOrder(make_prioritizer("priority"))
    assert static.score(_inputs(caller_priority=5.0), 0) < static.score(_inputs(), 0)
    assert static.score(_inputs(request_class=RequestClass.INTERACTIVE), 0) < static.score(
        _inputs(caller_priority=100.0), 0)


def test_admission_hands_slots_to_the_best_score_at_hand_off_time():
    async def main():
        adm = Admission(max_in_flight=1, max_queue=10)
        await adm.enter()
        order = []
        scores = {"late-but-urgent": lambda now: 0.0, "early": lambda now: 5.0, "middle": lambda now: 1.0}

        async def waiter(name):
            await adm.enter(scores[name])
            order.append(name)
            adm.leave()

        tasks = [asyncio.create_task(waiter(n)) for n in ("early", "middle", "late-but-urgent")]
        await asyncio.sleep(0)
        assert adm.num_ahead(2.0) == 2
        adm.leave()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["late-but-urgent", "middle", "early"]


# -- pause policy ----------------------------------------------------------------------
def _pause(**kw) -> PauseInputs:
    base = dict(num_context_tokens=2048, num_blocks=128, expected_pause_ms=2000, pool_used_blocks=500,
                pool_num_blocks=1000, pool_pinned_blocks=0, can_demote=False)
    base.update(kw)
    return PauseInputs(**base)


def test_pause_keeps_short_pauses_and_drops_long_ones_under_pressure():
    policy = make_pause_policy(PausePolicyName.COST)
    short = policy.decide(_pause(expected_pause_ms=300))
    assert short.decision is PauseDecision.KEEP and 300 < short.pin_ttl_ms <= 60_000
    long = policy.decide(_pause(expected_pause_ms=60_000, pool_used_blocks=950))
    assert long.decision is PauseDecision.DROP


def test_pause_demotes_long_pauses_when_the_cachestore_can_take_them():
    policy = make_pause_policy("cost", PauseCosts(transfer_ms_per_block=0.5))
    plan = policy.decide(_pause(expected_pause_ms=60_000, pool_used_blocks=950, can_demote=True))
    assert plan.decision is PauseDecision.DEMOTE
    assert dict(plan.costs_ms)["demote"] < dict(plan.costs_ms)["drop"]


def test_pause_never_pins_past_the_pin_budget_and_idle_pools_keep_for_free():
    policy = make_pause_policy("cost", PauseCosts(max_pinned_fraction=0.5))
    assert policy.decide(_pause(pool_pinned_blocks=450, expected_pause_ms=100)).decision is PauseDecision.DROP
    assert policy.decide(_pause(pool_used_blocks=0, expected_pause_ms=10**6)).decision is PauseDecision.KEEP
    assert make_pause_policy("drop").decide(_pause()).decision is PauseDecision.DROP


# -- contracts -------------------------------------------------------------------------
def test_contract_asking_more_than_the_tenant_quota_is_refused_naming_the_field():
    book = ContractBook(parse_tenant_quotas("acme=64"))
    book.validate(ContractTerms(kv_quota_blocks=64), "acme", 1000)
    with pytest.raises(InvalidScheduleRequest) as err:
        book.validate(ContractTerms(kv_quota_blocks=65), "acme", 1000)
    assert err.value.field == "session.contract.kv_quota_blocks"
    with pytest.raises(InvalidScheduleRequest):
        book.validate(ContractTerms(kv_quota_blocks=2000), "other", 1000)  # no tenant quota: the pool


def test_fallback_path_follows_the_contract_when_the_ttft_ceiling_cannot_be_met():
    book = ContractBook(initial_request_ms=1000)
    ok = book.choose_fallback(ContractTerms(ttft_ceiling_ms=5000), True, num_ahead=1, num_slots=4, num_new_tokens=10)
    assert ok.path is Fallback.NONE
    tight = dict(num_ahead=8, num_slots=2, num_new_tokens=10)
    assert book.choose_fallback(ContractTerms(ttft_ceiling_ms=100), True, **tight).path is Fallback.REROUTE
    degraded = book.choose_fallback(ContractTerms(ttft_ceiling_ms=100), False, **tight)
    assert degraded.path is Fallback.DEGRADE and "ceiling" in degraded.reason
    with pytest.raises(OverloadedError):
        book.choose_fallback(ContractTerms(ttft_ceiling_ms=100, fallback=Fallback.FAIL_FAST), True, **tight)


def test_the_admission_ttft_estimate_prices_only_the_prefill_an_executor_has_not_cached():
    """A long hop whose prefix an executor holds meets a ceiling its whole prompt would
    miss (the estimate used to price every prompt token as prefill)."""
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"),
                       ContractBook(prefill_ms_per_token=1.0, initial_request_ms=10))
    terms = ContractTerms(ttft_ceiling_ms=200)
    prompt = list(range(1000))
    whole = plane.begin(HopRequest("r0", "t", prompt, terms=terms), 1000)
    assert plane.fallback(whole, 0, 4).path is not Fallback.NONE  # 1000 tokens x 1 ms > 200 ms
    cached = plane.begin(HopRequest("r1", "t", prompt, terms=terms), 1000)
    choice = plane.fallback(cached, 0, 4, num_cached_tokens=960)
    assert choice.path is Fallback.NONE and choice.ttft_estimate_ms < 200


def test_tpot_ceiling_takes_the_fallback_once_observed_token_times_exceed_it_under_load():
    book = ContractBook(initial_tpot_ms=10)
    terms = ContractTerms(tpot_ceiling_ms=30)
    idle = dict(num_ahead=0, num_slots=4, num_new_tokens=10)
    assert book.choose_fallback(terms, True, **idle).path is Fallback.NONE
    for _ in range(30):  # requests now take 50 ms per output token
        book.observe_request_ms(5000, num_output_tokens=100)
    slow = book.choose_fallback(terms, True, **idle)
    assert slow.path is Fallback.REROUTE and "tpot" in slow.reason
    # a looser ceiling still holds when idle, but not with a queue as deep as the slots
    loose = ContractTerms(tpot_ceiling_ms=60)
    assert book.choose_fallback(loose, False, **idle).path is Fallback.NONE
    assert book.choose_fallback(loose, False, num_ahead=4, num_slots=4, num_new_tokens=10).path is Fallback.DEGRADE


# -- intent shift ----------------------------------------------------------------------
def test_intent_shift_flags_a_new_topic_but_not_a_continuation():
    context = [i % 50 for i in range(300)]
    same = [i % 50 for i in range(7, 60)]
    other = [1000 + (i * 37) % 300 for i in range(60)]
    metric = HashedBowDistance()
    assert metric.distance(context, same) < 0.5 < metric.distance(context, other)
    detector = IntentShiftDetector(metric, threshold=0.9)
    assert detector.shifted(context, other) and not detector.shifted(context, same)


def test_agent_plane_releases_kept_kv_early_on_intent_shift():
    clock = Clock()
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), clock=clock)
    ctx = [i % 50 for i in range(64)]
    plan = plane.begin(HopRequest("r0", "t", ctx, session_id="s", expected_tool_ms=1000), 1000)
    assert plane.pause(plan, "ex", 10, 1000).decision is PauseDecision.KEEP
    plane.finish(plan, "ex", [1, 2], 0, 0.0, 50.0)
    assert plane.pinned_blocks("ex") == 4
    clock.now += 0.5
    other = [1000 + (i * 37) % 300 for i in range(40)]
    nxt = plane.begin(HopRequest("r1", "t", other, session_id="s", hop_index=1), 1000)
    assert nxt.release is not None and nxt.release.executor == "ex"
    assert plane.pinned_blocks("ex") == 0
    assert nxt.prompt_token_ids == other


def test_a_turn_that_extends_the_whole_kept_context_keeps_its_pin_whatever_its_topic():
    """A stateful hop (or a full resend) reuses every kept block: releasing them would
    only let this very hop's KV be evicted, so the intent check does not run."""
    clock = Clock()
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), clock=clock)
    ctx = [i % 50 for i in range(64)]
    plan = plane.begin(HopRequest("r0", "t", ctx, session_id="s", expected_tool_ms=1000), 1000)
    plane.pause(plan, "ex", 10, 1000)
    plane.finish(plan, "ex", [1, 2], 0, 0.0, 50.0)
    clock.now += 0.5
    other = [1000 + (i * 37) % 300 for i in range(40)]
    nxt = plane.begin(HopRequest("r1", "t", other, session_id="s", hop_index=1, stateful=True), 1000)
    assert nxt.release is None and nxt.intent is None
    assert plane.pinned_blocks("ex") == 4
    assert nxt.prompt_token_ids == ctx + [1, 2] + other


def test_pinned_block_accounting_keeps_two_tenants_with_one_session_id_apart():
    """Two tenants may both call their session "s": ending one's pins must not forget the
    other's (the table was keyed by session id alone)."""
    clock = Clock()
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("keep"), ContractBook(), clock=clock)
    ctx = [i % 50 for i in range(64)]
    for tenant in ("acme", "globex"):
        plan = plane.begin(HopRequest(f"r-{tenant}", tenant, ctx, session_id="s", expected_tool_ms=1000), 1000)
        assert plane.pause(plan, "ex", 10, 1000).decision is PauseDecision.KEEP
        plane.finish(plan, "ex", [1, 2], 0, 0.0, 50.0)
    assert plane.pinned_blocks("ex") == 8
    plane.forget_pins("acme", "s")
    assert plane.pinned_blocks("ex") == 4  # globex's "s" still holds its blocks


def test_attained_service_counts_the_programs_own_tokens_not_recomputed_kv():
    """A hop whose context the pool evicted is recomputed (nothing cached): charging that
    recomputation to the program's attained service sank a long program under KV pressure,
    which got it evicted again. Only its new prompt tokens and its output count."""
    plane = AgentPlane(make_prioritizer("weft"), make_pause_policy("drop"), ContractBook(), clock=Clock())
    ctx = [i % 50 for i in range(300)]
    first = plane.begin(HopRequest("r0", "t", ctx, session_id="s", program_id="p", expected_tool_ms=500), 1000)
    plane.finish(first, "ex", [7, 8], 0, 0.0, 50.0)
    assert plane.sessions.program("t", "p").attained_tokens == 302  # the first prompt is the program's own
    nxt = ctx + [7, 8] + [3] * 20
    second = plane.begin(HopRequest("r1", "t", nxt, session_id="s", program_id="p", hop_index=1), 1000)
    plane.finish(second, "ex", [9, 9], 0, 0.0, 50.0)  # recomputed whole: num_cached_tokens 0
    assert plane.sessions.program("t", "p").attained_tokens == 302 + 20 + 2
