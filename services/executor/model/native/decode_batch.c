/* Weft's native multi-row CPU decode: one Llama decode step for R sequences (one new token
 * each, each with its own position, cache slot, block table and length) in one C call.
 *
 * NOTE: why a separate step. At batch 1 a step is bound by memory bandwidth (decode.c); at
 * R rows the same weights feed R dot products each (SmolLM2 at 16 rows: ~4.3 GFLOP against
 * ~540 MB of weights), so FMA throughput matters as much as bandwidth. The GEMM here streams
 * every weight row from DRAM once and dots it with all R activation rows, register-blocked:
 *
 *            X rows r0 .. r0+3 (L1/L2, re-read per tile)
 *            x0  x1  x2  x3
 *   W row o0 [a00 a01 a02 a03]     16 AVX-512 accumulators: each 16-float chunk of a
 *   W row o1 [a10 ...        ]     weight row is loaded once and FMA'd into 4 of them,
 *   W row o2 [...            ]     each x chunk once into 4: 8 loads per 16 FMAs.
 *   W row o3 [...         a33]     One transpose-add tree reduces the 16 sums at the end.
 *
 * The 4-row weight tile (4 x in_features floats, <= 24 KiB) stays in L1 while every block
 * of 4 activation rows passes over it; the next tile is prefetched a few rows per pass
 * (prefetch_rows: a burst in the first pass left the DRAM stream idle in the others).
 * Each thread owns one contiguous range of tiles, as the batch-1 GEMV owns rows. The whole
 * step runs inside ONE parallel region (6 barriers per layer: the batch-1 step's 5 plus
 * one between writing every row's K/V and attending, so no row can read a slot another row
 * is writing, as on the torch path). Attention is one row per iteration (attend_row:
 * llama_step.h's attend_kv_heads, the one decode.c calls per KV head), and SiLU is exp16
 * on AVX-512 builds too.
 */
#include "llama_step.h"
#include "gemm_packed.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TILE_W 6 /* weight rows per register tile: two halves of 3 (half_dots) */
#else
#define TILE_W 4 /* weight rows per register tile */
#endif
#define TILE_R 4 /* activation rows per register tile */
#define PF_DIST 1 /* the weight tile prefetched: the next one (2 ahead, or into L2, measured no better) */
#define PF_HINT _MM_HINT_T0

#if defined(__AVX512F__)
/* acc[a][b] += W[a, i:i+16] . X[b, i:i+16] (m masks the columns past k). */
#define TILE_STEP(LOAD)                                                                         \
    do {                                                                                        \
        __m512 wv[TILE_W];                                                                      \
        for (int a = 0; a < nw; a++) wv[a] = LOAD(w + (size_t)a * ldw + i);                     \
        for (int a = 0; a < TILE_W; a++)                                                        \
            if (pf_rows & (1u << a)) _mm_prefetch((const char *)(pf + (size_t)a * ldw + i), PF_HINT); \
        for (int b = 0; b < nr; b++) {                                                          \
            __m512 xv = LOAD(x + (size_t)b * ldx + i);                                          \
            __asm__("" : "+v"(xv)); /* one load into a register, not one folded into each FMA */ \
            for (int a = 0; a < nw; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);     \
        }                                                                                       \
    } while (0)
#define LOAD_FULL(p) _mm512_loadu_ps(p)
#define LOAD_MASKED(p) _mm512_maskz_loadu_ps(m, p)

/* out[a * TILE_R + b] = W[a, :] . X[b, :] for a < nw, b < nr. w: nw weight rows of k
 * floats, ldw apart (k: adjacent rows); x: [nr, ldx] activation rows; pf: a later tile's first row, of which the rows
 * in the bit mask pf_rows are prefetched (prefetch_rows).
 * Always inlined with constant nw / nr, so the accumulators live in registers (acc is
 * never address-taken: copied out for the reduction, or gcc spills it every iteration). */
static inline __attribute__((always_inline)) void tile_dots(const float *w, size_t ldw, int k, const float *x, int ldx,
                                                            const int nw, const int nr, const float *pf,
                                                            unsigned pf_rows, float *out) {
    __m512 acc[TILE_W][TILE_R];
    for (int a = 0; a < TILE_W; a++)
        for (int b = 0; b < TILE_R; b++) acc[a][b] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) TILE_STEP(LOAD_FULL);
    if (i < k) {
        const __mmask16 m = (__mmask16)((1u << (k - i)) - 1u);
        TILE_STEP(LOAD_MASKED);
    }
    if (nw == TILE_W && nr == TILE_R) {
        __m512 v[TILE_W * TILE_R];
        for (int a = 0; a < TILE_W; a++)
            for (int b = 0; b < TILE_R; b++) v[a * TILE_R + b] = acc[a][b];
        reduce16(v, out);
    } else {
        for (int a = 0; a < nw; a++)
            for (int b = 0; b < nr; b++) out[a * TILE_R + b] = _mm512_reduce_add_ps(acc[a][b]);
    }
}

