"""Int8 KV cache with one scale per (token slot, KV head): write, decode and prefill.

NOTE. This is the executor's int8 cache (``QuantizedKVCache`` in
services/executor/attention/base.py): a block fills one token at a time, so each new
token's K and V are quantised on their own, per KV head, and nothing is ever
requantised::

    data   [2, NB, BS, KVH, D] int8        scales [2, NB, BS, KVH] fp32
    scale[kv, slot, h] = max_d |x[kv, slot, h, d]| / 127
    q = clamp(round_half_even(x / scale), -127, 127)           (scale 0: q = 0)

The write kernel is bit-equal to ``quantize_int8`` (torch): both divisions are
IEEE-rounded (``div_rn``; plain ``/`` compiles to an approximate division) and ties
round to even, as ``torch.round`` does, computed exactly from floor and the fraction.
Decode and prefill are the kernels of paged_decode / paged_prefill with KV_INT8 and
scales of shape [NB, BS, KVH] (the per-block format of kernels.kv_int8 is the same
read path with an offset stride of 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache_write import check_write_inputs
from kernels.paged_decode import check_decode_inputs, launch_decode, next_pow2
from kernels.paged_prefill import check_prefill_inputs, launch_prefill

INT8_MAX = tl.constexpr(127.0)  # a constexpr global: the only kind a compiled kernel may read


@triton.jit
def _quantize_rows(x):
    """x [R, D] fp32 -> (q [R, D] fp32 holding integers, scale [R] fp32), as quantize_int8."""
    absmax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.math.div_rn(absmax, tl.zeros_like(absmax) + INT8_MAX)
    safe_scale = tl.where(scale > 0, scale, 1.0)  # scale 0 means x is all zeros: q = 0
    y = tl.math.div_rn(x, tl.zeros_like(x) + safe_scale[:, None])
    # Round half to even, exactly: a - floor(a) is exact for a >= 0 (Sterbenz).
    a = tl.abs(y)
    r = tl.floor(a)
    frac = a - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    q = tl.where(y < 0, -r, r)
    return tl.minimum(tl.maximum(q, -INT8_MAX), INT8_MAX), scale


@triton.jit
def _write_kv_int8_kernel(
    k_ptr,  # [T, KVH, D] fp16/bf16/fp32
    v_ptr,  # [T, KVH, D] k's dtype
    k_data_ptr,  # [NB, BS, KVH, D] int8
    v_data_ptr,  # [NB, BS, KVH, D] int8
    k_scales_ptr,  # [NB, BS, KVH] fp32
    v_scales_ptr,  # [NB, BS, KVH] fp32
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kdb,
    stride_kdo,
    stride_kdh,
    stride_vdb,
    stride_vdo,
    stride_vdh,
    stride_ksb,
    stride_kso,
    stride_ksh,
    stride_vsb,
    stride_vso,
    stride_vsh,
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
    head_mask = offs_h < NUM_KV_HEADS
    src = token.to(tl.int64)

    k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0).to(tl.float32)  # [KV_HEADS_PAD, D]
    v = tl.load(v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0).to(tl.float32)
    k_q, k_scale = _quantize_rows(k)
    v_q, v_scale = _quantize_rows(v)
    tl.store(k_data_ptr + block * stride_kdb + offset * stride_kdo + offs_h[:, None] * stride_kdh
             + offs_d[None, :], k_q.to(tl.int8), mask=head_mask[:, None])
    tl.store(v_data_ptr + block * stride_vdb + offset * stride_vdo + offs_h[:, None] * stride_vdh
             + offs_d[None, :], v_q.to(tl.int8), mask=head_mask[:, None])
    tl.store(k_scales_ptr + block * stride_ksb + offset * stride_kso + offs_h * stride_ksh,
             k_scale, mask=head_mask)
    tl.store(v_scales_ptr + block * stride_vsb + offset * stride_vso + offs_h * stride_vsh,
             v_scale, mask=head_mask)


def _check_int8_cache(kv_data: torch.Tensor, kv_scales: torch.Tensor) -> None:
    assert kv_data.dim() == 5 and kv_data.shape[0] == 2 and kv_data.dtype == torch.int8, \
        f"kv_data must be [2, NB, BS, KVH, D] int8, got {kv_data.dtype} {tuple(kv_data.shape)}"
    assert kv_scales.shape == kv_data.shape[:4] and kv_scales.dtype == torch.float32, \
        f"kv_scales must be {list(kv_data.shape[:4])} fp32, got {kv_scales.dtype} {tuple(kv_scales.shape)}"
    assert kv_data.stride(-1) == 1, "head_dim must be the unit-stride dim"
    assert kv_scales.device == kv_data.device, f"kv_scales on {kv_scales.device}, data on {kv_data.device}"


def write_kv_cache_int8(
    k: torch.Tensor,  # [T, KVH, D] fp16/bf16/fp32
    v: torch.Tensor,  # [T, KVH, D] k's dtype
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8; mutated
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32; mutated
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: skip the token
) -> None:
    """Quantise k[t] / v[t] per KV head into slot slot_mapping[t] (data and scale).

    Mutates only those slots; bit-equal to ``QuantizedKVCache.write``.
    """
    _check_int8_cache(kv_data, kv_scales)
    assert k.dtype in (torch.float16, torch.bfloat16, torch.float32), f"k / v dtype {k.dtype}"
    check_write_inputs(k, v, kv_data, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = kv_data.shape[2]
    if num_tokens == 0:
        return
    k_data, v_data, k_scales, v_scales = kv_data[0], kv_data[1], kv_scales[0], kv_scales[1]
    _write_kv_int8_kernel[(num_tokens,)](
        k, v, k_data, v_data, k_scales, v_scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_data.stride(0), k_data.stride(1), k_data.stride(2),
        v_data.stride(0), v_data.stride(1), v_data.stride(2),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        v_scales.stride(0), v_scales.stride(1), v_scales.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def paged_decode_attention_int8_token(
    q: torch.Tensor,  # [B, H, D] fp16/bf16/fp32
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32, the new token included
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]: written in place when given
) -> torch.Tensor:  # [B, H, D], q's dtype
    """paged_decode_attention over the dequantised per-token int8 cache, up to rounding.

    Reads the cache; mutates nothing but ``out``; never syncs with the host.
    """
    check_decode_inputs(q, kv_data, block_tables, seq_lens)
    _check_int8_cache(kv_data, kv_scales)
    return launch_decode(q, kv_data[0], kv_data[1], kv_scales[0], kv_scales[1],
                         block_tables, seq_lens, scale, num_splits, out)


def paged_prefill_attention_int8_token(
    q: torch.Tensor,  # [T, H, D] fp16/bf16/fp32
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8; the chunks' K/V already in it
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32
    block_tables: torch.Tensor,  # [P, MAXB] int32
    query_start_loc: torch.Tensor,  # [P + 1] int32
    context_lens: torch.Tensor,  # [P] int32
    seq_lens: torch.Tensor,  # [P] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]: written in place when given
) -> torch.Tensor:  # [T, H, D], q's dtype
    """paged_prefill_attention over the dequantised per-token int8 cache, up to rounding.

    Reads the cache; mutates nothing but ``out``; never syncs with the host.
    """
    check_prefill_inputs(q, kv_data, block_tables, query_start_loc, context_lens, seq_lens)
    _check_int8_cache(kv_data, kv_scales)
    return launch_prefill(q, kv_data[0], kv_data[1], kv_scales[0], kv_scales[1], block_tables,
                          query_start_loc, context_lens, seq_lens, scale, out)
