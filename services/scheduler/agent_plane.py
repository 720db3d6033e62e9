"""The scheduler's agent-native layer: one object that the dispatcher asks, per hop,
"what is this request, when does it run, what happens to its KV afterwards".

    intent_inputs(hop)  what the hop's intent check compares (kept or demoted context only),
                        judged before ``begin`` (dispatch/agent_steps.judge_intent)
    begin(hop)          validate session / hop / contract, resolve a stateful prompt,
                        class, priority (higher first; re-evaluated at every slot hand-off),
                        intent-shift release of stale kept or demoted KV
    fallback(plan, …)   contract ceilings → the fallback path (or FAIL_FAST)
    pause(plan, …)      keep / demote / drop for the tool call after this hop
    finish(plan, …)     record the hop: session context, program attained service,
                        entropy, kept-block accounting

Domain types only (no protobuf): ``api/convert.py`` converts, ``dispatch/agent_steps.py``
calls it on the request path. Mutates only its own tables.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from services.scheduler.policy.contracts import ContractBook, ContractTerms, Fallback, FallbackChoice
from services.shared.vocabulary import Rung
from services.scheduler.errors import InvalidScheduleRequest
from services.scheduler.policy.intent_shift import IntentShiftDecision, IntentShiftDetector
from services.scheduler.policy.pause import PauseDecision, PauseInputs, PausePlan, PausePolicy
from services.scheduler.policy.priority import PriorityInputs, Prioritizer
from services.scheduler.state.blocks import num_full_blocks
from services.scheduler.state.membership import MeasuredRates
from services.scheduler.state.sessions import HopContext, SessionState, SessionTable
from services.shared.vocabulary import RequestClass

log = structlog.get_logger(__name__)


class KvArchive(Protocol):
    """The lowest KV tier, as released KV is sent down to it (api/cachestore_port.py)."""

    async def archive_blocks(self, block_hashes: Sequence[int]) -> int:
        """Move these blocks to the archive tier; returns how many moved. Raises on failure."""


@dataclass(frozen=True)
class JudgedIntent:
    """An intent check awaited before ``begin`` and the context length it judged: ``begin``
    uses it only while the session's context is still that long."""

    decision: IntentShiftDecision
    num_context_tokens: int


@dataclass(frozen=True)
class HopRequest:
    request_id: str
    tenant: str
    prompt_token_ids: Sequence[int]
    session_id: str = ""
    program_id: str = ""
    hop_index: int = 0
    expected_tool_ms: int = 0
    stateful: bool = False
    request_class: RequestClass | None = None  # None: decided here
    terms: ContractTerms = ContractTerms()
    caller_priority: float = 0.0
    fork_id: str = ""  # ScheduleRequest.fork_id: the fork that created its session for this hop
    judged_intent: JudgedIntent | None = None  # set by dispatch/agent_steps.judge_intent

    def judged(self, decision: IntentShiftDecision, num_context_tokens: int) -> HopRequest:
        """This hop with an awaited intent verdict attached (a new object)."""
        return replace(self, judged_intent=JudgedIntent(decision, num_context_tokens))


@dataclass(frozen=True)
class StaleRelease:
    """Kept or demoted KV a session's new turn will not use: unpin it, forget these
    tokens' blocks on the executor and send them down to the archive tier."""

    executor: str
    session_id: str
    stale_context_token_ids: tuple[int, ...]
    new_prompt_token_ids: tuple[int, ...]
    was_demoted: bool = False  # the blocks were in the cachestore's host tier, not pinned


@dataclass
class HopPlan:
    request: HopRequest
    prompt_token_ids: list[int]
    request_class: RequestClass
    arrival_s: float
    inputs: PriorityInputs
    priority: Callable[[float], float]  # now_s -> priority, higher runs first
    resumes_demoted: str = ""  # executor whose demoted blocks should be promoted first
    num_new_tokens: int = 0  # prompt tokens beyond the session's known context (the whole prompt without one)
    release: StaleRelease | None = None
    intent: IntentShiftDecision | None = None  # the intent check's verdict (None: not checked)
    fallback: FallbackChoice = field(default_factory=lambda: FallbackChoice(Fallback.NONE))
    pause: PausePlan = field(default_factory=lambda: PausePlan(PauseDecision.NONE))
    # Filled while the hop streams (dispatch/agent_steps.py):
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_chunks: int = 0
    executor: str = ""  # where it runs (first chunk)
    session_ended: bool = False  # its session was ended while it ran (dispatch/agent_steps.py)

    @property
    def pauses_after(self) -> bool:
        r = self.request
        return bool(r.session_id) and (r.expected_tool_ms > 0 or self.request_class is RequestClass.AGENTIC)


