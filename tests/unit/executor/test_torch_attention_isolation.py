"""The torch attention back end's batched decode reads, for every row shorter than the
batch's longest, cache slots the row does not own: the stale slots of its last block and
block 0, the table's padding. Their probability is 0, but 0 * NaN is NaN, so one
request's non-finite K/V reached another request's output (found by the AVX2 attack
helper of 2026-12-02, comparing the native step against this path). A row's output must
depend on its own slots only."""
from __future__ import annotations

import math

import pytest
import torch

from services.executor.attention.base import AttentionMetadata
from services.executor.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4


def _step(cache: torch.Tensor, table: torch.Tensor, lens: list[int], q: torch.Tensor) -> torch.Tensor:
    backend = TorchAttentionBackend(HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM))
    slots = torch.tensor([int(table[r, (n - 1) // BS]) * BS + (n - 1) % BS for r, n in enumerate(lens)])
    k_new = cache[0].view(-1, KV_HEADS, DIM)[slots].clone()  # rewrite what is there: the cache stays as set up
    v_new = cache[1].view(-1, KV_HEADS, DIM)[slots].clone()
    return backend.forward(q, k_new, v_new, cache, AttentionMetadata.decode_only(slots, table, lens))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["stale_slot_of_own_block", "padding_block_0"])
def test_a_short_row_never_reads_another_requests_values(poison, where):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((2, 8, BS, KV_HEADS, DIM), generator=gen)
    # row 0: 9 tokens over blocks 3, 5, 6 (block 6 holds 1 of its 4 slots); row 1: 3 tokens
    # in block 2, its table padded with block 0 where row 0 has blocks
    table = torch.tensor([[3, 5, 6], [2, 0, 0]], dtype=torch.int32)
    lens = [9, 3]
    q = torch.randn((2, HEADS, DIM), generator=gen)
    clean = _step(cache.clone(), table, lens, q)
    poisoned = cache.clone()
    if where == "stale_slot_of_own_block":
        poisoned[:, 2, 3] = poison  # the slot after row 1's last token: left by an earlier owner
    else:
        poisoned[:, 0] = poison  # block 0: another request's, here all non-finite
    got = _step(poisoned, table, lens, q)
    assert torch.isfinite(got[1]).all(), "row 1 read values it does not own"
    torch.testing.assert_close(got[1], clean[1])
    torch.testing.assert_close(got[0], clean[0])  # row 0 owns none of them either


def test_a_rows_own_non_finite_value_still_shows():
    """The mask only covers slots past a row's end: its own NaN is its own result."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn((2, 8, BS, KV_HEADS, DIM), generator=gen)
    table = torch.tensor([[3, 5, 6], [2, 0, 0]], dtype=torch.int32)
    cache[1, 2, 0] = float("nan")  # row 1's first token's value
    got = _step(cache, table, [9, 3], torch.randn((2, HEADS, DIM), generator=gen))
    assert torch.isnan(got[1]).all()
    assert torch.isfinite(got[0]).all()
