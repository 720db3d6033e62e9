"""The Triton attention back end: paged KV write, then decode and prefill kernels.

The kernels (``kernels/``) are imported on first use, so importing this module does not
import Triton. Without a CUDA device, TRITON_INTERPRET=1 is set before that import (the
interpreter reads it when the kernels are decorated), so the same code runs on CPU,
slowly: it is meant for tests, the torch back end is the CPU path.

A ``QuantizedKVCache`` (int8, one scale per slot and KV head) goes through the int8
kernels of ``kernels/kv_int8_token.py``: quantise on write, int8 tiles read directly by
the same decode and prefill kernels.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from services.executor.attention.base import AttentionBackend, AttentionMetadata, QuantizedKVCache


class TritonAttentionBackend(AttentionBackend):
    """Writes the step's K/V with one scatter kernel, then attends with two kernels.

    Tokens are laid out decodes first, then prefill chunks (see base.py): the first
    ``meta.num_decodes`` rows go to the split-K decode kernel, the rest to the varlen
    prefill kernel, each writing its rows of one output tensor in place.
    """

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernels: tuple[ModuleType, ModuleType, ModuleType, ModuleType] | None = None

    def _load_kernels(self) -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
        if self._kernels is None:
            if not torch.cuda.is_available():
                os.environ.setdefault("TRITON_INTERPRET", "1")
            from kernels import kv_cache_write, kv_int8_token, paged_decode, paged_prefill

            self._kernels = (kv_cache_write, paged_decode, paged_prefill, kv_int8_token)
        return self._kernels

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | QuantizedKVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at ``meta.slot_mapping`` in ``kv_cache`` and return attention output."""
        kv_cache_write, paged_decode, paged_prefill, kv_int8_token = self._load_kernels()
        num_decodes = meta.num_decodes
        if q.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(f"q is {tuple(q.shape)}, expected [T, {self.num_heads}, {self.head_dim}]")
        if q.shape[0] < num_decodes:
            raise ValueError(f"{q.shape[0]} tokens but {num_decodes} decodes")

        if isinstance(kv_cache, QuantizedKVCache):
            int8_cache = dict(kv_data=kv_cache.data, kv_scales=kv_cache.scales)
            kv_int8_token.write_kv_cache_int8(k, v, slot_mapping=meta.slot_mapping, **int8_cache)
            decode = functools.partial(kv_int8_token.paged_decode_attention_int8_token, **int8_cache)
            prefill = functools.partial(kv_int8_token.paged_prefill_attention_int8_token, **int8_cache)
        else:
            kv_cache_write.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
            decode = functools.partial(paged_decode.paged_decode_attention, kv_cache=kv_cache)
            prefill = functools.partial(paged_prefill.paged_prefill_attention, kv_cache=kv_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if num_decodes > 0:
            num_splits = None  # the kernel's bound: block-table width * block size
            if meta.decode_seq_lens_host:  # real lengths, known on the host for free
                num_splits = paged_decode.choose_num_splits(
                    num_decodes, self.num_kv_heads, max(meta.decode_seq_lens_host),
                    paged_decode.num_sms(q.device))
            decode(q[:num_decodes], block_tables=meta.decode_block_tables,
                   seq_lens=meta.decode_seq_lens, scale=self.scale, num_splits=num_splits,
                   out=out[:num_decodes])
        if meta.num_prefills > 0 and q.shape[0] > num_decodes:
            prefill(q[num_decodes:], block_tables=meta.prefill_block_tables,
                    query_start_loc=meta.prefill_query_start_loc,
                    context_lens=meta.prefill_context_lens, seq_lens=meta.prefill_seq_lens,
                    scale=self.scale, out=out[num_decodes:])
        return out