class AgentPlane:
    def __init__(self, prioritizer: Prioritizer, pause_policy: PausePolicy, contracts: ContractBook,
                 intent: IntentShiftDetector | None = None, sessions: SessionTable | None = None,
                 block_size_of: Callable[[str], int] = lambda _: 16,
                 clock: Callable[[], float] = time.monotonic, can_demote: bool = True,
                 kv_archive: KvArchive | None = None, intent_timeout_s: float = 0.25,
                 rates_of: Callable[[str], MeasuredRates | None] = lambda _: None) -> None:
        """``can_demote``: whether the pause policy may choose demote (the executors'
        cachestore tier is configured); turned off for good once an executor cannot.
        ``rates_of``: an executor's measured cost-model rates (``Membership.rates``), which
        price its pause decisions where measured (None: the configured costs).
        ``kv_archive``: where released KV goes (None: it is only forgotten on the executor).
        ``intent_timeout_s``: how long a hop waits for the embedding signal before the
        intent check falls back to bigrams."""
        if intent_timeout_s <= 0:
            raise ValueError(f"intent_timeout_s must be > 0, got {intent_timeout_s}")
        self.prioritizer = prioritizer
        self.pause_policy = pause_policy
        self.contracts = contracts
        self.intent = intent or IntentShiftDetector()
        self.sessions = sessions or SessionTable(clock=clock)
        self.block_size_of = block_size_of
        self.rates_of = rates_of
        self.clock = clock
        self._pinned: dict[str, dict[tuple[str, str], tuple[int, float]]] = {}  # executor -> (tenant, session) -> (blocks, until)
        self.can_demote = can_demote
        self.kv_archive = kv_archive
        self.intent_timeout_s = intent_timeout_s

    # -- before admission -------------------------------------------------------------
    def intent_inputs(self, hop: HopRequest) -> tuple[list[int], list[int]] | None:
        """(session context, new turn) that ``hop``'s intent check compares; None when
        there is nothing to judge: no session or hop 0, KV neither kept (pinned) nor
        demoted (dropped KV has nothing left to release), or a turn that extends the whole
        context (a stateful hop, a client resending everything: every kept block is reused,
        so a shift would release nothing and the hop never waits for the embedding). A hop ``begin`` would refuse is
        None too (``begin`` names the field). Modifies nothing."""
        if not hop.session_id or hop.hop_index == 0:
            return None
        ses = self.sessions.get(hop.tenant, hop.session_id)
        if ses is None or not (ses.pinned_until_s > self.clock() or ses.demoted):
            return None
        try:
            ctx = self.sessions.begin_hop(hop.tenant, hop.session_id, hop.program_id, hop.hop_index,
                                          hop.stateful, hop.prompt_token_ids)
        except InvalidScheduleRequest:
            return None
        if _extends_context(ctx, ses):
            return None
        return ses.context_token_ids.tolist(), ctx.prompt_token_ids[len(ctx.prompt_token_ids) - ctx.num_new_tokens:]

    def begin(self, hop: HopRequest, pool_num_blocks: int) -> HopPlan:
        """Validate and plan a hop; raises InvalidScheduleRequest naming the field.
        Modifies nothing but the session's observed pause length, its fork id (cleared by
        a hop that is not its fork's own) and, on an intent shift, its pin and demoted state
        (released KV is never promoted back)."""
        self.contracts.validate(hop.terms, hop.tenant, pool_num_blocks)
        ctx: HopContext = self.sessions.begin_hop(hop.tenant, hop.session_id, hop.program_id, hop.hop_index,
                                                  hop.stateful, hop.prompt_token_ids)
        ses = ctx.session
        if ses is not None and ses.fork_id != hop.fork_id:
            ses.fork_id = ""  # a hop not the fork's own: the session is the caller's now (``created_by``)
        now = self.clock()
        cls = hop.request_class or (RequestClass.AGENTIC if hop.session_id else RequestClass.INTERACTIVE)
        fresh = False
        release = None
        resumes_demoted = ""
        intent = None
        if ses is not None:
            fresh = ses.pinned_until_s > now
            if ses.demoted:
                resumes_demoted = ses.executor
            self.sessions.resumed(ses)
            if (fresh or ses.demoted) and not _extends_context(ctx, ses):
                intent = self._judge(hop, ses, ctx)
            if intent is not None and intent.shifted:
                release = StaleRelease(ses.executor, ses.session_id, tuple(ses.context_token_ids),
                                       tuple(ctx.prompt_token_ids), was_demoted=ses.demoted)
                self._unpin(ses.executor, ses.tenant, ses.session_id)
                ses.pinned_until_s = 0.0
                ses.demoted = False  # its pause's prefetch must not promote it (agent_steps._demote)
                # Promotion loads only the new prompt's leading blocks: the part of the old
                # context this hop reuses (it needs them), never the stale rest, which goes to
                # the archive. With no full block reused there is nothing to promote.
                if len(ctx.prompt_token_ids) - ctx.num_new_tokens < self.block_size_of(ses.executor):
                    resumes_demoted = ""
                log.info("intent_shift_release", session_id=ses.session_id, executor=ses.executor,
                         signal=intent.signal, distance=round(intent.distance, 3), was_demoted=release.was_demoted)
        inputs = PriorityInputs(
            arrival_s=now, request_class=cls, caller_priority=hop.caller_priority,
            attained_tokens=ctx.program.attained_tokens if ctx.program else 0,
            ttft_ceiling_ms=hop.terms.ttft_ceiling_ms, fresh_resume=fresh,
            mean_entropy=ses.mean_entropy if ses else 0.0,
        )
        prioritizer = self.prioritizer
        return HopPlan(hop, ctx.prompt_token_ids, cls, now, inputs, lambda t: prioritizer.priority(inputs, t),
                       resumes_demoted, ctx.num_new_tokens, release, intent)

    def _judge(self, hop: HopRequest, ses: SessionState, ctx: HopContext) -> IntentShiftDecision:
        """The awaited verdict while it still applies (the context it judged is the
        session's), else the detector's synchronous one (its fallback when the primary
        signal is remote). Modifies nothing."""
        judged = hop.judged_intent
        if judged is not None and judged.num_context_tokens == len(ses.context_token_ids):
            return judged.decision
        new_turn = ctx.prompt_token_ids[len(ctx.prompt_token_ids) - ctx.num_new_tokens:]
        return self.intent.decide(ses.context_token_ids, new_turn)

    def fallback(self, plan: HopPlan, num_ahead: int, num_slots: int, offered: Iterable[Rung] = (),
                 num_cached_tokens: int = 0) -> FallbackChoice:
        """Contract check at admission; raises OverloadedError for FAIL_FAST. ``offered``:
        the degradation rungs live executors serve (a DEGRADE fallback may use one; never
        for a DETERMINISTIC hop, which is served at full quality or not at all).
        ``num_cached_tokens``: the prompt's longest prefix an executor already holds (only
        the rest is prefill in the TTFT estimate)."""
        if plan.request_class is RequestClass.DETERMINISTIC:
            offered = ()
        num_new = max(0, len(plan.prompt_token_ids) - num_cached_tokens)
        plan.fallback = self.contracts.choose_fallback(
            plan.request.terms, plan.request_class is RequestClass.INTERACTIVE, num_ahead, num_slots,
            num_new, offered)
        return plan.fallback

    # -- at placement -----------------------------------------------------------------
    def pause(self, plan: HopPlan, executor: str, pool_used_blocks: int, pool_num_blocks: int) -> PausePlan:
        """Decide keep / demote / drop for the tool call after this hop (known before it
        runs: the executor applies a keep atomically when the hop finishes)."""
        if not plan.pauses_after:
            return plan.pause
        ses = self.sessions.get(plan.request.tenant, plan.request.session_id)
        expected = plan.request.expected_tool_ms or (ses.observed_pause_ms if ses else 0.0) \
            or self.pause_policy_default_ms()
        num_tokens = len(plan.prompt_token_ids)
        rates = self.rates_of(executor) or MeasuredRates()
        plan.pause = self.pause_policy.decide(PauseInputs(
            num_context_tokens=num_tokens, num_blocks=num_full_blocks(num_tokens, self.block_size_of(executor)),
            expected_pause_ms=float(expected),
            pool_used_blocks=pool_used_blocks, pool_num_blocks=pool_num_blocks,
            pool_pinned_blocks=self.pinned_blocks(executor), can_demote=self.can_demote,
            prefill_ms_per_token=rates.prefill_ms_per_token, transfer_ms_per_block=rates.transfer_ms_per_block,
            transfer_overhead_ms=rates.transfer_overhead_ms,
        ))
        log.info("pause_decided", request_id=plan.request.request_id, session_id=plan.request.session_id,
                 executor=executor, decision=plan.pause.decision.value, reason=plan.pause.reason,
                 costs_ms={k: round(v, 2) for k, v in plan.pause.costs_ms}, cost_source=plan.pause.cost_source)
        return plan.pause

    def prefill_ms_per_token(self, executor: str) -> float | None:
        """``executor``'s measured prefill time per prompt token; None when not measured."""
        rates = self.rates_of(executor)
        return rates.prefill_ms_per_token if rates is not None else None

    def pause_policy_default_ms(self) -> float:
        return getattr(getattr(self.pause_policy, "c", None), "default_pause_ms", 2000.0)

    # -- after the hop ----------------------------------------------------------------
    def finish(self, plan: HopPlan, executor: str, output_token_ids: Sequence[int], num_cached_tokens: int,
               mean_entropy: float, elapsed_ms: float) -> SessionState | None:
        r = plan.request
        self.contracts.observe_request_ms(elapsed_ms, len(output_token_ids))
        # Attained service is what the program asked for (its new prompt tokens and its output),
        # never the engine's recomputation of KV it evicted (num_cached_tokens): charging that
        # sank a long program each time pool pressure evicted it, which got it evicted again.
        ses = self.sessions.end_hop(
            r.tenant, r.session_id, r.program_id, r.hop_index, plan.prompt_token_ids, output_token_ids, executor,
            plan.num_new_tokens, r.expected_tool_ms, mean_entropy)
        if ses is None:
            return None
        if plan.pause.decision is PauseDecision.KEEP:
            until = self.clock() + plan.pause.pin_ttl_ms / 1000.0
            blocks = num_full_blocks(len(ses.context_token_ids), self.block_size_of(executor))
            self._pinned.setdefault(executor, {})[(ses.tenant, ses.session_id)] = (blocks, until)
            ses.pinned_until_s, ses.pinned_blocks = until, blocks
        else:
            self._unpin(executor, ses.tenant, ses.session_id)
            ses.pinned_until_s, ses.pinned_blocks = 0.0, 0
        ses.demoted = plan.pause.decision is PauseDecision.DEMOTE
        return ses

    def demote_unavailable(self, ses: SessionState | None) -> None:
        """The executor cannot demote (RPC missing): stop choosing it; the session's
        blocks are left to LRU (a drop)."""
        if self.can_demote:
            log.warning("demote_unavailable", detail="executors lack DemoteBlocks; falling back to keep/drop")
        self.can_demote = False
        if ses is not None:
            ses.demoted = False

    def pinned_blocks(self, executor: str) -> int:
        now = self.clock()
        table = self._pinned.get(executor, {})
        for sid in [s for s, (_, until) in table.items() if until <= now]:
            del table[sid]
        return sum(b for b, _ in table.values())

    def forget_pins(self, tenant: str, session_id: str) -> None:
        """The session ended: its kept blocks no longer count against any executor. Keyed by
        tenant too: two tenants may use the same session id."""
        for table in self._pinned.values():
            table.pop((tenant, session_id), None)

    def _unpin(self, executor: str, tenant: str, session_id: str) -> None:
        self._pinned.get(executor, {}).pop((tenant, session_id), None)


def _extends_context(ctx: HopContext, ses: SessionState) -> bool:
    """Whether the hop's prompt starts with the session's whole context (a stateful hop,
    or a client resending everything): every kept block is reused, so an intent shift
    would release nothing and is not judged."""
    context = ses.context_token_ids
    n = len(context)
    return len(ctx.prompt_token_ids) >= n and list(ctx.prompt_token_ids[:n]) == context.tolist()
