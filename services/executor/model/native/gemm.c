/* Weft's packed fp32 GEMM on AVX2 (layout and contract: gemm_packed.h).
 *
 * NOTE: why an outer-product tile. decode_batch.c's dot-product tiles (a weight row
 * against several activation rows, summed horizontally at the end) and oneDNN's fp32
 * linear both stay near 55-70 % of the two cores' FMA peak on AVX2 Zen (~115 and ~148
 * GFLOPS of ~214 on the 16-row decode and 2,048-row prefill shapes). Here a register tile
 * is 6 activation rows x 16 outputs: per column of X, two 8-float loads of the packed
 * weights (64 contiguous bytes) and six broadcasts of X feed 12 FMAs into 12 accumulators
 * that never need a horizontal sum (the BLIS / llama.cpp-repack shape, written anew).
 *
 *   panel p (16 outputs)      X row r0 .. r0+5 (broadcast one float each)
 *   P[p][c][0..7]  P[p][c][8..15]
 *       acc[0][0]     acc[0][1]    <- x[r0][c]
 *       ...           ...
 *       acc[5][0]     acc[5][1]    <- x[r0+5][c]
 *
 * Loop order: rows in blocks of at most MC (the block of X stays in L2 while the panels
 * pass), then the thread's panels, then KC columns at a time (a 16 KiB slice of the panel
 * and the 6 rows' slice of X stay in L1; KC_FEW for a decode step's few rows:
 * column_block), then 6-row passes. A pass's accumulators start
 * from where the previous column block left them (a per-panel buffer of the block's rows,
 * in L1), so every output is still one left-to-right sum over all k columns in fp32: a
 * row's result depends neither on the other rows of its call nor on the thread count.
 * While a column block is computed, its passes prefetch the next block of the panel (or
 * the next panel's first), each pass its share of the lines.
 */
#include "gemm_packed.h"
#include "llama_step.h"

#define MR 6     /* activation rows per register tile */
#ifndef MC_MAX
#define MC_MAX 120 /* activation rows per block at most (a multiple of MR) */
#endif
#ifndef KC
#define KC 256   /* columns per block: the panel's slice is 16 KiB */
#endif
#ifndef KC_FEW
#define KC_FEW 64 /* columns per block when the row block is a decode step's few rows */
#endif
#ifndef FEW_ROWS
#define FEW_ROWS 48 /* row blocks of at most this many rows take KC_FEW */
#endif
#ifndef BLOCK_FLOATS
#define BLOCK_FLOATS 65536 /* floats of X a row block holds at most (256 KiB, in L2) */
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
int weft_gemm_packed_available(void) { return 1; }

