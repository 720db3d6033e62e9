"""The Executor gRPC servicer over ``AsyncEngine``: the only place executor protos meet
the engine's dataclasses.

Cancellation: each Generate stream reads the engine's outputs in its own handler task
(no pump task and queue in between: that was one more event-loop turn, under the engine
thread's GIL contention, before each chunk went out). When the client goes away
(disconnect, deadline, cancelled scheduler stream) gRPC cancels the handler, which closes
the engine stream, which aborts the request in the engine: its blocks are freed within
one step. ``Abort`` ends the stream with FINISH_REASON_ABORT instead, and a dead engine
(``fail_streams``) with UNAVAILABLE: both are told to the stream (``_Stream.end``), which
acts on it before its next read, or at once when it is waiting on the engine.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import structlog

from services.executor.engine.async_engine import AsyncEngine, EngineDeadError
from services.executor.engine.engine import StepOutput
from services.executor.errors import CapacityError, InvalidRequestError
from services.executor.engine.sampling_params import GrammarSpec, SamplingParams
from services.executor.engine.sequence import FinishReason, SessionOptions
from services.executor.engine.step_trace import RequestSteps, StepTrace, add_executor_spans
from services.mesh import metric_catalogue as catalogue
from services.mesh import metrics
from services.mesh.grpc_server import DrainingError, ErrorRule
from services.mesh.timeline import Trace, context_from_metadata, spans_metadata
from services.mesh.logging import request_context
from services.shared.vocabulary import partition_of
from weft.v1 import common_pb2, executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:  # tier_ops imports the cachestore client, loaded only with a cachestore
    from services.executor.tiers.tier_ops import TierOps

log = structlog.get_logger(__name__)

ERROR_RULES = (
    ErrorRule(InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorRule(CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorRule(EngineDeadError, grpc.StatusCode.UNAVAILABLE),
)

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.KV_QUOTA: common_pb2.FINISH_REASON_KV_QUOTA,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}

REQUESTS = metrics.counter("weft_executor_requests_total", "Generate streams by outcome.", ["outcome"])
TOKENS = metrics.counter("weft_executor_output_tokens_total", "Tokens streamed.")
RUNNING = metrics.gauge("weft_executor_streams_running", "Generate streams open.")
ENGINE_REQUESTS = metrics.gauge(
    "weft_executor_engine_requests", "Requests the engine thread streams to a caller (idle: 0; more is a leak).")

_ABORTED = object()  # a stream's ending: the Abort RPC for this request


class _Stream:
    """One open Generate stream, as ``Abort`` and ``fail_streams`` see it."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()  # the handler's task
        self.reading = False  # the handler waits on the engine's next output
        self.ending: object = None  # _ABORTED or the error to raise: set by ``end``

    def end(self, why: object) -> None:
        """End the stream: at once when it waits on the engine (its task is cancelled and
        takes the cancellation back), else before its next read."""
        if self.ending is None:
            self.ending = why
            if self.reading:
                self.task.cancel()


def sampling_from_proto(msg: common_pb2.SamplingParams, present: bool) -> SamplingParams:
    """Proto → SamplingParams (validates; raises InvalidRequestError naming the field).
    An absent message means the defaults of SamplingParams."""
    if not present:
        return SamplingParams()
    if msg.n > 1:
        raise InvalidRequestError("sampling.n", "the executor runs one completion per request; the router fans out n")
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        min_tokens=msg.min_tokens,
        grammar=grammar_from_proto(msg),
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=tuple(msg.logit_bias.items()),
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        resumed_output_tokens=msg.resumed_output_tokens,
    )


def grammar_from_proto(msg: common_pb2.SamplingParams) -> GrammarSpec | None:
    """The oneof as a GrammarSpec (None: free text)."""
    kind = msg.grammar.WhichOneof("kind") if msg.HasField("grammar") else None
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.grammar.json_object:
            return None
        return GrammarSpec("json_object")
    return GrammarSpec(kind, getattr(msg.grammar, kind))


def _top_logprobs_pb(rows) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(token_ids=[t for t, _ in row], logprobs=[lp for _, lp in row]) for row in rows]


