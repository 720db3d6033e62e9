"""Issue 16, attacks on the AVX2 stream partitioning of the native decode (7aa2370, 3b7ea7b,
b3788b9):

* decode.c (batch-1 step): ``gemv_for`` cuts each OpenMP thread's row range [lo, hi) into
  4 quarters and computes one row of each quarter at a time (``dot4``), the < 4 leftover
  rows with ``dot``; ``gate_up_for`` takes 2 gate rows and their 2 up rows the same way.
* decode_batch.c (multi-row step): for R <= 6 rows (STREAM_MAX_ROWS) a thread's range is
  cut into 6 parts (TILE_W) and a tile takes row i of each part (stride part * k), the
  < 6 leftover rows one adjacent tile; for R > 6 wide tiles (``gemm_wide_for``: 2
  adjacent rows, or the range's 1 leftover, against passes of <= 6 activation rows).

Three layers of attack (2 and 3: test_issue16_native_streams_steps.py; the fixtures of
both: native_kernel_shim.py):

1. ``weft_gemv`` (decode.c's exported GEMV, its own parallel region) through ctypes, and
   the static kernels themselves (``gemv_for`` with accumulate, ``gate_up_for``,
   ``gemm_rows_for``, ``gate_up_rows_for``) through a small shim (native_kernel_shim.py) compiled from the
   real sources with the library's own flags. Small-integer data make every dot product
   exact in fp32 whatever the summation order, so these compare for EQUALITY: a row
   skipped, written twice, added twice into the residual, given the wrong bias or read
   from the wrong stream shows up exactly. NaN guards around the weights and past each
   activation row (ldx gaps), sentinels around and between the outputs (ldy gaps), and
   weights / activations ending right before a PROT_NONE page (in a subprocess, so an
   over-read is a failed test, not a dead run).
2. White-box guards (AVX2 builds without AVX-512 only): a row [1e8, 1, -1e8] sums to 1 in
   ``dot4`` / ``hsum8`` order and to 0 in ``dot``'s scalar-tail (and ``reduce8``'s) order,
   so each output reveals which kernel computed it. The pattern must be exactly the
   documented partition for every thread count 1..9 and every n: proof that the sweeps
   above really run the quarter / six-part splits, the leftovers and the empty ranges
   (more threads than rows), and that the thread count asked for is the one used.
3. Both decode steps against the torch forward pass (helpers of
   test_issue16_native_avx2_attacks.py): thread counts 1..9, hidden / intermediate /
   vocab / qkv sizes around multiples of 4 * threads and 6 * threads, k % 16 in 1..15
   and k < 8, R = 1..12 (6 and 7: the stream / wide boundary), q/k/v/o biases
   (llama attention_bias) and qwen2's qkv bias, two layers (the residual accumulated
   twice per layer), NaN in one lm_head row at partition boundaries, bitwise determinism
   across repeated calls, and an OpenMP team smaller than the one asked for
   (omp_set_dynamic)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from tests.adversarial.native_kernel_shim import (  # noqa: F401  (fixtures, skip marks)
    GUARD_PREAMBLE, INF, NAN, SENT, _exact_rows_case, _guarded_weight, _ints, _ptr, _silu_times, _thread_ranges, lib,
    pytestmark, run_guarded, shim, shim_path)


def _exact_gemv_case(call, gen, n: int, k: int, threads: int, accumulate: bool, bias: bool) -> None:
    W = _guarded_weight(gen, n, k)
    b = torch.cat([_ints(gen, n, lo=-9, hi=10), torch.full((8,), NAN)])
    x = torch.cat([_ints(gen, k), torch.full((16,), NAN)])  # NaN past k: never read
    y0 = _ints(gen, n, lo=-50, hi=51)
    y = torch.cat([y0, torch.full((16,), SENT)])
    call(W, b if bias else None, x, y, n, k, threads, accumulate)
    want = W.double() @ x[:k].double() + (b[:n].double() if bias else 0) + (y0.double() if accumulate else 0)
    got = y[:n].double()
    where = f"threads={threads} n={n} k={k} acc={accumulate} bias={bias}"
    assert torch.equal(got, want), f"{where}: rows {(got != want).nonzero().flatten().tolist()} differ"
    assert (y[n:] == SENT).all(), f"{where}: written past y[n - 1]"


def _sizes_around(threads: int, per: int, multiples=(1, 2, 3)) -> list[int]:
    """n around multiples of per * threads (per = 4: quarters, 6: parts), and the small ones."""
    ns = {1, 2, 3, 4, 5, 7, 8, 9, 23, 24, 25}
    for m in multiples:
        ns |= {m * per * threads - 1, m * per * threads, m * per * threads + 1}
    return sorted(ns)


# ---- 1. weft_gemv and the static kernels, exact ----------------------------------------

K_TAILS = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 33]  # k % 8 and k % 16: every tail of dot4


@pytest.mark.parametrize("threads", range(1, 10))
def test_weft_gemv_every_row_exact_around_quarter_boundaries(lib, threads):
    gen = torch.Generator().manual_seed(threads)

    def call(W, b, x, y, n, k, t, acc):
        assert not acc
        lib.weft_gemv(_ptr(W), _ptr(b), _ptr(x), _ptr(y), n, k, t)

    for n in _sizes_around(threads, 4):
        for k in K_TAILS:
            _exact_gemv_case(call, gen, n, k, threads, False, (n + k) % 2 == 0)


@pytest.mark.parametrize("threads", [0, -1, -7])
def test_weft_gemv_clamps_a_thread_count_below_one(lib, threads):
    """Found by this attack: ``weft_gemv`` handed its thread count to OpenMP as it came (a
    negative one becomes a huge unsigned team size), where the decode steps clamp it to 1."""
    gen = torch.Generator().manual_seed(7)

    def call(W, b, x, y, n, k, t, acc):
        lib.weft_gemv(_ptr(W), _ptr(b), _ptr(x), _ptr(y), n, k, threads)

    _exact_gemv_case(call, gen, 13, 17, 1, False, True)


@pytest.mark.parametrize("threads", [10, 13, 16, 33])
def test_weft_gemv_more_threads_than_rows(lib, threads):
    # every n < threads: some threads own no rows at all (lo == hi, q == 0)
    gen = torch.Generator().manual_seed(100 + threads)

    def call(W, b, x, y, n, k, t, acc):
        lib.weft_gemv(_ptr(W), _ptr(b), _ptr(x), _ptr(y), n, k, t)

    for n in (1, 2, 3, 4, 5, 7, 9):
        for k in (1, 7, 17):
            _exact_gemv_case(call, gen, n, k, threads, False, True)


def test_weft_gemv_zero_rows_and_zero_columns(lib):
    y = torch.full((8,), SENT)
    x, W, b = torch.ones(4), torch.ones(16), torch.arange(8.0)
    lib.weft_gemv(_ptr(W), None, _ptr(x), _ptr(y), 0, 4, 3)  # n = 0: nothing written
    assert (y == SENT).all()
    lib.weft_gemv(_ptr(W), _ptr(b), _ptr(x), _ptr(y), 5, 0, 3)  # k = 0: y = b
    assert y[:5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and (y[5:] == SENT).all()


@pytest.mark.parametrize("threads", range(1, 10))
def test_batch1_gemv_for_accumulates_every_row_exactly_once(shim, threads):
    # what the o / down projections do: y += W x (+ b), into a residual with values in it
    gen = torch.Generator().manual_seed(200 + threads)

    def call(W, b, x, y, n, k, t, acc):
        shim.shim_gemv(_ptr(W), _ptr(b), _ptr(x), _ptr(y), n, k, int(acc), t)

    for n in _sizes_around(threads, 4):
        for k in (1, 7, 9, 16, 17, 33):
            _exact_gemv_case(call, gen, n, k, threads, True, (n + k) % 2 == 0)
        _exact_gemv_case(call, gen, n, 3, threads, False, True)


@pytest.mark.parametrize("threads", range(1, 10))
def test_batch1_gate_up_for_pairs_each_gate_row_with_its_own_up_row(shim, threads):
    # integer g and u (exact dots): only SiLU's rounding remains; a gate row paired with
    # the wrong up row, or a row of a half skipped, is far outside 1e-5
    gen = torch.Generator().manual_seed(300 + threads)
    for inter in sorted({1, 2, 3, 5, 7, 2 * threads - 1, 2 * threads, 2 * threads + 1, 4 * threads + 1, 37}):
        for H in (1, 3, 7, 9, 17, 33):
            gu = torch.cat([_ints(gen, inter, H, lo=-2, hi=3), _ints(gen, inter, H, lo=-2, hi=3)])
            x = torch.cat([_ints(gen, H, lo=-2, hi=3), torch.full((16,), NAN)])
            act = torch.full((inter + 8,), SENT)
            shim.shim_gate_up(_ptr(gu), _ptr(x), _ptr(act), inter, H, threads)
            want = _silu_times(gu[:inter].double() @ x[:H].double(), gu[inter:].double() @ x[:H].double())
            torch.testing.assert_close(act[:inter].double(), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"threads={threads} inter={inter} H={H}: {m}")
            assert (act[inter:] == SENT).all()


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17])
@pytest.mark.parametrize("threads", [1, 2, 3, 5, 9])
def test_gemm_rows_for_every_output_exact_around_six_part_boundaries(shim, threads, R):
    gen = torch.Generator().manual_seed(400 + 16 * threads + R)
    for n in _sizes_around(threads, 6, (1, 2)):
        for k in (7, 17):
            _exact_rows_case(shim, gen, n, k, R, threads, accumulate=True, bias=(n + R) % 2 == 0)
        _exact_rows_case(shim, gen, n, (1, 8, 9)[n % 3], R, threads, accumulate=False, bias=True)


@pytest.mark.parametrize("threads", [4, 6, 7, 8])
def test_gemm_rows_for_stream_boundary_6_and_7_rows(shim, threads):
    gen = torch.Generator().manual_seed(500 + threads)
    for R in (6, 7):
        for n in (6 * threads - 1, 6 * threads, 6 * threads + 5, 12 * threads + 7, 61):
            _exact_rows_case(shim, gen, n, 33, R, threads, accumulate=True, bias=True)


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 9])
def test_gate_up_rows_for_pairs_each_gate_row_with_its_own_up_row(shim, threads):
    gen = torch.Generator().manual_seed(600 + threads)
    for R in (1, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17):
        for inter in sorted({1, 5, 6, 7, 6 * threads - 1, 6 * threads + 1, 12 * threads + 5}):
            H = (1, 9, 17)[(R + inter) % 3]
            gu = torch.cat([_ints(gen, inter, H, lo=-2, hi=3), _ints(gen, inter, H, lo=-2, hi=3)])
            X = _ints(gen, R, H, lo=-2, hi=3)
            act = torch.full((R * inter + 8,), SENT)
            shim.shim_gate_up_rows(_ptr(gu), _ptr(X), _ptr(act), inter, H, R, threads)
            want = _silu_times(X.double() @ gu[:inter].double().T, X.double() @ gu[inter:].double().T)
            torch.testing.assert_close(act[:R * inter].view(R, inter).double(), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"threads={threads} R={R} inter={inter} H={H}: {m}")
            assert (act[R * inter:] == SENT).all()


@pytest.mark.parametrize("value", [NAN, INF])
def test_a_non_finite_weight_row_poisons_only_its_own_output(lib, shim, value):
    gen = torch.Generator().manual_seed(7)
    for threads, n, k in ((2, 25, 3), (3, 7, 17), (5, 37, 3), (9, 24, 17), (9, 13, 9)):
        W = _ints(gen, n, k)
        x = _ints(gen, k, lo=1, hi=4)  # no zero: inf * x stays inf
        X = _ints(gen, 9, k, lo=1, hi=4)
        for j in range(n):
            Wp = W.clone()
            Wp[j, (5 * j) % k] = value
            want = Wp.double() @ x.double()
            y = torch.full((n,), SENT)
            lib.weft_gemv(_ptr(Wp), None, _ptr(x), _ptr(y), n, k, threads)
            other = torch.arange(n) != j
            assert torch.equal(y[other].double(), want[other]), \
                f"gemv threads={threads} n={n} k={k}: poison in row {j} leaked: {y.tolist()}"
            assert not torch.isfinite(y[j]), f"gemv threads={threads} n={n} k={k}: row {j} lost its {value}"
            for R in (4, 9):
                Y = torch.full((R, n), SENT)
                shim.shim_gemm_rows(_ptr(Wp), None, _ptr(X), k, _ptr(Y), n, n, k, R, 0, threads)
                ref = X[:R].double() @ Wp.double().T
                assert torch.equal(Y[:, other].double(), ref[:, other]), \
                    f"rows threads={threads} n={n} k={k} R={R}: poison in row {j} leaked"
                assert not torch.isfinite(Y[:, j]).any(), f"rows R={R}: row {j} lost its {value}"


@pytest.mark.parametrize("threads", range(1, 10))
def test_repeated_calls_are_bitwise_identical(lib, shim, threads):
    gen = torch.Generator().manual_seed(900 + threads)
    W, x = torch.randn(101, 77, generator=gen), torch.randn(77, generator=gen)
    X = torch.randn(9, 77, generator=gen)
    ys, Ys = [], []
    for _ in range(4):
        y = torch.empty(101)
        lib.weft_gemv(_ptr(W), None, _ptr(x), _ptr(y), 101, 77, threads)
        ys.append(y)
        for R in (6, 7):
            Y = torch.empty(R, 101)
            shim.shim_gemm_rows(_ptr(W), None, _ptr(X), 77, _ptr(Y), 101, 101, 77, R, 0, threads)
            Ys.append(Y)
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert all(torch.equal(Y, Ys[Y.shape[0] - 6]) for Y in Ys)
    # and equal to torch's x @ W.T within fp32 rounding, whatever the thread count
    scale = (W.abs() @ x.abs()).double()
    assert ((ys[0].double() - (W.double() @ x.double())).abs() <= 1e-5 * scale).all()
    Yscale = (X.abs() @ W.abs().T).double()
    assert ((Ys[1].double() - X[:7].double() @ W.double().T).abs() <= 1e-5 * Yscale[:7]).all()
    torch.testing.assert_close(ys[0], x @ W.T, rtol=1e-4, atol=1e-4)


GUARD_PAGE_SCRIPT = GUARD_PREAMBLE + textwrap.dedent("""
    def at_page_end(values):
        # a float tensor whose last element ends right before a PROT_NONE page
        values = values.reshape(-1)
        nbytes, pages = values.numel() * 4, (values.numel() * 4 + PAGE - 1) // PAGE + 1
        mm = mmap.mmap(-1, pages * PAGE)
        keep.append(mm)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(base + (pages - 1) * PAGE, PAGE, 0) == 0
        t = torch.frombuffer(mm, dtype=torch.float32, count=values.numel(), offset=(pages - 1) * PAGE - nbytes)
        t.copy_(values)
        return t

    g = torch.Generator().manual_seed(0)
    ints = lambda *s: torch.randint(-3, 4, s, generator=g).float()
    wrong = []
    for T in (1, 3, 9):
        for n in (1, 5, 7, 25):
            for k in (1, 7, 9, 17):
                W, x, b = at_page_end(ints(n, k)), at_page_end(ints(k)), at_page_end(ints(n))
                gu, y = at_page_end(ints(2 * n, k)), at_page_end(torch.zeros(n))
                lib.weft_gemv(W.data_ptr(), b.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, T)
                shim.shim_gemv(W.data_ptr(), b.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, 1, T)
                shim.shim_gate_up(gu.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, T)
                if not torch.isfinite(y).all():
                    wrong.append(("batch-1", T, n, k))
                for R in (1, 4, 6, 7, 9, 12, 16):
                    X, Y = at_page_end(ints(R, k)), at_page_end(torch.zeros(R * n))
                    shim.shim_gemm_rows(W.data_ptr(), b.data_ptr(), X.data_ptr(), k, Y.data_ptr(), n, n, k, R, 0, T)
                    want = X.view(R, k).double() @ W.view(n, k).double().T + b.double()
                    if not torch.equal(Y.view(R, n).double(), want):
                        wrong.append(("rows", T, n, k, R))
                    Y = at_page_end(torch.zeros(R * n))
                    shim.shim_gate_up_rows(gu.data_ptr(), X.data_ptr(), Y.data_ptr(), n, k, R, T)
    print("WRONG", wrong)
""")


def test_no_kernel_reads_past_the_last_weight_or_activation(shim_path):
    # weights, bias and activations each end right before an unmapped page: a load past
    # them (a prefetch may go there, a load may not) kills the child, not this run
    out = run_guarded(GUARD_PAGE_SCRIPT, shim_path)
    assert "WRONG []" in out, out[-2000:]
