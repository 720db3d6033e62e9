"""KV cache scatter against the reference: slots, skipped tokens, untouched slots."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_write import write_kv_cache
from kernels.reference import ref_write_kv_cache
from tests.kernels.paged_inputs import DEVICE, FP_DTYPES, generator, randn, require_dtype


def _slots(num_blocks: int, block_size: int, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[num_tokens] int64 distinct shuffled slots, every third one -1 (skip)."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("dtype", FP_DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_write_matches_reference_and_skips_negative_slots(block_size, num_kv_heads, dtype):
    require_dtype(dtype)
    gen = generator(0)
    num_blocks, head_dim, num_tokens = 6, 16, 13
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    slot_mapping = _slots(num_blocks, block_size, num_tokens, gen)
    # A sentinel-filled cache shows both the written slots and the untouched ones.
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), -9.0,
                          dtype=dtype, device=DEVICE)
    expected = kv_cache.clone()

    write_kv_cache(k, v, kv_cache, slot_mapping)
    ref_write_kv_cache(k, v, expected, slot_mapping)
    assert torch.equal(kv_cache, expected)
    assert (kv_cache != -9.0).sum() == 2 * (slot_mapping >= 0).sum() * num_kv_heads * head_dim


def test_write_reads_strided_k_and_v():
    gen = generator(1)
    num_tokens, num_kv_heads, head_dim = 5, 2, 16
    # k and v as views into one fused [T, 2 * KVH, D] projection.
    fused = randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    assert not k.is_contiguous()
    slot_mapping = torch.tensor([7, 0, 12, -1, 3], device=DEVICE)
    kv_cache = torch.zeros(2, 4, 4, num_kv_heads, head_dim, device=DEVICE)
    expected = kv_cache.clone()
    write_kv_cache(k, v, kv_cache, slot_mapping)
    ref_write_kv_cache(k.contiguous(), v.contiguous(), expected, slot_mapping)
    assert torch.equal(kv_cache, expected)


def test_write_rejects_int32_slots():
    k = torch.zeros(2, 1, 16, device=DEVICE)
    kv_cache = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="int64"):
        write_kv_cache(k, k, kv_cache, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