def step_to_proto(out: StepOutput, executor: str) -> executor_pb2.ExecuteResponse:
    return executor_pb2.ExecuteResponse(
        request_id=out.request_id,
        token_ids_delta=out.new_token_ids,
        logprobs_delta=out.new_logprobs,
        finish_reason=_FINISH[out.finish_reason] if out.finished and out.finish_reason else 0,
        usage=common_pb2.Usage(
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
        ),
        executor=executor,
        mean_entropy=out.mean_entropy,
        top_logprobs_delta=_top_logprobs_pb(out.new_top_logprobs),
        prompt_logprobs=out.prompt_logprobs,
        prompt_top_logprobs=_top_logprobs_pb(out.prompt_top_logprobs),
    )


FIRST_TOKEN_CLASSES = frozenset({common_pb2.REQUEST_CLASS_UNSPECIFIED, common_pb2.REQUEST_CLASS_INTERACTIVE})


def wants_first_token_yield(request: executor_pb2.ExecuteRequest) -> bool:
    """Whether the request's promise is a fast first token, so the engine may pause after
    it (async_engine.py's first-token yield): the interactive class, and a request sent
    without a class (only a direct caller of this API; the router always sends one). An
    agent's hop, batch work and a deterministic task wait for the whole reply instead."""
    return request.session.request_class in FIRST_TOKEN_CLASSES


def session_from_proto(request: executor_pb2.ExecuteRequest) -> SessionOptions:
    """The hop's pause / quota / entropy options (raises InvalidRequestError naming the field)."""
    sid = request.session.session_id
    if request.pin_ttl_ms and not sid:
        raise InvalidRequestError("pin_ttl_ms", "needs session.session_id")
    return SessionOptions(session_id=sid, pin_ttl_s=request.pin_ttl_ms / 1000.0,
                          kv_quota_blocks=request.kv_quota_blocks, track_entropy=bool(sid))


