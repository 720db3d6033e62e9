"""Attention over the paged cache with plain torch ops: the CPU back end.

Decodes are batched into one SDPA call (keys gathered through the block tables and
padded to the longest context, masked by length); each prefill chunk is one SDPA call
over its gathered prefix + itself with an offset-causal mask. A ``QuantizedKVCache``
quantises new rows on write and dequantises gathered blocks to the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.executor.attention.base import AttentionBackend, AttentionMetadata, QuantizedKVCache


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    produces_block_scores = True
    # The model runner's native decode-row attention (NativeDecoder.attend_rows) where it has
    # one: decode rows then read their contexts through the block tables in C instead of
    # being gathered into dense copies here. Used for fp32 caches when attention mass is not
    # being tracked; None: the gather path below.
    native_decode = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | QuantizedKVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if isinstance(kv_cache, QuantizedKVCache):
            block_size = kv_cache.block_size
            kv_cache.write(meta.slot_mapping, k, v)
        else:
            block_size = kv_cache.shape[2]
            flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)  # [2, slots, kvh, d]
            flat[0].index_copy_(0, meta.slot_mapping, k)
            flat[1].index_copy_(0, meta.slot_mapping, v)

        nd = meta.num_decodes
        if not meta.num_prefills:  # a decode-only step: its output is the result, no copy
            return self._decode(q, kv_cache, meta, block_size)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, block_size)
        self._prefill(q[nd:], k[nd:], v[nd:], kv_cache, meta, block_size, out[nd:])
        return out

    def _gather(self, kv_cache: torch.Tensor | QuantizedKVCache, block_tables: torch.Tensor,
                num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given block-table rows, [rows, kvh, num_blocks*block_size, d]
        (dequantised to the model dtype when the cache is int8)."""
        table = block_tables[:, :num_blocks].reshape(-1)
        rows = block_tables.shape[0]
        if isinstance(kv_cache, QuantizedKVCache):
            k, v = kv_cache.gather(0, table), kv_cache.gather(1, table)
        else:
            # index_select is ~50x cheaper than advanced indexing for this on CPU; one
            # call gathers keys and values together
            k, v = kv_cache.index_select(1, table).unbind(0)
        k = k.view(rows, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(rows, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        if (self.native_decode is not None and meta.block_scores is None
                and not isinstance(kv_cache, QuantizedKVCache) and q.dtype == torch.float32):
            return self.native_decode(kv_cache, q, meta.decode_block_tables, meta.decode_seq_lens)
        lens = meta.decode_seq_lens_host
        max_len = max(lens)
        k, v = self._gather(kv_cache, meta.decode_block_tables, -(-max_len // block_size))
        k, v = k[:, :, :max_len], v[:, :, :max_len]
        b = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        # One query per sequence: a plain batched matmul beats SDPA's CPU kernel here.
        qg = q.view(b, self.num_kv_heads, group, self.head_dim)  # [B, kvh, group, d]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # [B, kvh, group, L]
        if min(lens) != max_len:
            # [B, 1, 1, L]: True where the key position is past the sequence's end
            pad = (torch.arange(max_len, device=q.device) >= meta.decode_seq_lens.to(torch.long)[:, None])[:, None, None, :]
            scores = scores.masked_fill(pad, float("-inf"))
            # Past its end a row reads slots it does not own: stale ones in its last block
            # and block 0 (the table's padding), which other requests may hold. Their
            # probability is 0, but 0 * NaN is NaN: one request's non-finite values must not
            # reach another's output, so those values are zeroed (v is the gather's copy).
            v.masked_fill_(pad.transpose(-1, -2), 0.0)  # [B, 1, L, 1] over [B, kvh, L, d]
        probs = scores.softmax(-1)  # [B, kvh, group, L]
        if meta.block_scores is not None:
            _add_block_mass(meta.block_scores[:b], probs.sum((1, 2)), block_size)
        o = torch.matmul(probs, v)  # [B, kvh, group, d]
        return o.view(b, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata, block_size: int, out: torch.Tensor
    ) -> None:
        start = 0
        gqa = self.num_heads != self.num_kv_heads
        # a cache that holds the keys as written (not int8, not another dtype)
        exact = not isinstance(kv_cache, QuantizedKVCache) and kv_cache.dtype == k_new.dtype
        for i, (qlen, ctx) in enumerate(zip(meta.prefill_query_lens_host, meta.prefill_context_lens_host)):
            seq_len = ctx + qlen
            if ctx == 0 and exact:
                # A chunk with nothing cached before it attends to exactly the keys and values
                # it just wrote: read them from the projection, not back through the blocks.
                k = k_new[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, kvh, qlen, d]
                v = v_new[start : start + qlen].transpose(0, 1).unsqueeze(0)
            else:  # (an int8 cache attends to its dequantised copy, as its decodes will)
                k, v = self._gather(kv_cache, meta.prefill_block_tables[i : i + 1], -(-seq_len // block_size))
                k, v = k[:, :, :seq_len], v[:, :, :seq_len]
            qi = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, h, qlen, d]
            if ctx == 0:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
            else:
                # query j sits at position ctx + j and sees keys 0..ctx+j
                dev = q.device
                mask = torch.arange(seq_len, device=dev)[None, :] <= (torch.arange(qlen, device=dev)[:, None] + ctx)
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            out[start : start + qlen] = o[0].transpose(0, 1)
            if meta.block_scores is not None:
                # Observation window of one: the chunk's last query row, explicitly
                # (it sees every key), stands for the chunk's attention.
                last = q[start + qlen - 1].view(self.num_kv_heads, -1, self.head_dim)  # [kvh, group, d]
                probs = (torch.matmul(last, k[0].transpose(-1, -2)).float() * self.scale).softmax(-1)  # [kvh, group, L]
                _add_block_mass(meta.block_scores[meta.num_decodes + i : meta.num_decodes + i + 1],
                                probs.sum((0, 1))[None], block_size)
            start += qlen


def _add_block_mass(block_scores: torch.Tensor, mass: torch.Tensor, block_size: int) -> None:
    """Add per-key attention ``mass`` [rows, L] into ``block_scores`` [rows, max_blocks]
    (in place), summed per cache block: key j belongs to block-table entry j // block_size."""
    rows, length = mass.shape
    num_blocks = -(-length // block_size)
    padded = F.pad(mass.float(), (0, num_blocks * block_size - length))  # [rows, num_blocks * bs]
    block_scores[:, :num_blocks] += padded.view(rows, num_blocks, block_size).sum(-1)
