"""Token counts as KV blocks, the scheduler's one place for the arithmetic.

    num_blocks_spanned(n, bs) = ⌈n / bs⌉   blocks n tokens occupy on an executor (the last
                                           one partly filled): what a stream holds
    num_full_blocks(n, bs)    = ⌊n / bs⌋   blocks n tokens fill completely: what can be
                                           hashed, matched, kept or released

A block size below 1 (an executor that never said) counts as 1.
"""
from __future__ import annotations


def num_blocks_spanned(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // max(1, block_size))


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    return num_tokens // max(1, block_size)
