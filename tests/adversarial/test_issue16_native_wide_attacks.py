"""Issue 16, attacks on the wide tiles of the native multi-row decode (7f29a04,
decode_batch.c, AVX2 builds without AVX-512): a step of R > STREAM_MAX_ROWS (6) rows sends
every GEMM to ``gemm_wide_for`` and the MLP's gate/up to ``gate_up_wide_for``. Each OpenMP
thread walks its contiguous range of weight rows two adjacent rows at a time (``wide_dots``:
both weight chunks pinned in registers, an odd leftover row a 1-row tile), each tile against
the R activation rows in ceil(R / 6) near-equal passes (``wide_pass_start``: 7 -> 3 + 4,
13 -> 4 + 4 + 5, 16 -> 5 + 5 + 6), the next tile's rows prefetched per pass
(``wide_spread``), the last 8-float chunk of every row a masked load.

What is attacked, and how (every case deterministic, no timing):

1. The static kernels through the ctypes shim of native_kernel_shim.py
   (compiled from the real sources with the library's flags), with small-integer data so
   every dot product is exact in fp32 whatever the order: compared for EQUALITY against
   float64. Every R from 7 to 70 (every pass layout of 2..12 passes, primes, 6m +- 1) and
   R = 100..300; n around multiples of 2 * threads (odd leftover rows, single-row ranges,
   threads > n: empty ranges); k = 0..40 (k % 8 in 0..7, k < 8: the masked tails);
   ldx / ldy gaps of 0..13 floats, NaN in every ldx gap and around X and W, sentinels in
   every ldy gap and around Y; the residual added exactly once (accumulate = 1 into
   non-zero Y); the bias once; n = 0 (nothing written) and k = 0 (Y = bias); gate/up
   pairing (a gate row with its own up row) with NaN past the last up row.
2. Poison: a NaN / inf weight in any row j (including the odd leftover and the second
   row of a pinned pair) stays in output column j, a NaN activation row in any pass
   position stays in its own output row; the rest stay exact.
3. Bitwise determinism (AVX2 only, white-box by construction: each output is one FMA
   chain per lane and one hsum8): an output row depends only on its activation row, not
   on R, on its position in the batch or pass, on ldx, on the thread count or on repeated
   calls, for random (non-exact) data; the [1e8, 1, -1e8] pattern of
   test_issue16_native_streams_steps.py shows every output of R = 7..70 comes from the
   wide kernel; an OpenMP team smaller than asked (omp_set_dynamic) still covers every row.
4. Reads past the end (in a subprocess): weights, activations, bias, gate/up and outputs
   each ending right before (or starting right after) a PROT_NONE page, for k % 8 in 0..7,
   odd and even n, R = 7..20 and 64: a masked tail or a 1-row tile that loaded a second
   row would kill the child.
5. (test_issue16_native_wide_steps.py) The whole decode step (weft_decode_rows) against
   the torch forward at R = 7..20 for a llama (q/k/v/o bias) and a qwen2 (qkv bias,
   tied) tiny shape and thread counts 1..3;
   the step's logits and K/V bitwise independent of the other rows of the batch and of
   the thread count (AVX2); a NaN lm_head row on either row of a pair or on the odd
   leftover stays in its logit; 97 and 128 rows (past the engine's 64, which step_rows
   itself does not enforce); and the engine, native on, greedy token-for-token equal to
   the torch path (bench llama, small qwen2) with 16 requests finishing one per step
   (every native step size 16 down to 7 and below)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from tests.adversarial.native_kernel_shim import (  # noqa: F401  (fixtures, skip marks)
    GUARD, GUARD_PREAMBLE, INF, NAN, SENT, _avx2_streams_build, _exact_rows_case, _ints, _ptr, _silu_times,
    avx2_only, lib, pytestmark, run_guarded, shim, shim_path)
from tests.adversarial.test_issue16_native_streams_steps import CANCEL, _dynamic_team

WIDE_R = 6  # activation rows per pass (and STREAM_MAX_ROWS): R > 6 is the wide path


def _passes(R: int) -> list[int]:
    """The documented pass sizes: ceil(R / 6) near-equal passes (wide_pass_start)."""
    p = -(-R // WIDE_R)
    return [(q + 1) * R // p - q * R // p for q in range(p)]


def _sizes_around_pairs(threads: int) -> list[int]:
    """n around multiples of 2 * threads (each range even / odd: a 1-row leftover tile or
    not), a range of 1 row per thread, and fewer rows than threads."""
    t2 = 2 * threads
    return sorted({1, 2, 3, threads, threads + 1, t2 - 1, t2, t2 + 1, 2 * t2 + 1, 3 * t2 - 1, 13})


def _wide_case(shim, gen, n: int, k: int, R: int, threads: int, *, accumulate: bool = True, bias: bool = True,
               ldx_gap: int = 3, ldy_gap: int = 2) -> None:
    """The shim's exact GEMM case, its failure message naming the passes."""
    _exact_rows_case(shim, gen, n, k, R, threads, accumulate, bias, ldx_gap=ldx_gap, ldy_gap=ldy_gap,
                     note=f"passes={_passes(R)}")


