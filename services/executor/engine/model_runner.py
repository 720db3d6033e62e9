"""Turns a step plan into tensors, runs the model, samples. Owns the KV cache tensors.

It also owns prompt logprobs: a sequence whose params ask for them gets, as each of its
prefill chunks runs, the logprob of every prompt token after the first (from the logits
at the position before it) and its alternatives, appended to ``seq.prompt_logprobs`` /
``seq.prompt_top_logprobs``. Positions already recorded are skipped, so a preempted and
recomputed sequence does not append them twice; the KV manager keeps such a sequence off
the prefix cache until they are all recorded (a cached position has no logits).
"""
from __future__ import annotations

import dataclasses

import structlog
import torch

from services.executor.attention.base import AttentionMetadata, QuantizedKVCache
from services.executor.engine.cuda_graphs import Capture, DecodeGraphs
from services.executor.engine.input_batch import InputBatch, StepInputs
from services.executor.engine.step_plan import StepPlan, StepResult
from services.executor.model.llama import LlamaModel
from services.executor.engine.sequence import Sequence
from services.executor.model.logits_processors import TokenHistory, needs_history
from services.executor.model.sampler import SampledTokens, is_plain_greedy, sample, sample_greedy

log = structlog.get_logger(__name__)

# A mixed step (decodes beside prefill chunks) runs as one pass of the model's forward over
# every row, the decode rows' attention native (ModelRunner.native_decode_attention: one
# pass over the weights, no gathers; 1.02-1.16x faster than the split below on both models,
# benchmarks/results/mixed_steps.md). Without native attention (the ablation, or a back end
# that has none) the split applies: the decodes in the native step and only the chunks
# through the model once the decodes' contexts hold this many tokens in all. The model's
# gathering decode path copies each row's whole context in every layer: beside a hop's
# 112-token prefill, 8 SmolLM2 rows of 1,400 tokens took the step from ~540 ms to ~920 ms.
# A second pass over the weights is not free, so small contexts stay in one pass: at 1-2
# rows of 200 tokens the split gained nothing (medians 0.95-1.18x with wide ranges in
# benchmarks/results/mixed_steps.md, 0.82-1.03x in an exploratory run).
NATIVE_MIXED_MIN_CONTEXT = 1024

