"""The synchronous engine: requests in, one batched step at a time, token deltas out.

Single-threaded by design: ``AsyncEngine`` drives it from one worker thread, so nothing
here locks. A step never waits on the network.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from services.executor.attention.selector import backend_class
from services.executor.engine.batch_scheduler import BatchScheduler
from services.executor.engine.step_plan import StepPlan
from services.shared.block_hash import extra_keys_for
from services.executor.kv.block_pool import BlockPool, KVEvent, PartitionSpec
from services.shared.vocabulary import DEFAULT_PARTITION
from services.executor.model.checkpoint import load_state_dict
from services.executor.engine.config import EngineConfig
from services.executor.errors import InvalidRequestError
from services.executor.policy.kv_compress import CompressPolicy, choose_victims
from services.executor.kv.manager import KVCacheManager
from services.executor.model.llama import LlamaModel
from services.executor.model.config import ModelConfig
from services.executor.engine.model_runner import ModelRunner
from services.executor.policy.preemption import make_preemption_policy
from services.executor.engine.sampling_params import SamplingParams
from services.executor.kv.pinning import PinTable
from services.executor.engine.sequence import NO_SESSION, FinishReason, Sequence, SessionOptions
from services.executor.engine.step_trace import StepTrace
from services.executor.engine.grammar_import import grammar_package

if TYPE_CHECKING:  # imported on first use (LLMEngine.grammars): xgrammar's import is ~1.1 s
    from services.executor.grammar import GrammarCache, GrammarState

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: new tokens, and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    mean_entropy: float = 0.0  # nats; sessions that track entropy, on the last output
    # With params.top_logprobs: (token id, logprob) alternatives of each new token, most likely first.
    new_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # With params.prompt_logprobs (first output only): each prompt token's logprob after the
    # first, and (when > 0) the alternatives of each of those positions.
    prompt_logprobs: tuple[float, ...] = ()
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig(),
                 step_trace: StepTrace | None = None) -> None:
        """``step_trace``: optional per-request step timings and KV gauges (step_trace.py)."""
        self.config = config
        self.model_dir = Path(model_dir)
        if config.num_threads and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        state_dict = load_state_dict(self.model_dir, self.model_config, dtype=config.torch_dtype)
        self.model = LlamaModel(
            self.model_config,
            state_dict,
            backend_class(config.resolved_attention_backend),
            dtype=config.torch_dtype,
            device=config.device,
            native_decode=config.native_decode,
        )
        del state_dict
        # Sliding-window attention is not implemented: cap the context at the window
        # instead, inside which full attention is exactly what the model computes.
        model_len = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            model_len = min(model_len, self.model_config.sliding_window)
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        block_bytes = ModelRunner.kv_bytes_per_block(self.model, config.block_size, config.kv_cache_dtype)
        # A byte budget (the default 1 GiB: SmolLM2-135M's fp32 KV for ~23 k tokens, what
        # llama-server's 6 x 4096 slots hold in f16) stops at twice what max_num_seqs full-length
        # sequences use: half for running work, half for the prefix cache. A tiny model would
        # otherwise get 10^5 blocks it never touches (seconds to set up, per engine).
        useful = 2 * config.max_num_seqs * -(-self.max_model_len // config.block_size)
        self.num_blocks = config.num_kv_blocks or max(1, min(config.kv_cache_memory_bytes // block_bytes, useful))
        self.pool = BlockPool(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.pins = PinTable(self.pool)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.scheduler = BatchScheduler(
            self.kv,
            make_preemption_policy(config.preemption_policy),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk,
            eos_token_ids=self.eos_token_ids,
            on_finish=self._finish_session,
            kv_compression=config.kv_compress_budget_blocks > 0,
        )
        self.scheduler.reclaim_pins = self.pins.release_for  # live work before kept KV
        # scores only feed the attention policy; "oldest" needs none (all-equal scores)
        track_block_scores = (config.kv_compress_budget_blocks > 0
                              and config.kv_compress_policy == CompressPolicy.ATTENTION.value)
        self.runner = ModelRunner(self.model, self.num_blocks, config.block_size, config.kv_cache_dtype,
                                  track_block_scores)
        if config.cuda_graphs:
            self._capture_decode_graphs()
        self.model_id = config.model_id or self.model_dir.name
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_compressed_blocks = 0  # KV blocks dropped by compression (kv_compress.py)
        self.step_trace = step_trace
        self._grammars: GrammarCache | None = None  # built on the first constrained request
        log.info(
            "engine_ready", model=str(self.model_dir), num_kv_blocks=self.num_blocks,
            block_size=config.block_size, attention=config.resolved_attention_backend,
            kv_compress_budget_blocks=config.kv_compress_budget_blocks,
        )

    def _capture_decode_graphs(self) -> None:
        max_blocks = -(-self.max_model_len // self.config.block_size)
        self.runner.capture_decode_graphs_or_stay_eager(self.config.max_num_seqs, max_blocks)

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        partition: str = DEFAULT_PARTITION,
        tenant_salt: str = "",
        priority: float = 0.0,
        session: SessionOptions = NO_SESSION,
    ) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (naming the field) when it can
        never be served; the engine state is unchanged then."""
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token ids must be integers, got {bad!r}")
        bad = next((t for t in prompt_token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens leave no room in the context of {self.max_model_len}"
            )
        need_blocks = self.kv.num_blocks_to_run(len(prompt_token_ids))
        limit = min(self.num_blocks, self.pool.spec(partition).limit_blocks)
        if session.kv_quota_blocks and need_blocks > session.kv_quota_blocks:
            raise InvalidRequestError(
                "session.contract.kv_quota_blocks",
                f"{len(prompt_token_ids)} tokens need {need_blocks} KV blocks, more than the task's quota of "
                f"{session.kv_quota_blocks}")
        if need_blocks > limit:
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens need {need_blocks} KV blocks, more than the {limit} available"
            )
        grammar = self._grammar_state(request_id, prompt_token_ids, params)
        quota_num_tokens = session.kv_quota_blocks * self.config.block_size
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            partition=partition,
            extra_keys=extra_keys_for(self.model_id, tenant_salt, self.config.kv_cache_dtype),
            priority=priority,
            session=session,
            max_num_tokens=min(self.max_model_len, quota_num_tokens or self.max_model_len),
            capped_by_kv_quota=0 < quota_num_tokens < self.max_model_len,
        )
        seq.grammar = grammar
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache, made on first use (reading the tokenizer costs
        ~0.1 s, not worth paying for an engine that never sees a grammar). The grammar
        package itself is imported here, not at module load: xgrammar pulls in
        transformers, ~1.1 s of an executor's ~3.2 s import (the executor process warms it
        in a background thread once it is ready: services/executor/app.py)."""
        if self._grammars is None:
            grammar = grammar_package()
            GrammarCache, GrammarLimits, load_tokenizer_info = (  # noqa: N806 - the package's classes
                grammar.GrammarCache, grammar.GrammarLimits, grammar.load_tokenizer_info)
            c = self.config
            try:
                info = load_tokenizer_info(self.model_dir, self.model_config.vocab_size,
                                           self.model_config.eos_token_ids)
            except FileNotFoundError as e:
                raise InvalidRequestError("grammar", f"this executor cannot constrain output: {e}") from None
            self._grammars = GrammarCache(info, GrammarLimits(
                max_entries=c.grammar_cache_entries, max_grammar_bytes=c.grammar_max_bytes,
                compile_timeout_s=c.grammar_compile_timeout_s))
        return self._grammars

    def _grammar_state(self, request_id: str, prompt: list[int], params: SamplingParams) -> GrammarState | None:
        """The request's matcher, already past the tokens an earlier attempt generated (the
        prompt's last ``resumed_output_tokens``), so a migrated stream continues inside its
        grammar. Compiles on a cache miss (bounded by grammar_compile_timeout_s)."""
        resumed = params.resumed_output_tokens
        if resumed > len(prompt):
            raise InvalidRequestError("sampling.resumed_output_tokens",
                                      f"{resumed} is more than the prompt's {len(prompt)} tokens")
        if params.grammar is None:
            return None
        state = grammar_package().GrammarState(self.grammars.get(params.grammar), request_id)
        rejected = state.replay(prompt[len(prompt) - resumed:]) if resumed else None
        if rejected is not None:
            raise InvalidRequestError(
                "sampling.resumed_output_tokens",
                f"resumed token {rejected} (id {prompt[len(prompt) - resumed + rejected]}) does not follow the grammar")
        if state.terminated:
            raise InvalidRequestError("sampling.resumed_output_tokens", "the resumed output already ends the grammar")
        return state

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks now; False when it is unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    def set_partitions(self, partitions: list[PartitionSpec]) -> None:
        self.pool.set_partitions(partitions)

    def release_session(self, session_id: str, evict_block_hashes=()) -> tuple[int, int]:
        """Unpin a session and forget the given cached hashes where no request holds
        them (its stale part); returns (blocks unpinned, hashes forgotten). The session is
        over (ended, joined into its parent, or its intent moved on), so its released
        blocks go first in line for eviction, its deepest first: a finished program's
        context is evicted before any block an idle session may come back to (LRU alone
        would keep it longest, as the most recently freed)."""
        pinned = [b.block_hash for b in self.pins.pinned_blocks(session_id) if b.block_hash is not None]
        unpinned = self.pins.release(session_id)
        evicted = self.pool.evict_cached(evict_block_hashes)
        self.pool.queue_for_eviction(pinned)
        return unpinned, evicted

    def update_priorities(self, priorities: dict[str, float]) -> int:
        """Set new priorities (higher runs first) of known requests; returns how many.
        The waiting order and preemption victims follow from the next step on."""
        n = 0
        for rid, priority in priorities.items():
            seq = self.requests.get(rid)
            if seq is not None:
                seq.priority = priority
                n += 1
        return n

    def take_kv_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run and apply one batch. Returns one output per request that got a
        token or finished."""
        if self.pins.next_expiry_s <= time.monotonic():
            self.pins.expire()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        outputs = []
        for seq in self._requeue_if_pins_yield(plan.unservable):
            # It outgrew the pool (or its partition's quota): end it as a length stop.
            log.warning("request_outgrew_kv_pool", request_id=seq.request_id, num_tokens=seq.num_tokens)
            self.scheduler.finish(seq, FinishReason.LENGTH)
            self.requests.pop(seq.request_id, None)
            outputs.append(self._output(seq, 0))
        if not plan.decodes and not plan.prefills:
            return outputs
        start_ns = time.time_ns()
        result = self.runner.execute(plan)
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted)
        if result.block_scores is not None:
            self._fold_block_scores(plan, result.block_scores)
        if self.step_trace is not None:  # before update: it sees the pool as the step left it
            self.step_trace.on_step(self, plan, start_ns, time.time_ns())
        for seq in self.scheduler.update(plan, result):
            outputs.append(self._output(seq, 1))
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
        if self.config.kv_compress_budget_blocks:
            for item in plan.decodes + plan.prefills:
                self._compress(item.seq)
        return outputs

    @staticmethod
    def _fold_block_scores(plan: StepPlan, block_scores: torch.Tensor) -> None:
        """Add the step's attention mass per block ([rows, max_blocks], rows in plan
        order) to each sequence's running scores, kept aligned with ``seq.blocks``."""
        rows = block_scores.tolist()
        for item, row in zip(plan.decodes + plan.prefills, rows):
            seq = item.seq
            n = len(seq.blocks)
            seq.block_scores.extend([0.0] * (n - len(seq.block_scores)))
            seq.block_scores = [a + b for a, b in zip(seq.block_scores, row[:n])]

    def _compress(self, seq: Sequence) -> None:
        """KV compression: drop the sequence's lowest-scored middle blocks until it holds
        at most the budget. Only once its prompt is computed: a prompt longer than the
        budget is prefilled whole and compressed afterwards, while a recompute after
        preemption is compressed between its chunks past the prompt (else a sequence
        that outgrew the pool under compression could never be recomputed)."""
        if seq.is_finished or seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        c = self.config
        scores = seq.block_scores or [0.0] * len(seq.blocks)  # no scores (triton): oldest first
        victims = choose_victims(scores, c.kv_compress_budget_blocks, c.kv_compress_sink_blocks,
                                 c.kv_compress_recent_blocks)
        if victims:
            self.kv.drop_blocks(seq, victims)
            self.num_compressed_blocks += len(victims)

    def _requeue_if_pins_yield(self, unservable: list[Sequence]) -> list[Sequence]:
        """A request that does not fit only because idle sessions' pins fill its
        partition gets those pins released and waits again; the rest are unservable."""
        if not unservable or not self.pins.num_pinned_blocks:
            return unservable
        left = []
        for seq in unservable:
            need = self.kv.num_blocks_to_run(seq.num_tokens)
            sid = seq.session.session_id
            if self.kv.can_ever_hold(seq) and (
                    self.pins.release_for(seq.partition, need, sid, seq.partition)
                    or (self.pool.usage_allows(need, seq.partition)
                        and self.pins.release_for(None, need, sid, seq.partition))):
                self.scheduler.requeue(seq)
            else:
                left.append(seq)
        return left

    def _finish_session(self, seq: Sequence) -> None:
        """A hop ended: its previous pin goes; a keep decision pins this hop's blocks
        (taken before the sequence frees its own references, so nothing is evicted)."""
        sid = seq.session.session_id
        if not sid:
            return
        if seq.session.pin_ttl_s > 0:
            self.pins.pin(sid, seq.blocks, seq.partition, seq.session.pin_ttl_s)
        else:
            self.pins.release(sid)

    @staticmethod
    def _output(seq: Sequence, num_new: int) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(seq.output_token_ids[-num_new:]) if num_new else (),
            new_logprobs=tuple(seq.output_logprobs[-num_new:]) if seq.params.logprobs and num_new else (),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            mean_entropy=seq.mean_entropy if seq.session.track_entropy and seq.is_finished else 0.0,
            new_top_logprobs=tuple(seq.output_top_logprobs[-num_new:]) if seq.params.top_logprobs and num_new else (),
            # the prompt's logprobs ride on the first output only
            prompt_logprobs=tuple(seq.prompt_logprobs) if num_new and seq.num_output_tokens == num_new else (),
            prompt_top_logprobs=tuple(seq.prompt_top_logprobs)
            if num_new and seq.num_output_tokens == num_new else (),
        )

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.pool.num_free_blocks,
            "num_preemptions": self.num_preemptions,
            "num_compressed_blocks": self.num_compressed_blocks,
            "num_blocks": self.num_blocks,
            "num_pinned_blocks": self.pins.num_pinned_blocks,
            "num_pin_yields": self.scheduler.num_pin_yields,
            "time": time.monotonic(),
        }