def _gate_up_case(shim, gen, inter: int, H: int, R: int, threads: int) -> None:
    # integer g and u (exact dots), only SiLU's rounding left: a gate row paired with the
    # wrong up row, a row skipped or a pass lost is far outside 1e-5; NaN past the last up row
    gubuf = torch.full((2 * inter * H + GUARD,), NAN)
    gu = gubuf[:2 * inter * H].view(2 * inter, H)
    gu.copy_(_ints(gen, 2 * inter, H, lo=-2, hi=3))
    xbuf = torch.full((R * H + GUARD,), NAN)
    X = xbuf[:R * H].view(R, H)
    X.copy_(_ints(gen, R, H, lo=-2, hi=3))
    act = torch.full((R * inter + 16,), SENT)
    shim.shim_gate_up_rows(_ptr(gu), _ptr(X), _ptr(act), inter, H, R, threads)
    want = _silu_times(X.double() @ gu[:inter].double().T, X.double() @ gu[inter:].double().T)
    torch.testing.assert_close(act[:R * inter].view(R, inter).double(), want, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"threads={threads} R={R} inter={inter} H={H}: {m}")
    assert (act[R * inter:] == SENT).all(), f"threads={threads} R={R} inter={inter} H={H}: written past act"


def test_the_documented_pass_layouts_this_file_covers():
    # the R values below reach every pass count 2..12 and every pass size the wide path
    # can produce (3..6: a pass of 1 or 2 rows never happens past 6 rows)
    assert _passes(7) == [3, 4] and _passes(13) == [4, 4, 5] and _passes(16) == [5, 5, 6]
    sizes = {s for R in range(7, 71) for s in _passes(R)}
    assert sizes == {3, 4, 5, 6}
    assert {len(_passes(R)) for R in range(7, 71)} == set(range(2, 13))


# ---- 1. the kernels, exact -------------------------------------------------------------