static void tile_dispatch(const float *w, size_t ldw, int k, const float *x, int ldx, int nw, int nr, const float *pf,
                          unsigned pf_rows, float *out) {
#define TILE_CASE(W_, R_) \
    if (nw == W_ && nr == R_) { tile_dots(w, ldw, k, x, ldx, W_, R_, pf, pf_rows, out); return; }
    TILE_CASE(4, 4) TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
    TILE_CASE(3, 4) TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
    TILE_CASE(2, 4) TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
    TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
#undef TILE_CASE
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has 16 vector registers, not 32: the tile is 6 weight rows x 4 activation rows, run
 * as two 3 x 4 halves (12 accumulators). gcc keeps the activation chunk in a register and
 * folds the weight loads into the FMAs (16 loads per 12 FMAs): ~115 GFLOPS with the weights
 * in cache, ~100 streamed, of a ~207 peak on a 2-core Zen 2. Steps of up to STREAM_MAX_ROWS
 * rows use it (they wait on DRAM: six streams); larger ones use the wide tiles below (2
 * weight rows pinned in registers x 6 activation rows: 141 / 114-118 GFLOPS), which lose
 * at 3-5 rows (a pass of <= 4 rows runs 8 or fewer FMA chains, and one stream of adjacent
 * rows). One plain dot per pair (the fallback below) loads twice per FMA and reduces every
 * pair on its own: a 16-row SmolLM2 step took ~1.7x as long that way. */
#define HALF_W 3
#define HALF_STEP(LOAD, at)                                                                     \
    do {                                                                                        \
        __m256 wv[HALF_W];                                                                      \
        for (int a = 0; a < nw; a++) wv[a] = LOAD(w + (size_t)a * ldw + (at));                  \
        for (int b = 0; b < nr; b++) {                                                          \
            __m256 xv = LOAD(x + (size_t)b * ldx + (at));                                       \
            __asm__("" : "+x"(xv)); /* one load into a register, not one folded into each FMA */ \
            for (int a = 0; a < nw; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);     \
        }                                                                                       \
    } while (0)
#define LOAD_FULL(p) _mm256_loadu_ps(p)
#define LOAD_MASKED(p) _mm256_maskload_ps(p, m)

/* out[a * TILE_R + b] = W[a, :] . X[b, :] for a < nw <= HALF_W, b < nr; the rows of the later
 * tile pf in the bit mask pf_rows are prefetched, one cache line per 16 columns. Always
 * inlined with constant nw / nr (the accumulators stay in registers; see tile_dots above). */
static inline __attribute__((always_inline)) void half_dots(const float *w, size_t ldw, int k, const float *x, int ldx,
                                                            const int nw, const int nr, const float *pf,
                                                            unsigned pf_rows, float *out) {
    __m256 acc[HALF_W][TILE_R];
    for (int a = 0; a < HALF_W; a++)
        for (int b = 0; b < TILE_R; b++) acc[a][b] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        for (int a = 0; a < HALF_W; a++)
            if (pf_rows & (1u << a)) _mm_prefetch((const char *)(pf + (size_t)a * ldw + i), PF_HINT);
        HALF_STEP(LOAD_FULL, i);
        HALF_STEP(LOAD_FULL, i + 8);
    }
    for (; i + 8 <= k; i += 8) HALF_STEP(LOAD_FULL, i);
    if (i < k) {
        const __m256i m = mask8(k - i);
        HALF_STEP(LOAD_MASKED, i);
    }
    if (nw == HALF_W && nr == TILE_R) {
        __m256 v[HALF_W * TILE_R];
        for (int a = 0; a < HALF_W; a++)
            for (int b = 0; b < TILE_R; b++) v[a * TILE_R + b] = acc[a][b];
        _mm256_storeu_ps(out, reduce8(v)); /* the first 8 sums in one tree, the rest one by one */
        for (int j = 8; j < HALF_W * TILE_R; j++) out[j] = hsum8(v[j]);
    } else {
        for (int a = 0; a < nw; a++)
            for (int b = 0; b < nr; b++) out[a * TILE_R + b] = hsum8(acc[a][b]);
    }
}

static void half_dispatch(const float *w, size_t ldw, int k, const float *x, int ldx, int nw, int nr,
                          const float *pf, unsigned pf_rows, float *out) {
#define HALF_CASE(W_, R_) \
    if (nw == W_ && nr == R_) { half_dots(w, ldw, k, x, ldx, W_, R_, pf, pf_rows, out); return; }
    HALF_CASE(3, 4) HALF_CASE(3, 3) HALF_CASE(3, 2) HALF_CASE(3, 1)
    HALF_CASE(2, 4) HALF_CASE(2, 3) HALF_CASE(2, 2) HALF_CASE(2, 1)
    HALF_CASE(1, 4) HALF_CASE(1, 3) HALF_CASE(1, 2) HALF_CASE(1, 1)
#undef HALF_CASE
}