# Prompt positions turned into [rows, vocab] logits at a time (bounds the memory of a
# long prompt's prompt logprobs: 256 x 49k fp32 = 50 MB).
PROMPT_LOGPROBS_ROWS = 256


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto",
                 track_block_scores: bool = False) -> None:
        """``track_block_scores``: the engine's KV compression ranks blocks by attention
        mass, so steps then carry a block_scores accumulator (when the back end fills
        one); off, the default path pays nothing."""
        self.model = model
        self.track_block_scores = track_block_scores
        self.block_size = block_size
        self.device = model.device
        self.kv_caches: list[torch.Tensor | QuantizedKVCache]
        if kv_cache_dtype == "int8":
            # one per layer: int8 [2, num_blocks, block_size, kvh, d] + float32 scales [2, num_blocks, block_size, kvh]
            self.kv_caches = [
                QuantizedKVCache.zeros(num_blocks, block_size, model.num_kv_heads, model.head_dim, model.dtype, self.device)
                for _ in range(model.num_layers)
            ]
        else:
            shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
            # one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
            self.kv_caches = [torch.zeros(shape, dtype=model.dtype, device=self.device) for _ in range(model.num_layers)]
        self.batch = InputBatch(block_size, self.device, num_blocks)
        # the native batch-1 decode step (model/native/): fp32 caches only, and not when
        # steps must report attention mass (only the torch back end computes it)
        self.native = (model.native_decoder(self.kv_caches)
                       if kv_cache_dtype != "int8" and not track_block_scores else None)
        self.graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs (capture_decode_graphs)
        # the torch path's decode rows attend natively (NativeDecoder.attend_rows), so a mixed
        # step runs as one pass over the weights, its decodes' projections in the prefill's
        # GEMMs, and steps the native step does not cover (past MAX_ROWS, rows that sample
        # nothing) stop gathering contexts (False: the split below, or the gather path;
        # benchmarks/mixed_steps.py's ablations)
        self.native_decode_attention = self.native is not None and model.attn.name == "torch"
        # without native attention: a mixed step's decodes natively, its prefill chunks through
        # the model, once the decodes hold this many context tokens in all (False: all through
        # the model, gathered)
        self.native_mixed_steps = True
        self.native_mixed_min_context = NATIVE_MIXED_MIN_CONTEXT

    def capture_decode_graphs(self, max_batch: int, max_blocks_per_seq: int, capture: Capture | None = None) -> DecodeGraphs:
        """Capture decode-only steps of up to ``max_batch`` rows (cuda_graphs.py); from then
        on such steps replay them. Needs a back end whose decode never reads host lengths
        (triton) and no attention-mass tracking (a graph returns logits only). ``capture``:
        how (default: CUDA graphs; tests pass ``eager_capture``)."""
        if self.track_block_scores:
            raise ValueError("decode graphs do not track attention mass (KV compression by attention)")
        if self.model.attn.name != "triton":
            raise ValueError(f"decode graphs need the triton attention back end, not {self.model.attn.name!r}")
        graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks_per_seq)
        graphs.capture(capture)
        self.graphs = graphs
        return graphs

    def capture_decode_graphs_or_stay_eager(self, max_batch: int, max_blocks_per_seq: int) -> None:
        """What an engine asked for ``cuda_graphs`` does at start: capture where graphs apply
        (CUDA, the triton back end, no attention-mass tracking), else log why not. A failed
        capture is logged and leaves the runner eager: slower, never wrong."""
        why_not = ("not on a CUDA device" if self.model.device.type != "cuda"
                   else "the attention back end is not triton" if self.model.attn.name != "triton"
                   else "KV compression tracks attention mass" if self.track_block_scores else "")
        if why_not:
            log.info("cuda_graphs_not_used", reason=why_not)
            return
        try:
            graphs = self.capture_decode_graphs(max_batch, max_blocks_per_seq)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager steps
            self.graphs = None
            log.warning("cuda_graphs_unavailable", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("cuda_graphs_captured", buckets=list(graphs.buckets), seconds=round(graphs.capture_s, 2))

    def _graph_covers(self, plan: StepPlan) -> bool:
        graphs = self.graphs
        return (graphs is not None and not plan.prefills
                and graphs.covers(len(plan.decodes), max(len(d.seq.blocks) for d in plan.decodes))
                and all(d.samples for d in plan.decodes))

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes one KV block takes over all layers (int8: data plus its float32 scales)."""
        if kv_cache_dtype == "int8":
            per_layer = QuantizedKVCache.bytes_per_block(block_size, model.num_kv_heads, model.head_dim)
            return per_layer * model.num_layers
        return 2 * block_size * model.num_kv_heads * model.head_dim * model.num_layers * model.dtype.itemsize

    def _prepare(self, plan: StepPlan) -> StepInputs:
        """The step's inputs, in the persistent batch's buffers (input_batch.py); with
        KV compression's attention mass accumulator when it is tracked."""
        inputs = self.batch.prepare(plan)
        if self.track_block_scores and self.model.attn.produces_block_scores:
            items = plan.decodes + plan.prefills
            width = max(len(s.seq.blocks) for s in items)
            # fresh each step: the engine reads it after the step (StepResult.block_scores)
            block_scores = torch.zeros((len(items), width), dtype=torch.float32, device=self.device)
            inputs = inputs._replace(meta=dataclasses.replace(inputs.meta, block_scores=block_scores))
        return inputs

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Writes the new tokens' K/V into the cache; does not touch
        sequence state (the engine applies the result)."""
        items = plan.decodes + plan.prefills
        if plan.decodes and self._graph_covers(plan):
            # decodes only, each sampling: the captured forward (cuda_graphs.py), fed from
            # the batch's host buffers straight into the graphs' static ones
            meta = self.batch.prepare(plan, on_device=False).meta
            w = max(len(d.seq.blocks) for d in plan.decodes)
            logits = self.graphs.run(self.batch.token_rows(len(items)), meta.decode_seq_lens,
                                     meta.decode_block_tables[:, :w])
            return self._sample(items, logits, meta)
        input_ids, positions, meta, sample_rows, row_starts = self._prepare(plan)
        nd = len(plan.decodes)
        single_pass = self.native_decode_attention and self.native is not None
        self.model.attn.native_decode = self.native.attend_rows if single_pass else None  # read by _forward
        if plan.prefills and single_pass:  # one pass, the decode rows' attention native
            return self._sample(*self._forward(items, input_ids, positions, meta, sample_rows, row_starts), meta)
        if not (self.native is not None and self.native.covers(nd) and all(d.samples for d in plan.decodes)
                and (not plan.prefills or self.native_mixed_steps
                     and sum(meta.decode_seq_lens_host) >= self.native_mixed_min_context)):
            return self._sample(*self._forward(items, input_ids, positions, meta, sample_rows, row_starts), meta)
        # The decodes (each sampling) in one native call: decode.c for one row,
        # decode_batch.c for several (fp32 KV and no attention-mass tracking were checked
        # when self.native was made).
        logits = self._native_decodes(input_ids[:nd], positions[:nd], meta)
        if not plan.prefills:
            return self._sample(items, logits, meta)
        # A mixed step: the prefill chunks go through the model on their own (see
        # NATIVE_MIXED_MIN_CONTEXT).
        starts = [r - nd for r in row_starts[nd:]]
        rows = [r + item.num_new_tokens - 1 for item, r in zip(plan.prefills, starts) if item.samples]
        sampled, prefill_logits = self._forward(plan.prefills, input_ids[nd:], positions[nd:],
                                                _without_decodes(meta, nd), rows, starts)
        return self._sample(plan.decodes + sampled, torch.cat([logits, prefill_logits]), meta)

    def _native_decodes(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """[decodes, vocab] logits of the step's decode rows, from the native step."""
        if meta.num_decodes == 1:
            return self.native.step(int(input_ids[0]), int(positions[0]), int(meta.slot_mapping[0]),
                                    meta.decode_block_tables[0], meta.decode_seq_lens_host[0])
        return self.native.step_rows(input_ids, positions, meta.slot_mapping[:meta.num_decodes],
                                     meta.decode_block_tables, meta.decode_seq_lens, meta.decode_seq_lens_host)

    def _forward(self, items: list, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                 sample_rows, row_starts: list[int]) -> tuple[list, torch.Tensor]:
        """The model's forward over ``items``' tokens: (the items that sample, their logits),
        recording prompt logprobs on the way."""
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        for item, row in zip(items, row_starts):
            if item.seq.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(item.seq, item.num_new_tokens, hidden, row)
        sampled = [s for s in items if s.samples]
        if not sampled:
            return [], hidden.new_empty((0, self.model.config.vocab_size))
        return sampled, self.model.compute_logits(hidden[sample_rows])  # [rows, vocab]

    def _sample(self, sampled: list, logits: torch.Tensor, meta) -> StepResult:
        """The step's tokens from ``logits`` ([rows, vocab], one row per ``sampled`` item)."""
        if not sampled:
            return StepResult([], SampledTokens([], None), meta.block_scores)
        native = self.native
        seqs = [s.seq for s in sampled]
        if all(_is_plain(s) for s in seqs):  # one argmax, no per-row lists
            # the native argmax when the library is loaded (~0.05 ms where torch's took
            # ~0.45 ms at 16 rows x 49152); None (a NaN, an odd tensor) -> torch's
            greedy = native.argmax_rows(logits) if native is not None else None
            return StepResult(sampled, SampledTokens(greedy, None) if greedy is not None else sample_greedy(logits),
                              meta.block_scores)
        if native is not None and all(_is_plain(s, entropy_ok=True) for s in seqs):
            # greedy agent rows: argmax and entropy natively (~0.1 ms where the sampler's
            # log_softmax path took ~1-2 ms a step: 5-10 % of a small model's decode step)
            got = native.argmax_entropy_rows(logits, [s.session.track_entropy for s in seqs])
            if got is not None:
                return StepResult(sampled, SampledTokens(got[0], None, got[1]), meta.block_scores)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                        [s.session.track_entropy for s in seqs] if any(s.session.track_entropy for s in seqs) else (),
                        histories=[_history(s) for s in seqs] if any(needs_history(s.params) for s in seqs) else (),
                        grammars=[s.grammar for s in seqs] if any(s.grammar is not None for s in seqs) else (),
                        fallback_ids=[self._fallback_id(s) for s in seqs])
        return StepResult(sampled, tokens, meta.block_scores)

    def _fallback_id(self, seq: Sequence) -> int:
        """The token a row gets when its processed logits allow none: a stop token."""
        eos = self.model.config.eos_token_ids
        return seq.params.stop_token_ids[0] if seq.params.stop_token_ids else (eos[0] if eos else 0)

    def _record_prompt_logprobs(self, seq: Sequence, n: int, hidden: torch.Tensor, row0: int) -> None:
        """Append the prompt logprobs this chunk's positions give: position j's logits score
        prompt token j + 1. Skips positions recorded by an earlier (preempted) attempt."""
        start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
        first, end = max(start, done), min(start + n, seq.num_prompt_tokens - 1)
        if first > done or first >= end:  # a gap cannot be filled; nothing new to record
            return
        k = seq.params.prompt_logprobs
        for lo in range(first, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            lp = self.model.compute_logits(hidden[row0 + lo - start: row0 + hi - start]).log_softmax(-1)
            targets = torch.tensor(seq.prompt_token_ids[lo + 1: hi + 1], device=lp.device)
            seq.prompt_logprobs.extend(lp.gather(1, targets[:, None]).squeeze(1).tolist())
            if k:  # k = 0: the tokens' own logprobs only, no alternatives (as the proto says)
                values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                seq.prompt_top_logprobs.extend(
                    tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))


def _is_plain(seq: Sequence, entropy_ok: bool = False) -> bool:
    """A row the sampler's greedy fast path serves: no processor, no logprobs, no entropy
    (``entropy_ok``: the native argmax-and-entropy path serves the entropy too)."""
    return (seq.grammar is None and (entropy_ok or not seq.session.track_entropy)
            and is_plain_greedy(seq.params))


def _history(seq: Sequence) -> TokenHistory | None:
    """The tokens a row's penalties read (None when it has none)."""
    p = seq.params
    if not needs_history(p):
        return None
    return TokenHistory.of(seq.all_token_ids, seq.num_prompt_tokens, p.resumed_output_tokens)


def _without_decodes(meta: AttentionMetadata, num_decodes: int) -> AttentionMetadata:
    """``meta`` for the step's prefill chunks alone (its tokens after the decodes')."""
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping[num_decodes:], num_decodes=0,
                               decode_block_tables=meta.decode_block_tables[:0],
                               decode_seq_lens=meta.decode_seq_lens[:0], decode_seq_lens_host=())