K_CYCLE = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 23, 24, 26, 31, 32, 33, 38]  # every k % 8, k % 16, k < 8


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_wide_gemm_exact_for_every_row_count_7_to_70(shim, threads):
    gen = torch.Generator().manual_seed(1000 + threads)
    for R in range(7, 71):
        for i, n in enumerate(_sizes_around_pairs(threads)):
            j = R + 3 * i
            _wide_case(shim, gen, n, K_CYCLE[j % len(K_CYCLE)], R, threads, accumulate=j % 3 != 0,
                       bias=j % 2 == 0, ldx_gap=(0, 1, 3, 8)[j % 4], ldy_gap=(0, 2, 5)[j % 3])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_wide_gemm_exact_for_every_k_tail(shim, threads):
    gen = torch.Generator().manual_seed(1100 + threads)
    for R in (7, 13, 24, 31):
        for k in range(0, 41):  # k = 0: no chunk at all, Y = bias (+ Y0)
            for n in (1, 2, 3, 5, 2 * threads + 1, 8):
                _wide_case(shim, gen, n, k, R, threads, accumulate=(k + n) % 2 == 0, bias=True,
                           ldx_gap=(k * 7 + n) % 5, ldy_gap=n % 3)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_wide_gemm_exact_for_large_row_counts(shim, threads):
    gen = torch.Generator().manual_seed(1200 + threads)
    for R in (97, 100, 127, 128, 255, 256, 300):
        for n, k in ((1, 17), (3, 8), (7, 33), (2 * threads + 1, 5), (12, 31)):
            _wide_case(shim, gen, n, k, R, threads, accumulate=True, bias=R % 2 == 0, ldx_gap=R % 4, ldy_gap=1)


@pytest.mark.parametrize("threads", [4, 7, 9, 16])
def test_wide_gemm_more_threads_than_weight_rows(shim, threads):
    # most threads own no row (lo == hi) or a single one (a 1-row tile with no next tile);
    # each still reaches the barrier
    gen = torch.Generator().manual_seed(1300 + threads)
    for n in range(1, threads + 3):
        for R in (7, 13, 20):
            _wide_case(shim, gen, n, (3, 8, 17)[(n + R) % 3], R, threads, accumulate=True, bias=n % 2 == 1)


@pytest.mark.parametrize("threads", [1, 3])
def test_wide_gemm_no_rows_writes_nothing_and_no_columns_writes_the_bias(shim, threads):
    W, X = torch.full((64,), NAN), torch.full((13, 8), NAN)
    Y = torch.full((13, 9), SENT)
    shim.shim_gemm_rows(_ptr(W), None, _ptr(X), 8, _ptr(Y), 9, 0, 8, 13, 1, threads)  # n = 0
    assert (Y == SENT).all()
    b = torch.arange(7.0) - 3
    for accumulate in (0, 1):
        Y = torch.full((13, 9), SENT)
        Y[:, :7] = 10.0
        shim.shim_gemm_rows(_ptr(W), _ptr(b), _ptr(X), 8, _ptr(Y), 9, 7, 0, 13, accumulate, threads)  # k = 0
        assert torch.equal(Y[:, :7], b.expand(13, 7) + (10.0 if accumulate else 0.0)), f"acc={accumulate}"
        assert (Y[:, 7:] == SENT).all()


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_wide_gate_up_pairs_each_gate_row_with_its_own_up_row(shim, threads):
    gen = torch.Generator().manual_seed(1400 + threads)
    for R in [*range(7, 21), 25, 31, 37, 64, 100]:
        for inter in sorted({1, 2, 3, 2 * threads - 1, 2 * threads, 2 * threads + 1, 4 * threads + 3, 37}):
            _gate_up_case(shim, gen, inter, (1, 5, 8, 9, 16, 23, 31)[(R + inter) % 7], R, threads)


# ---- 2. poison stays where it belongs ---------------------------------------------------

