"""The dispatcher: one scheduler request from arrival to its last token, in one reading
order (domain types in and out; the api layer converts):

    screen     request id, suspected poison pill, prompt             (bad input: 400)
    intent     agent plane: a session hop's turn vs its kept or demoted context, on the
               cachestore's embeddings (bounded wait; bigram fallback, counted)
    plan       agent plane: session / hop / contract, the hop's full prompt, priority
    rung       degradation ladder: the rung it is served on, or shed
    admission  per-tenant and global slots, waiting by priority       (full: 429 + hint)
    placement  executors serving the rung, ranked by the placer (placement.py)
    place      agent plane: reroute, pause decision, stale-KV release, promotion
    relay      the executor's stream, with migration (relay.py)

Placement hashes the prompt exactly as each executor does (its block size and
extra_keys_for(its model id, tenant, KV dtype)), so the kv index answers for its blocks.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import structlog

from services.mesh import metric_catalogue as catalogue
from services.mesh import metrics
from services.mesh.logging import request_context
from services.mesh.timeline import Span, Trace
from services.scheduler.dispatch.agent_steps import AgentSteps
from services.scheduler.dispatch.degrade_steps import DegradeSteps
from services.scheduler.dispatch.job import Chunk, ExecutorPort, Job
from services.scheduler.dispatch.relay import Relay
from services.scheduler.errors import InvalidScheduleRequest, NoExecutorError, OverloadedError, SuspectedPoisonError
from services.scheduler.migration import MigrationPolicy
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.degradation import LoadSignal, Rung
from services.scheduler.policy.placement import Candidate, InflightTracker, Placement, Placer
from services.scheduler.policy.suspects import SuspectRegistry
from services.scheduler.policy.tenant_limits import TenantAdmission
from services.scheduler.state.kv_index import KvIndex
from services.scheduler.state.membership import ExecutorLoad, Membership
from services.shared.block_hash import extra_keys_for, hash_block_chain

log = structlog.get_logger(__name__)

REQUESTS = metrics.counter("weft_scheduler_requests_total", "Generate streams by outcome.", ["outcome"])
QUEUE_SECONDS = metrics.histogram("weft_scheduler_queue_seconds", "Time waiting for admission.")
INTENT_FALLBACKS = metrics.counter(
    "weft_scheduler_intent_fallbacks_total",
    "Intent checks the bigram fallback decided because the embedding signal was unavailable or late.",
    ["reason"])


class MeshState(Protocol):
    """What the dispatcher reads of the mesh (api/events.MeshView keeps it current)."""

    membership: Membership
    kv_index: KvIndex


STARTUP_GRACE_S = 3.0  # a restarted scheduler waits this long for its first executor heartbeat (_first_executors)


class _HashChains:
    """The block hash chains of recent prompts, least recently used dropped. A request
    with a TTFT ceiling ranks its prompt twice (the contract's cached-prefix estimate, then
    placement), and an agent hop's prompt is its whole context: hashing 2k tokens costs
    ~0.2 ms of the scheduler's CPU each time. Keyed by content (a tuple of the ids costs a
    fraction of a hash), so a changed prompt can never be served an old chain. The lists
    returned are shared: callers only read them."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._chains: OrderedDict[tuple, list[int]] = OrderedDict()

    def get(self, prompt: Sequence[int], block_size: int, extra_keys: bytes) -> list[int]:
        key = (block_size, extra_keys, tuple(prompt))
        hashes = self._chains.get(key)
        if hashes is not None:
            self._chains.move_to_end(key)
            return hashes
        hashes = hash_block_chain(prompt, block_size, extra_keys)
        self._chains[key] = hashes
        if len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return hashes