def _transfer_block_bytes(engine) -> int:  # one block's keys and values in every layer; reads only
    return sum(kv[:, 0].nbytes for kv in engine.runner.kv_caches)  # kv: [2, num_blocks, block_size, heads, dim]


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, engine: AsyncEngine, name: str, model_id: str, block_size: int, *,
                 tiers: TierOps | None = None, no_tiers_reason: str = "no cachestore configured",
                 step_trace: StepTrace | None = None) -> None:
        """``tiers``: the cachestore operations when one is configured, else None and
        ``no_tiers_reason`` says why (in the RPC error). ``step_trace``: the engine's step
        record (the same object the engine writes), whose entries become a finished
        request's executor spans; None: no step spans."""
        self.engine = engine
        self.tiers = tiers
        self.no_tiers_reason = no_tiers_reason
        self.step_trace = step_trace
        self.name = name
        self.model_id = model_id
        self.block_size = block_size
        self.draining = False
        self.failed = ""  # why the engine is out of service (dead / wedged); set by fail_streams
        self._streams: dict[str, _Stream] = {}
        self._tier_ns: dict[str, tuple[int, int]] = {}  # request id -> promotion lookup (start, end), for timelines
        self._block_bytes = 0  # one KV block as it transfers; read from the engine on first use

    def measured_rates(self) -> dict[str, float | int]:
        """The load report's measured cost-model fields (the Promoter's rates, which price
        the scheduler's pauses); empty without a cachestore tier, where nothing measures them."""
        if self.tiers is None:
            return {}
        if not self._block_bytes:
            self._block_bytes = int(self.engine.peek(_transfer_block_bytes))  # static: never stale
        cost = self.tiers.promoter.cost
        return dict(prefill_tokens_per_s=cost.prefill_tokens_per_s, num_prefills=cost.num_prefills,
                    transfer_bytes_per_s=cost.transfer_bytes_per_s, num_transfers=cost.num_transfers,
                    block_bytes=self._block_bytes, transfer_overhead_ms=cost.rpc_overhead_s * 1000.0)

    def fail_streams(self, reason: str) -> int:
        """The engine is dead or wedged: refuse new streams and end every open one with
        UNAVAILABLE (EngineDeadError), so the scheduler moves them elsewhere. Returns how
        many were open. A stream waiting on a wedged engine is cancelled out of that wait
        (``_Stream.end``); its ``finally`` closes the engine stream."""
        self.failed = reason
        for stream in self._streams.values():
            stream.end(EngineDeadError(f"executor {self.name}: {reason}"))
        return len(self._streams)

    async def Generate(self, request: executor_pb2.ExecuteRequest, context: grpc.aio.ServicerContext):
        if self.failed:
            raise EngineDeadError(f"executor {self.name}: {self.failed}")
        if self.draining:
            raise DrainingError(f"executor {self.name} is draining")
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id", "must not be empty")
        if rid in self._streams:
            raise InvalidRequestError("request_id", f"{rid!r} is already running")
        params = sampling_from_proto(request.sampling, request.HasField("sampling"))
        session = session_from_proto(request)
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before start")
        with request_context(rid):
            trace = Trace(rid, "executor", context_from_metadata(context.invocation_metadata()), executor=self.name)
            first_token_ns = None
            stream = self._streams[rid] = _Stream()
            outputs = self._outputs(request, params, session)
            RUNNING.inc()
            outcome = "cancelled"
            try:
                while True:
                    if stream.ending is None:
                        stream.reading = True
                        try:
                            item = await anext(outputs)
                        except asyncio.CancelledError:
                            if stream.ending is None or stream.task.uncancel():
                                raise  # not (only) ours: the client left
                        except Exception:
                            outcome = "error"
                            raise
                        finally:
                            stream.reading = False
                    if stream.ending is _ABORTED:
                        outcome = "aborted"
                        yield executor_pb2.ExecuteResponse(
                            request_id=rid, finish_reason=common_pb2.FINISH_REASON_ABORT, executor=self.name)
                        return
                    if stream.ending is not None:
                        outcome = "error"
                        raise stream.ending
                    TOKENS.inc(len(item.new_token_ids))
                    if first_token_ns is None and item.new_token_ids:
                        first_token_ns = time.time_ns()
                        catalogue.count_prefix_lookup(item.num_prompt_tokens, item.num_cached_tokens)
                    if item.finished:
                        context.set_trailing_metadata(spans_metadata(self._finish_trace(trace, item, first_token_ns)))
                    yield step_to_proto(item, self.name)
                    if item.finished:
                        outcome = "finished"
                        return
            finally:
                RUNNING.dec()
                REQUESTS.labels(outcome).inc()
                self._streams.pop(rid, None)
                self._steps(rid)  # forget the step record of a cancelled / failed request
                self._tier_ns.pop(rid, None)
                if self.tiers is not None:  # a cancelled / failed request never reaches observe's finish
                    self.tiers.forget(rid)
                await outputs.aclose()  # aborts the request in the engine unless it finished
                # Covers a cancel that lands while the add is still in flight; a no-op
                # when the request already finished or was aborted.
                self.engine.abort(rid)
                if outcome == "cancelled":
                    log.info("request_cancelled", executor=self.name)

    def _steps(self, request_id: str) -> RequestSteps:
        return self.step_trace.pop(request_id) if self.step_trace is not None else RequestSteps()

    def _finish_trace(self, trace: Trace, out: StepOutput, first_token_ns: int | None) -> list:
        """Close this request's executor spans (returned to the scheduler in the trailers)."""
        received_ns = trace.start_ns
        tier = self._tier_ns.pop(out.request_id, None)
        if tier is not None:  # the prompt's prefix was looked up (and maybe promoted) before the engine got it
            trace.span("executor.tier_fetch", *tier)
            received_ns = tier[1]
        add_executor_spans(trace, self._steps(out.request_id), received_ns, first_token_ns, time.time_ns(),
                           out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
        return trace.finish(num_output_tokens=out.num_output_tokens)

    async def _outputs(self, request, params: SamplingParams, session: SessionOptions):
        """The request's engine outputs, after its prefix was promoted from the cachestore
        (when one is configured)."""
        if self.tiers is not None:
            tier_start_ns = time.time_ns()
            await self.tiers.before_submit(request)
            self._tier_ns[request.request_id] = (tier_start_ns, time.time_ns())
        async for out in self.engine.generate(
            request.request_id, list(request.prompt_token_ids), params,
            # Each tenant is charged to its own partition (its quota, when one is configured).
            partition=partition_of(request.partition, request.tenant_salt), tenant_salt=request.tenant_salt,
            priority=request.priority, session=session,  # higher runs first, on the wire and in the engine
            first_token_yield=wants_first_token_yield(request),
        ):
            if self.tiers is not None:
                self.tiers.observe(request.request_id, out)
            yield out

    async def Abort(self, request: executor_pb2.AbortRequest, context) -> executor_pb2.AbortResponse:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return executor_pb2.AbortResponse(aborted=False)
        self.engine.abort(request.request_id)
        stream.end(_ABORTED)
        log.info("request_abort_requested", request_id=request.request_id)
        return executor_pb2.AbortResponse(aborted=True)

    async def ReleaseSession(self, request: executor_pb2.ReleaseSessionRequest,
                             context) -> executor_pb2.ReleaseSessionResponse:
        if not request.session_id:
            raise InvalidRequestError("session_id", "must not be empty")
        hashes = list(request.evict_block_hashes)
        unpinned, evicted = await self.engine.call(lambda e: e.release_session(request.session_id, hashes))
        log.info("session_released", session_id=request.session_id, num_unpinned_blocks=unpinned,
                 num_evicted_blocks=evicted)
        return executor_pb2.ReleaseSessionResponse(num_unpinned_blocks=unpinned, num_evicted_blocks=evicted)

    async def DemoteBlocks(self, request: executor_pb2.DemoteBlocksRequest,
                           context) -> executor_pb2.DemoteBlocksResponse:
        if self.tiers is None:
            raise InvalidRequestError("cachestore_address", f"executor {self.name}: {self.no_tiers_reason}")
        r = await self.tiers.demoter.demote(
            request.block_hashes, request.token_ids, request.tenant_salt, request.priority,
            request.expected_pause_ms, request.evict_local, request.evict_first)
        return executor_pb2.DemoteBlocksResponse(
            num_demoted_blocks=r.num_demoted_blocks, num_already_stored_blocks=r.num_already_stored_blocks,
            num_missing_blocks=r.num_missing_blocks, demoted_bytes=r.demoted_bytes,
            num_evicted_blocks=r.num_evicted_blocks)

    async def PromoteBlocks(self, request: executor_pb2.PromoteBlocksRequest,
                            context) -> executor_pb2.PromoteBlocksResponse:
        if self.tiers is None:
            raise InvalidRequestError("cachestore_address", f"executor {self.name}: {self.no_tiers_reason}")
        r = await self.tiers.promoter.promote(
            list(request.token_ids), request.tenant_salt, partition_of(request.partition, request.tenant_salt),
            force=request.force)
        return executor_pb2.PromoteBlocksResponse(
            num_local_blocks=r.num_local_blocks, num_promoted_blocks=r.num_promoted_blocks,
            num_available_blocks=r.num_available_blocks, promoted_bytes=r.promoted_bytes,
            load_ms=r.load_s * 1000.0, skipped_by_cost_model=r.skipped_by_cost_model)

    async def UpdatePriorities(self, request: executor_pb2.UpdatePrioritiesRequest,
                               context) -> executor_pb2.UpdatePrioritiesResponse:
        if len(request.request_ids) != len(request.priorities):
            raise InvalidRequestError("priorities", "must have one entry per request id")
        new = dict(zip(request.request_ids, request.priorities))  # higher runs first, as in the engine
        n = await self.engine.call(lambda e: e.update_priorities(new))
        return executor_pb2.UpdatePrioritiesResponse(num_updated=n)

    async def GetStats(self, request, context) -> executor_pb2.GetStatsResponse:
        stats = await self.engine.call(lambda e: {**e.stats(), "num_steps": e.num_steps})
        return executor_pb2.GetStatsResponse(
            executor=self.name, model_id=self.model_id, block_size=self.block_size,
            num_blocks=int(stats["num_blocks"]), num_free_blocks=int(stats["num_free_blocks"]),
            num_running=int(stats["num_running"]), num_waiting=int(stats["num_waiting"]),
            num_steps=int(stats["num_steps"]),
        )
