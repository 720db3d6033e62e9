"""What flows along the scheduler's request path, and the port it calls executors through.

A ``Job`` is one Scheduler.Generate request as the dispatcher sees it; a ``Chunk`` is one
piece of its stream. Both are built and read by ``api/convert.py`` only; the dispatcher
fills in what it decides (priority, stamps) and never sees protobuf. The api layer's
``wire`` message rides along untouched for the port (sampling and session fields the
scheduler passes through to the executor without reading them).

``Decisions`` is what the scheduler decided for one job, as the response reports it: the
agent plane fills its part at placement (``AgentSteps.place``), the relay the rest
(rung, queue time, expected cached tokens, achieved TTFT) and stamps it on the stream.

``ExecutorPort`` is the executor as the dispatcher needs it: a token stream per call plus
four session calls. Failures the path reacts to arrive as ``ExecutorCallError``; any
other error of the executor passes through untouched (it reaches the client as the
executor chose it).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.mesh.timeline import Span, TraceContext
from services.scheduler.policy.contracts import FallbackChoice
from services.scheduler.policy.degradation import DegradationContract, Rung
from services.scheduler.policy.pause import PauseDecision
from services.shared.vocabulary import RequestClass


@dataclass
class Decisions:
    """One job's scheduling decisions (``weft.v1.SchedulingDecisions``). Everything but
    ``pause`` is reported on the first chunk; ``pause`` (the session's KV during the
    coming tool call, decided at placement) on the last. None / 0: not decided."""

    request_class: RequestClass | None = None
    priority: float = 0.0  # higher ran first
    queue_ms: int = 0
    fallback: FallbackChoice | None = None
    rung: Rung | None = None
    intent_checked: bool = False  # an intent-shift check ran for this hop
    intent_shift: bool = False
    intent_distance: float = 0.0
    intent_signal: str = ""  # "embedding", "bigram", "none" (no signal could judge it)
    ttft_estimate_ms: int = 0  # counting the placement's expected cached prefix
    ttft_ceiling_ms: int = 0  # 0: no contract ceiling
    ttft_achieved_ms: float | None = None  # scheduler arrival to the first token chunk; None: none yet
    expected_cached_tokens: int = 0  # prompt tokens the placement expected cached on its executor
    pause: PauseDecision | None = None
    pause_reason: str = ""
    pin_ttl_ms: int = 0

    @property
    def ttft_met(self) -> bool | None:
        """Whether the achieved TTFT met the contract ceiling (None: no ceiling or no token yet)."""
        if not self.ttft_ceiling_ms or self.ttft_achieved_ms is None:
            return None
        return self.ttft_achieved_ms <= self.ttft_ceiling_ms


@dataclass
class Job:
    """One request on the path. ``priority`` (higher runs first) is the caller's until the
    agent plane replaces it at placement; nothing else is modified."""

    request_id: str
    prompt_token_ids: list[int]
    model_id: str
    tenant: str
    priority: float = 0.0
    max_tokens: int = 0  # 0: no limit requested
    min_tokens: int = 0
    seed: int | None = None
    request_class: RequestClass | None = None  # None: unspecified
    contract: DegradationContract = field(default_factory=DegradationContract)
    hop: object = None  # agent_plane.HopRequest, read only when the agent plane is on
    session_id: str = ""  # as the caller named it (scoped by tenant on the way down)
    deadline_unix_ms: int = 0  # 0: none
    time_remaining_s: Callable[[], float | None] = lambda: None  # the caller's own deadline
    trace_parent: TraceContext | None = None
    wire: object = None  # the api layer's request message, for the port only
    decisions: Decisions = field(default_factory=Decisions)  # filled at placement and by the relay

    @property
    def class_label(self) -> str:
        """The class as metrics and the ladder name it ("" when unspecified)."""
        return self.request_class.value if self.request_class is not None else ""


@dataclass
class Chunk:
    """One piece of a stream. Token and usage fields come from the executor; the rest is
    stamped by the dispatcher on its way out (None / 0: not stamped)."""

    token_ids: tuple[int, ...]
    finished: bool
    executor: str
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    mean_entropy: float = 0.0
    trailer_spans: Callable[[], Awaitable[list[Span]]] | None = None  # the executor's spans (last chunk)
    payload: object = None  # the port's own message (logprobs, finish reason), passed through
    queue_ms: int = 0
    request_class: RequestClass | None = None
    fallback: FallbackChoice | None = None
    pause: PauseDecision | None = None
    rung: Rung | None = None
    num_migrations: int = 0
    # The job's decisions (first chunk: all but the pause; last chunk: the pause). The
    # relay stamps copies, so a chunk's stays as it was sent.
    decisions: Decisions | None = None


@dataclass(frozen=True)
class ExecutorCall:
    """What one executor is asked to generate (one attempt of a job)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    tenant: str
    priority: float  # higher runs first, as the executor's queue reads it
    session_id: str  # already scoped by tenant (state/sessions.executor_session_id)
    max_tokens: int
    min_tokens: int
    seed: int | None
    pin_ttl_ms: int = 0
    kv_quota_blocks: int = 0
    wire: object = None  # Job.wire
    # Trailing prompt tokens an earlier attempt generated (a migration): the executor's
    # grammar and penalties replay them as output.
    resumed_output_tokens: int = 0


class ExecutorCallError(Exception):
    """An executor call failed the way the path reacts to: ``unavailable`` (unreachable,
    or its stream broke), or an internal / unknown failure. ``engine_failed``: the
    executor named its engine's death as the cause (policy/suspects.py)."""

    def __init__(self, code: str, details: str, unavailable: bool, engine_failed: bool = False) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        self.unavailable = unavailable
        self.engine_failed = engine_failed


class ExecutorStream(Protocol):
    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    def cancel(self) -> None:
        """Abort the call (a no-op once it finished): the executor drops the request."""


class ExecutorPort(Protocol):
    """The executors as the dispatcher calls them (api/executor_port.py implements it).
    Every method but ``generate`` raises ExecutorCallError on failure."""

    def generate(self, address: str, call: ExecutorCall, timeout_s: float | None,
                 traceparent: str | None) -> ExecutorStream: ...

    async def update_priorities(self, address: str, request_ids: Sequence[str],
                                priorities: Sequence[float]) -> None: ...

    async def release_session(self, address: str, session_id: str, evict_block_hashes: Sequence[int]) -> None: ...

    async def demote_blocks(self, address: str, token_ids: Sequence[int], tenant: str, priority: float,
                            expected_pause_ms: int) -> None: ...

    async def promote_blocks(self, address: str, token_ids: Sequence[int], tenant: str) -> None: ...
