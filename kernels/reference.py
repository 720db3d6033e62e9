"""Pure-torch references of the Triton kernels, with the same signatures.

Written for clarity, not speed: plain loops over sequences and slots, fp32 math. Tests
compare every kernel against these; the torch attention back end may use them as well.

Cache layout (see services/executor/attention/base.py)::

    kv_cache        [2, num_blocks, block_size, num_kv_heads, head_dim]   # [0] keys, [1] values
    kv_cache_int8   same shape, int8
    kv_scales       [2, num_blocks, num_kv_heads] fp32: one scale per (K/V, block, KV head)
    kv_token_scales [2, num_blocks, block_size, num_kv_heads] fp32: one per (K/V, slot, KV head)
    slot = block_id * block_size + offset_in_block
"""
from __future__ import annotations

import torch

INT8_MAX = 127


def _gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor,
               seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first ``seq_len`` tokens, [seq_len, KVH, D] each."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table_row[:num_blocks].long()
    keys = kv_cache[0, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = kv_cache[1, block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention in fp32.

    q [n, H, D]; keys / values [L, KVH, D]; allowed [n, L] bool. Returns [n, H, D] fp32;
    a query row with no allowed key gets zeros.
    """
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [L, H, D]
    values = values.float().repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale  # [H, n, L]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: nan -> 0
    return torch.einsum("hnl,lhd->nhd", probs, values)


def ref_paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,  # accepted for signature parity; no effect
) -> torch.Tensor:  # [B, H, D]
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        keys, values = _gather_kv(kv_cache, block_tables[b], seq_len)
        allowed = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b:b + 1], keys, values, scale, allowed)[0].to(q.dtype)
    return out


def ref_paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], the chunks' own K/V already written
    block_tables: torch.Tensor,  # [P, MAXB] int32
    query_start_loc: torch.Tensor,  # [P + 1] int32
    context_lens: torch.Tensor,  # [P] int32
    seq_lens: torch.Tensor,  # [P] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, (context_len, seq_len) in enumerate(zip(context_lens.tolist(), seq_lens.tolist())):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys, values = _gather_kv(kv_cache, block_tables[i], seq_len)
        query_pos = context_len + torch.arange(end - start, device=q.device)  # absolute
        key_pos = torch.arange(seq_len, device=q.device)
        allowed = key_pos[None, :] <= query_pos[:, None]  # causal, prefix included
        out[start:end] = _attend(q[start:end], keys, values, scale, allowed).to(q.dtype)
    return out


def ref_write_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D], mutated
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: skip the token
) -> None:
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[0, slot // block_size, slot % block_size] = k[t]
        kv_cache[1, slot // block_size, slot % block_size] = v[t]


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (what the int8 kernel does)."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def ref_quantize_kv_blocks(
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D] fp16/bf16/fp32
    block_ids: torch.Tensor,  # [N] int32
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8, mutated (listed blocks)
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32, mutated (listed blocks)
) -> None:
    """Symmetric int8 per (K/V, block, KV head): scale = absmax / 127, q = round(x / scale)."""
    for block in block_ids.tolist():
        for kv in range(2):
            x = kv_cache[kv, block].float()  # [BS, KVH, D]
            scale = x.abs().amax(dim=(0, 2)) / INT8_MAX  # [KVH]
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            quant = round_half_away(x / safe[None, :, None]).clamp(-INT8_MAX, INT8_MAX)
            kv_cache_int8[kv, block] = quant.to(torch.int8)
            kv_scales[kv, block] = scale


def ref_dequantize_kv_blocks(
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32
    block_ids: torch.Tensor,  # [N] int32
    kv_cache: torch.Tensor,  # [2, NB, BS, KVH, D] fp16/bf16/fp32, mutated (listed blocks)
) -> None:
    for block in block_ids.tolist():
        for kv in range(2):
            x = kv_cache_int8[kv, block].float() * kv_scales[kv, block][None, :, None]
            kv_cache[kv, block] = x.to(kv_cache.dtype)


def ref_paged_decode_attention_int8(
    q: torch.Tensor,  # [B, H, D]
    kv_cache_int8: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, KVH] fp32
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,  # accepted for signature parity; no effect
) -> torch.Tensor:  # [B, H, D]
    """Decode attention over the fp32 dequantisation of the int8 cache."""
    kv_cache = kv_cache_int8.float() * kv_scales[:, :, None, :, None]  # [2, NB, BS, KVH, D]
    return ref_paged_decode_attention(q.float(), kv_cache, block_tables, seq_lens,
                                      scale).to(q.dtype)


def ref_write_kv_cache_int8(
    k: torch.Tensor,  # [T, KVH, D] fp16/bf16/fp32
    v: torch.Tensor,  # [T, KVH, D]
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8, mutated
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32, mutated
    slot_mapping: torch.Tensor,  # [T] int64; slot < 0: skip the token
) -> None:
    """Symmetric int8 per (token, KV head): scale = absmax / 127, q = round_half_even(x / scale)."""
    block_size = kv_data.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        for kv, x in enumerate((k[t].float(), v[t].float())):  # [KVH, D]
            absmax = x.abs().amax(dim=1)
            scale = absmax / torch.full_like(absmax, INT8_MAX)  # IEEE division on every device
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            quant = torch.round(x / safe[:, None]).clamp(-INT8_MAX, INT8_MAX)  # ties to even
            kv_data[kv, slot // block_size, slot % block_size] = quant.to(torch.int8)
            kv_scales[kv, slot // block_size, slot % block_size] = scale


def ref_dequantize_kv_tokens(kv_data: torch.Tensor, kv_scales: torch.Tensor) -> torch.Tensor:
    """[2, NB, BS, KVH, D] fp32: the per-token int8 cache times its scales."""
    return kv_data.float() * kv_scales[..., None]


def ref_paged_decode_attention_int8_token(
    q: torch.Tensor,  # [B, H, D]
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32
    block_tables: torch.Tensor,  # [B, MAXB] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,  # accepted for signature parity; no effect
) -> torch.Tensor:  # [B, H, D]
    """Decode attention over the fp32 dequantisation of the per-token int8 cache."""
    return ref_paged_decode_attention(q.float(), ref_dequantize_kv_tokens(kv_data, kv_scales),
                                      block_tables, seq_lens, scale).to(q.dtype)


def ref_paged_prefill_attention_int8_token(
    q: torch.Tensor,  # [T, H, D]
    kv_data: torch.Tensor,  # [2, NB, BS, KVH, D] int8
    kv_scales: torch.Tensor,  # [2, NB, BS, KVH] fp32
    block_tables: torch.Tensor,  # [P, MAXB] int32
    query_start_loc: torch.Tensor,  # [P + 1] int32
    context_lens: torch.Tensor,  # [P] int32
    seq_lens: torch.Tensor,  # [P] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Prefill attention over the fp32 dequantisation of the per-token int8 cache."""
    return ref_paged_prefill_attention(q.float(), ref_dequantize_kv_tokens(kv_data, kv_scales),
                                       block_tables, query_start_loc, context_lens, seq_lens,
                                       scale).to(q.dtype)