/* Steps of more than STREAM_MAX_ROWS rows are bound by the FMAs, not by DRAM: there a
 * tile is WIDE_W = 2 adjacent weight rows against up to WIDE_R = 6 activation rows, the two
 * weight chunks pinned in registers (the asm barrier stops gcc folding them into the FMAs
 * as it does above) and each activation chunk loaded once: 8 loads per 12 FMAs, 15 of the 16
 * registers. A step's rows are cut into ceil(R / 6) passes of near-equal size (16 rows:
 * 5 + 5 + 6), so every pass keeps >= 8 independent FMA chains. */
#define WIDE_W 2
#define WIDE_R 6
#define WIDE_STEP(LOAD, at)                                                                     \
    do {                                                                                        \
        __m256 w0 = LOAD(w + (at)), w1 = nw > 1 ? LOAD(w + ldw + (at)) : w0;                    \
        __asm__("" : "+x"(w0), "+x"(w1)); /* both weight chunks stay in registers */           \
        for (int b = 0; b < nr; b++) {                                                          \
            __m256 xv = LOAD(x + (size_t)b * ldx + (at));                                       \
            __asm__("" : "+x"(xv));                                                             \
            acc[0][b] = _mm256_fmadd_ps(w0, xv, acc[0][b]);                                     \
            if (nw > 1) acc[1][b] = _mm256_fmadd_ps(w1, xv, acc[1][b]);                         \
        }                                                                                       \
    } while (0)

/* out[a * WIDE_R + b] = W[a, :] . X[b, :] for a < nw <= WIDE_W, b < nr <= WIDE_R; the rows
 * of the later tile pf in the bit mask pf_rows are prefetched, one cache line per 16
 * columns. Always inlined with constant nw / nr (see half_dots). */
static inline __attribute__((always_inline)) void wide_dots(const float *w, size_t ldw, int k, const float *x, int ldx,
                                                            const int nw, const int nr, const float *pf,
                                                            unsigned pf_rows, float *out) {
    __m256 acc[WIDE_W][WIDE_R];
    for (int a = 0; a < WIDE_W; a++)
        for (int b = 0; b < WIDE_R; b++) acc[a][b] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        for (int a = 0; a < WIDE_W; a++)
            if (pf_rows & (1u << a)) _mm_prefetch((const char *)(pf + (size_t)a * ldw + i), PF_HINT);
        WIDE_STEP(LOAD_FULL, i);
        WIDE_STEP(LOAD_FULL, i + 8);
    }
    for (; i + 8 <= k; i += 8) WIDE_STEP(LOAD_FULL, i);
    if (i < k) {
        const __m256i m = mask8(k - i);
        WIDE_STEP(LOAD_MASKED, i);
    }
    for (int a = 0; a < nw; a++)
        for (int b = 0; b < nr; b++) out[a * WIDE_R + b] = hsum8(acc[a][b]);
}

static void wide_dispatch(const float *w, size_t ldw, int k, const float *x, int ldx, int nw, int nr,
                          const float *pf, unsigned pf_rows, float *out) {
#define WIDE_CASE(W_, R_) \
    if (nw == W_ && nr == R_) { wide_dots(w, ldw, k, x, ldx, W_, R_, pf, pf_rows, out); return; }
    /* Past STREAM_MAX_ROWS = 6 rows a pass holds 3 to 6 rows (7: 3 + 4); the 1- and 2-row
     * cases keep the dispatch total should STREAM_MAX_ROWS ever be lowered. */
    WIDE_CASE(2, 6) WIDE_CASE(2, 5) WIDE_CASE(2, 4) WIDE_CASE(2, 3) WIDE_CASE(2, 2) WIDE_CASE(2, 1)
    WIDE_CASE(1, 6) WIDE_CASE(1, 5) WIDE_CASE(1, 4) WIDE_CASE(1, 3) WIDE_CASE(1, 2) WIDE_CASE(1, 1)
#undef WIDE_CASE
}

