"""The per-token int8 KV cache kernels (the executor's QuantizedKVCache format): the write
kernel is bit-equal to the torch quantisation, decode and prefill match attention over the
dequantised cache, and the Triton back end serves a QuantizedKVCache like the torch one."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_int8_token import (
    paged_decode_attention_int8_token,
    paged_prefill_attention_int8_token,
    write_kv_cache_int8,
)
from kernels.reference import (
    ref_paged_decode_attention,
    ref_paged_decode_attention_int8_token,
    ref_paged_prefill_attention_int8_token,
    ref_write_kv_cache_int8,
)
from services.executor.attention.base import AttentionMetadata, QuantizedKVCache, quantize_int8
from services.executor.attention.torch_backend import TorchAttentionBackend
from services.executor.attention.triton_backend import TritonAttentionBackend
from tests.kernels.paged_inputs import (
    DEVICE,
    FP_DTYPES,
    assert_close,
    boundary_lengths,
    generator,
    int32,
    make_block_tables,
    make_kv_cache,
    query_start_loc,
    randn,
    require_dtype,
)

NUM_KV_HEADS, HEAD_DIM = 2, 16


def _quantized(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of a float cache quantised per (token, KV head): (data, scales). Uses the
    torch quantisation (the write kernel is bit-equal to it, tested below; the interpreter
    would take seconds to write every slot)."""
    return quantize_int8(kv_cache)


# -- write ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [4, 5])
def test_write_is_bit_equal_to_the_torch_quantized_cache(block_size, dtype):
    require_dtype(dtype)
    gen = generator(0)
    num_blocks, num_tokens, kvh = 6, 11, 3  # 3 KV heads: a padded head dimension in the kernel
    # Magnitudes from 1e-4 to 1e4, an all-zero row, and exact ties (x / scale = n + 0.5).
    qkv = randn(num_tokens, 3 * kvh, HEAD_DIM, dtype=torch.float32, gen=gen)
    qkv *= torch.logspace(-4, 4, num_tokens, device=DEVICE)[:, None, None]
    qkv[2, kvh] = 0.0  # keys of head 0
    qkv[3, kvh + 1] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -3.5, 126.5, -126.5, 4.5, 5.5,
                              -1.5, 0, 0, 0], device=DEVICE)
    qkv = qkv.to(dtype)
    k, v = qkv[:, kvh:2 * kvh], qkv[:, 2 * kvh:]  # strided views, as sliced from a fused QKV
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)

    got = QuantizedKVCache.zeros(num_blocks, block_size, kvh, HEAD_DIM, dtype, DEVICE)
    got.data.fill_(99)
    got.scales.fill_(-1.0)
    expected = QuantizedKVCache(got.data.clone(), got.scales.clone(), dtype)
    write_kv_cache_int8(k, v, got.data, got.scales, slots)
    expected.write(slots, k, v)

    assert torch.equal(got.data, expected.data) and torch.equal(got.scales, expected.scales)
    ref_data, ref_scales = got.data.clone().fill_(99), got.scales.clone().fill_(-1.0)
    ref_write_kv_cache_int8(k, v, ref_data, ref_scales, slots)
    assert torch.equal(ref_data, got.data) and torch.equal(ref_scales, got.scales)
    tie_row = got.data[0].view(-1, kvh, HEAD_DIM)[slots[3], 1, :13].tolist()
    assert tie_row == [127, 0, 2, 2, 0, -2, 4, -4, 126, -126, 4, 6, -2]  # ties to even


def test_write_skips_padding_slots():
    gen = generator(1)
    k = randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    v = randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    data = torch.full((2, 2, 4, NUM_KV_HEADS, HEAD_DIM), 99, dtype=torch.int8, device=DEVICE)
    scales = torch.full((2, 2, 4, NUM_KV_HEADS), -1.0, device=DEVICE)
    write_kv_cache_int8(k, v, data, scales, torch.tensor([5, -1, 2], device=DEVICE))
    written = torch.zeros(2, 8, dtype=torch.bool)
    written[:, [5, 2]] = True
    assert (data.view(2, 8, -1)[~written] == 99).all() and (scales.view(2, 8, -1)[~written] == -1).all()
    assert (scales.view(2, 8, -1)[written] > 0).all()


