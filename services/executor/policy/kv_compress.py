"""KV compression policy: which of a sequence's KV blocks to drop when it is over budget.

NOTE: a compressed sequence keeps at most ``budget`` blocks. Its first ``num_sink``
blocks (attention sinks) and its newest ``num_recent`` blocks are always kept; the
blocks between them are candidates, and the ones with the least accumulated attention
mass go first (heavy hitters stay, H2O / SnapKV-style at block granularity)::

    | sink .. | middle: lowest score dropped (ties: oldest) | .. recent |
      0..S-1    S .. n-R-1                                    n-R .. n-1

With every score equal (a back end that produces none gives all zeros) this is
StreamingLLM: the oldest middle block goes first.

Pure functions over a list of per-block scores: the engine applies the result (frees
the blocks, shifts positions); nothing here touches sequence or pool state.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence


class CompressPolicy(enum.Enum):
    """Which middle block goes first: the least attended (heavy hitters stay), or the
    oldest (StreamingLLM: sinks + a sliding window; the ablation of the scores)."""

    ATTENTION = "attention"
    OLDEST = "oldest"


KV_COMPRESS_POLICIES = tuple(p.value for p in CompressPolicy)


def choose_victims(scores: Sequence[float], budget: int, num_sink: int, num_recent: int) -> list[int]:
    """Indices (ascending) of the blocks to drop so that ``len(scores) - len(result) ==
    budget``, or [] when the sequence is within budget. Never a sink or a recent block.

    Raises ``ValueError`` when the arguments leave no middle block to drop
    (``budget <= num_sink + num_recent``), a misconfiguration ``EngineConfig`` refuses.
    """
    if num_sink < 0 or num_recent < 0 or budget <= num_sink + num_recent:
        raise ValueError(f"budget ({budget}) must exceed sink ({num_sink}) + recent ({num_recent}), both >= 0")
    num_drop = len(scores) - budget
    if num_drop <= 0:
        return []
    # Removing a middle block changes neither the others' scores nor which blocks are
    # recent, so dropping the k lowest at once equals dropping the lowest k times.
    middle = range(num_sink, len(scores) - num_recent)  # len(middle) >= num_drop since budget > sink + recent
    ranked = sorted(middle, key=lambda i: (scores[i], i))
    return sorted(ranked[:num_drop])
