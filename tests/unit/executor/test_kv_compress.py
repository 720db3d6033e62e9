"""KV compression without a model: the victim policy, the manager's block dropping, and
the torch back end's per-block attention mass against an explicit softmax."""
from __future__ import annotations

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.torch_backend import TorchAttentionBackend
from services.executor.kv.block_pool import BlockPool
from services.executor.policy.kv_compress import choose_victims
from services.executor.kv.manager import KVCacheManager
from services.executor.engine.sampling_params import SamplingParams
from services.executor.engine.sequence import Sequence


# -- the policy -------------------------------------------------------------------------
def test_within_budget_drops_nothing():
    assert choose_victims([0.0] * 6, budget=6, num_sink=1, num_recent=2) == []
    assert choose_victims([], budget=6, num_sink=1, num_recent=2) == []


def test_drops_the_lowest_scored_middle_block():
    #         sink  middle ...............  recent
    scores = [0.0, 5.0, 1.0, 3.0, 4.0, 0.0, 0.0]
    assert choose_victims(scores, budget=6, num_sink=1, num_recent=2) == [2]


def test_sinks_and_recent_blocks_are_kept_even_with_the_lowest_scores():
    scores = [-9.0, -9.0, 1.0, 2.0, 3.0, -9.0, -9.0, -9.0]
    victims = choose_victims(scores, budget=6, num_sink=2, num_recent=3)
    assert victims == [2, 3]


def test_ties_go_to_the_oldest_block():
    assert choose_victims([1.0] * 8, budget=6, num_sink=1, num_recent=2) == [1, 2]
    assert choose_victims([0.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0], budget=6, num_sink=1, num_recent=2) == [2]


def test_drops_exactly_enough_to_reach_the_budget():
    scores = [float(i % 3) for i in range(20)]
    victims = choose_victims(scores, budget=5, num_sink=1, num_recent=3)
    assert len(victims) == 15
    assert victims == sorted(victims) and all(1 <= i < 17 for i in victims)


def test_a_budget_without_middle_blocks_is_refused():
    with pytest.raises(ValueError):
        choose_victims([0.0] * 8, budget=3, num_sink=1, num_recent=2)


# -- the manager ------------------------------------------------------------------------
def _seq_with_blocks(kv: KVCacheManager, num_tokens: int) -> Sequence:
    seq = Sequence("r", list(range(num_tokens)), SamplingParams())
    assert kv.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(seq)
    return seq


def test_drop_blocks_frees_them_and_shifts_the_cache():
    pool = BlockPool(16, block_size=4)
    kv = KVCacheManager(pool)
    seq = _seq_with_blocks(kv, 22)  # 6 blocks, the last one partial
    seq.block_scores = [float(i) for i in range(6)]
    before = seq.block_ids()
    kv.drop_blocks(seq, [1, 3])
    assert seq.block_ids() == [before[i] for i in (0, 2, 4, 5)]
    assert seq.block_scores == [0.0, 2.0, 4.0, 5.0]
    assert seq.num_evicted_tokens == 8 and seq.num_cached_kv_tokens == 14
    assert pool.num_free_blocks == 12 and pool.used_blocks(seq.partition) == 4
    # the dropped blocks were registered over the whole prefix: still prefix-cache hits
    assert all(pool.contains(h) for h in seq.block_hashes[:5])


def test_a_compressed_sequence_needs_blocks_only_for_its_kept_tokens():
    kv = KVCacheManager(BlockPool(16, block_size=4))
    seq = _seq_with_blocks(kv, 24)  # 6 full blocks
    kv.drop_blocks(seq, [1, 2])
    assert kv.num_blocks_needed(seq, 1) == 1  # position 24 -> cache index 16: a fifth block
    assert kv.allocate_slots(seq, 1) and len(seq.blocks) == 5


def test_blocks_completed_after_an_eviction_are_not_registered():
    pool = BlockPool(16, block_size=4)
    kv = KVCacheManager(pool)
    seq = _seq_with_blocks(kv, 22)
    kv.drop_blocks(seq, [1])
    stored = len(pool.cached_hashes())
    seq.all_token_ids.extend([7, 7])
    assert kv.allocate_slots(seq, 2)
    seq.num_computed_tokens = 24  # the sixth block is now full, over a compressed context
    kv.cache_computed_blocks(seq)
    assert len(pool.cached_hashes()) == stored == 5


def test_only_full_blocks_can_be_dropped():
    kv = KVCacheManager(BlockPool(16, block_size=4))
    seq = _seq_with_blocks(kv, 22)
    with pytest.raises(ValueError):
        kv.drop_blocks(seq, [5])


def test_freeing_a_sequence_resets_its_compression_state():
    pool = BlockPool(16, block_size=4)
    kv = KVCacheManager(pool)
    seq = _seq_with_blocks(kv, 22)
    seq.block_scores = [1.0] * 6
    kv.drop_blocks(seq, [2])
    kv.free(seq)
    assert seq.num_evicted_tokens == 0 and seq.block_scores == [] and pool.num_free_blocks == 16


# -- the torch back end's scores ---------------------------------------------------------
def test_torch_backend_block_scores_equal_explicit_softmax_mass():
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 8, 4, 16
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim)
    # two decodes (contexts 7 and 13 incl. the new token), one prefill chunk of 5 after 6
    tables = [[3, 8], [1, 2, 9, 4], [5, 6, 7]]
    lens = [7, 13]
    ctx, qlen = 6, 5
    slots = [tables[0][6 // bs] * bs + 6 % bs, tables[1][12 // bs] * bs + 12 % bs]
    slots += [tables[2][p // bs] * bs + p % bs for p in range(ctx, ctx + qlen)]
    n = 2 + qlen
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    scores = torch.zeros(3, 4)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=2,
        decode_block_tables=torch.tensor([tables[0] + [0, 0], tables[1]], dtype=torch.int32),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32), num_prefills=1,
        prefill_query_start_loc=torch.tensor([0, qlen], dtype=torch.int32),
        prefill_context_lens=torch.tensor([ctx], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([ctx + qlen], dtype=torch.int32),
        prefill_block_tables=torch.tensor([tables[2]], dtype=torch.int32),
        prefill_query_lens_host=(qlen,), prefill_context_lens_host=(ctx,), decode_seq_lens_host=tuple(lens),
        block_scores=scores,
    )
    backend.forward(q, k, v, cache, meta)

    def expected(query, table, length):  # query [heads, dim] -> mass per block
        keys = torch.cat([cache[0, b] for b in table])[:length]  # [length, kvh, dim]
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [length, heads, dim]
        probs = (torch.einsum("hd,lhd->hl", query, keys) * dim**-0.5).softmax(-1).sum(0)
        return torch.stack([probs[i : i + bs].sum() for i in range(0, len(table) * bs, bs)])

    assert torch.allclose(scores[0, :2], expected(q[0], tables[0], 7), atol=1e-5)
    assert torch.allclose(scores[1], expected(q[1], tables[1], 13), atol=1e-5)
    assert torch.allclose(scores[2, :3], expected(q[n - 1], tables[2], ctx + qlen), atol=1e-5)
    assert scores[0, 2:].abs().sum() == 0
    assert torch.allclose(scores.sum(1), torch.full((3,), float(heads)), atol=1e-5)  # one unit per head