class Dispatcher:
    def __init__(self, view: MeshState, placer: Placer, admission: Admission, port: ExecutorPort, *,
                 tenant_admission: TenantAdmission | None = None, degrade: DegradeSteps | None = None,
                 agent: AgentSteps | None = None, inflight: InflightTracker | None = None,
                 placement_attempts: int = 2, migration: MigrationPolicy | None = None,
                 suspects: SuspectRegistry | None = None, executor_overcommit: float = 1.25,
                 startup_grace_s: float = STARTUP_GRACE_S) -> None:
        """``agent``: sessions, dynamic priority, contracts, pauses (None: plain requests);
        built over the same ``inflight`` tracker as this dispatcher's. ``executor_overcommit``:
        requests kept in flight per batch slot of the serving executors (the rest waits in
        the scored queue, see ``executor_slots``); 0: no bound but ``max_in_flight``."""
        if executor_overcommit and executor_overcommit < 1:
            raise ValueError(f"executor_overcommit must be 0 or >= 1, got {executor_overcommit}")
        self.executor_overcommit = executor_overcommit
        self.grace_until_s = time.monotonic() + startup_grace_s
        self.view = view
        self.placer = placer
        self.admission = admission
        self.port = port
        self.tenant_admission = tenant_admission or TenantAdmission(  # default: the admission's own caps
            admission, admission.max_in_flight_per_tenant, admission.max_queue_per_tenant)
        self.degrade = degrade or DegradeSteps()
        self.agent = agent
        self.inflight = inflight or InflightTracker()
        self.suspects = suspects or SuspectRegistry()
        self.relay = Relay(view.membership, port, self.inflight, self.rank, placement_attempts, migration,
                           self.suspects)
        self.hash_chains = _HashChains()

    async def _first_executors(self, job: Job, prompt, rung) -> list:
        """A scheduler just (re)started knows no executor until their heartbeats arrive
        (about one interval): a request in that window (a router's retry or continuation
        after a restart) waits for the first one, up to ``startup_grace_s`` from the start,
        instead of failing UNAVAILABLE. Never waits once any executor is known."""
        while not self.view.membership.all() and time.monotonic() < self.grace_until_s:
            await asyncio.sleep(0.05)
        return self.rank(job.model_id, job.tenant, prompt, rung)

    def screen(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Refuse what cannot be scheduled before anything is decided about it."""
        if not request_id:
            raise InvalidScheduleRequest("request_id", "must not be empty")
        suspected = self.suspects.reason(request_id)
        if suspected is not None:  # a resend of a suspected poison pill: no executor is risked again
            raise SuspectedPoisonError(suspected)
        if not prompt_token_ids:
            raise InvalidScheduleRequest("prompt_token_ids", "must contain at least one token")

    async def generate(self, job: Job, finished: Callable[[list[Span]], None]) -> AsyncIterator[Chunk]:
        """The job's stream (``screen`` it first). ``finished`` gets this request's spans
        once its stream ended normally."""
        rid = job.request_id
        if self.agent is not None:
            intent = await self.agent.judge_intent(job)  # before begin: it may release the session's KV
            if intent is not None and intent.fallback_reason:
                INTENT_FALLBACKS.labels(intent.fallback_reason).inc()
        plan = (self.agent.begin(job, lambda p: self.cached_prefix_tokens(job.model_id, job.tenant, p))
                if self.agent is not None else None)
        prompt = plan.prompt_token_ids if plan is not None else list(job.prompt_token_ids)
        with request_context(rid):
            t0 = time.monotonic()
            trace = Trace(rid, "scheduler", job.trace_parent)
            try:
                rung = self.degrade.serve_rung(
                    job, plan.fallback if plan is not None else None, self.load_signal(job.model_id),
                    self.view.membership.offered_rungs(job.model_id), self.admission.retry_after_ms)
                self.admission.limit_in_flight(self.executor_slots())
                await self.tenant_admission.enter(job.tenant, self.agent.order_key(plan) if plan is not None
                                                  else None)
            except BaseException as exc:  # refused, or cancelled / timed out while queued
                if plan is not None:
                    self.agent.end(rid)  # else its plan and session claim leak: the session answers 409 for ever
                if isinstance(exc, OverloadedError):
                    REQUESTS.labels("rejected").inc()
                    catalogue.count_admission_rejection(self.degrade.rejection_reason(job))
                raise
            outcome = "cancelled"
            try:
                queue_s = time.monotonic() - t0
                QUEUE_SECONDS.observe(queue_s)
                catalogue.observe_queue_wait(job.class_label, queue_s)
                admitted_ns = trace.span("scheduler.queue", trace.start_ns, time.time_ns()).end_ns
                ranked = self.rank(job.model_id, job.tenant, prompt, rung)
                if not ranked and rung is not Rung.NONE:  # its pool left while it queued
                    rung = Rung.NONE
                    ranked = self.rank(job.model_id, job.tenant, prompt, rung)
                trace.span("scheduler.place", admitted_ns, time.time_ns(), num_candidates=len(ranked),
                           rung=rung.label)
                if not ranked:
                    ranked = await self._first_executors(job, prompt, rung)
                if not ranked:
                    outcome = "no_executor"
                    catalogue.count_admission_rejection("no_executor")
                    raise NoExecutorError(f"no serving executor for model {job.model_id or '(any)'!r}")
                exec_fields = {}
                if plan is not None:
                    ranked = await self.agent.place(plan, job, prompt, ranked)
                    exec_fields = self.agent.exec_fields(plan)
                async for chunk in self.relay.stream(job, prompt, ranked, int(queue_s * 1000), trace, rung,
                                                     exec_fields):
                    if plan is not None:
                        self.agent.observe(plan, chunk, t0)
                    yield chunk
                outcome = "finished"
                finished(trace.finish(outcome=outcome))
            except Exception:
                outcome = "error" if outcome == "cancelled" else outcome
                raise
            finally:
                self.admission.limit_in_flight(self.executor_slots())  # executors may have come or gone
                self.tenant_admission.leave(job.tenant)
                if plan is not None:
                    self.agent.end(rid)
                REQUESTS.labels(outcome).inc()

    def executor_slots(self) -> int:
        """In-flight requests the serving executors can take now: their batch slots
        (``max_num_seqs``) times ``executor_overcommit``, rounded up; 0 when unknown (no
        executor reports its slots, or no bound asked). The margin over the slots keeps a
        next request ready in each executor's queue; beyond it requests wait in admission,
        in the policy's order and fair across tenants. Does not modify anything."""
        num_seqs = sum(rec.max_num_seqs for rec in self.view.membership.placeable())
        return math.ceil(num_seqs * self.executor_overcommit) if num_seqs and self.executor_overcommit else 0

    def load_signal(self, model_id: str = "") -> LoadSignal:
        """What the degradation ladder reads now. Does not modify anything."""
        return LoadSignal(admission_fraction=self.tenant_admission.load_fraction(),
                          kv_used_fraction=self.view.membership.kv_used_fraction(model_id))

    def cached_prefix_tokens(self, model_id: str, tenant: str, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt``'s longest prefix that a placeable executor holds (KV index)."""
        return max((c.num_matched_blocks * block_size for c, block_size in self._candidates(model_id, tenant, prompt)),
                   default=0)

    def rank(self, model_id: str, tenant: str, prompt: Sequence[int], rung: Rung = Rung.NONE) -> list[Placement]:
        """Placeable executors serving ``rung``, best first. Hashes are computed exactly as
        the executor does: its block size and extra_keys_for(its model id, tenant, KV dtype)."""
        return self.placer.rank([c for c, _ in self._candidates(model_id, tenant, prompt, rung)])

    def _candidates(self, model_id: str, tenant: str, prompt: Sequence[int],
                    rung: Rung = Rung.NONE) -> list[tuple[Candidate, int]]:
        """Each placeable executor serving ``rung`` as a placement candidate, with its block size."""
        records = self.view.membership.placeable(model_id, rung)
        chains: dict[tuple[str, int, str], tuple[int, dict[str, int], list[int]]] = {}
        candidates = []
        for rec in records:
            key = (rec.model_id, rec.block_size, rec.kv_cache_dtype)
            if key not in chains:
                keys = extra_keys_for(rec.model_id, tenant, rec.kv_cache_dtype)
                hashes = self.hash_chains.get(prompt, rec.block_size, keys)
                chains[key] = (len(hashes), self.view.kv_index.match_prefix(hashes), hashes)
            num_prompt_blocks, matched, hashes = chains[key]
            load = rec.load or ExecutorLoad()
            reported_used = max(0, load.num_blocks - load.num_free_blocks)
            candidates.append((Candidate(
                name=rec.name, address=rec.address, num_prompt_blocks=num_prompt_blocks,
                num_matched_blocks=matched.get(rec.name, 0),
                num_store_blocks=self.view.kv_index.num_store_blocks(hashes, matched.get(rec.name, 0)),
                num_used_blocks=max(reported_used, self.inflight.num_blocks(rec.name)),
                num_blocks=rec.num_blocks or load.num_blocks,
                num_active_requests=max(load.num_running + load.num_waiting, self.inflight.num_requests(rec.name)),
                max_num_seqs=rec.max_num_seqs,
            ), rec.block_size))
        return candidates
