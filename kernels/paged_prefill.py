"""Paged prefill attention: chunks of new query tokens over each sequence's paged cache.

NOTE. Sequence i contributes the queries q[query_start_loc[i] : query_start_loc[i+1]],
which sit at absolute positions context_len[i] .. seq_len[i]-1 of that sequence. Their
own K/V were written to the cache before this call, so every key and value, the cached
prefix and the chunk alike, is read from the paged cache; query j attends to keys
0 .. context_len + j (the whole prefix, then causally within the chunk).

One program handles BLOCK_Q query tokens of one sequence for all GROUP query heads of
one KV head, packed as the BLOCK_M = BLOCK_Q * GROUP (padded) rows of a flash-attention
tile, so K/V tiles are read once per GQA group::

    row r  ->  token  q_block * BLOCK_Q + r // GROUP,   head  kv_head * GROUP + r % GROUP

The grid has no host sync: q blocks are numbered globally, sequence i owning blocks
from  query_start_loc[i] // BLOCK_Q + i  on, which leaves room for its
cdiv(query_len, BLOCK_Q) blocks; a program finds its sequence by binary search over that
bound, and programs past the end of their sequence's queries exit at once. The grid is
T // BLOCK_Q + P programs long, an upper bound of sum_i cdiv(query_len_i, BLOCK_Q).

With KV_INT8 the cache is int8 with one fp32 scale per (token, KV head), as in the
decode kernel: tiles are cast exactly to the dot dtype, the key scales multiply the
scores and the value scales the probabilities, which equals attending over the
dequantised cache without materialising it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_decode import LOG2E, is_interpreted, next_pow2, tile_dot


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first q block, query_start_loc[i] // BLOCK_Q + i, is <= q_block."""
    lo = num_seqs * 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])  # one prefill must not compile a variant
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D] q's dtype, or int8 when KV_INT8
    v_cache_ptr,  # [NB, BS, KVH, D] q's dtype, or int8 when KV_INT8
    k_scales_ptr,  # [NB, BS, KVH] fp32, read only when KV_INT8
    v_scales_ptr,  # [NB, BS, KVH] fp32, read only when KV_INT8
    block_tables_ptr,  # [P, MAXB] int32
    query_start_loc_ptr,  # [P + 1] int32
    context_lens_ptr,  # [P] int32
    seq_lens_ptr,  # [P] int32
    out_ptr,  # [T, H, D]
    qk_scale,  # float: softmax scale * log2(e)
    num_seqs,  # int: P
    stride_qt,
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
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows of a tile: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per loop iteration
    KV_INT8: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M)
    tl.static_assert(BLOCK_Q >= 1)
    tl.static_assert(BLOCK_M >= 16 and TILE_N >= 16 and HEAD_DIM >= 16)  # tl.dot minimums

    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    tok = local_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token within the chunk
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < query_len)
    rows = (q_start + tok).to(tl.int64)  # [BLOCK_M] token within the batch

    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]
    query_pos = context_len + tok  # [BLOCK_M] absolute position in the sequence

    # Keys past the last query of this program are never attended.
    last_tok = tl.minimum((local_block + 1) * BLOCK_Q, query_len) - 1
    kv_end = tl.minimum(context_len + last_tok + 1, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_btb

    for tile in range(0, tl.cdiv(kv_end, TILE_N)):
        pos = tile * TILE_N + offs_n  # [TILE_N] key positions
        kv_mask = pos < kv_end
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko
                    + kv_head * stride_kh + offs_d[:, None],
                    mask=kv_mask[None, :], other=0.0)  # [D, TILE_N]
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                    + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask[:, None], other=0.0)  # [TILE_N, D]

        if KV_INT8:
            # Exact casts (straight to fp32 for an fp32 dot: the interpreter's int8 -> bf16
            # cast is wrong); the per-token scales are folded in below.
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
            x = tile_dot(q, k, DOT_FP32) * qk_scale  # [BLOCK_M, TILE_N]
        allowed = kv_mask[None, :] & (pos[None, :] <= query_pos[:, None])
        x = tl.where(allowed, x, float("-inf"))

        # Tile 0 holds key 0, allowed for every row, so m_i is finite from then on and a
        # row whose keys in a later tile are all masked gets p = 0, never nan.
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(x - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_INT8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_tiles(group: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, TILE_N) for a GQA group size: untuned defaults, see docs/kernels.md."""
    if is_interpreted():
        return max(16, next_pow2(group)), 16  # tiny tiles: tests exercise many programs
    if dtype == torch.float32:
        return max(16, next_pow2(group)), 16  # the IEEE fp32 dot spills past 16 x 16 (D 128)
    return max(64 if group <= 4 else 128, next_pow2(group)), 64


def check_prefill_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                         seq_lens: torch.Tensor) -> None:
    """Assert the shapes, dtypes and strides the prefill kernel relies on (not the cache dtype)."""
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        f"kv_cache must be [2, NB, BS, KVH, D], got {tuple(kv_cache.shape)}"
    _, num_heads, head_dim = q.shape
    _, _, _, num_kv_heads, cache_head_dim = kv_cache.shape
    num_seqs = block_tables.shape[0]
    assert cache_head_dim == head_dim, f"head_dim mismatch: q {head_dim}, cache {cache_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, \
        f"head_dim must be a power of two >= 16, got {head_dim}"
    assert num_heads % num_kv_heads == 0, f"H ({num_heads}) not a multiple of KVH ({num_kv_heads})"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q dtype {q.dtype}"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be the unit-stride dim"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 \
        and block_tables.stride(1) == 1, "block_tables must be [P, MAXB] int32, unit inner stride"
    for name, t, n in (("query_start_loc", query_start_loc, num_seqs + 1),
                       ("context_lens", context_lens, num_seqs), ("seq_lens", seq_lens, num_seqs)):
        assert t.dtype == torch.int32 and t.shape == (n,) and t.is_contiguous(), \
            f"{name} must be [{n}] int32 contiguous, got {t.dtype} {tuple(t.shape)}"
    for t in (kv_cache, block_tables, query_start_loc, context_lens, seq_lens):
        assert t.device == q.device, f"all inputs must be on {q.device}, got {t.device}"


def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                   block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                   context_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   out: torch.Tensor | None) -> torch.Tensor:
    """Shared launcher of the fp and int8 prefill kernels; inputs already checked.

    k_cache / v_cache: [NB, BS, KVH, D] views; k_scales / v_scales: [NB, BS, KVH] fp32 when
    the caches are int8, else None.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    kv_int8 = k_cache.dtype == torch.int8
    if kv_int8:
        assert k_scales is not None and v_scales is not None
        assert k_scales.shape == v_scales.shape == k_cache.shape[:3]
        k_scales_arg, v_scales_arg = k_scales, v_scales
    else:
        k_scales_arg = v_scales_arg = seq_lens  # never read: any valid pointer
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_m, tile_n = prefill_tiles(group, q.dtype)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    dot_fp32 = q.dtype == torch.float32 or is_interpreted()
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scales_arg, v_scales_arg, block_tables, query_start_loc,
        context_lens, seq_lens, out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(k_scales_arg.stride() if kv_int8 else (0, 0, 0)),
        *(v_scales_arg.stride() if kv_int8 else (0, 0, 0)),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, KV_INT8=kv_int8,
        DOT_FP32=dot_fp32,
        # int8 tiles upcast for an fp32 dot spill registers when pipelined (sm_90: 255 + stack)
        num_warps=4 if block_m <= 64 else 8, num_stages=1 if kv_int8 and dot_fp32 else 2,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], q's dtype; the chunks' K/V already in it
    block_tables: torch.Tensor,  # [P, MAXB] int32
    query_start_loc: torch.Tensor,  # [P + 1] int32, query_start_loc[0] == 0, [P] == T
    context_lens: torch.Tensor,  # [P] int32: tokens cached before each chunk
    seq_lens: torch.Tensor,  # [P] int32: context_lens + chunk lengths
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]: written in place when given
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each chunk's queries over its sequence's cached prefix and itself.

    Reads ``kv_cache``; mutates nothing but ``out``. Never syncs with the host.
    """
    check_prefill_inputs(q, kv_cache, block_tables, query_start_loc, context_lens, seq_lens)
    assert kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}"
    return launch_prefill(q, kv_cache[0], kv_cache[1], None, None, block_tables, query_start_loc,
                          context_lens, seq_lens, scale, out)