static void tile_dispatch(const float *w, size_t ldw, int k, const float *x, int ldx, int nw, int nr, const float *pf,
                          unsigned pf_rows, float *out) {
    for (int a0 = 0; a0 < nw; a0 += HALF_W)
        half_dispatch(w + (size_t)a0 * ldw, ldw, k, x, ldx, nw - a0 < HALF_W ? nw - a0 : HALF_W, nr,
                      pf + (size_t)a0 * ldw, (pf_rows >> a0) & ((1u << HALF_W) - 1u), out + a0 * TILE_R);
}
#else
/* Without AVX2 or AVX-512: one dot per (weight row, activation row); same results, slower. */
static void tile_dispatch(const float *w, size_t ldw, int k, const float *x, int ldx, int nw, int nr, const float *pf,
                          unsigned pf_rows, float *out) {
    (void)pf;
    (void)pf_rows;
    for (int a = 0; a < nw; a++)
        for (int b = 0; b < nr; b++) out[a * TILE_R + b] = dot(w + (size_t)a * ldw, x + (size_t)b * ldx, k);
}
#endif


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 builds read each thread's weight rows as TILE_W streams when R <= STREAM_MAX_ROWS:
 * the thread's range of n rows is cut into TILE_W equal parts and a tile takes one row of
 * each (row i of every part, ldw = part * k apart), the few rows left over (< TILE_W)
 * making one last tile of adjacent rows. Six distant streams keep more DRAM reads in
 * flight than one stream of adjacent tiles, which is what a step of a few rows waits on:
 * an alternating A/B put 2-8 row steps 1.02-1.18x faster (bench 1.11-1.18x, SmolLM2
 * 1.02-1.06x) than adjacent tiles. The next tile's rows are prefetched, spread over the
 * passes as prefetch_rows does. Past 6 rows a step is bound by the FMAs and the wide tiles
 * take over (gemm_wide_for: 7-16 rows 1.14-1.38x the streams, 3-5 rows 0.71-1.06x). */
#define STREAM_MAX_ROWS 6

/* Which of the tile's TILE_W rows pass `pass` (of `passes`) prefetches. */
static inline unsigned spread_rows(int pass, int passes) {
    unsigned mask = 0;
    for (int a = 0; a < TILE_W; a++)
        if (passes > TILE_W ? a == pass : a * passes / TILE_W == pass) mask |= 1u << a;
    return mask;
}

/* Tile i of a thread's range [lo, hi) cut into TILE_W parts of `part` rows: TILE_W streams
 * (i < part: rows lo + i + a * part) or the leftover tile of adjacent rows. As (its first
 * row, output stride, rows, row stride in floats). */
typedef struct { int o0, ostride, nw; size_t ldw; } stream_tile;

static inline stream_tile stream_tile_at(int i, int lo, int hi, int part, int k) {
    stream_tile t;
    if (i < part) {
        t.o0 = lo + i, t.ostride = part, t.nw = TILE_W, t.ldw = (size_t)part * k;
    } else {
        t.o0 = lo + TILE_W * part, t.ostride = 1, t.nw = hi - t.o0, t.ldw = (size_t)k;
    }
    return t;
}

static void gemm_wide_for(const float *W, const float *b, const float *X, int ldx, float *Y, int ldy, int n, int k,
                          int R, int accumulate);
static void gate_up_wide_for(const float *gu, const float *X, float *act, int inter, int H, int R);

/* Inside a parallel region: Y[r, o] (+)= W[o, :] . X[r, :] + b[o] for r < R, o < n.
 * W [n, k]; X [R, ldx]; Y [R, ldy]. accumulate != 0 adds into Y (a residual). Each thread
 * owns a contiguous range of rows, read as TILE_W streams up to STREAM_MAX_ROWS rows and
 * as wide tiles past it (gemm_wide_for). Ends with a barrier. */

static void gemm_rows_for(const float *W, const float *P, const float *b, const float *X, int ldx, float *Y, int ldy,
                          int n, int k, int R, int accumulate) {
    /* Past STREAM_MAX_ROWS, gemm.c's outer-product tiles over the packed copy where the model
     * has one: 1.14-1.18x faster steps at 16 rows, 1.28-1.43x at 32 (SmolLM2 / bench,
     * benchmarks/packed_gemm.py); at 7-10 rows alternating rounds read 0.87-1.13x, but every
     * step past 6 rows keeps one kernel, so a row's bits do not depend on its batch there. */
    if (R > STREAM_MAX_ROWS && P) {
        gemm_packed_for(P, b, X, ldx, Y, ldy, n, k, R, accumulate);
        #pragma omp barrier
        return;
    }
    if (R > STREAM_MAX_ROWS) {
        gemm_wide_for(W, b, X, ldx, Y, ldy, n, k, R, accumulate);
        return;
    }
    int lo, hi;
    thread_rows(n, &lo, &hi);
    const int part = (hi - lo) / TILE_W, passes = (R + TILE_R - 1) / TILE_R;
    const size_t next = (size_t)k; /* the next tile (< part): its first row */
    for (int i = 0; i <= part; i++) {
        const stream_tile t = stream_tile_at(i, lo, hi, part, k);
        if (t.nw <= 0) break;
        const float *w = W + (size_t)t.o0 * k;
        for (int r0 = 0; r0 < R; r0 += TILE_R) {
            const int nr = imin(TILE_R, R - r0);
            float out[TILE_W * TILE_R];
            const unsigned pf_rows = i + 1 < part ? spread_rows(r0 / TILE_R, passes) : 0;
            tile_dispatch(w, t.ldw, k, X + (size_t)r0 * ldx, ldx, t.nw, nr, w + next, pf_rows, out);
            for (int a = 0; a < t.nw; a++)
                for (int r = 0; r < nr; r++) {
                    const int o = t.o0 + a * t.ostride;
                    float v = out[a * TILE_R + r] + (b ? b[o] : 0.f);
                    float *y = Y + (size_t)(r0 + r) * ldy + o;
                    *y = accumulate ? *y + v : v;
                }
        }
    }
    #pragma omp barrier
}

