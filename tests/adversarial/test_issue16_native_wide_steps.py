"""Issue 16, attacks on the wide tiles of the native multi-row decode, layer 5 (layers 1-4,
the kernels through the shim, and what each layer does: test_issue16_native_wide_attacks.py):
the whole decode step (weft_decode_rows) against the torch forward at 7..20 rows, 97 and 128
rows, a NaN lm_head row on a wide tile, bitwise independence from the rest of the batch and
from the thread count, and the engine's greedy tokens with native decode on equal to the
torch path's at steps of 16 down to 7 rows."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.adversarial.native_kernel_shim import (  # noqa: F401  (skip marks)
    NAN, _avx2_streams_build, avx2_only, pytestmark)
from tests.adversarial.test_issue16_native_avx2_attacks import Case, _check
from tests.adversarial.test_issue16_native_engine_s25 import _run
from tests.adversarial.test_issue16_native_streams_steps import SHAPES, _model
from weft.testing.tiny_model import make_tiny_checkpoint


# ---- 5. the decode step and the engine ----------------------------------------------------

ARCHS = {"llama_qkvo_bias": ("llama", {"attention_bias": True}), "qwen2_qkv_bias_tied": ("qwen2", {})}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("shape", ["n_23_24_25", "k_below_8", "k_tail_5_and_9"])
def test_rows_step_matches_torch_for_7_to_20_rows(arch, shape):
    name, extra = ARCHS[arch]
    model = _model(name, {**SHAPES[shape], **extra}, seed=len(shape))
    for threads in (1, 2, 3):
        for R in range(7, 21):
            _check(Case(model, 4, [1 + (5 * r + R) % 31 for r in range(R)], seed=R + 50 * threads), threads=threads,
                   batch1=False)


def test_rows_step_matches_torch_past_the_engine_row_limit():
    # the engine never sends more than 64 rows (decoder.MAX_ROWS), but step_rows itself
    # takes any count: 97 (17 passes, the last 5 + 6 ...) and 128 rows
    model = _model("qwen2", SHAPES["k_tail_1_and_9"], seed=4)
    for R in (97, 128):
        _check(Case(model, 3, [1 + (11 * r) % 37 for r in range(R)], seed=R), threads=2, batch1=False)


@pytest.mark.parametrize("threads", [2, 3])
def test_nan_lm_head_row_on_a_wide_tile_stays_in_its_logit(threads):
    # vocab 217 over `threads` ranges: the first and second row of a pinned pair, the odd
    # leftover (1-row tile) and the row before it, at R = 7 (3 + 4), 13 (4 + 4 + 5), 20
    vocab = 217
    cols = set()
    for lo, hi in _ranges(vocab, threads):
        cols |= {lo, lo + 1, hi - 1, hi - 2}
    for col in sorted(cols)[:6]:
        model = _model("llama", SHAPES["multiples_of_36_and_54"], edits={"lm_head.weight": ((col, 11), NAN)})
        for R in (7, 13, 20):
            case = Case(model, 4, [2 + 3 * r for r in range(R)], seed=col + R)
            want, _ = case.torch_forward()
            got, _ = case.native_rows(threads)
            keep = torch.arange(vocab) != col
            assert torch.isnan(got[:, col]).all(), f"R={R}: logit {col} lost its NaN"
            assert torch.isfinite(got[:, keep]).all(), f"R={R}: the NaN of logit {col} leaked"
            torch.testing.assert_close(got[:, keep], want[:, keep], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"R={R} col {col}: {m}")


def _ranges(n: int, threads: int) -> list[tuple[int, int]]:
    """thread_rows: each OpenMP thread's contiguous range of the n weight rows."""
    return [(n * t // threads, n * (t + 1) // threads) for t in range(threads)]


def _sub_case(case: Case, rows: list[int]) -> Case:
    """The same rows (tokens, positions, slots, tables, caches) as a batch of their own."""
    sub = copy.copy(case)
    sub.lens = [case.lens[r] for r in rows]
    sub.table, sub.slots = case.table[rows].contiguous(), case.slots[rows].contiguous()
    sub.positions, sub.tokens = case.positions[rows].contiguous(), case.tokens[rows].contiguous()
    return sub


@avx2_only
@pytest.mark.parametrize("arch", list(ARCHS))
def test_rows_step_is_bitwise_independent_of_the_rest_of_the_batch_and_of_threads(arch):
    # past 6 rows every GEMM output is one per-lane FMA chain and one hsum8, attention and
    # the norms are per row: a row's logits and K/V are the same bits in any batch of 7+
    name, extra = ARCHS[arch]
    model = _model(name, {**SHAPES["k_tail_5_and_9"], **extra})
    case = Case(model, 4, [1 + (7 * r) % 31 for r in range(24)], seed=3)
    full, full_caches = case.native_rows(1)
    for threads in (1, 2, 3, 4):
        got, caches = case.native_rows(threads)
        assert torch.equal(got, full), f"threads={threads}: the 24-row step changed bits"
        assert all(torch.equal(a, b) for a, b in zip(caches, full_caches))
        for R in (7, 8, 12, 13, 17, 19):
            rows = sorted(torch.randperm(24, generator=torch.Generator().manual_seed(R))[:R].tolist())
            sub, sub_caches = _sub_case(case, rows).native_rows(threads)
            assert torch.equal(sub, full[rows]), f"threads={threads} R={R}: rows {rows} changed bits"
            for a, b in zip(sub_caches, full_caches):  # this batch's slots hold the full step's K/V
                for r in rows:
                    blk, off = divmod(int(case.slots[r]), case.bs)
                    assert torch.equal(a[:, blk, off], b[:, blk, off])


@pytest.mark.parametrize("preset,arch", [("bench", "llama"), ("small", "qwen2")])
def test_engine_greedy_native_equals_torch_at_16_down_to_7_rows(tmp_path, preset, arch):
    # 16 requests, one finishing per step: native steps of every size 16 down to 7
    checkpoint = make_tiny_checkpoint(tmp_path, preset, arch, seed=16)
    requests = [([(17 * i + 5 * j) % 4000 + 3 for j in range(2 + (7 * i) % 23)], 3 + i) for i in range(16)]
    native, rows, _ = _run(checkpoint, True, requests, {"max_num_seqs": 16})
    reference, _, _ = _run(checkpoint, False, requests, {"max_num_seqs": 16})
    assert native == reference
    assert set(range(7, 17)) <= set(rows), rows
