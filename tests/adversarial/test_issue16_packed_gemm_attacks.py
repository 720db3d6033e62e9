"""Issue 16, attacks on the packed outer-product fp32 GEMM (886c3ca: native/gemm.c,
gemm_packed.h, model/linear.py's PackedLinear, decode_batch.c's steps of more than 6 rows
over the packed copies). AVX2 builds without AVX-512 only (module skip elsewhere).

What is attacked (every case deterministic; nothing here repeats test_packed_gemm.py):

1. The exported kernels on small integers (every dot product exact in fp32 whatever the
   order, compared for EQUALITY with float64): the column-block edges k = 1, 255, 256,
   257, 513, 1000; the row-block edges R = 0, 1, 6, 7, 120, 121, 241; a huge k that makes
   block_rows() 6 or 12; partial panels (n % 16, inter % 8); thread counts 1..9 (more
   threads than panels, n = 1) and an OpenMP team smaller than asked; NaN in every ldx gap
   and around X, NaN right after the bias's n floats, sentinels in every ldy / ld_act gap
   and around Y / act; the residual added exactly once.
2. Poison: a NaN / inf activation row stays in its row (the padded zero weight rows turn
   0 * inf into NaN only in discarded lanes), an inf / NaN weight row (gate or up) stays
   in its column.
3. Bitwise invariance of a row's output (the doc comment's claim): alone, among 17, 130
   or 241 rows at any position, with ldx gaps, threads 1 / 2 / 3: gemm and gate_up.
4. Reads / writes past the end (subprocess, guard pages): X, bias, Y, act and the packed
   weights each ending right before (or starting right after) a PROT_NONE page, with n and
   inter that leave a fully masked second half (the masked loads / stores of gemm.c).
5. The few-row column blocks (2ccad7f: 64 columns for row blocks of <= 48 rows, 256
   beyond): exact products at k = 63..193 around the 64-column blocks, row counts around
   FEW_ROWS (48 / 49), a many-row call whose last row block is a few-row one; a row's bits
   across 1 / 48 / 49 / 109 / 130-row calls, gemm and gate_up.
6.-7. PackedLinear, the switch, no columns (k = 0) and the model:
   test_issue16_packed_linear_attacks.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from services.executor.model.native import library
from tests.adversarial.native_kernel_shim import GUARD_PAGES, INF, NAN, SENT, pytestmark as _native_only
from tests.adversarial.test_issue16_native_streams_steps import _dynamic_team

LIB = library.load() if library.native_enabled() else None
pytestmark = [
    _native_only,
    pytest.mark.skipif(LIB is None or not LIB.weft_gemm_packed_available(),
                       reason="the packed GEMM is built for AVX2 CPUs without AVX-512 only"),
]

ROOT = str(library.SOURCES[0].parents[4])


# ---- helpers ----------------------------------------------------------------------------

def _ints(gen, *shape, lo=-3, hi=4) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen).float()


def _pack(W: torch.Tensor) -> torch.Tensor:
    n, k = W.shape
    P = torch.full((((n + 15) // 16) * k * 16,), NAN)
    LIB.weft_pack_panels(W.contiguous().data_ptr(), n, k, P.data_ptr())
    return P


def _pack_gu(GU: torch.Tensor) -> torch.Tensor:
    n2, k = GU.shape
    inter = n2 // 2
    P = torch.full((((inter + 7) // 8) * k * 16,), NAN)
    LIB.weft_pack_gate_up(GU.contiguous().data_ptr(), inter, k, P.data_ptr())
    return P


class _Guarded:
    """[R, width] fp32 rows of stride ld inside a buffer with `pad` floats of `fill` before
    and after and `fill` in every gap."""

    def __init__(self, R: int, width: int, ld: int, fill: float, pad: int = 24) -> None:
        self.R, self.width, self.ld, self.pad, self.fill = R, width, ld, pad, fill
        self.buf = torch.full((R * ld + 2 * pad,), fill)
        self.view = self.buf[pad:pad + R * ld].view(R, ld) if R else self.buf[pad:pad]

    def ptr(self) -> int:
        return self.buf.data_ptr() + 4 * self.pad

    def body(self) -> torch.Tensor:
        return self.view[:, :self.width] if self.R else torch.empty(0, self.width)

    def untouched_outside(self) -> bool:
        same = (lambda t: torch.isnan(t).all()) if self.fill != self.fill else (lambda t: (t == self.fill).all())
        ok = bool(same(self.buf[:self.pad])) and bool(same(self.buf[self.pad + self.R * self.ld:]))
        if self.R and self.ld > self.width:
            ok = ok and bool(same(self.view[:, self.width:]))
        return ok


def _gemm_case(gen, n: int, k: int, R: int, threads: int, *, accumulate: bool, bias: bool, ldx_gap: int = 3,
               ldy_gap: int = 5, note: str = "") -> None:
    W = _ints(gen, n, k)
    P = _pack(W)
    b = torch.cat([_ints(gen, n, lo=-9, hi=10), torch.full((16,), NAN)])  # NaN right after the n biases
    X = _Guarded(R, k, k + ldx_gap, NAN)
    if R:
        X.view[:, :k] = _ints(gen, R, k)
    Y = _Guarded(R, n, n + ldy_gap, SENT)
    Y0 = _ints(gen, R, n, lo=-50, hi=51)
    if R:
        Y.view[:, :n] = Y0
    LIB.weft_gemm_packed(P.data_ptr(), b.data_ptr() if bias else None, X.ptr(), X.ld, Y.ptr(), Y.ld, n, k, R,
                         int(accumulate), threads)
    want = X.body().double() @ W.double().T + (b[:n].double() if bias else 0) + (Y0.double() if accumulate else 0)
    got = Y.body().double()
    where = f"n={n} k={k} R={R} threads={threads} acc={accumulate} bias={bias} {note}"
    bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    assert not bad.any(), f"{where}: (row, out) {bad.nonzero().tolist()[:8]} differ"
    assert Y.untouched_outside(), f"{where}: written outside Y's valid columns"


def _gate_up_case(gen, inter: int, k: int, R: int, threads: int, *, ldx_gap: int = 2, lda_gap: int = 3,
                  note: str = "") -> None:
    GU = _ints(gen, 2 * inter, k, lo=-1, hi=2)
    P = _pack_gu(GU)
    X = _Guarded(R, k, k + ldx_gap, NAN)
    if R:
        X.view[:, :k] = _ints(gen, R, k, lo=-1, hi=2)
    A = _Guarded(R, inter, inter + lda_gap, SENT)
    LIB.weft_gate_up_packed(P.data_ptr(), X.ptr(), X.ld, A.ptr(), A.ld, inter, k, R, threads)
    g = X.body().double() @ GU[:inter].double().T  # exact small integers
    u = X.body().double() @ GU[inter:].double().T
    want = F.silu(g) * u
    where = f"inter={inter} k={k} R={R} threads={threads} {note}"
    torch.testing.assert_close(A.body().double(), want, rtol=2e-6, atol=2e-6, msg=lambda m: f"{where}: {m}")
    assert A.untouched_outside(), f"{where}: written outside act's valid columns"


# ---- 1. exact products at every block edge ----------------------------------------------

@pytest.mark.parametrize("k", [1, 7, 255, 256, 257, 513, 1000])
def test_exact_at_column_and_row_block_edges(k):
    gen = torch.Generator().manual_seed(k)
    i = 0
    for R in (0, 1, 6, 7, 120, 121, 241):
        for n in (1, 15, 16, 17, 33):
            for threads in (1, 2, 3):
                i += 1
                _gemm_case(gen, n, k, R, threads, accumulate=bool(i % 2), bias=bool(i % 3))


@pytest.mark.parametrize("k", [5000, 11000, 20000])  # block_rows(k) = 12, 6, 6
def test_exact_when_a_huge_k_makes_the_row_blocks_small(k):
    gen = torch.Generator().manual_seed(k)
    for R in (5, 6, 7, 13, 25):
        _gemm_case(gen, 17, k, R, 2, accumulate=True, bias=True)


@pytest.mark.parametrize("k", [1, 255, 256, 257, 600])
def test_gate_up_exact_at_block_edges_and_partial_panels(k):
    gen = torch.Generator().manual_seed(k + 1)
    for R in (0, 1, 7, 121):
        for inter in (1, 7, 8, 9, 17):
            for threads in (1, 3):
                _gate_up_case(gen, inter, k, R, threads)


def test_more_threads_than_panels_and_a_smaller_team_than_asked():
    gen = torch.Generator().manual_seed(99)
    for threads in (2, 4, 9):
        _gemm_case(gen, 1, 40, 13, threads, accumulate=True, bias=True, note="n=1")
        _gemm_case(gen, 17, 40, 9, threads, accumulate=False, bias=True, note="2 panels")
        _gate_up_case(gen, 3, 40, 9, threads, note="one gate/up panel")
    with _dynamic_team():
        for threads in (3, 9, 33):
            _gemm_case(gen, 73, 300, 19, threads, accumulate=True, bias=True, note="dynamic team")
            _gate_up_case(gen, 41, 300, 19, threads, note="dynamic team")


def test_zero_rows_write_nothing():
    gen = torch.Generator().manual_seed(3)
    for threads in (1, 2):
        _gemm_case(gen, 20, 30, 0, threads, accumulate=True, bias=True)
        _gate_up_case(gen, 9, 30, 0, threads)


# ---- 2. non-finite values stay where they belong ----------------------------------------

@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_non_finite_activation_row_stays_in_its_row(value):
    gen = torch.Generator().manual_seed(5)
    n, k, R = 21, 300, 13  # a partial panel: padded weight rows meet the inf (0 * inf = NaN, discarded)
    W, b = _ints(gen, n, k), _ints(gen, n)
    P = _pack(W)
    X = _ints(gen, R, k)
    X[4, 17] = value
    X[9, :] = value
    Y = _Guarded(R, n, n + 3, SENT)
    LIB.weft_gemm_packed(P.data_ptr(), b.data_ptr(), X.data_ptr(), k, Y.ptr(), Y.ld, n, k, R, 0, 2)
    want = X.double() @ W.double().T + b.double()
    clean = [r for r in range(R) if r not in (4, 9)]
    assert torch.equal(Y.body()[clean].double(), want[clean])
    assert not torch.isfinite(Y.body()[9]).any()
    assert Y.untouched_outside(), "a discarded padded lane was written"
    # gate / up: the same, with a partial interleaved panel
    inter = 11
    GU = _ints(gen, 2 * inter, k, lo=-1, hi=2)
    Xg = _ints(gen, R, k, lo=-1, hi=2)
    Xg[2, 0] = value
    A = _Guarded(R, inter, inter + 5, SENT)
    Pg = _pack_gu(GU)  # held: a temporary's data_ptr() dangles
    LIB.weft_gate_up_packed(Pg.data_ptr(), Xg.data_ptr(), k, A.ptr(), A.ld, inter, k, R, 2)
    ref = F.silu(Xg.double() @ GU[:inter].double().T) * (Xg.double() @ GU[inter:].double().T)
    rows = [r for r in range(R) if r != 2]
    torch.testing.assert_close(A.body()[rows].double(), ref[rows], rtol=2e-6, atol=2e-6)
    assert A.untouched_outside(), "a discarded padded lane of act was written"


@pytest.mark.parametrize("value", [NAN, INF])
def test_a_non_finite_weight_row_stays_in_its_column(value):
    gen = torch.Generator().manual_seed(6)
    n, k, R = 37, 260, 9
    W = _ints(gen, n, k)
    W[17, 3] = value  # second panel, first lane
    W[36, 259] = value  # the last (partial) panel, last column of the last column block
    X = _ints(gen, R, k, lo=1, hi=3)  # positive: an inf weight gives inf, never inf - inf
    Y = torch.full((R, n), SENT)
    P = _pack(W)
    LIB.weft_gemm_packed(P.data_ptr(), None, X.data_ptr(), k, Y.data_ptr(), n, n, k, R, 0, 3)
    want = X.double() @ W.double().T
    cols = [c for c in range(n) if c not in (17, 36)]
    assert torch.equal(Y[:, cols].double(), want[:, cols])
    assert not torch.isfinite(Y[:, [17, 36]]).any()
    # a gate row and (another) up row
    inter = 13
    GU = _ints(gen, 2 * inter, k, lo=-1, hi=2)
    GU[5, 7] = value  # gate 5
    GU[inter + 12, 100] = value  # up 12 (the partial panel)
    A = torch.full((R, inter), SENT)
    Pg = _pack_gu(GU)
    LIB.weft_gate_up_packed(Pg.data_ptr(), X.data_ptr(), k, A.data_ptr(), inter, inter, k, R, 2)
    ref = F.silu(X.double() @ GU[:inter].double().T) * (X.double() @ GU[inter:].double().T)
    cols = [c for c in range(inter) if c not in (5, 12)]
    torch.testing.assert_close(A[:, cols].double(), ref[:, cols], rtol=2e-6, atol=2e-6)


# ---- 3. a row's result depends on nothing but its row -----------------------------------

@pytest.mark.parametrize("k", [37, 300, 1000])  # 1000: block_rows 60, so 130 rows are 3 row blocks
def test_a_row_is_bitwise_the_same_alone_among_others_and_for_any_thread_count(k):
    gen = torch.Generator().manual_seed(k)
    n, inter = 45, 19
    W, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    GU = torch.randn(2 * inter, k, generator=gen)
    P, Pg = _pack(W), _pack_gu(GU)
    probe = torch.randn(k, generator=gen)

    def run(R: int, at: int, threads: int, gap: int):
        X = torch.randn(R, k + gap, generator=gen)
        X[at, :k] = probe
        Y, A = torch.empty(R, n), torch.empty(R, inter)
        LIB.weft_gemm_packed(P.data_ptr(), b.data_ptr(), X.data_ptr(), k + gap, Y.data_ptr(), n, n, k, R, 0, threads)
        LIB.weft_gate_up_packed(Pg.data_ptr(), X.data_ptr(), k + gap, A.data_ptr(), inter, inter, k, R, threads)
        return Y[at].clone(), A[at].clone()

    y1, a1 = run(1, 0, 1, 0)
    for R, at in ((2, 1), (7, 6), (17, 0), (17, 8), (17, 16), (130, 65), (130, 129), (241, 120), (241, 240)):
        for threads in (1, 2, 3):
            y, a = run(R, at, threads, 3 if threads == 2 else 0)
            assert torch.equal(y, y1), f"gemm row {at} of {R}, threads={threads}"
            assert torch.equal(a, a1), f"gate_up row {at} of {R}, threads={threads}"


# ---- the few-row column blocks (2ccad7f: 64 columns for row blocks of <= 48 rows) ------

@pytest.mark.parametrize("k", [63, 64, 65, 127, 128, 129, 192, 193])
def test_exact_products_around_the_few_row_column_blocks(k):
    gen = torch.Generator().manual_seed(k)
    i = 0
    for R in (1, 5, 7, 47, 48, 49, 50):
        for n in (3, 16, 33):
            for threads in (1, 2, 3):
                i += 1
                _gemm_case(gen, n, k, R, threads, accumulate=bool(i % 2), bias=bool(i % 3))


def test_exact_when_a_many_row_call_ends_in_a_few_row_block():
    gen = torch.Generator().manual_seed(1000)
    for R in (61, 108, 109, 120, 121):  # k = 1000: row blocks of 60, so 1..48 or 49..60 rows last
        _gemm_case(gen, 17, 1000, R, 2, accumulate=True, bias=True)


@pytest.mark.parametrize("k", [64, 129, 1000])
def test_a_row_has_the_same_bits_on_either_side_of_few_rows(k):
    gen = torch.Generator().manual_seed(k + 5)
    n, inter = 35, 21
    W, b, GU = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(2 * inter, k, generator=gen)
    P = _pack(W)
    Pg = torch.empty(((inter + 7) // 8) * k * 16)
    LIB.weft_pack_gate_up(GU.data_ptr(), inter, k, Pg.data_ptr())
    X = torch.randn(130, k, generator=gen)

    def run(R: int, threads: int):
        Y, A = torch.empty(R, n), torch.empty(R, inter)
        LIB.weft_gemm_packed(P.data_ptr(), b.data_ptr(), X.data_ptr(), k, Y.data_ptr(), n, n, k, R, 0, threads)
        LIB.weft_gate_up_packed(Pg.data_ptr(), X.data_ptr(), k, A.data_ptr(), inter, inter, k, R, threads)
        return Y, A

    ref_y, ref_a = run(130, 2)
    for R in (1, 7, 47, 48, 49, 50, 109):
        for threads in (1, 3):
            y, a = run(R, threads)
            assert torch.equal(y, ref_y[:R]), f"gemm: R={R} threads={threads}"
            assert torch.equal(a, ref_a[:R]), f"gate_up: R={R} threads={threads}"


# ---- 4. nothing read or written past the operands (guard pages, subprocess) -------------

GUARD_SCRIPT = GUARD_PAGES + textwrap.dedent("""
    from services.executor.model.native import library
    lib = library.load()

    def pack(W, gate_up):
        n, k = W.shape
        if gate_up:
            P = torch.empty(((n // 2 + 7) // 8) * k * 16)
            lib.weft_pack_gate_up(W.data_ptr(), n // 2, k, P.data_ptr())
        else:
            P = torch.empty(((n + 15) // 16) * k * 16)
            lib.weft_pack_panels(W.data_ptr(), n, k, P.data_ptr())
        return P

    g = torch.Generator().manual_seed(0)
    ints = lambda *s: torch.randint(-3, 4, s, generator=g).float()
    wrong, done = [], 0
    for at_end in (True, False):
        for T in (1, 2):
            for k in (1, 5, 256, 257):
                for n in (1, 7, 8, 9, 16, 17, 24):
                    W = ints(n, k)
                    P = guarded(pack(W, False), at_end)
                    b = guarded(ints(n), at_end)
                    Pg = guarded(pack(ints(2 * n, k), True), at_end)
                    for R in (1, 7, 13):
                        X = guarded(ints(R, k), at_end)
                        for acc in (0, 1):
                            Y0 = ints(R, n)
                            Y = guarded(Y0, at_end)
                            lib.weft_gemm_packed(P.data_ptr(), b.data_ptr(), X.data_ptr(), k, Y.data_ptr(), n, n,
                                                 k, R, acc, T)
                            want = X.view(R, k).double() @ W.double().T + b.double() + (Y0.double() if acc else 0)
                            if not torch.equal(Y.view(R, n).double(), want):
                                wrong.append(("gemm", at_end, T, n, k, R, acc))
                        A = guarded(torch.zeros(R * n), at_end)
                        lib.weft_gate_up_packed(Pg.data_ptr(), X.data_ptr(), k, A.data_ptr(), n, n, k, R, T)
                        if not torch.isfinite(A).all():
                            wrong.append(("gate_up", at_end, T, n, k, R))
                        done += 1
    print("DONE", done, "WRONG", wrong)
""")


def _child(script: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_no_packed_kernel_touches_memory_past_its_operands():
    """Masked loads / stores (the bias's and Y's second half when n % 16 <= 8, act's tail)
    reach past the operand's last float: a masked-out lane must not fault even when the
    page there is PROT_NONE; the packed weights' prefetch past their end is a hint."""
    proc = _child(GUARD_SCRIPT)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert "DONE 336 WRONG []" in proc.stdout, proc.stdout[-2000:]