/* Inside a parallel region: act[r, i] = silu(gate[r, i]) * up[r, i] for i < inter, a tile
 * of gate rows and the same tile of up rows in one pass over the R rows (TILE_W streams
 * each up to STREAM_MAX_ROWS rows, wide tiles past it). gu [2 * inter, H]. Ends with a barrier. */
static void gate_up_rows_for(const float *gu, const float *P, const float *X, float *act, int inter, int H, int R) {
    if (R > STREAM_MAX_ROWS && P) {
        gate_up_packed_for(P, X, H, act, inter, inter, H, R);
        #pragma omp barrier
        return;
    }
    if (R > STREAM_MAX_ROWS) {
        gate_up_wide_for(gu, X, act, inter, H, R);
        return;
    }
    int lo, hi;
    thread_rows(inter, &lo, &hi);
    const int part = (hi - lo) / TILE_W, passes = (R + TILE_R - 1) / TILE_R;
    const size_t next = (size_t)H; /* the next tile (< part): its first row */
    for (int i = 0; i <= part; i++) {
        const stream_tile t = stream_tile_at(i, lo, hi, part, H);
        if (t.nw <= 0) break;
        const float *wg = gu + (size_t)t.o0 * H, *wu = gu + (size_t)(inter + t.o0) * H;
        for (int r0 = 0; r0 < R; r0 += TILE_R) {
            const int nr = imin(TILE_R, R - r0);
            const unsigned pf_rows = i + 1 < part ? spread_rows(r0 / TILE_R, passes) : 0;
            float g[TILE_W * TILE_R] = {0}, u[TILE_W * TILE_R] = {0};
            tile_dispatch(wg, t.ldw, H, X + (size_t)r0 * H, H, t.nw, nr, wg + next, pf_rows, g);
            tile_dispatch(wu, t.ldw, H, X + (size_t)r0 * H, H, t.nw, nr, wu + next, pf_rows, u);
            for (int j = 0; j < TILE_W * TILE_R; j += 8) { /* 8 silu(g) * u at a time */
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(e, _mm256_set1_ps(1.f))),
                                                      _mm256_loadu_ps(u + j)));
            }
            for (int a = 0; a < t.nw; a++)
                for (int r = 0; r < nr; r++) act[(size_t)(r0 + r) * inter + t.o0 + a * t.ostride] = g[a * TILE_R + r];
        }
    }
    #pragma omp barrier
}

/* Row r0 of pass p of the `passes` near-equal passes over R activation rows. */
static inline int wide_pass_start(int p, int passes, int R) { return p * R / passes; }

/* Which of the next wide tile's rows (of `rows`) pass p of `passes` prefetches. */
static inline unsigned wide_spread(int p, int passes, int rows) {
    unsigned mask = 0;
    for (int a = 0; a < rows; a++)
        if (passes > WIDE_W ? a == p : a * passes / WIDE_W == p) mask |= 1u << a;
    return mask;
}

/* gemm_rows_for past STREAM_MAX_ROWS rows: the thread's contiguous range in wide tiles of
 * 2 adjacent rows, each against every activation row in ceil(R / 6) passes. Ends with a
 * barrier. */
static void gemm_wide_for(const float *W, const float *b, const float *X, int ldx, float *Y, int ldy, int n, int k,
                          int R, int accumulate) {
    int lo, hi;
    thread_rows(n, &lo, &hi);
    const int passes = (R + WIDE_R - 1) / WIDE_R;
    for (int o0 = lo; o0 < hi; o0 += WIDE_W) {
        const int nw = imin(WIDE_W, hi - o0), next_rows = imin(WIDE_W, hi - o0 - WIDE_W);
        const float *w = W + (size_t)o0 * k;
        for (int p = 0; p < passes; p++) {
            const int r0 = wide_pass_start(p, passes, R), nr = wide_pass_start(p + 1, passes, R) - r0;
            float out[WIDE_W * WIDE_R];
            const unsigned pf_rows = next_rows > 0 ? wide_spread(p, passes, next_rows) : 0;
            wide_dispatch(w, (size_t)k, k, X + (size_t)r0 * ldx, ldx, nw, nr, w + (size_t)WIDE_W * k, pf_rows, out);
            for (int a = 0; a < nw; a++)
                for (int r = 0; r < nr; r++) {
                    float v = out[a * WIDE_R + r] + (b ? b[o0 + a] : 0.f);
                    float *y = Y + (size_t)(r0 + r) * ldy + o0 + a;
                    *y = accumulate ? *y + v : v;
                }
        }
    }
    #pragma omp barrier
}

