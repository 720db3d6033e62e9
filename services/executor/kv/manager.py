"""Ties sequences to the block pool: prefix matching, slot allocation, hash registration."""
from __future__ import annotations

from services.shared.block_hash import hash_block_chain
from services.executor.kv.block_pool import Block, BlockPool
from services.executor.engine.sequence import Sequence


def _owed_prompt_logprobs(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1


class KVCacheManager:
    """Per-sequence view of the pool. Policy-free: callers decide who gets blocks."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        # request_id -> number of the sequence's blocks whose hashes are registered
        self._num_registered: dict[str, int] = {}

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq.block_hashes`` cover every full block of its first ``num_tokens``."""
        have = len(seq.block_hashes)
        want = num_tokens // self.block_size
        if want > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes.extend(
                hash_block_chain(
                    seq.all_token_ids[: want * self.block_size],
                    self.block_size,
                    seq.extra_keys,
                    parent=parent,
                    start=have * self.block_size,
                )
            )

    def match_prefix(self, seq: Sequence) -> list[Block]:
        """Cached blocks covering a prefix of ``seq``; at least one token is left to
        compute, since the step must produce logits. Does not take references.

        Nothing for a sequence still owed prompt logprobs: a cached position has no logits
        (vLLM skips the cache for them too); once recorded, a recompute may hit."""
        if not self.pool.enable_prefix_caching or _owed_prompt_logprobs(seq):
            return []
        max_hit_tokens = seq.num_tokens - 1
        self._extend_hashes(seq, max_hit_tokens)
        return self.pool.get_cached_blocks(seq.block_hashes[: max_hit_tokens // self.block_size])

    def completing_hashes(self, seq: Sequence, num_new_tokens: int) -> list:
        """Hashes of the blocks a step of ``num_new_tokens`` more tokens fills (full after
        it, not before): what ``cache_computed_blocks`` will register after that step.
        Empty without prefix caching or once the sequence dropped blocks."""
        if not self.pool.enable_prefix_caching or seq.num_evicted_tokens:
            return []
        start = seq.num_computed_tokens // self.block_size
        end = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        if end <= start:
            return []
        self._extend_hashes(seq, end * self.block_size)
        return seq.block_hashes[start:end]

    def next_hit_hash(self, seq: Sequence, num_hit_blocks: int):
        """The hash a prefix hit would look up next after ``num_hit_blocks`` hits (the first
        block ``match_prefix`` found missing); None when no hit could cover it (caching off,
        prompt logprobs owed, or the hits already reach the last block a hit may cover)."""
        if not self.pool.enable_prefix_caching or _owed_prompt_logprobs(seq):
            return None
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        if num_hit_blocks >= max_hit_blocks:
            return None
        self._extend_hashes(seq, max_hit_blocks * self.block_size)
        return seq.block_hashes[num_hit_blocks]

    # -- questions (none of these modifies anything) ----------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def num_blocks_to_run(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens is charged when it is checked for
        fitting at all: its tokens' blocks plus one for the tokens it will generate."""
        return self.num_blocks_for(num_tokens) + 1

    def can_ever_hold(self, seq: Sequence) -> bool:
        """Whether ``seq``'s tokens fit in its partition's cap (or the pool) even when nothing
        else holds a block: one that has outgrown it can never take another step."""
        cap = min(self.pool.num_blocks, self.pool.spec(seq.partition).limit_blocks)
        return self.num_blocks_for(seq.num_tokens) <= cap

    def partition_allows(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq``'s partition quota (not the free pool) leaves room for the
        blocks ``num_new_tokens`` more tokens need."""
        return self.pool.usage_allows(self.num_blocks_needed(seq, num_new_tokens), seq.partition)

    def is_borrowing(self, partition: str) -> bool:
        """Whether ``partition`` holds more blocks than it reserves (the first to give back)."""
        return self.pool.borrowed_blocks(partition) > 0

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Fresh blocks needed to hold ``num_new_tokens`` more tokens after the hits.
        Only kept blocks count: tokens dropped by compression hold none."""
        computed = max(seq.num_cached_kv_tokens, num_hit_blocks * self.block_size)
        total = self.num_blocks_for(computed + num_new_tokens)
        return max(0, total - max(len(seq.blocks), num_hit_blocks))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit_blocks: list[Block] = ()) -> bool:
        """Take the cache hits (on first admission) and enough fresh blocks for
        ``num_new_tokens``. False, with nothing changed, when they do not fit."""
        need = self.num_blocks_needed(seq, num_new_tokens, len(hit_blocks))
        if not self.pool.can_allocate(need, seq.partition, hits=hit_blocks):
            return False
        if hit_blocks:
            self.pool.touch(hit_blocks, seq.partition)
            seq.blocks = list(hit_blocks)
            seq.num_computed_tokens = len(hit_blocks) * self.block_size
            self._num_registered[seq.request_id] = len(hit_blocks)
        if need:
            fresh = self.pool.allocate(need, seq.partition)
            assert fresh is not None  # can_allocate said yes
            seq.blocks.extend(fresh)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full and computed this step. Once a
        sequence dropped blocks, nothing more of it is registered: later K/V were
        computed over a compressed context, not over the prefix its hash names."""
        if seq.num_evicted_tokens:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done or not self.pool.enable_prefix_caching:
            return
        self._extend_hashes(seq, num_full * self.block_size)
        parent = seq.block_hashes[done - 1] if done else None
        self.pool.cache_full_blocks(
            seq.blocks[done:num_full], seq.block_hashes[done:num_full], parent, seq.partition
        )
        self._num_registered[seq.request_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; full ones stay cached for later hits. Its
        compression state goes with them (a recompute starts uncompressed)."""
        if seq.blocks:
            self.pool.free(seq.blocks, seq.partition)
        seq.blocks = []
        seq.num_evicted_tokens = 0
        seq.block_scores = []
        self._num_registered.pop(seq.request_id, None)

    def drop_blocks(self, seq: Sequence, indices: list[int]) -> None:
        """Compression: release the full blocks at ``indices`` (positions in
        ``seq.blocks``) and shift the sequence's cache past them. Registered hashes stay
        valid (those blocks were computed over the whole prefix) and remain hits.
        Raises ``ValueError`` for the partial last block or an index out of range."""
        if not indices:
            return
        drop = set(indices)
        num_full = seq.num_cached_kv_tokens // self.block_size
        if min(drop) < 0 or max(drop) >= num_full:
            raise ValueError(f"can only drop full blocks 0..{num_full - 1}, got {sorted(drop)}")
        victims = [b for i, b in enumerate(seq.blocks) if i in drop]
        self.pool.free(victims, seq.partition)
        seq.blocks = [b for i, b in enumerate(seq.blocks) if i not in drop]
        if seq.block_scores:
            seq.block_scores = [s for i, s in enumerate(seq.block_scores) if i not in drop]
        seq.num_evicted_tokens += len(drop) * self.block_size
