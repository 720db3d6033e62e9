"""Paged decode attention (split-K flash-decoding) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import (
    MAX_NUM_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention,
)
from kernels.reference import ref_paged_decode_attention
from tests.kernels.paged_inputs import (
    DEVICE,
    FP_DTYPES,
    assert_close,
    boundary_lengths,
    generator,
    int32,
    make_block_tables,
    make_kv_cache,
    randn,
    require_dtype,
)

NUM_KV_HEADS = 2


def _decode_case(seq_lens: list[int], group: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0):
    gen = generator(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    kv_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    q = randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen)
    return q, kv_cache, block_tables, int32(seq_lens)


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_reference(group, head_dim, block_size, dtype):
    require_dtype(dtype)
    q, kv_cache, block_tables, seq_lens = _decode_case(
        boundary_lengths(block_size), group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref_paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale), dtype)


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_equals_single_split(num_splits, dtype):
    require_dtype(dtype)
    # Lengths from 1 (most splits empty) to 70 (5 tiles of 16 keys on the interpreter).
    q, kv_cache, block_tables, seq_lens = _decode_case([1, 17, 33, 70], 2, 32, 8, dtype, seed=1)
    one = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.2, num_splits=1)
    split = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.2, num_splits=num_splits)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(split.float(), one.float(), atol=atol, rtol=rtol)
    assert_close(split, ref_paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.2), dtype)


def test_zero_length_sequence_gives_zeros_not_nan():
    q, kv_cache, block_tables, _ = _decode_case([5, 5], 2, 16, 4, torch.float32)
    seq_lens = int32([0, 5])  # a padded batch slot next to a real sequence
    for num_splits in (1, 2):
        out = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.25, num_splits=num_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1]).all()


def test_decode_reads_strided_q_and_writes_into_given_out():
    q_full, kv_cache, block_tables, seq_lens = _decode_case([3, 9, 20], 2, 16, 4, torch.float32)
    # q as a view into a fused [B, H + 2 * KVH, D] projection, out as rows of a bigger buffer.
    fused = torch.cat([q_full, torch.zeros_like(q_full[:, :4])], dim=1)
    q = fused[:, :q_full.shape[1]]
    assert not q.is_contiguous()
    buffer = torch.full((5, *q.shape[1:]), 7.0, device=DEVICE)
    result = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.25, out=buffer[1:4])
    assert result.data_ptr() == buffer[1:4].data_ptr()
    assert_close(buffer[1:4], ref_paged_decode_attention(q_full, kv_cache, block_tables, seq_lens, 0.25),
                 torch.float32)
    assert (buffer[0] == 7.0).all() and (buffer[4] == 7.0).all()


def test_decode_rejects_int64_block_tables():
    q, kv_cache, block_tables, seq_lens = _decode_case([3], 1, 16, 4, torch.float32)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention(q, kv_cache, block_tables.long(), seq_lens, 0.25)


def test_split_heuristic_does_not_split_a_full_grid():
    assert choose_num_splits(batch_size=64, num_kv_heads=8, max_context_len=32768, sm_count=132) == 1


def test_split_heuristic_splits_long_contexts_of_small_batches():
    splits = choose_num_splits(batch_size=1, num_kv_heads=8, max_context_len=16384, sm_count=132)
    assert 1 < splits <= MAX_NUM_SPLITS
    assert 16384 // splits >= MIN_TOKENS_PER_SPLIT


def test_split_heuristic_keeps_short_contexts_whole():
    assert choose_num_splits(batch_size=1, num_kv_heads=8, max_context_len=MIN_TOKENS_PER_SPLIT,
                             sm_count=132) == 1