/* gate_up_rows_for past STREAM_MAX_ROWS rows: 2 gate rows and their 2 up rows per tile. Ends
 * with a barrier. */
static void gate_up_wide_for(const float *gu, const float *X, float *act, int inter, int H, int R) {
    int lo, hi;
    thread_rows(inter, &lo, &hi);
    const int passes = (R + WIDE_R - 1) / WIDE_R;
    for (int i0 = lo; i0 < hi; i0 += WIDE_W) {
        const int nw = imin(WIDE_W, hi - i0), next_rows = imin(WIDE_W, hi - i0 - WIDE_W);
        const float *wg = gu + (size_t)i0 * H, *wu = gu + (size_t)(inter + i0) * H;
        for (int p = 0; p < passes; p++) {
            const int r0 = wide_pass_start(p, passes, R), nr = wide_pass_start(p + 1, passes, R) - r0;
            const unsigned pf_rows = next_rows > 0 ? wide_spread(p, passes, next_rows) : 0;
            float g[16] = {0}, u[16] = {0}; /* WIDE_W * WIDE_R = 12 used, 16 for two vectors */
            wide_dispatch(wg, (size_t)H, H, X + (size_t)r0 * H, H, nw, nr, wg + (size_t)WIDE_W * H, pf_rows, g);
            wide_dispatch(wu, (size_t)H, H, X + (size_t)r0 * H, H, nw, nr, wu + (size_t)WIDE_W * H, pf_rows, u);
            for (int j = 0; j < 16; j += 8) { /* 8 silu(g) * u at a time */
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(e, _mm256_set1_ps(1.f))),
                                                      _mm256_loadu_ps(u + j)));
            }
            for (int a = 0; a < nw; a++)
                for (int r = 0; r < nr; r++) act[(size_t)(r0 + r) * inter + i0 + a] = g[a * WIDE_R + r];
        }
    }
    #pragma omp barrier
}
#else
/* Which rows of the tile PF_DIST ahead pass `pass` (of `passes` over the activation rows)
 * prefetches: spread over the passes, so the weight stream runs all through the tile's
 * arithmetic instead of in a burst during its first pass. */
static inline unsigned prefetch_rows(int pass, int passes, int tile, int tiles, int n) {
    if (tile + PF_DIST >= tiles) return 0;
    const int rows = imin(TILE_W, n - (tile + PF_DIST) * TILE_W);
    unsigned mask = 0;
    for (int a = 0; a < rows; a++)
        if (passes > TILE_W ? a == pass : a * passes / TILE_W == pass) mask |= 1u << a;
    return mask;
}

/* Inside a parallel region: Y[r, o] (+)= W[o, :] . X[r, :] + b[o] for r < R, o < n.
 * W [n, k]; X [R, ldx]; Y [R, ldy]. accumulate != 0 adds into Y (a residual). Each thread
 * owns a contiguous range of 4-row weight tiles. Ends with the loop's barrier. */
static void gemm_rows_for(const float *W, const float *P, const float *b, const float *X, int ldx, float *Y, int ldy,
                          int n, int k, int R, int accumulate) {
    (void)P; /* packed copies exist on AVX2 builds only (gemm_packed.h) */
    const int tiles = (n + TILE_W - 1) / TILE_W, passes = (R + TILE_R - 1) / TILE_R;
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int o0 = t * TILE_W, nw = imin(TILE_W, n - o0);
        const float *w = W + (size_t)o0 * k;
        for (int r0 = 0; r0 < R; r0 += TILE_R) {
            const int nr = imin(TILE_R, R - r0);
            float out[TILE_W * TILE_R];
            const unsigned pf_rows = prefetch_rows(r0 / TILE_R, passes, t, tiles, n);
            tile_dispatch(w, k, k, X + (size_t)r0 * ldx, ldx, nw, nr, w + (size_t)PF_DIST * TILE_W * k, pf_rows, out);
            for (int a = 0; a < nw; a++)
                for (int r = 0; r < nr; r++) {
                    float v = out[a * TILE_R + r] + (b ? b[o0 + a] : 0.f);
                    float *y = Y + (size_t)(r0 + r) * ldy + o0 + a;
                    *y = accumulate ? *y + v : v;
                }
        }
    }
}

/* Inside a parallel region: act[r, i] = silu(gate[r, i]) * up[r, i] for i < inter, the gate
 * rows' tile and its up rows' tile in one pass over the R rows. gu [2 * inter, H]. */