/* acc[r][0..15] += sum_{c < kc} x[r][c] * p[c][0..15] for r < mr (acc zero when first):
 * the 6 x 16 register tile. pf: kc cache lines to prefetch (one per column), or NULL.
 * The accumulators are locals (an __m256 array behind a pointer may alias x and p, and gcc
 * then reloads it every column), read from and written to acc once per call. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int ldx, const float *p, int kc,
                                                       const float *pf, int npf, float acc[][PACK_NR], int first) {
#define LD(r, h) (first || mr <= (r) ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[r] + 8 * (h)))
    __m256 a00 = LD(0, 0), a01 = LD(0, 1), a10 = LD(1, 0), a11 = LD(1, 1), a20 = LD(2, 0), a21 = LD(2, 1);
    __m256 a30 = LD(3, 0), a31 = LD(3, 1), a40 = LD(4, 0), a41 = LD(4, 1), a50 = LD(5, 0), a51 = LD(5, 1);
#undef LD
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * (size_t)ldx, *x3 = x + 3 * (size_t)ldx;
    const float *x4 = x + 4 * (size_t)ldx, *x5 = x + 5 * (size_t)ldx;
    for (int c = 0; c < kc; c++) {
        if (c < npf) _mm_prefetch((const char *)(pf + (size_t)c * PACK_NR), _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(p + (size_t)c * PACK_NR), b1 = _mm256_loadu_ps(p + (size_t)c * PACK_NR + 8);
        __m256 a = _mm256_broadcast_ss(x0 + c);
        a00 = _mm256_fmadd_ps(a, b0, a00), a01 = _mm256_fmadd_ps(a, b1, a01);
        if (mr > 1) a = _mm256_broadcast_ss(x1 + c), a10 = _mm256_fmadd_ps(a, b0, a10), a11 = _mm256_fmadd_ps(a, b1, a11);
        if (mr > 2) a = _mm256_broadcast_ss(x2 + c), a20 = _mm256_fmadd_ps(a, b0, a20), a21 = _mm256_fmadd_ps(a, b1, a21);
        if (mr > 3) a = _mm256_broadcast_ss(x3 + c), a30 = _mm256_fmadd_ps(a, b0, a30), a31 = _mm256_fmadd_ps(a, b1, a31);
        if (mr > 4) a = _mm256_broadcast_ss(x4 + c), a40 = _mm256_fmadd_ps(a, b0, a40), a41 = _mm256_fmadd_ps(a, b1, a41);
        if (mr > 5) a = _mm256_broadcast_ss(x5 + c), a50 = _mm256_fmadd_ps(a, b0, a50), a51 = _mm256_fmadd_ps(a, b1, a51);
    }
    _mm256_storeu_ps(acc[0], a00), _mm256_storeu_ps(acc[0] + 8, a01);
    if (mr > 1) _mm256_storeu_ps(acc[1], a10), _mm256_storeu_ps(acc[1] + 8, a11);
    if (mr > 2) _mm256_storeu_ps(acc[2], a20), _mm256_storeu_ps(acc[2] + 8, a21);
    if (mr > 3) _mm256_storeu_ps(acc[3], a30), _mm256_storeu_ps(acc[3] + 8, a31);
    if (mr > 4) _mm256_storeu_ps(acc[4], a40), _mm256_storeu_ps(acc[4] + 8, a41);
    if (mr > 5) _mm256_storeu_ps(acc[5], a50), _mm256_storeu_ps(acc[5] + 8, a51);
}

/* tile() for mr rows (1..6), the row count a compile-time constant in each branch. */
static void tile_rows(int mr, const float *x, int ldx, const float *p, int kc, const float *pf, int npf,
                      float acc[][PACK_NR], int first) {
    switch (mr) {
    case 6: tile(6, x, ldx, p, kc, pf, npf, acc, first); break;
    case 5: tile(5, x, ldx, p, kc, pf, npf, acc, first); break;
    case 4: tile(4, x, ldx, p, kc, pf, npf, acc, first); break;
    case 3: tile(3, x, ldx, p, kc, pf, npf, acc, first); break;
    case 2: tile(2, x, ldx, p, kc, pf, npf, acc, first); break;
    default: tile(1, x, ldx, p, kc, pf, npf, acc, first); break;
    }
}

static inline int imax0(int a) { return a > 0 ? a : 0; }

/* The rows of a block: at most MC_MAX, and few enough that the block's k columns of X stay
 * in L2 (~256 KiB) while the thread's panels pass; a multiple of MR. */
static inline int block_rows(int k) {
    int mc = (BLOCK_FLOATS / (k > 0 ? k : 1)) / MR * MR;
    return mc < MR ? MR : mc > MC_MAX ? MC_MAX : mc;
}

/* Columns per block for a row block of mc rows. Few rows (a decode step) stream their
 * weights from DRAM once per call: a short block keeps the rows' slice of X, the panel's
 * slice and the prefetched next slice together in L1 (16 rows x 256 columns of X alone
 * are 16 KiB). Many rows (a prefill) reuse each panel from cache, where a long block
 * spends less on carrying the accumulators. Sums run left to right whatever the block, so
 * the choice changes no bit. */
static inline int column_block(int mc) { return mc <= FEW_ROWS ? KC_FEW : KC; }

/* acc[r][j] = X[m0 + r, :] . P[pn][:][j] for r < mc (<= MC_MAX), j < 16: one panel of one
 * block, in KC-column blocks and 6-row passes. nextp: the panel after it in this thread's
 * range (prefetched during the last column block), or NULL. */
