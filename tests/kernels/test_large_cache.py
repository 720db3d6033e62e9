"""Kernels on a cache of more than 2^31 elements per K/V half: 64-bit index math (GPU only).

Blocks at the top of the cache sit past element offset 2^31 (block * block_stride
overflows int32), and the values half starts another 2^31 elements further on. Expected
results come from the references on a compact copy of the blocks in use.
"""
from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_write import write_kv_cache
from kernels.kv_int8 import paged_decode_attention_int8, quantize_kv_blocks
from kernels.kv_int8_token import (
    paged_decode_attention_int8_token,
    paged_prefill_attention_int8_token,
    write_kv_cache_int8,
)
from kernels.paged_decode import paged_decode_attention
from kernels.paged_prefill import paged_prefill_attention
from kernels.reference import (
    ref_paged_decode_attention,
    ref_paged_decode_attention_int8,
    ref_paged_decode_attention_int8_token,
    ref_paged_prefill_attention_int8_token,
    ref_paged_prefill_attention,
    ref_quantize_kv_blocks,
)
from services.executor.attention.base import quantize_int8
from tests.kernels.paged_inputs import DEVICE, ON_GPU, assert_close, int32, query_start_loc

pytestmark = pytest.mark.skipif(
    not ON_GPU, reason="needs a CUDA device with ~14 GB free: the cache must exceed 2^31 "
                       "elements per half, far too big and slow for the CPU interpreter")

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 16, 2, 64, 8
ELEMENTS_PER_BLOCK = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
NUM_BLOCKS = 2 ** 31 // ELEMENTS_PER_BLOCK + 64  # the top 64 blocks start past 2^31
SEQ_LENS = [1, 17, 100, 300]
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def big_case():
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    kv_cache = torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                           device=DEVICE)
    assert kv_cache[0].numel() > 2 ** 31
    top = NUM_BLOCKS - 64 + torch.randperm(64, generator=gen, device=DEVICE)  # shuffled, all > 2^31
    kv_cache[:, top] = 0  # no uninitialised (maybe nan) memory in the slots the tokens leave free
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in SEQ_LENS]
    assert sum(blocks_per_seq) < 64
    # Padding entries name a zeroed top block that no sequence uses.
    block_tables = torch.full((len(SEQ_LENS), max(blocks_per_seq)), int(top[-1]),
                              dtype=torch.int32, device=DEVICE)
    used = 0
    for row, n in enumerate(blocks_per_seq):
        block_tables[row, :n] = top[used:used + n]
        used += n
    # Every token of every sequence is written by the kernel under test.
    slots = torch.cat([
        (block_tables[row, torch.arange(n, device=DEVICE) // BLOCK_SIZE].long() * BLOCK_SIZE
         + torch.arange(n, device=DEVICE) % BLOCK_SIZE)
        for row, n in enumerate(SEQ_LENS)
    ])
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
    write_kv_cache(k, v, kv_cache, slots)
    yield kv_cache, block_tables, slots, k, v
    del kv_cache
    torch.cuda.empty_cache()


def _compact(kv_cache: torch.Tensor, block_tables: torch.Tensor):
    """The blocks the tables name, renumbered 0..n-1, and the tables rewritten to match."""
    used, inverse = torch.unique(block_tables, return_inverse=True)
    return kv_cache[:, used.long()].clone(), inverse.to(torch.int32), used.to(torch.int32)


def test_write_reaches_slots_past_int32(big_case):
    kv_cache, _, slots, k, v = big_case
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    assert (blocks * ELEMENTS_PER_BLOCK).min() >= 2 ** 31  # int32 max is 2^31 - 1
    assert torch.equal(kv_cache[0, blocks, offsets], k)
    assert torch.equal(kv_cache[1, blocks, offsets], v)


@pytest.mark.parametrize("num_splits", [1, None])
def test_decode_reads_blocks_past_int32(big_case, num_splits):
    kv_cache, block_tables, _, _, _ = big_case
    q = torch.randn(len(SEQ_LENS), NUM_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    lens = int32(SEQ_LENS)
    out = paged_decode_attention(q, kv_cache, block_tables, lens, 0.125, num_splits=num_splits)
    compact, tables, _ = _compact(kv_cache, block_tables)
    assert_close(out, ref_paged_decode_attention(q, compact, tables, lens, 0.125), DTYPE)


def test_prefill_reads_blocks_past_int32(big_case):
    kv_cache, block_tables, _, _, _ = big_case
    query_lens = [1, 5, 37, 64]
    context_lens = [n - c for n, c in zip(SEQ_LENS, query_lens)]
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    args = (block_tables, query_start_loc(query_lens), int32(context_lens), int32(SEQ_LENS))
    out = paged_prefill_attention(q, kv_cache, *args, 0.125)
    compact, tables, _ = _compact(kv_cache, block_tables)
    expected = ref_paged_prefill_attention(q, compact, tables, *args[1:], 0.125)
    assert_close(out, expected, DTYPE)


def test_int8_quantize_and_decode_past_int32(big_case):
    kv_cache, block_tables, _, _, _ = big_case
    cache_int8 = torch.empty(kv_cache.shape, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(2, NUM_BLOCKS, NUM_KV_HEADS, device=DEVICE)
    compact, tables, used = _compact(kv_cache, block_tables)
    quantize_kv_blocks(kv_cache, used, cache_int8, scales)

    compact_int8 = torch.empty(compact.shape, dtype=torch.int8, device=DEVICE)
    compact_scales = torch.zeros(2, compact.shape[1], NUM_KV_HEADS, device=DEVICE)
    all_compact = torch.arange(compact.shape[1], dtype=torch.int32, device=DEVICE)
    ref_quantize_kv_blocks(compact, all_compact, compact_int8, compact_scales)
    assert (cache_int8[:, used.long()].int() - compact_int8.int()).abs().max() <= 1
    torch.testing.assert_close(scales[:, used.long()], compact_scales, atol=0, rtol=1e-6)

    q = torch.randn(len(SEQ_LENS), NUM_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    lens = int32(SEQ_LENS)
    out = paged_decode_attention_int8(q, cache_int8, scales, block_tables, lens, 0.125)
    expected = ref_paged_decode_attention_int8(q, compact_int8, compact_scales, tables, lens, 0.125)
    assert_close(out, expected, DTYPE)
    del cache_int8


def test_int8_per_token_write_decode_and_prefill_past_int32(big_case):
    _, block_tables, slots, k, v = big_case
    data = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(data.shape[:4], device=DEVICE)
    assert data[0].numel() > 2 ** 31
    write_kv_cache_int8(k, v, data, scales, slots)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for i, x in enumerate((k, v)):
        expected_q, expected_scale = quantize_int8(x)
        assert torch.equal(data[i, blocks, offsets], expected_q)
        assert torch.equal(scales[i, blocks, offsets], expected_scale)

    compact_data, tables, _ = _compact(data, block_tables)
    compact_scales = _compact(scales, block_tables)[0]
    lens = int32(SEQ_LENS)
    q = torch.randn(len(SEQ_LENS), NUM_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    out = paged_decode_attention_int8_token(q, data, scales, block_tables, lens, 0.125)
    assert_close(out, ref_paged_decode_attention_int8_token(q, compact_data, compact_scales, tables,
                                                            lens, 0.125), DTYPE)
    query_lens = [1, 5, 37, 64]
    context_lens = [n - c for n, c in zip(SEQ_LENS, query_lens)]
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
    args = (query_start_loc(query_lens), int32(context_lens), lens)
    out = paged_prefill_attention_int8_token(q, data, scales, block_tables, *args, 0.125)
    assert_close(out, ref_paged_prefill_attention_int8_token(q, compact_data, compact_scales, tables,
                                                             *args, 0.125), DTYPE)
    del data, scales