static void gate_up_rows_for(const float *gu, const float *P, const float *X, float *act, int inter, int H, int R) {
    (void)P;
    const int tiles = (inter + TILE_W - 1) / TILE_W, passes = (R + TILE_R - 1) / TILE_R;
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int i0 = t * TILE_W, nw = imin(TILE_W, inter - i0);
        const float *wg = gu + (size_t)i0 * H, *wu = gu + (size_t)(inter + i0) * H;
        for (int r0 = 0; r0 < R; r0 += TILE_R) {
            const int nr = imin(TILE_R, R - r0);
            const unsigned pf_rows = prefetch_rows(r0 / TILE_R, passes, t, tiles, inter);
            const size_t ahead = (size_t)PF_DIST * TILE_W * H;
            float g[TILE_W * TILE_R] = {0}, u[TILE_W * TILE_R] = {0};
            tile_dispatch(wg, H, H, X + (size_t)r0 * H, H, nw, nr, wg + ahead, pf_rows, g);
            tile_dispatch(wu, H, H, X + (size_t)r0 * H, H, nw, nr, wu + ahead, pf_rows, u);
#if defined(__AVX512F__)
            { /* the tile's 16 silu(g) * u at once (TILE_W * TILE_R == 16) */
                const __m512 gv = _mm512_loadu_ps(g);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
                _mm512_storeu_ps(g, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(e, _mm512_set1_ps(1.f))),
                                                  _mm512_loadu_ps(u)));
            }
#elif defined(__AVX2__) && defined(__FMA__)
            for (int j = 0; j < TILE_W * TILE_R; j += 8) { /* 8 silu(g) * u at a time */
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(e, _mm256_set1_ps(1.f))),
                                                      _mm256_loadu_ps(u + j)));
            }
#else
            for (int j = 0; j < TILE_W * TILE_R; j++) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
#endif
            for (int a = 0; a < nw; a++)
                for (int r = 0; r < nr; r++) act[(size_t)(r0 + r) * inter + i0 + a] = g[a * TILE_R + r];
        }
    }
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* llama_step.h's attend_kv_heads: the attention decode.c shares. */
#define attend_row attend_kv_heads
#else
/* Without AVX2 or AVX-512: attend_head (llama_step.h) per query head. */
static void attend_row(const weft_model *m, const float *cache, const float *q, float *out, float *scores,
                       int64_t *tok, int g0, int g1, int group, const int32_t *block_table, int seq_len) {
    (void)tok;
    for (int hd = g0 * group; hd < g1 * group; hd++)
        attend_head(m, cache, q + (size_t)hd * m->head_dim, out + (size_t)hd * m->head_dim, scores, hd / group,
                    block_table, seq_len);
}
#endif

/* One decode step of R sequences: row r decodes token_ids[r] at positions[r], its K/V go
 * to cache slot slots[r]; block_tables [R, table_stride] lists each row's blocks and
 * seq_lens[r] counts its tokens including this one. Writes the R K/V slots of every layer
 * and logits [R, vocab]; reads nothing else it does not own. Returns 0, or -1 when out
 * of memory. */