# -- decode -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("group, num_splits", [(1, 1), (4, 3)])
def test_decode_matches_reference_on_the_dequantized_cache(group, num_splits, dtype):
    require_dtype(dtype)
    block_size = 5
    gen = generator(2)
    seq_lens = boundary_lengths(block_size)  # 1, 4, 5, 6, 17
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    data, scales = _quantized(kv_cache)
    block_tables = make_block_tables(seq_lens, block_size, num_blocks, gen)
    q = randn(len(seq_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, gen=gen)
    lens = int32(seq_lens)

    out = paged_decode_attention_int8_token(q, data, scales, block_tables, lens, 0.25,
                                            num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, ref_paged_decode_attention_int8_token(q, data, scales, block_tables, lens, 0.25),
                 dtype)
    # And it stays near full-precision attention (quantisation error only).
    full = ref_paged_decode_attention(q.float(), kv_cache.float(), block_tables, lens, 0.25)
    torch.testing.assert_close(out.float(), full, atol=5e-2, rtol=5e-2)


# -- prefill ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2])
def test_prefill_matches_reference_on_the_dequantized_cache(group, dtype):
    require_dtype(dtype)
    block_size = 4
    gen = generator(3)
    # empty and cached prefixes, chunks across block edges, an empty chunk
    context_lens, query_lens = [0, block_size - 1, 2 * block_size + 1, 5], [block_size + 1, 3, 5, 0]
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = make_kv_cache(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    data, scales = _quantized(kv_cache)
    case = (make_block_tables(seq_lens, block_size, num_blocks, gen), query_start_loc(query_lens),
            int32(context_lens), int32(seq_lens))
    q = randn(sum(query_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, gen=gen)

    out = paged_prefill_attention_int8_token(q, data, scales, *case, 0.25)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref_paged_prefill_attention_int8_token(q, data, scales, *case, 0.25), dtype)


def test_one_token_prefill_chunks_equal_int8_decode():
    gen = generator(4)
    block_size, seq_lens = 4, [1, 5, 12]
    kv_cache = make_kv_cache(8, block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, gen)
    data, scales = _quantized(kv_cache)
    block_tables = make_block_tables(seq_lens, block_size, 8, gen)
    q = randn(3, 2 * NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    lens = int32(seq_lens)
    prefill = paged_prefill_attention_int8_token(q, data, scales, block_tables, query_start_loc([1, 1, 1]),
                                                 int32([n - 1 for n in seq_lens]), lens, 0.3)
    decode = paged_decode_attention_int8_token(q, data, scales, block_tables, lens, 0.3, num_splits=1)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


# -- the back end -----------------------------------------------------------------------
def test_triton_backend_on_a_quantized_cache_equals_the_torch_backend():
    """One step with a decode and a prefill chunk over cached history: the caches end
    bit-equal and the outputs agree."""
    gen = generator(5)
    heads, bs, nblocks = 4, 4, 8
    caches = [QuantizedKVCache.zeros(nblocks, bs, NUM_KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
              for _ in range(2)]
    hist_slots = torch.tensor([4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16], device=DEVICE)
    hk = randn(11, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    hv = randn(11, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    for cache in caches:
        cache.write(hist_slots, hk, hv)
    q = randn(4, heads, HEAD_DIM, dtype=torch.float32, gen=gen)
    k = randn(4, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    v = randn(4, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen)
    meta = AttentionMetadata(  # a decode of 7 tokens in blocks [1, 2]; 3 new tokens after 5 in [3, 4]
        slot_mapping=torch.tensor([10, 17, 18, 19], device=DEVICE), num_decodes=1,
        decode_block_tables=int32([1, 2])[None], decode_seq_lens=int32([7]),
        num_prefills=1, prefill_query_start_loc=int32([0, 3]), prefill_context_lens=int32([5]),
        prefill_seq_lens=int32([8]), prefill_block_tables=int32([3, 4])[None],
        prefill_query_lens_host=(3,), prefill_context_lens_host=(5,), decode_seq_lens_host=(7,),
    )
    args = (heads, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    out_triton = TritonAttentionBackend(*args).forward(q, k, v, caches[0], meta)
    out_torch = TorchAttentionBackend(*args).forward(q, k, v, caches[1], meta)
    assert torch.equal(caches[0].data, caches[1].data) and torch.equal(caches[0].scales, caches[1].scales)
    torch.testing.assert_close(out_triton, out_torch, atol=1e-4, rtol=1e-4)
