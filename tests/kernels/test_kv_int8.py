"""Per-block int8 KV quantisation and int8 decode attention against the references."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_int8 import dequantize_kv_blocks, paged_decode_attention_int8, quantize_kv_blocks
from kernels.reference import (
    ref_dequantize_kv_blocks,
    ref_paged_decode_attention,
    ref_paged_decode_attention_int8,
    ref_quantize_kv_blocks,
)
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

NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 16


def _int8_buffers(shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache and scales pre-filled with sentinels (to see what gets written)."""
    cache_int8 = torch.full(shape, 99, dtype=torch.int8, device=DEVICE)
    scales = torch.full((2, shape[1], shape[3]), -1.0, device=DEVICE)
    return cache_int8, scales


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_quantize_matches_reference_on_listed_blocks_only(block_size, dtype):
    require_dtype(dtype)
    kv_cache = make_kv_cache(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, generator(0))
    kv_cache[:, 2] = 0  # an all-zero block quantises to scale 0, values 0
    block_ids = int32([7, 2, 0, 11])
    cache_int8, scales = _int8_buffers(kv_cache.shape)
    expected_int8, expected_scales = _int8_buffers(kv_cache.shape)

    quantize_kv_blocks(kv_cache, block_ids, cache_int8, scales)
    ref_quantize_kv_blocks(kv_cache, block_ids, expected_int8, expected_scales)
    torch.testing.assert_close(scales, expected_scales, atol=0, rtol=1e-6)
    # Divisions are IEEE-rounded on both sides; allow one step for a tie decided differently.
    assert (cache_int8.int() - expected_int8.int()).abs().max() <= 1
    unlisted = [b for b in range(NUM_BLOCKS) if b not in block_ids.tolist()]
    assert (cache_int8[:, unlisted] == 99).all() and (scales[:, unlisted] == -1.0).all()
    assert (scales[:, 2] == 0).all() and (cache_int8[:, 2] == 0).all()


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
def test_quantize_dequantize_error_is_at_most_half_a_step(dtype):
    require_dtype(dtype)
    block_size = 8
    kv_cache = make_kv_cache(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, generator(1))
    kv_cache[0, 3, :, 1] *= 50.0  # an outlier head costs only its own block's precision
    block_ids = int32(list(range(NUM_BLOCKS)))
    cache_int8, scales = _int8_buffers(kv_cache.shape)
    restored = torch.zeros_like(kv_cache)

    quantize_kv_blocks(kv_cache, block_ids, cache_int8, scales)
    dequantize_kv_blocks(cache_int8, scales, block_ids, restored)
    expected = torch.zeros_like(kv_cache)
    ref_dequantize_kv_blocks(cache_int8, scales, block_ids, expected)
    assert_close(restored, expected, dtype)

    step = scales[:, :, None, :, None]  # [2, NB, 1, KVH, 1]
    # Half a quantisation step, plus the rounding of the dtype the values come back in.
    bound = step / 2 + torch.finfo(dtype).eps * kv_cache.float().abs() + 1e-7
    assert ((restored.float() - kv_cache.float()).abs() <= bound).all()
    assert scales[0, 3, 1] > 20 * scales[0, 3, 0]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_int8_decode_matches_reference_on_dequantized_cache(group, dtype, num_splits):
    require_dtype(dtype)
    block_size = 4
    gen = generator(2)
    seq_lens = boundary_lengths(block_size) + [37]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    kv_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, gen)
    cache_int8, scales = _int8_buffers(kv_cache.shape)
    quantize_kv_blocks(kv_cache, int32(list(range(num_blocks))), cache_int8, scales)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    q = randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, gen=gen)
    lens = int32(seq_lens)

    out = paged_decode_attention_int8(q, cache_int8, scales, block_tables, lens, 0.25,
                                      num_splits=num_splits)
    assert out.dtype == dtype
    expected = ref_paged_decode_attention_int8(q, cache_int8, scales, block_tables, lens, 0.25)
    assert_close(out, expected, dtype)
    # And int8 attention stays near full-precision attention (quantisation error only).
    full = ref_paged_decode_attention(q.float(), kv_cache, block_tables, lens, 0.25)
    torch.testing.assert_close(out.float(), full, atol=5e-2, rtol=5e-2)