@pytest.mark.parametrize("value", [NAN, INF])
def test_a_non_finite_weight_row_poisons_only_its_own_column_of_the_wide_tiles(shim, value):
    gen = torch.Generator().manual_seed(1500)
    for threads, n, k in ((1, 9, 7), (2, 14, 17), (2, 13, 9), (3, 11, 3), (3, 16, 24)):
        W = _ints(gen, n, k)
        X = _ints(gen, 17, k, lo=1, hi=4)  # no zero: inf * x stays inf
        for j in range(n):
            Wp = W.clone()
            Wp[j, (5 * j) % k] = value
            other = torch.arange(n) != j
            for R in (7, 13, 17):
                Xr = X[:R].contiguous()
                Y = torch.full((R, n), SENT)
                shim.shim_gemm_rows(_ptr(Wp), None, _ptr(Xr), k, _ptr(Y), n, n, k, R, 0, threads)
                ref = Xr.double() @ Wp.double().T
                assert torch.equal(Y[:, other].double(), ref[:, other]), \
                    f"threads={threads} n={n} k={k} R={R}: poison in weight row {j} leaked"
                assert not torch.isfinite(Y[:, j]).any(), f"R={R}: weight row {j} lost its {value}"
            # the same through gate/up: gate row j or up row j poisons act column j only
            for half in (0, n):
                gu = torch.cat([W, _ints(gen, n, k)])
                gu[half + j, (3 * j) % k] = value
                act = torch.full((13 * n,), SENT)
                Xg = X[:13].contiguous()
                shim.shim_gate_up_rows(_ptr(gu), _ptr(Xg), _ptr(act), n, k, 13, threads)
                act = act.view(13, n)
                assert not torch.isfinite(act[:, j]).any(), f"gate_up row {half + j}: lost its {value}"
                assert torch.isfinite(act[:, other]).all(), f"gate_up row {half + j}: poison leaked"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_nan_activation_row_in_any_pass_position_stays_in_its_row(shim, threads):
    gen = torch.Generator().manual_seed(1600 + threads)
    n, k = 2 * threads + 3, 19
    W = _ints(gen, n, k)
    for R in range(7, 20):
        X = _ints(gen, R, k)
        want = X.double() @ W.double().T
        for r in range(R):
            Xp = X.clone()
            Xp[r, (r * 5) % k] = NAN
            Y = torch.full((R, n), SENT)
            shim.shim_gemm_rows(_ptr(W), None, _ptr(Xp), k, _ptr(Y), n, n, k, R, 0, threads)
            rest = torch.arange(R) != r
            assert torch.isnan(Y[r]).all(), f"R={R} passes={_passes(R)}: row {r} lost its NaN"
            assert torch.equal(Y[rest].double(), want[rest]), f"R={R} passes={_passes(R)}: NaN row {r} leaked"


# ---- 3. bitwise: an output row depends on its activation row only ------------------------

def _gemm(shim, W: torch.Tensor, X: torch.Tensor, threads: int, ldx_gap: int = 0) -> torch.Tensor:
    R, k = X.shape
    n = W.shape[0]
    ldx = k + ldx_gap
    Xs = torch.full((R, ldx), NAN)
    Xs[:, :k] = X
    Y = torch.full((R, n), SENT)
    shim.shim_gemm_rows(_ptr(W), None, _ptr(Xs), ldx, _ptr(Y), n, n, k, R, 0, threads)
    return Y


def _gate_up(shim, gu: torch.Tensor, X: torch.Tensor, threads: int) -> torch.Tensor:
    R, H = X.shape
    inter = gu.shape[0] // 2
    Xs = X.contiguous()
    act = torch.full((R, inter), SENT)
    shim.shim_gate_up_rows(_ptr(gu), _ptr(Xs), _ptr(act), inter, H, R, threads)
    return act