int weft_decode_rows(const weft_model *m, int R, const int64_t *token_ids, const int64_t *positions,
                     const int64_t *slots, const int32_t *block_tables, int table_stride, const int32_t *seq_lens,
                     float *logits, int num_threads) {
    const int H = m->hidden, d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int q_dim = nh * d, kv_dim = nkv * d, qkv_dim = q_dim + 2 * kv_dim, inter = m->intermediate;
    const int group = nh / nkv;
    if (num_threads < 1) num_threads = 1;
    const int split = R >= 2 * num_threads ? 1 : nkv; /* attention items per row */
    int max_len = 1;
    for (int r = 0; r < R; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    /* scratch: h [R, H] | qkv [R, qkv_dim] | attn [R, q_dim] | act [R, inter]
     *          | scores [threads, num_heads, max_len] | x [threads, R, H]
     *          | token slots [threads, max_len] (int64, attend_row's) */
    size_t n_scratch = (size_t)R * (H + qkv_dim + q_dim + inter) + (size_t)num_threads * nh * max_len
                       + (size_t)num_threads * R * H;
    n_scratch += n_scratch & 1; /* the int64 slots after the floats start 8-byte aligned */
    float *buf = (float *)malloc(n_scratch * sizeof(float) + (size_t)num_threads * max_len * sizeof(int64_t));
    if (!buf) return -1;
    float *h = buf, *qkv = h + (size_t)R * H, *attn = qkv + (size_t)R * qkv_dim, *act = attn + (size_t)R * q_dim;
    float *scores = act + (size_t)R * inter, *xs = scores + (size_t)num_threads * nh * max_len;
    int64_t *toks = (int64_t *)(buf + n_scratch);
    for (int r = 0; r < R; r++) memcpy(h + (size_t)r * H, m->embed + (size_t)token_ids[r] * H, (size_t)H * sizeof(float));
    const size_t v_offset = (size_t)m->num_blocks * m->block_size * kv_dim;

    #pragma omp parallel num_threads(num_threads)
    {
        /* Each thread normalises all R rows of h into its own x (cheaper than a barrier). */
        const int tid = omp_get_thread_num();
        float *x = xs + (size_t)tid * R * H, *sc = scores + (size_t)tid * nh * max_len;
        int64_t *tok = toks + (size_t)tid * max_len;
        for (int l = 0; l < m->num_layers; l++) {
            float *cache = m->kv_cache[l];
            for (int r = 0; r < R; r++) rms_norm(h + (size_t)r * H, m->input_norm[l], x + (size_t)r * H, H, m->eps);
            gemm_rows_for(m->qkv[l], m->qkv_p ? m->qkv_p[l] : NULL, m->qkv_bias[l], x, H, qkv, qkv_dim, qkv_dim, H, R, 0);
            /* rope each row's key and query heads at its position, write its K/V slot */
            #pragma omp for schedule(static)
            for (int p = 0; p < R * nkv; p++) {
                const int r = p / nkv, g = p % nkv;
                const float *cos = m->cos + (size_t)positions[r] * d, *sin = m->sin + (size_t)positions[r] * d;
                float *row = qkv + (size_t)r * qkv_dim;
                float *k = row + q_dim + (size_t)g * d, *v = k + kv_dim;
                rope(k, 1, d, cos, sin);
                rope(row + (size_t)g * group * d, group, d, cos, sin);
                const size_t k_slot = (size_t)slots[r] * kv_dim + (size_t)g * d;
                memcpy(cache + k_slot, k, (size_t)d * sizeof(float));
                memcpy(cache + v_offset + k_slot, v, (size_t)d * sizeof(float));
            }
            /* every slot written (the barrier above): attend, one row (or, with fewer rows
             * than 2 per thread, one (row, KV head)) per item */
            #pragma omp for schedule(dynamic, 1)
            for (int p = 0; p < R * split; p++) {
                const int r = p / split, part = p % split;
                attend_row(m, cache, qkv + (size_t)r * qkv_dim, attn + (size_t)r * q_dim, sc, tok, part * nkv / split,
                           (part + 1) * nkv / split, group, block_tables + (size_t)r * table_stride, seq_lens[r]);
            }
            gemm_rows_for(m->o[l], m->o_p ? m->o_p[l] : NULL, m->o_bias[l], attn, q_dim, h, H, H, q_dim, R, 1); /* h += o(attn) */
            for (int r = 0; r < R; r++) rms_norm(h + (size_t)r * H, m->post_norm[l], x + (size_t)r * H, H, m->eps);
            gate_up_rows_for(m->gate_up[l], m->gate_up_p ? m->gate_up_p[l] : NULL, x, act, inter, H, R);
            gemm_rows_for(m->down[l], m->down_p ? m->down_p[l] : NULL, NULL, act, inter, h, H, H, inter, R, 1); /* h += down(act) */
        }
        for (int r = 0; r < R; r++) rms_norm(h + (size_t)r * H, m->final_norm, x + (size_t)r * H, H, m->eps);
        gemm_rows_for(m->lm_head, m->lm_head_p, NULL, x, H, logits, m->vocab, m->vocab, H, R, 0);
    }
    free(buf);
    return 0;
}

/* The attention of R decode rows over one layer's cache, for the torch path: its forward
 * computes the projections of every row of a step (a mixed step's prefill chunks and
 * decodes in one pass over the weights) and hands the decode rows' attention here instead
 * of gathering each row's whole context into a dense copy. q: [R, num_heads * head_dim]
 * rows q_stride floats apart (rotated, as the step computes them); out: the same shape,
 * out_stride apart; cache: the layer's [2, num_blocks, block_size, kv_heads, head_dim]
 * (each row's new K/V already written); block_tables, seq_lens: as weft_decode_rows.
 * Returns 0, or -1 when out of memory. */
int weft_attend_rows(const weft_model *m, const float *cache, int R, const float *q, int q_stride, float *out,
                     int out_stride, const int32_t *block_tables, int table_stride, const int32_t *seq_lens,
                     int num_threads) {
    const int nh = m->num_heads, nkv = m->num_kv_heads, group = nh / nkv;
    if (num_threads < 1) num_threads = 1;
    const int split = R >= 2 * num_threads ? 1 : nkv; /* attention items per row, as in the step */
    int max_len = 1;
    for (int r = 0; r < R; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    size_t n_scores = (size_t)num_threads * nh * max_len;
    n_scores += n_scores & 1; /* the int64 slots after the floats start 8-byte aligned */
    float *buf = (float *)malloc(n_scores * sizeof(float) + (size_t)num_threads * max_len * sizeof(int64_t));
    if (!buf) return -1;
    int64_t *toks = (int64_t *)(buf + n_scores);
    #pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num();
        float *sc = buf + (size_t)tid * nh * max_len;
        int64_t *tok = toks + (size_t)tid * max_len;
        #pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < R * split; p++) {
            const int r = p / split, part = p % split;
            attend_row(m, cache, q + (size_t)r * q_stride, out + (size_t)r * out_stride, sc, tok, part * nkv / split,
                       (part + 1) * nkv / split, group, block_tables + (size_t)r * table_stride, seq_lens[r]);
        }
    }
    free(buf);
    return 0;
}
