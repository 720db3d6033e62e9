"""The per-step logits mask: one batched bitmask fill for every constrained row, applied
in place (disallowed tokens -> -inf). Free rows are neither filled nor touched."""
from __future__ import annotations

import time
from collections.abc import Sequence

import structlog
import torch
import xgrammar as xgr

from services.executor.grammar.state import GrammarState
from services.mesh import metrics

log = structlog.get_logger(__name__)

MASK_SECONDS = metrics.histogram(
    "weft_executor_grammar_mask_seconds", "Per step: filling and applying the grammar bitmask of all constrained rows.",
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1))
DEAD_ROWS = metrics.counter("weft_executor_grammar_dead_rows_total",
                            "Constrained rows that had no allowed token left and were ended with a stop token.")

_batch_matcher: xgr.BatchGrammarMatcher | None = None


def _batcher() -> xgr.BatchGrammarMatcher:
    global _batch_matcher
    if _batch_matcher is None:  # its worker threads start on first use, not at import
        _batch_matcher = xgr.BatchGrammarMatcher()
    return _batch_matcher


def mask_logits(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> float:
    """Mask ``logits`` ([rows, vocab], any device, rows in the order of ``states``) in
    place so each row with a state can only sample what its grammar allows next. Returns
    the seconds spent (0.0 without a constrained row: nothing is allocated then).

    A row left with no allowed token (a failed or already terminated state, or a
    grammar the vocabulary cannot continue) is forced to its first stop token, so it
    samples that, finishes, and never sees an all -inf row (NaN probabilities)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return 0.0
    start = time.perf_counter()
    live = [i for i in rows if not states[i].finished]
    dead = [i for i in rows if states[i].finished]
    if live:
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
        _batcher().batch_fill_next_token_bitmask([states[i].matcher for i in live], bitmask, live)
        empty = (bitmask[live] == 0).all(dim=-1).tolist()
        dead += [i for i, e in zip(live, empty) if e]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=live)
    for i in dead:
        _force_stop(logits, i, states[i])
    elapsed = time.perf_counter() - start
    MASK_SECONDS.observe(elapsed)
    return elapsed


def _force_stop(logits: torch.Tensor, row: int, state: GrammarState) -> None:
    stop = next((t for t in state.stop_token_ids if t < logits.shape[-1]), 0)
    if not state.terminated:
        DEAD_ROWS.inc()
        log.warning("grammar_no_allowed_token", request_id=state.request_id, failed=state.failed)
        state.failed = True
    logits[row].fill_(float("-inf"))
    logits[row, stop] = 0.0