@avx2_only
def test_wide_outputs_are_bitwise_independent_of_batch_position_stride_and_threads(shim):
    gen = torch.Generator().manual_seed(1700)
    n, k, pool = 37, 77, 90
    W = torch.randn(n, k, generator=gen)
    gu = torch.randn(2 * 29, k, generator=gen)
    X = torch.randn(pool, k, generator=gen)
    ref, ref_act = _gemm(shim, W, X, 1), _gate_up(shim, gu, X, 1)
    # random data: close to float64, not equal to it (so the bitwise checks below mean something)
    exact = X.double() @ W.double().T
    assert ((ref.double() - exact).abs() <= 1e-5 * (X.abs() @ W.abs().T).double()).all()
    assert not torch.equal(ref.double(), exact)
    for threads in (1, 2, 3, 5):
        for R in [*range(7, 41), 64]:
            idx = torch.randperm(pool, generator=gen)[:R]
            Y = _gemm(shim, W, X[idx], threads, ldx_gap=R % 5)
            assert torch.equal(Y, ref[idx]), f"threads={threads} R={R}: rows {idx.tolist()} changed bits"
            act = _gate_up(shim, gu, X[idx], threads)
            assert torch.equal(act, ref_act[idx]), f"threads={threads} R={R}: gate_up rows changed bits"
    for _ in range(3):  # and repeated calls
        assert torch.equal(_gemm(shim, W, X, 2), ref) and torch.equal(_gate_up(shim, gu, X, 2), ref_act)


@avx2_only
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_white_box_every_output_past_6_rows_comes_from_the_wide_kernel(shim, threads):
    # [1e8, 1, -1e8] . [1, 1, 1] is 1 in hsum8 order (the wide tiles, every output) and 0
    # in reduce8's (a full 3 x 4 half of the stream tiles): all ones proves no output of
    # R = 7..70 went through the streams
    for R in range(7, 71):
        for n in _sizes_around_pairs(threads):
            W, X, Y = torch.tensor(CANCEL).repeat(n, 1).contiguous(), torch.ones(R, 3), torch.full((R, n), SENT)
            shim.shim_gemm_rows(_ptr(W), None, _ptr(X), 3, _ptr(Y), n, n, 3, R, 0, threads)
            assert (Y == 1.0).all(), f"R={R} n={n}: {Y.tolist()}"


def test_a_smaller_team_than_asked_still_covers_every_wide_row(shim):
    gen = torch.Generator().manual_seed(1800)
    with _dynamic_team():
        for threads in (3, 9, 33):
            for n in (1, 7, 25, 73):
                for R in (7, 13, 64):
                    _wide_case(shim, gen, n, 17, R, threads, accumulate=True, bias=True)
                    _gate_up_case(shim, gen, n, 9, R, threads)


# ---- 4. no read past either end ----------------------------------------------------------

GUARD_PAGE_SCRIPT = GUARD_PREAMBLE + textwrap.dedent("""
    g = torch.Generator().manual_seed(0)
    ints = lambda *s: torch.randint(-3, 4, s, generator=g).float()
    wrong, done = [], 0
    for at_end in (True, False):
        for T in (1, 2, 3):
            for n in (1, 2, 3, 4, 5, 7):
                for k in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 24, 31):
                    W, b, gu = guarded(ints(n, k), at_end), guarded(ints(n), at_end), guarded(ints(2 * n, k), at_end)
                    for R in (7, 8, 11, 13, 19, 20, 64):
                        X = guarded(ints(R, k), at_end)
                        Y0 = ints(R, n)
                        Y = guarded(Y0, at_end)
                        shim.shim_gemm_rows(W.data_ptr(), b.data_ptr(), X.data_ptr(), k, Y.data_ptr(), n, n, k, R,
                                            1, T)
                        want = X.view(R, k).double() @ W.view(n, k).double().T + b.double() + Y0.double()
                        if not torch.equal(Y.view(R, n).double(), want):
                            wrong.append(("gemm", at_end, T, n, k, R))
                        A = guarded(torch.zeros(R * n), at_end)
                        shim.shim_gate_up_rows(gu.data_ptr(), X.data_ptr(), A.data_ptr(), n, k, R, T)
                        if not torch.isfinite(A).all():
                            wrong.append(("gate_up", at_end, T, n, k, R))
                        done += 1
    print("DONE", done, "WRONG", wrong)
""")


def test_no_wide_kernel_reads_before_or_past_its_operands(shim_path):
    out = run_guarded(GUARD_PAGE_SCRIPT, shim_path)
    assert "DONE 3528 WRONG []" in out, out[-2000:]
