"""Paged decode attention: one query token per sequence against its paged KV cache.

NOTE (flash-decoding). A decode step has one query row per (sequence, head). A grid of
one program per (sequence, KV head) leaves most SMs idle when the batch is small and the
context long, so each sequence's context is cut into ``num_splits`` ranges of KV tiles
(split-K). Kernel 1 computes, for each range s, a partial softmax over its keys: the
running max m_s, the sum l_s = sum_j 2^(x_j - m_s), and the unnormalised
acc_s = sum_j 2^(x_j - m_s) * v_j. Kernel 2 merges the ranges exactly:

    M = max_s m_s      L = sum_s l_s * 2^(m_s - M)      out = sum_s acc_s * 2^(m_s - M) / L

With one split, kernel 1 normalises and stores ``out`` itself and kernel 2 is skipped.
Scores are kept in base 2 (x = q.k * scale * log2(e)) so every exponential is an exp2.

All query heads of one KV head (GQA group) are processed by one program, as the rows of
one ``tl.dot``, so each K/V tile is read from memory once per group, not once per head.

Index math of one program (sequence b, KV head g, split s)::

    tokens of b     0 ............................................ seq_len-1
    KV tiles        | tile 0 | tile 1 |  ...  | tile n-1 |          TILE_N tokens each
    split s         tiles [s*tps, min((s+1)*tps, n))                tps = cdiv(n, num_splits)
    token t     ->  block = block_tables[b, t // BLOCK_SIZE], offset = t % BLOCK_SIZE
    K[t, g, :]  at  k_cache + block*stride_kb + offset*stride_ko + g*stride_kh + [0, D)

``block * stride_kb`` is computed in int64: a cache of more than 2^31 elements is an
ordinary size (e.g. 8 GiB of bf16 keys).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Scores are scaled by log2(e) so the softmax can use exp2.
LOG2E = 1.4426950408889634
# Split-K heuristic knobs (see choose_num_splits and docs/kernels.md).
MIN_TOKENS_PER_SPLIT = 256
MAX_NUM_SPLITS = 32
# Programs per SM the split heuristic aims for (about two waves of the grid).
TARGET_PROGRAMS_PER_SM = 2
# SM count assumed when running on CPU under the Triton interpreter.
INTERPRETER_NUM_SMS = 8


@triton.jit
def tile_dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in fp32.

    DOT_FP32 upcasts both operands and asks for IEEE fp32 products: used for fp32 caches
    (tf32 would cost ~1e-3 relative error) and under the interpreter, whose bf16 dot is wrong.
    """
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D] fp16/bf16/fp32
    k_cache_ptr,  # [NB, BS, KVH, D] q's dtype, or int8 when KV_INT8
    v_cache_ptr,  # [NB, BS, KVH, D] q's dtype, or int8 when KV_INT8
    k_scales_ptr,  # [NB, BS, KVH] fp32 (per-block scales: offset stride 0), read only when KV_INT8
    v_scales_ptr,  # [NB, BS, KVH] fp32 (per-block scales: offset stride 0), read only when KV_INT8
    block_tables_ptr,  # [B, MAXB] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] q's dtype, written only when WRITE_OUT
    part_acc_ptr,  # [B, H, S, D] fp32, written only when not WRITE_OUT
    part_m_ptr,  # [B, H, S] fp32 (base-2 running max)
    part_l_ptr,  # [B, H, S] fp32 (sum of 2^(x - m))
    qk_scale,  # float: softmax scale * log2(e)
    num_splits,  # int: S
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_ksb,
    stride_kso,
    stride_ksh,
    stride_vsb,
    stride_vso,
    stride_vsh,
    stride_btb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the dot: GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # keys per loop iteration
    KV_INT8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WRITE_OUT: tl.constexpr,  # single split: normalise and store out directly
):
    tl.static_assert(GROUP <= GROUP_PAD)
    tl.static_assert(GROUP_PAD >= 16)  # tl.dot needs M >= 16 on GPU
    tl.static_assert(TILE_N >= 16)
    tl.static_assert(HEAD_DIM >= 16)

    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_r = tl.arange(0, GROUP_PAD)  # query head within the group
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    row_mask = offs_r < GROUP
    heads = kv_head * GROUP + offs_r  # [GROUP_PAD]

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # [GROUP_PAD, D]

    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb

    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n  # [TILE_N] token positions
        kv_mask = pos < seq_len
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        # K loaded transposed, [D, TILE_N], so the scores are one dot.
        k_ptrs = (k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko
                  + kv_head * stride_kh + offs_d[:, None])
        v_ptrs = (v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                  + kv_head * stride_vh + offs_d[None, :])
        k = tl.load(k_ptrs, mask=kv_mask[None, :], other=0.0)  # [D, TILE_N]
        v = tl.load(v_ptrs, mask=kv_mask[:, None], other=0.0)  # [TILE_N, D]

        if KV_INT8:
            # int8 values are exact in fp16/bf16/fp32, so the tiles are cast as they are and
            # the per-(token, head) scales are folded into the scores and the probabilities
            # (per-block scales are per-token scales with offset stride 0).
            # (Straight to fp32 for an fp32 dot: the interpreter's int8 -> bf16 cast is wrong.)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            else:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            k_scale = tl.load(k_scales_ptr + block * stride_ksb + offset * stride_kso
                              + kv_head * stride_ksh, mask=kv_mask, other=0.0)  # [TILE_N]
            v_scale = tl.load(v_scales_ptr + block * stride_vsb + offset * stride_vso
                              + kv_head * stride_vsh, mask=kv_mask, other=0.0)  # [TILE_N]
            x = tile_dot(q, k, DOT_FP32) * (k_scale[None, :] * qk_scale)
        else:
            x = tile_dot(q, k, DOT_FP32) * qk_scale  # [GROUP_PAD, TILE_N]
        x = tl.where(kv_mask[None, :], x, float("-inf"))

        # Every tile in range holds at least one valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(x - m_new[:, None])  # [GROUP_PAD, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_INT8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    if WRITE_OUT:
        # l_i == 0 only for an empty sequence (seq_len 0): its output is defined as 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # acc is 0 there too
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # Partials are laid out [B, H, S, D] contiguous, so the reduce reads S*D in a row.
        part_row = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_m_ptr + part_row, m_i, mask=row_mask)
        tl.store(part_l_ptr + part_row, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,  # [B, H, S, D] fp32
    part_m_ptr,  # [B, H, S] fp32
    part_l_ptr,  # [B, H, S] fp32
    out_ptr,  # [B, H, D]
    num_heads,  # int: H
    num_splits,  # int: S
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # S padded to a power of two
):
    tl.static_assert(SPLITS_PAD >= 1)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits

    part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part_row, mask=split_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part_row, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=split_mask[:, None], other=0.0)  # [SPLITS_PAD, D]

    # Splits that held no keys carry m = -inf: their weight is 2^-inf = 0. If every split
    # is empty (seq_len 0), use 0 as the max so no -inf - -inf = nan appears.
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [SPLITS_PAD]
    l_total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0)  # [D]
    out = out / tl.where(l_total > 0, l_total, 1.0)  # out is 0 when l_total is
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def is_interpreted() -> bool:
    """True when the kernels run under the Triton interpreter (TRITON_INTERPRET=1 at import).

    Launch configurations follow how a kernel executes, not where its tensors live: the
    interpreter gets small tiles and fp32 dots (its bf16 tl.dot is wrong).
    """
    return not isinstance(_decode_split_kernel, triton.JITFunction)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal count off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def choose_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int,
                      sm_count: int) -> int:
    """Split-K factor for a decode batch.

    Without splits the grid is batch_size * num_kv_heads programs. If that already fills
    the GPU, split nothing (the merge costs an extra pass). Otherwise split up to about
    TARGET_PROGRAMS_PER_SM programs per SM, but give every split at least
    MIN_TOKENS_PER_SPLIT keys so the partial writes and the merge stay small against the
    K/V reads, and never more than MAX_NUM_SPLITS.
    """
    programs = batch_size * num_kv_heads
    if programs >= sm_count or max_context_len <= MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = math.ceil(TARGET_PROGRAMS_PER_SM * sm_count / programs)
    by_work = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(wanted, by_work, MAX_NUM_SPLITS))


