"""Symmetric int8 KV cache: one scale per (K/V, block, KV head).

NOTE. The int8 rung of the degradation ladder halves (fp16/bf16) the bytes a cache block
holds. Quantisation is per block and per KV head, so a block is quantised once, when it
is full and will not change, and outliers in one head or one block do not cost the
others their precision::

    scale[kv, block, h] = max |x[kv, block, :, h, :]| / 127
    q = clamp(round_half_away(x / scale), -127, 127)           (scale 0: q = 0)
    x ~ q * scale,   |x - q * scale| <= scale / 2

Divisions are IEEE-rounded (div_rn) so the kernel matches the torch reference bit for
bit. Decode attention reads the int8 cache directly (kernels.paged_decode with KV_INT8):
int8 values are exact in fp16/bf16, and the scales are folded into the scores and the
probabilities instead of dequantised tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_decode import check_decode_inputs, launch_decode, next_pow2

INT8_MAX = tl.constexpr(127.0)  # a constexpr global: the only kind a compiled kernel may read


@triton.jit
def _quantize_kernel(
    src_ptr,  # [2, NB, BS, KVH, D] fp16/bf16/fp32
    block_ids_ptr,  # [N] int32
    dst_ptr,  # [2, NB, BS, KVH, D] int8
    scales_ptr,  # [2, NB, KVH] fp32
    stride_src_kv,
    stride_src_b,
    stride_src_o,
    stride_src_h,
    stride_dst_kv,
    stride_dst_b,
    stride_dst_o,
    stride_dst_h,
    stride_sc_kv,
    stride_sc_b,
    stride_sc_h,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_SIZE_PAD: tl.constexpr,  # BLOCK_SIZE padded to a power of two
    HEAD_DIM: tl.constexpr,
):
    tl.static_assert(BLOCK_SIZE <= BLOCK_SIZE_PAD)
    i = tl.program_id(0)
    head = tl.program_id(1)
    kv = tl.program_id(2).to(tl.int64)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    offs_o = tl.arange(0, BLOCK_SIZE_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_o[:, None] < BLOCK_SIZE

    x = tl.load(src_ptr + kv * stride_src_kv + block * stride_src_b + offs_o[:, None] * stride_src_o
                + head * stride_src_h + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.math.div_rn(absmax, INT8_MAX)
    safe_scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, tl.zeros_like(x) + safe_scale)
    quant = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))  # ties away from zero
    quant = tl.minimum(tl.maximum(quant, -INT8_MAX), INT8_MAX)
    tl.store(dst_ptr + kv * stride_dst_kv + block * stride_dst_b + offs_o[:, None] * stride_dst_o
             + head * stride_dst_h + offs_d[None, :], quant.to(tl.int8), mask=mask)
    tl.store(scales_ptr + kv * stride_sc_kv + block * stride_sc_b + head * stride_sc_h, scale)


@triton.jit
def _dequantize_kernel(
    src_ptr,  # [2, NB, BS, KVH, D] int8
    scales_ptr,  # [2, NB, KVH] fp32
    block_ids_ptr,  # [N] int32
    dst_ptr,  # [2, NB, BS, KVH, D] fp16/bf16/fp32
    stride_src_kv,
    stride_src_b,
    stride_src_o,
    stride_src_h,
    stride_sc_kv,
    stride_sc_b,
    stride_sc_h,
    stride_dst_kv,
    stride_dst_b,
    stride_dst_o,
    stride_dst_h,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    tl.static_assert(BLOCK_SIZE <= BLOCK_SIZE_PAD)
    i = tl.program_id(0)
    head = tl.program_id(1)
    kv = tl.program_id(2).to(tl.int64)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    offs_o = tl.arange(0, BLOCK_SIZE_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_o[:, None] < BLOCK_SIZE

    quant = tl.load(src_ptr + kv * stride_src_kv + block * stride_src_b + offs_o[:, None] * stride_src_o
                    + head * stride_src_h + offs_d[None, :], mask=mask, other=0)
    scale = tl.load(scales_ptr + kv * stride_sc_kv + block * stride_sc_b + head * stride_sc_h)
    x = quant.to(tl.float32) * scale
    tl.store(dst_ptr + kv * stride_dst_kv + block * stride_dst_b + offs_o[:, None] * stride_dst_o
             + head * stride_dst_h + offs_d[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


def _check_block_args(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      kv_cache_int8: torch.Tensor, kv_scales: torch.Tensor) -> None:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        f"kv_cache must be [2, NB, BS, KVH, D], got {tuple(kv_cache.shape)}"
    assert kv_cache.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"kv_cache dtype {kv_cache.dtype}"
    assert kv_cache_int8.shape == kv_cache.shape and kv_cache_int8.dtype == torch.int8, \
        f"kv_cache_int8 must be int8 {tuple(kv_cache.shape)}, got {kv_cache_int8.dtype} {tuple(kv_cache_int8.shape)}"
    _, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert kv_scales.shape == (2, num_blocks, num_kv_heads) and kv_scales.dtype == torch.float32, \
        f"kv_scales must be [2, {num_blocks}, {num_kv_heads}] fp32, got {kv_scales.dtype} {tuple(kv_scales.shape)}"
    assert kv_cache.stride(-1) == 1 and kv_cache_int8.stride(-1) == 1, \
        "head_dim must be the unit-stride dim"
    assert block_ids.dtype == torch.int32 and block_ids.dim() == 1 and block_ids.is_contiguous(), \
        f"block_ids must be [N] int32 contiguous, got {block_ids.dtype} {tuple(block_ids.shape)}"
    for t in (block_ids, kv_cache_int8, kv_scales):
        assert t.device == kv_cache.device, f"all inputs must be on {kv_cache.device}, got {t.device}"


def quantize_kv_blocks(
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D] fp16/bf16/fp32
    block_ids: torch.Tensor,  # [N] int32
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8; mutated (listed blocks)
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32; mutated (listed blocks)
) -> None:
    """Quantise the listed blocks of ``kv_cache`` into ``kv_cache_int8`` / ``kv_scales``.

    Reads ``kv_cache``; writes only the listed blocks' rows of the int8 cache and scales.
    """
    _check_block_args(kv_cache, block_ids, kv_cache_int8, kv_scales)
    if block_ids.numel() == 0:
        return
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    _quantize_kernel[(block_ids.numel(), num_kv_heads, 2)](
        kv_cache, block_ids, kv_cache_int8, kv_scales,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache_int8.stride(0), kv_cache_int8.stride(1), kv_cache_int8.stride(2),
        kv_cache_int8.stride(3),
        kv_scales.stride(0), kv_scales.stride(1), kv_scales.stride(2),
        BLOCK_SIZE=block_size, BLOCK_SIZE_PAD=next_pow2(block_size), HEAD_DIM=head_dim,
        num_warps=4 if block_size * head_dim >= 2048 else 1,
    )


def dequantize_kv_blocks(
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32
    block_ids: torch.Tensor,  # [N] int32
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D] fp16/bf16/fp32; mutated (listed blocks)
) -> None:
    """Write q * scale of the listed int8 blocks into ``kv_cache``; mutates only those blocks."""
    _check_block_args(kv_cache, block_ids, kv_cache_int8, kv_scales)
    if block_ids.numel() == 0:
        return
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    _dequantize_kernel[(block_ids.numel(), num_kv_heads, 2)](
        kv_cache_int8, kv_scales, block_ids, kv_cache,
        kv_cache_int8.stride(0), kv_cache_int8.stride(1), kv_cache_int8.stride(2),
        kv_cache_int8.stride(3),
        kv_scales.stride(0), kv_scales.stride(1), kv_scales.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, BLOCK_SIZE_PAD=next_pow2(block_size), HEAD_DIM=head_dim,
        num_warps=4 if block_size * head_dim >= 2048 else 1,
    )


def paged_decode_attention_int8(
    q: torch.Tensor,  # [B, H, D] fp16/bf16/fp32
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]: written in place when given
) -> torch.Tensor:  # [B, H, D], q's dtype
    """Decode attention straight from the int8 cache (see kernels.paged_decode).

    Equals paged_decode_attention over the dequantised cache up to rounding; reads the
    caches, mutates nothing but ``out``.
    """
    check_decode_inputs(q, kv_cache_int8, block_tables, seq_lens)
    assert kv_cache_int8.dtype == torch.int8, f"kv_cache_int8 dtype {kv_cache_int8.dtype}"
    _, num_blocks, _, num_kv_heads, _ = kv_cache_int8.shape
    assert kv_scales.shape == (2, num_blocks, num_kv_heads) and kv_scales.dtype == torch.float32, \
        f"kv_scales must be [2, {num_blocks}, {num_kv_heads}] fp32, got {kv_scales.dtype} {tuple(kv_scales.shape)}"
    assert kv_scales.device == q.device
    block_size = kv_cache_int8.shape[2]
    k_scales, v_scales = (kv_scales[i][:, None, :].expand(-1, block_size, -1) for i in range(2))
    return launch_decode(q, kv_cache_int8[0], kv_cache_int8[1], k_scales, v_scales,
                         block_tables, seq_lens, scale, num_splits, out)
