"""The native kernels behind a test shim, for the issue-16 attack files: the static GEMV /
GEMM / gate-up kernels of decode.c and decode_batch.c and the multi-row step's attention
(``attend_row``: llama_step.h's attend_kv_heads on AVX-512 / AVX2 builds, the one decode.c
calls per KV head too) behind exported wrappers, compiled
from the real sources with the library's own flags (``shim`` / ``shim_path`` fixtures),
the library itself (``lib``), small-integer operands with NaN guards and sentinels that
make every dot product exact in fp32 (``_exact_rows_case``), and the preamble of the
guard-page subprocesses. Importing a fixture from here makes it a fixture of the module."""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from services.executor.model.native import library

CC = os.environ.get("WEFT_NATIVE_CC", "gcc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None or not library.native_enabled(),
                                reason="needs gcc and WEFT_NATIVE_DECODE not 0")

NAN, INF = float("nan"), float("inf")
SENT = -4242.0  # an output slot nobody may write
GUARD = 64  # NaN floats before / after a weight matrix


@functools.cache
def _avx2_streams_build() -> bool:
    """Whether -march=native compiles the AVX2 (no AVX-512) paths these commits changed."""
    try:
        out = subprocess.run([CC, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "__AVX2__" in out and "__FMA__" in out and "__AVX512F__" not in out


avx2_only = pytest.mark.skipif("not _avx2_streams_build()", reason="the AVX2 (no AVX-512) stream kernels only")

P, I32 = ctypes.c_void_p, ctypes.c_int


@pytest.fixture(scope="module")
def lib():
    handle = library.load()
    assert handle is not None, "the native library did not build"
    return handle


SHIM_ONE = """
#include "{src}/decode.c"
void shim_gemv(const float *W, const float *b, const float *x, float *y, int n, int k, int acc, int t) {{
    #pragma omp parallel num_threads(t)
    gemv_for(W, b, x, y, n, k, acc);
}}
void shim_gate_up(const float *gu, const float *x, float *act, int inter, int H, int t) {{
    #pragma omp parallel num_threads(t)
    gate_up_for(gu, x, act, inter, H);
}}
"""
SHIM_ROWS = """
#include "{src}/decode_batch.c"
void shim_gemm_rows(const float *W, const float *b, const float *X, int ldx, float *Y, int ldy, int n, int k,
                    int R, int acc, int t) {{
    #pragma omp parallel num_threads(t)
    gemm_rows_for(W, NULL, b, X, ldx, Y, ldy, n, k, R, acc); /* NULL: the plain-weight tiles */
}}
void shim_gate_up_rows(const float *gu, const float *X, float *act, int inter, int H, int R, int t) {{
    #pragma omp parallel num_threads(t)
    gate_up_rows_for(gu, NULL, X, act, inter, H, R);
}}
void shim_attend(const weft_model *m, const float *cache, const float *q, float *out, float *scores, int64_t *tok,
                 int g0, int g1, int group, const int32_t *block_table, int seq_len) {{
    attend_row(m, cache, q, out, scores, tok, g0, g1, group, block_table, seq_len);
}}
"""

SHIM_GEMM = """
#include "{src}/gemm.c"
"""  # decode_batch.c's wide steps call gemm.c's packed GEMM (given NULL above: never run)


def _build_shim(directory) -> str:
    """The static kernels of decode.c / decode_batch.c behind exported wrappers, compiled
    from the real sources with the library's flags (three translation units, in parallel)."""
    src = library.SOURCES[0].parent
    flags = [f for f in library.FLAGS if f != "-shared"]
    objs, procs = [], []
    for name, text in (("shim_one", SHIM_ONE), ("shim_rows", SHIM_ROWS), ("shim_gemm", SHIM_GEMM)):
        c = directory / f"{name}.c"
        c.write_text(text.format(src=src))
        objs.append(str(directory / f"{name}.o"))
        procs.append(subprocess.Popen([CC, *flags, "-c", str(c), "-o", objs[-1]], stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    so = str(directory / "shim.so")
    subprocess.run([CC, *library.FLAGS, *objs, "-o", so, "-lm"], check=True, capture_output=True, timeout=120)
    return so


def _declare_shim(handle: ctypes.CDLL) -> ctypes.CDLL:
    handle.shim_gemv.argtypes = [P, P, P, P, I32, I32, I32, I32]
    handle.shim_gate_up.argtypes = [P, P, P, I32, I32, I32]
    handle.shim_gemm_rows.argtypes = [P, P, P, I32, P, I32, I32, I32, I32, I32, I32]
    handle.shim_gate_up_rows.argtypes = [P, P, P, I32, I32, I32, I32]
    handle.shim_attend.argtypes = [P, P, P, P, P, P, I32, I32, I32, P, I32]
    for f in (handle.shim_gemv, handle.shim_gate_up, handle.shim_gemm_rows, handle.shim_gate_up_rows,
              handle.shim_attend):
        f.restype = None
    return handle


@pytest.fixture(scope="module")
def shim_path(lib, tmp_path_factory):  # lib first: torch's libgomp mapped before the shim's
    return _build_shim(tmp_path_factory.mktemp("native_shim"))


@pytest.fixture(scope="module")
def shim(shim_path):
    return _declare_shim(ctypes.CDLL(shim_path))


def _ints(gen, *shape, lo=-3, hi=4) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen).float()


def _guarded_weight(gen, n: int, k: int) -> torch.Tensor:
    """[n, k] small integers, a view into a buffer with NaN rows' worth before and after."""
    buf = torch.full((n * k + 2 * GUARD,), NAN)
    buf[GUARD:GUARD + n * k] = _ints(gen, n * k)
    return buf[GUARD:GUARD + n * k].view(n, k)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _thread_ranges(n: int, threads: int):
    return [(n * t // threads, n * (t + 1) // threads) for t in range(threads)]


def _silu_times(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(g) * u


def _exact_rows_case(shim, gen, n: int, k: int, R: int, threads: int, accumulate: bool, bias: bool, *,
                     ldx_gap: int = 3, ldy_gap: int = 2, note: str = "") -> None:
    """shim_gemm_rows on exact small integers, compared for equality with float64; NaN
    around W (GUARD floats), around X and in its ldx gaps; sentinels around Y and in its
    ldy gaps. ``note`` joins the failure message."""
    W = _guarded_weight(gen, n, k)
    b = torch.cat([_ints(gen, n, lo=-9, hi=10), torch.full((8,), NAN)])
    ldx, ldy = k + ldx_gap, n + ldy_gap
    xbuf = torch.full((R * ldx + 2 * GUARD,), NAN)
    X = xbuf[GUARD:GUARD + R * ldx].view(R, ldx)
    X[:, :k] = _ints(gen, R, k)
    ybuf = torch.full((R * ldy + 16,), SENT)
    Y = ybuf[8:8 + R * ldy].view(R, ldy)
    Y0 = _ints(gen, R, n, lo=-50, hi=51)
    Y[:, :n] = Y0
    shim.shim_gemm_rows(_ptr(W), _ptr(b) if bias else None, _ptr(X), ldx, _ptr(Y), ldy, n, k, R, int(accumulate),
                        threads)
    want = X[:, :k].double() @ W.double().T + (b[:n].double() if bias else 0) + (Y0.double() if accumulate else 0)
    got = Y[:, :n].double()
    where = f"threads={threads} n={n} k={k} R={R} {note} acc={accumulate} bias={bias} ldx={ldx} ldy={ldy}"
    assert torch.equal(got, want), f"{where}: (row, out) {(got != want).nonzero().tolist()[:8]} differ"
    assert (Y[:, n:] == SENT).all(), f"{where}: written into an ldy gap"
    assert (ybuf[:8] == SENT).all() and (ybuf[8 + R * ldy:] == SENT).all(), f"{where}: written outside Y"


# what every guard-page subprocess starts with
GUARD_PAGES = textwrap.dedent("""
    import ctypes, mmap, sys
    import torch
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE, keep = mmap.PAGESIZE, []

    def guarded(values, at_end):
        # a float tensor ending right before a PROT_NONE page (at_end) or starting right
        # after one; values.numel() == 0 gives None
        values = values.reshape(-1)
        nbytes = values.numel() * 4
        pages = (nbytes + PAGE - 1) // PAGE + 1
        mm = mmap.mmap(-1, pages * PAGE)
        keep.append(mm)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        guard = base + (pages - 1) * PAGE if at_end else base
        assert libc.mprotect(guard, PAGE, 0) == 0
        offset = (pages - 1) * PAGE - nbytes if at_end else PAGE
        t = torch.frombuffer(mm, dtype=torch.float32, count=values.numel(), offset=offset) if nbytes else None
        if t is not None:
            t.copy_(values)
        return t
""")  # the start of a guard-page script: ``guarded`` (scripts may define their own, typed)
GUARD_PREAMBLE = GUARD_PAGES + textwrap.dedent("""
    from services.executor.model.native import library
    from tests.adversarial.native_kernel_shim import _declare_shim
    lib = library.load()
    shim = _declare_shim(ctypes.CDLL(sys.argv[1]))
""")


def run_guarded(script: str, *args: str) -> str:
    """Run a guard-page ``script`` (GUARD_PREAMBLE + its cases) in a child Python with the
    repository on its path; a read past a guarded operand kills the child, not the test
    run. Asserts it exited cleanly and returns its stdout (the script's DONE / WRONG line)."""
    root = str(library.SOURCES[0].parents[4])
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout
