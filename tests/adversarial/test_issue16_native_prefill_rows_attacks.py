"""Issue 16, attacks on native/rows.c (a330e28: weft_rms_norm_rows / weft_rope_rows, the
prefill's RMSNorm and RoPE in one C call each). The model, add_into, the attention's fresh
chunks, the engine and gemm.c's few-row column blocks: test_issue16_prefill_forward_attacks.py.

What is attacked (every case deterministic; nothing here repeats test_native_rows.py):

1. rows.c directly: RoPE on d = 2..34 (a half that is no multiple of 8: the scalar tail
   only or AVX + tail), positions 0 and the table's last row, rows = 0, threads 0 / 1 / 3 /
   -1, the v heads and any ldx gap left alone, NaN / inf confined to their row (and head);
   RMSNorm for n = 1..17 and 31..33, threads, in place, non-finite rows confined, rows = 0.
2. Guard pages (child process): x, w, y, the cos / sin tables and the positions each
   ending right before (or starting right after) a PROT_NONE page, positions at the
   table's last row.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from services.executor.model.llama import apply_rope_
from services.executor.model.native import library
from tests.adversarial.native_kernel_shim import GUARD_PAGES, INF, NAN, SENT, pytestmark as _native_only

LIB = library.load() if library.native_enabled() else None
pytestmark = [_native_only, pytest.mark.skipif(LIB is None, reason="the native library did not build")]
ROOT = str(library.SOURCES[0].parents[4])


# ---- helpers ----------------------------------------------------------------------------

def _tables(d: int, max_pos: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(max_pos).float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    sin = emb.sin()
    return emb.cos().contiguous(), torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), -1).contiguous()


def _rope_ref(x: torch.Tensor, positions: torch.Tensor, heads: int, d: int, cos, sin) -> torch.Tensor:
    out = x.clone()
    apply_rope_(out[:, : heads * d].view(x.shape[0], heads, d), cos[positions].unsqueeze(1),
                sin[positions].unsqueeze(1))
    return out


def _rope_native(x: torch.Tensor, positions: torch.Tensor, heads: int, d: int, cos, sin, threads: int = 2):
    out = x.clone()
    LIB.weft_rope_rows(out.data_ptr(), out.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       heads, d, out.shape[0], threads)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# ---- 1. rows.c directly -----------------------------------------------------------------

@pytest.mark.parametrize("d", [2, 6, 10, 16, 18, 34])
def test_rope_small_and_odd_half_head_dims_are_bit_identical_and_stay_in_their_heads(d):
    gen = torch.Generator().manual_seed(d)
    cos, sin = _tables(d)
    for rows, heads, v_heads, gap in ((1, 1, 0, 0), (5, 3, 2, 3), (9, 7, 1, 1)):
        width = (heads + v_heads) * d + gap
        x = torch.randn(rows, width, generator=gen) * 50
        x[:, (heads + v_heads) * d:] = SENT  # an ldx gap nobody may write
        positions = torch.randint(0, 50, (rows,), generator=gen)
        positions[0], positions[-1] = 49, 0  # the table's last row and its first
        want = _rope_ref(x, positions, heads, d, cos, sin)
        for threads in (0, 1, 3, -1):
            got = _rope_native(x, positions, heads, d, cos, sin, threads)
            assert torch.equal(got, want), f"d={d} rows={rows} heads={heads} threads={threads}"
            assert torch.equal(got[:, heads * d:], x[:, heads * d:]), "v heads or the gap were written"


def test_rope_with_no_rows_or_no_heads_writes_nothing():
    cos, sin = _tables(8)
    x = torch.full((3, 24), SENT)
    LIB.weft_rope_rows(x.data_ptr(), 24, None, cos.data_ptr(), sin.data_ptr(), 2, 8, 0, 2)  # rows = 0
    assert (x == SENT).all()
    positions = torch.tensor([1, 2, 3])
    LIB.weft_rope_rows(x.data_ptr(), 24, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), 0, 8, 3, 2)
    assert (x == SENT).all()


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_rope_non_finite_values_stay_in_their_row_and_head(value):
    d, heads = 16, 4
    gen = torch.Generator().manual_seed(11)
    cos, sin = _tables(d)
    x = torch.randn(7, heads * d, generator=gen)
    x[3, d + 5] = value  # row 3, head 1
    positions = torch.arange(7) * 7
    got = _rope_native(x, positions, heads, d, cos, sin, 3)
    assert _same(got, _rope_ref(x, positions, heads, d, cos, sin))
    clean = torch.ones(7, heads * d, dtype=torch.bool)
    clean[3, d:2 * d] = False
    assert torch.isfinite(got[clean]).all(), "a non-finite value left its row and head"


@pytest.mark.parametrize("n", list(range(1, 18)) + [31, 32, 33])
def test_rms_norm_every_small_width_threads_and_in_place(n):
    gen = torch.Generator().manual_seed(n)
    rows = 5
    x, w = torch.randn(rows, n, generator=gen) * 3, torch.randn(n, generator=gen)
    want = F.rms_norm(x, (n,), w, 1e-6)
    outs = []
    for threads in (0, 1, 3, -2):
        y = torch.full((rows + 1, n), SENT)  # one row past the end nobody may write
        LIB.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, n, 1e-6, threads)
        assert (y[rows] == SENT).all(), f"n={n} threads={threads}: written past the last row"
        torch.testing.assert_close(y[:rows], want, rtol=3e-6, atol=3e-6)
        outs.append(y[:rows])
    assert all(torch.equal(o, outs[0]) for o in outs), f"n={n}: the bits depend on the thread count"
    same = x.clone()
    LIB.weft_rms_norm_rows(same.data_ptr(), w.data_ptr(), same.data_ptr(), rows, n, 1e-6, 2)
    assert torch.equal(same, outs[0])
    y = torch.full((2, n), SENT)
    LIB.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), 0, n, 1e-6, 2)
    assert (y == SENT).all(), "rows = 0 wrote something"


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_rms_norm_a_non_finite_row_stays_in_its_row(value):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 40, generator=gen), torch.randn(40, generator=gen)
    x[4, 33] = value  # in the scalar tail after the 32 AVX columns
    x[6, 0] = value  # in the AVX part
    y = torch.empty_like(x)
    LIB.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), 9, 40, 1e-6, 3)
    clean = [r for r in range(9) if r not in (4, 6)]
    torch.testing.assert_close(y[clean], F.rms_norm(x[clean], (40,), w, 1e-6), rtol=3e-6, atol=3e-6)
    assert not torch.isfinite(y[[4, 6]]).all(dim=1).any(), "a non-finite row came out finite"
    # a huge but finite row: the sum of squares overflows to inf in fp32 in both
    x2 = x.clone()
    x2[4], x2[6] = 3e30, 1.0
    LIB.weft_rms_norm_rows(x2.data_ptr(), w.data_ptr(), y.data_ptr(), 9, 40, 1e-6, 2)
    assert torch.equal(y[4] == 0, F.rms_norm(x2[4:5], (40,), w, 1e-6)[0] == 0)
    torch.testing.assert_close(y[clean], F.rms_norm(x2[clean], (40,), w, 1e-6), rtol=3e-6, atol=3e-6)


# ---- 2. guard pages ---------------------------------------------------------------------

ROWS_GUARD_SCRIPT = GUARD_PAGES + textwrap.dedent("""
    import torch.nn.functional as F
    from services.executor.model.native import library
    from services.executor.model.llama import apply_rope_
    lib = library.load()
    g = torch.Generator().manual_seed(0)
    wrong, done = [], 0

    def tables(d, max_pos):
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        f = torch.arange(max_pos).float()[:, None] * inv[None]
        emb = torch.cat((f, f), -1)
        s = emb.sin()
        return emb.cos().contiguous(), torch.cat((-s[:, : d // 2], s[:, d // 2:]), -1).contiguous()

    for at_end in (True, False):
        for T in (1, 2):
            for n in list(range(1, 18)) + [31, 33, 64]:
                for rows in (1, 3):
                    x0, w0 = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
                    x, w, y = guarded(x0, at_end), guarded(w0, at_end), guarded(torch.zeros(rows * n), at_end)
                    lib.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, n, 1e-5, T)
                    if not torch.allclose(y.view(rows, n), F.rms_norm(x0, (n,), w0, 1e-5), rtol=3e-6, atol=3e-6):
                        wrong.append(("norm", at_end, T, n, rows))
                    lib.weft_rms_norm_rows(x.data_ptr(), w.data_ptr(), x.data_ptr(), rows, n, 1e-5, T)  # in place
                    if not torch.equal(x, y):
                        wrong.append(("norm in place", at_end, T, n, rows))
                    done += 1
            for d in (2, 6, 10, 16, 18, 64):
                max_pos = 5
                c0, s0 = tables(d, max_pos)
                c, s = guarded(c0, at_end), guarded(s0, at_end)
                for heads in (1, 3):
                    for rows in (1, 4):
                        x0 = torch.randn(rows, heads * d, generator=g) * 10  # ldx = heads * d: no v, no gap
                        p0 = torch.tensor([max_pos - 1 if at_end else 0] + [r % max_pos for r in range(1, rows)])
                        p = guarded(torch.zeros(2 * rows), at_end).view(torch.int64)
                        p.copy_(p0)
                        x = guarded(x0, at_end)
                        lib.weft_rope_rows(x.data_ptr(), heads * d, p.data_ptr(), c.data_ptr(), s.data_ptr(),
                                           heads, d, rows, T)
                        want = x0.clone()
                        apply_rope_(want.view(rows, heads, d), c0[p0].unsqueeze(1), s0[p0].unsqueeze(1))
                        if not torch.equal(x.view(rows, heads * d), want):
                            wrong.append(("rope", at_end, T, d, heads, rows))
                        done += 1
    print("DONE", done, "WRONG", wrong)
""")


def test_no_row_op_touches_memory_past_its_operands():
    proc = subprocess.run([sys.executable, "-c", ROWS_GUARD_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert "DONE 256 WRONG []" in proc.stdout, proc.stdout[-2000:]
