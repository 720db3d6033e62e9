"""The attention back-end contract: one interface, a torch CPU path and a Triton GPU path.

NOTE: there is no prefill phase nor decode phase in the engine step. One flat batch
of tokens goes through the model; the tokens are laid out decodes first, then the
prefill chunks, and this metadata tells a back end where each sequence's queries
sit and which cache blocks hold its keys and values.

Token layout of one step (``num_tokens = num_decodes + sum(prefill query lens)``)::

    | d0 | d1 | ... | d{D-1} | p0 chunk ......... | p1 chunk ... | ...
      one query per decode    query_start_loc[i] .. query_start_loc[i+1]

Paged KV cache of one layer (``kv_cache``)::

    [2, num_blocks, block_size, num_kv_heads, head_dim]     # [0] keys, [1] values
    slot = block_id * block_size + offset_in_block

A sequence's block table row lists its block ids in order; entries past the blocks it
owns are padding (any valid block id, never read because lengths bound the reads).

``kv_cache`` is either that tensor (the model dtype) or a ``QuantizedKVCache``: int8
data of the same shape plus one float32 scale per (slot, KV head)::

    data   [2, num_blocks, block_size, num_kv_heads, head_dim]   int8
    scales [2, num_blocks, block_size, num_kv_heads]             float32
    x[slot, h, :] ~= data[slot, h, :] * scales[slot, h]

Per-token scales let a block fill one token at a time without ever requantising it.
Both back ends read it: the torch one dequantises gathered blocks, the Triton one
(kernels/kv_int8_token.py) quantises on write and reads int8 tiles in its kernels.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs; built once per step by the model runner, shared by layers.

    Tensors live on the device of the KV cache. Valid only for the step they were built for.
    """

    # [num_tokens] int64: cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # Number of decode sequences (one query token each); they come first in the batch.
    num_decodes: int
    # [num_decodes, max_decode_blocks] int32: block tables of the decode sequences.
    decode_block_tables: torch.Tensor
    # [num_decodes] int32: context length of each decode sequence, its new token included.
    decode_seq_lens: torch.Tensor
    # Number of prefill (chunk) sequences, after the decodes.
    num_prefills: int
    # [num_prefills + 1] int32: start of each chunk's queries, relative to the first
    # prefill token (so query_start_loc[0] == 0).
    prefill_query_start_loc: torch.Tensor
    # [num_prefills] int32: tokens already in the cache before this chunk (prefix hits
    # and earlier chunks); the chunk's queries sit at positions context_len.. of the sequence.
    prefill_context_lens: torch.Tensor
    # [num_prefills] int32: context_len + chunk length.
    prefill_seq_lens: torch.Tensor
    # [num_prefills, max_prefill_blocks] int32: block tables of the prefill sequences.
    prefill_block_tables: torch.Tensor
    # Host-side copies of the per-prefill lengths, so CPU code need not sync on tensors.
    prefill_query_lens_host: tuple[int, ...] = ()
    prefill_context_lens_host: tuple[int, ...] = ()
    decode_seq_lens_host: tuple[int, ...] = ()
    # [num_decodes + num_prefills, max_blocks] float32, or None (KV compression off):
    # attention mass each sequence's queries put on each of its block-table entries,
    # summed over heads and layers. A back end that can adds to it in place (decodes:
    # every query; prefills: each chunk's last query); others leave it as it is.
    block_scores: torch.Tensor | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @classmethod
    def decode_only(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: list[int]) -> "AttentionMetadata":
        """A step of decodes only (no prefill chunk): what tests and benchmarks that call a
        model's forward pass directly build; the runner builds its own from the batch."""
        none = torch.zeros(0, dtype=torch.int32, device=block_tables.device)
        return cls(
            slot_mapping=slot_mapping, num_decodes=len(seq_lens), decode_block_tables=block_tables,
            decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=block_tables.device), num_prefills=0,
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=block_tables.device),
            prefill_context_lens=none, prefill_seq_lens=none,
            prefill_block_tables=torch.zeros((0, block_tables.shape[1]), dtype=torch.int32,
                                             device=block_tables.device),
            decode_seq_lens_host=tuple(seq_lens))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: ``(q, scale)`` with ``x ~= q * scale[..., None]``
    and ``|x - q * scale| <= scale / 2``; ``scale = amax(|x|) / 127`` (0 -> q = 0)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)  # [...] float32
    # A tensor divisor keeps the division IEEE-rounded on CUDA too (a Python-scalar divisor
    # becomes a multiplication by its reciprocal there), so the Triton write kernel
    # (kernels.kv_int8_token) matches this bit for bit on every device.
    scale = amax / torch.full_like(amax, 127.0)
    ratio = torch.where(scale[..., None] > 0, x32 / scale[..., None], 0.0)
    return ratio.round_().clamp_(-127, 127).to(torch.int8), scale  # round: ties to even


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale[..., None]`` in ``dtype``; the inverse of ``quantize_int8`` up to scale/2.
    The product is taken in float32 so a half-precision ``dtype`` rounds only once."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class QuantizedKVCache:
    """One layer's paged KV cache stored as int8 with a scale per (slot, KV head).

    The tensors are mutable (``write`` fills slots in place); the dataclass is not.
    """

    data: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim] int8
    scales: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads] float32
    dtype: torch.dtype  # what gathered keys/values dequantise to (the model's dtype)

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str) -> QuantizedKVCache:
        return cls(
            torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.int8, device=device),
            torch.zeros((2, num_blocks, block_size, num_kv_heads), dtype=torch.float32, device=device),
            dtype,
        )

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one block of one layer: int8 data plus float32 scales."""
        return 2 * block_size * num_kv_heads * (head_dim + torch.float32.itemsize)

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise ``k``/``v`` [num_tokens, kvh, d] into the slots ``slot_mapping`` names.
        Mutates those slots' data and scales only."""
        kvh, d = self.data.shape[3:]
        data = self.data.view(2, -1, kvh, d)  # [2, slots, kvh, d]
        scales = self.scales.view(2, -1, kvh)  # [2, slots, kvh]
        for i, x in enumerate((k, v)):
            q, scale = quantize_int8(x)
            data[i].index_copy_(0, slot_mapping, q)
            scales[i].index_copy_(0, slot_mapping, scale)

    def gather(self, kv: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Dequantised blocks ``block_ids`` of keys (kv=0) or values (kv=1),
        [len(block_ids), block_size, kvh, d] in ``self.dtype``. Reads only."""
        return dequantize_int8(self.data[kv].index_select(0, block_ids),
                               self.scales[kv].index_select(0, block_ids), self.dtype)


class AttentionBackend(abc.ABC):
    """Writes a layer's new K/V into the paged cache, then attends.

    ``forward`` mutates ``kv_cache`` (the slots named by ``meta.slot_mapping``; data and
    scales for a ``QuantizedKVCache``) and nothing else; it returns a new tensor.
    """

    name: str = "abstract"
    produces_block_scores: bool = False  # whether forward() fills meta.block_scores

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor | QuantizedKVCache,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at ``meta.slot_mapping`` in ``kv_cache`` and return attention output."""
