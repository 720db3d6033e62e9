"""Paged prefill attention (chunks over a cached prefix, causal) against the reference."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode_attention
from kernels.paged_prefill import paged_prefill_attention
from kernels.reference import ref_paged_prefill_attention
from tests.kernels.paged_inputs import (
    FP_DTYPES,
    assert_close,
    generator,
    int32,
    make_block_tables,
    make_kv_cache,
    query_start_loc,
    randn,
    require_dtype,
)

NUM_KV_HEADS = 2


def _prefill_case(context_lens: list[int], query_lens: list[int], group: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, seed: int = 0):
    gen = generator(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 8
    kv_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    q = randn(sum(query_lens), NUM_KV_HEADS * group, head_dim, dtype=dtype, gen=gen)
    return (q, kv_cache, block_tables, query_start_loc(query_lens), int32(context_lens),
            int32(seq_lens))


def _boundary_chunks(block_size: int) -> tuple[list[int], list[int]]:
    """(context_lens, query_lens): empty and cached prefixes, chunks across block edges."""
    context_lens = [0, 0, block_size - 1, block_size, 2 * block_size + 1]
    query_lens = [1, block_size + 1, 3, block_size, 5]
    return context_lens, query_lens


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_reference(group, head_dim, block_size, dtype):
    require_dtype(dtype)
    case = _prefill_case(*_boundary_chunks(block_size), group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(*case, scale)
    assert out.shape == case[0].shape and out.dtype == dtype
    assert_close(out, ref_paged_prefill_attention(*case, scale), dtype)


@pytest.mark.parametrize("group", [1, 3])
def test_long_chunks_span_several_query_blocks(group):
    # 40 and 23 queries need several programs per sequence (BLOCK_Q is 16 // group
    # under the interpreter), so the program -> sequence search crosses sequences.
    case = _prefill_case([0, 9, 0], [40, 23, 2], group, 16, 8, torch.float32, seed=2)
    assert_close(paged_prefill_attention(*case, 0.25), ref_paged_prefill_attention(*case, 0.25),
                 torch.float32)


def test_empty_chunk_between_chunks_is_skipped():
    case = _prefill_case([3, 6, 0], [4, 0, 5], 2, 16, 4, torch.float32, seed=3)
    assert_close(paged_prefill_attention(*case, 0.25), ref_paged_prefill_attention(*case, 0.25),
                 torch.float32)


def test_one_token_chunks_equal_decode():
    q, kv_cache, block_tables, qsl, context_lens, seq_lens = _prefill_case(
        [0, 4, 11], [1, 1, 1], 2, 16, 4, torch.float32, seed=4)
    prefill = paged_prefill_attention(q, kv_cache, block_tables, qsl, context_lens, seq_lens, 0.3)
    decode = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.3, num_splits=1)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_prefill_rejects_mismatched_query_start_loc():
    q, kv_cache, block_tables, qsl, context_lens, seq_lens = _prefill_case(
        [0, 2], [3, 3], 1, 16, 4, torch.float32)
    with pytest.raises(AssertionError, match="query_start_loc"):
        paged_prefill_attention(q, kv_cache, block_tables, qsl[:-1], context_lens, seq_lens, 0.25)
