"""Scatter a step's new keys and values into the paged KV cache.

One program per token: it reads the token's slot, and writes its [KVH, D] keys and
values to ``block = slot // BLOCK_SIZE``, ``offset = slot % BLOCK_SIZE``::

    k[t, :, :]  ->  k_cache + block*stride_cb + offset*stride_co + h*stride_ch + [0, D)

Slots are int64 and so is the address math: slot * (KVH * D) overflows int32 on large
caches. A negative slot (a padding token) writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_decode import next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [NB, BS, KVH, D] k's dtype
    v_cache_ptr,  # [NB, BS, KVH, D] v's dtype
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    tl.static_assert(NUM_KV_HEADS <= KV_HEADS_PAD)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_h[:, None] < NUM_KV_HEADS
    src = token.to(tl.int64)

    k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kco
             + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco
             + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def check_write_inputs(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What every KV write launcher needs of its inputs: k / v [T, KVH, D] of one dtype
    matching the cache's [2, NB, BS, KVH, D] heads (any cache dtype: the int8 writer shares
    it), a power-of-two unit-stride head_dim, slot_mapping [T] int64 contiguous, one device."""
    assert k.dim() == 3 and v.shape == k.shape, \
        f"k and v must both be [T, KVH, D], got {tuple(k.shape)} and {tuple(v.shape)}"
    num_tokens, num_kv_heads, head_dim = k.shape
    cache_kv_heads, cache_head_dim = cache.shape[3], cache.shape[4]
    assert (cache_kv_heads, cache_head_dim) == (num_kv_heads, head_dim), \
        f"k is [T, {num_kv_heads}, {head_dim}] but the cache holds [.., {cache_kv_heads}, {cache_head_dim}]"
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert k.dtype == v.dtype, f"dtypes differ: k {k.dtype}, v {v.dtype}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cache.stride(-1) == 1, \
        "head_dim must be the unit-stride dim"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,) \
        and slot_mapping.is_contiguous(), \
        f"slot_mapping must be [{num_tokens}] int64 contiguous, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
    for t in (v, cache, slot_mapping):
        assert t.device == k.device, f"all inputs must be on {k.device}, got {t.device}"


def write_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], k's dtype; mutated
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: skip the token
) -> None:
    """Store k[t] / v[t] at cache slot slot_mapping[t]; mutates only those slots."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        f"kv_cache must be [2, NB, BS, KVH, D], got {tuple(kv_cache.shape)}"
    assert k.dtype == kv_cache.dtype, f"dtypes differ: k {k.dtype}, cache {kv_cache.dtype}"
    check_write_inputs(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = kv_cache.shape[2]
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