def decode_tile_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per loop iteration (untuned default; see docs/kernels.md)."""
    if is_interpreted() or dtype == torch.float32:
        # Short tiles keep split-K meaningful on the tiny interpreter tests, and keep the
        # fp32 (IEEE dot) variant free of register spills.
        return 16
    return 64 if head_dim <= 64 else 32


def check_decode_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
    """Assert the shapes, dtypes and strides the decode kernels rely on."""
    assert q.dim() == 3, f"q must be [B, H, D], got {tuple(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        f"kv_cache must be [2, NB, BS, KVH, D], got {tuple(kv_cache.shape)}"
    batch, num_heads, head_dim = q.shape
    _, _, _, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim, f"head_dim mismatch: q {head_dim}, cache {cache_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, \
        f"head_dim must be a power of two >= 16, got {head_dim}"
    assert num_heads % num_kv_heads == 0, f"H ({num_heads}) not a multiple of KVH ({num_kv_heads})"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q dtype {q.dtype}"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be the unit-stride dim"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, \
        f"block_tables must be [B, MAXB] int32, got {block_tables.dtype} {tuple(block_tables.shape)}"
    assert block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous(), \
        f"seq_lens must be [B] int32 contiguous, got {seq_lens.dtype} {tuple(seq_lens.shape)}"
    for t in (kv_cache, block_tables, seq_lens):
        assert t.device == q.device, f"all inputs must be on {q.device}, got {t.device}"


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  num_splits: int | None, out: torch.Tensor | None) -> torch.Tensor:
    """Shared launcher of the fp and int8 decode kernels; inputs already checked.

    k_cache / v_cache: [NB, BS, KVH, D] views (kv_cache[0], kv_cache[1]); k_scales /
    v_scales: [NB, BS, KVH] fp32 views when the caches are int8 (a per-block scale is
    expanded over the block's offsets with stride 0), else None.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    kv_int8 = k_cache.dtype == torch.int8
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    if num_splits is None:
        max_context_len = block_tables.shape[1] * block_size  # upper bound, no host sync
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, num_sms(q.device))
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    group = num_heads // num_kv_heads
    if kv_int8:
        assert k_scales is not None and v_scales is not None
        assert k_scales.shape == v_scales.shape == k_cache.shape[:3]
        k_scales_arg, v_scales_arg = k_scales, v_scales
    else:
        k_scales_arg = v_scales_arg = seq_lens  # never read: any valid pointer
    write_out = num_splits == 1
    if write_out:
        part_acc = part_m = part_l = out  # never written: any valid pointer
    else:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    dot_fp32 = q.dtype == torch.float32 or is_interpreted()
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scales_arg, v_scales_arg, block_tables, seq_lens,
        out, part_acc, part_m, part_l,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(k_scales_arg.stride() if kv_int8 else (0, 0, 0)),
        *(v_scales_arg.stride() if kv_int8 else (0, 0, 0)),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=decode_tile_n(head_dim, q.dtype),
        KV_INT8=kv_int8, DOT_FP32=dot_fp32, WRITE_OUT=write_out,
        # int8 tiles upcast for an fp32 dot spill registers when pipelined (sm_90: 255 + stack)
        num_warps=4, num_stages=1 if kv_int8 and dot_fp32 else 2,
    )
    if not write_out:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, out, num_heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_PAD=next_pow2(num_splits),
            num_warps=4,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], q's dtype
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32, the new token included
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]: written in place when given
) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's one query token over its ``seq_lens[b]`` cached keys.

    Reads ``kv_cache``; mutates nothing but ``out``. ``num_splits=None`` picks the split-K
    factor with ``choose_num_splits``; any value gives the same result up to rounding.
    Never syncs with the host, so it can be captured in a CUDA graph.
    """
    check_decode_inputs(q, kv_cache, block_tables, seq_lens)
    assert kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}"
    return launch_decode(q, kv_cache[0], kv_cache[1], None, None, block_tables, seq_lens,
                         scale, num_splits, out)
