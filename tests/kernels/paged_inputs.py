"""Builders of paged-attention test inputs shared by the kernel tests.

Caches are random normal, block tables hand out distinct block ids in a shuffled order
(so no test passes because blocks happen to be contiguous), and table padding points at
real, random blocks (so a kernel that reads past a sequence's length gets garbage).
"""
from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

FP_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of a kernel's output against the fp32 reference, by the cache dtype. fp16 /
# bf16 kernels round the probabilities to that dtype before P @ V, as flash attention does.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def require_dtype(dtype: torch.dtype) -> None:
    """Skip (reported as skipped, never passed) fp16/bf16 cases off CUDA."""
    if dtype != torch.float32 and not ON_GPU:
        pytest.skip(f"{dtype} kernels are checked on CUDA only; the Triton interpreter "
                    "runs fp32 (its tl.dot is wrong for bf16)")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def boundary_lengths(block_size: int) -> list[int]:
    """Lengths around block edges plus a multi-block one: 1, BS-1, BS, BS+1, 3*BS+2."""
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 2})


def make_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim] random normal."""
    return randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                      gen: torch.Generator, extra_columns: int = 1) -> torch.Tensor:
    """[len(seq_lens), max_blocks] int32: distinct shuffled ids, random padding.

    ``extra_columns`` padding columns beyond the longest sequence make every row padded.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    assert sum(blocks_per_seq) <= num_blocks, "cache too small for these sequences"
    width = max(blocks_per_seq, default=0) + extra_columns
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    used = 0
    for row, n in enumerate(blocks_per_seq):
        table[row, :n] = order[used:used + n]
        used += n
    return table.to(dtype=torch.int32, device=DEVICE)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def query_start_loc(query_lens: list[int]) -> torch.Tensor:
    """[P + 1] int32 prefix sums of the chunk lengths."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return int32(starts)


def slots_of(block_table_row: torch.Tensor, positions: list[int], block_size: int) -> list[int]:
    """Cache slots of token positions of one sequence."""
    row = block_table_row.tolist()
    return [row[p // block_size] * block_size + p % block_size for p in positions]