static void panel_block(const float *p, const float *nextp, const float *X, int ldx, int m0, int mc, int k,
                        float acc[][PACK_NR]) {
    const int KC_ = column_block(mc);
    const int passes = (mc + MR - 1) / MR;
    if (k <= 0) { /* no columns: every sum is 0 (the loop below would leave acc as it was) */
        memset(acc, 0, (size_t)mc * sizeof *acc);
        return;
    }
    for (int k0 = 0; k0 < k; k0 += KC_) {
        const int kc = imin(KC_, k - k0);
        const float *pf = k0 + kc < k ? p + (size_t)(k0 + kc) * PACK_NR : nextp;
        for (int q = 0; q < passes; q++) {
            const int r0 = q * mc / passes, mr = (q + 1) * mc / passes - r0; /* near-equal, <= MR */
            /* pass q prefetches its share of the next block's kc lines: the weight stream
             * runs all through the block's passes instead of in a burst during the first
             * (a burst, or no software prefetch, measured 1.1-1.3x slower 16-row steps). A
             * prefetch past the weights' end (the last panel's shorter last block) is a hint
             * that never faults. */
            const int span = (kc + passes - 1) / passes, npf = pf ? imax0(imin(span, kc - q * span)) : 0;
            const float *pfq = npf ? pf + (size_t)(q * span) * PACK_NR : NULL;
            tile_rows(mr, X + (size_t)(m0 + r0) * ldx + k0, ldx, p + (size_t)k0 * PACK_NR, kc, pfq, npf, acc + r0,
                      k0 == 0);
        }
    }
}

/* Lanes j < n of 8 as a maskload/maskstore mask. */
static inline __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

void gemm_packed_for(const float *P, const float *bias, const float *X, int ldx, float *Y, int ldy, int n, int k,
                     int R, int accumulate) {
    const int panels = (n + PACK_NR - 1) / PACK_NR, MC = block_rows(k);
    int lo, hi;
    thread_rows(panels, &lo, &hi);
    float acc[MC_MAX][PACK_NR];
    for (int m0 = 0; m0 < R; m0 += MC) {
        const int mc = imin(MC, R - m0);
        for (int pn = lo; pn < hi; pn++) {
            const float *p = P + (size_t)pn * k * PACK_NR;
            panel_block(p, pn + 1 < hi ? p + (size_t)k * PACK_NR : NULL, X, ldx, m0, mc, k, acc);
            const int o0 = pn * PACK_NR, valid = imin(PACK_NR, n - o0);
            const __m256i m0v = lanes(valid), m1v = lanes(valid - 8);
            const __m256 b0 = bias ? _mm256_maskload_ps(bias + o0, m0v) : _mm256_setzero_ps();
            const __m256 b1 = bias ? _mm256_maskload_ps(bias + o0 + 8, m1v) : _mm256_setzero_ps();
            for (int r = 0; r < mc; r++) {
                float *y = Y + (size_t)(m0 + r) * ldy + o0;
                __m256 v0 = _mm256_add_ps(_mm256_loadu_ps(acc[r]), b0), v1 = _mm256_add_ps(_mm256_loadu_ps(acc[r] + 8), b1);
                if (valid == PACK_NR) {
                    if (accumulate) v0 = _mm256_add_ps(_mm256_loadu_ps(y), v0), v1 = _mm256_add_ps(_mm256_loadu_ps(y + 8), v1);
                    _mm256_storeu_ps(y, v0), _mm256_storeu_ps(y + 8, v1);
                } else {
                    if (accumulate)
                        v0 = _mm256_add_ps(_mm256_maskload_ps(y, m0v), v0), v1 = _mm256_add_ps(_mm256_maskload_ps(y + 8, m1v), v1);
                    _mm256_maskstore_ps(y, m0v, v0), _mm256_maskstore_ps(y + 8, m1v, v1);
                }
            }
        }
    }
}

void gate_up_packed_for(const float *P, const float *X, int ldx, float *act, int ld_act, int inter, int k, int R) {
    const int panels = (inter + 7) / 8, MC = block_rows(k);
    int lo, hi;
    thread_rows(panels, &lo, &hi);
    float acc[MC_MAX][PACK_NR];
    for (int m0 = 0; m0 < R; m0 += MC) {
        const int mc = imin(MC, R - m0);
        for (int pn = lo; pn < hi; pn++) {
            const float *p = P + (size_t)pn * k * PACK_NR;
            panel_block(p, pn + 1 < hi ? p + (size_t)k * PACK_NR : NULL, X, ldx, m0, mc, k, acc);
            const int i0 = pn * 8, valid = imin(8, inter - i0);
            const __m256i mv = lanes(valid);
            for (int r = 0; r < mc; r++) {
                const __m256 g = _mm256_loadu_ps(acc[r]), e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                const __m256 v = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.f))),
                                               _mm256_loadu_ps(acc[r] + 8));
                float *a = act + (size_t)(m0 + r) * ld_act + i0;
                if (valid == 8) _mm256_storeu_ps(a, v);
                else _mm256_maskstore_ps(a, mv, v);
            }
        }
    }
}
#else
int weft_gemm_packed_available(void) { return 0; }

void gemm_packed_for(const float *P, const float *bias, const float *X, int ldx, float *Y, int ldy, int n, int k,
                     int R, int accumulate) {
    (void)P, (void)bias, (void)X, (void)ldx, (void)Y, (void)ldy, (void)n, (void)k, (void)R, (void)accumulate;
}

void gate_up_packed_for(const float *P, const float *X, int ldx, float *act, int ld_act, int inter, int k, int R) {
    (void)P, (void)X, (void)ldx, (void)act, (void)ld_act, (void)inter, (void)k, (void)R;
}
#endif

/* ---- entry points for Python (model/linear.py) --------------------------------------- */

/* P = W [n, k] packed in panels of 16 (gemm_packed.h); P holds ceil(n / 16) * k * 16 floats. */
void weft_pack_panels(const float *W, int n, int k, float *P) {
    const int panels = (n + PACK_NR - 1) / PACK_NR;
    for (int pn = 0; pn < panels; pn++)
        for (int c = 0; c < k; c++)
            for (int j = 0; j < PACK_NR; j++) {
                const int o = pn * PACK_NR + j;
                P[((size_t)pn * k + c) * PACK_NR + j] = o < n ? W[(size_t)o * k + c] : 0.f;
            }
}

/* P = gate_up [2 * inter, k] (gate rows, then up rows) packed interleaved (gemm_packed.h);
 * P holds ceil(inter / 8) * k * 16 floats. */
void weft_pack_gate_up(const float *GU, int inter, int k, float *P) {
    const int panels = (inter + 7) / 8;
    for (int pn = 0; pn < panels; pn++)
        for (int c = 0; c < k; c++)
            for (int j = 0; j < 8; j++) {
                const int i = pn * 8 + j;
                float *dst = P + ((size_t)pn * k + c) * PACK_NR;
                dst[j] = i < inter ? GU[(size_t)i * k + c] : 0.f;
                dst[8 + j] = i < inter ? GU[(size_t)(inter + i) * k + c] : 0.f;
            }
}

/* Y [R, ldy] (+)= X [R, ldx] W^T + bias with its own parallel region of num_threads. */
void weft_gemm_packed(const float *P, const float *bias, const float *X, int ldx, float *Y, int ldy, int n, int k,
                      int R, int accumulate, int num_threads) {
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    gemm_packed_for(P, bias, X, ldx, Y, ldy, n, k, R, accumulate);
}

/* act [R, ld_act] = silu(X gate^T) * (X up^T) with its own parallel region. */
void weft_gate_up_packed(const float *P, const float *X, int ldx, float *act, int ld_act, int inter, int k, int R,
                         int num_threads) {
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    gate_up_packed_for(P, X, ldx, act, ld_act, inter, k, R);
}
