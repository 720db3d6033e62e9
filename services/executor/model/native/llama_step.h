/* What Weft's two native decode steps share (decode.c: one sequence; decode_batch.c: R
 * sequences): the model struct ctypes fills (native/decoder.py mirrors it), the one-row
 * dot product, RMSNorm, RoPE, one query head's paged attention (attend_head), the vector
 * exp (exp16 on AVX-512, exp8 on AVX2) and, on AVX-512 and AVX2 builds, the attention
 * both steps call (attend_kv_heads, one version per instruction set). All static: each .c
 * file gets its own copy, inlined where gcc sees fit.
 *
 * Layouts (all row-major fp32, the tensors torch already holds):
 *   weights        [out_features, in_features]
 *   kv cache       [2, num_blocks, block_size, num_kv_heads, head_dim]   ([0] K, [1] V)
 *                  slot = block_id * block_size + offset_in_block
 *   cos / sin      [max_positions, head_dim]  (HF's cat(freqs, freqs) tables, sin unsigned)
 *   gate_up        [2 * intermediate, hidden]: gate rows first, then up rows
 */
#ifndef WEFT_LLAMA_STEP_H
#define WEFT_LLAMA_STEP_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Floats ahead of the current column a row stream prefetches (1 KiB: the next rows of
 * the thread's contiguous range arrive while this one is summed). */
#define PREFETCH_AHEAD 256
/* Tokens ahead of the current block whose keys and values the AVX-512 attention prefetches
 * into L2 (on top of the next block's keys into L1): more misses in flight on the K/V
 * stream, which one block ahead left at ~15 GB/s. 64 and 160 measured alike, both ahead of
 * none (8-row steps at 1.8 K tokens of context 1.02-1.03x on top of pv_kv_head). */
#ifndef KV_AHEAD
#define KV_AHEAD 64
#endif

static inline int imin(int a, int b) { return a < b ? a : b; }

/* Inside a parallel region: this thread's share [lo, hi) of n rows, as equal as integers allow. */
static inline void thread_rows(int n, int *lo, int *hi) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = (int)((int64_t)n * t / nt);
    *hi = (int)((int64_t)n * (t + 1) / nt);
}

/* ---- one weight row against one vector ---------------------------------------------- */

#if defined(__AVX512F__)
static float dot(const float *w, const float *x, int k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; /* 4 independent FMA chains */
    int i = 0;
    for (; i + 64 <= k; i += 64) {
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + 48), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i < k; i += 16) { /* tail: masked loads of the last < 64 columns */
        __mmask16 m = (k - i >= 16) ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1u);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, x + i), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static float dot(const float *w, const float *x, int k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + 16), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    float sum = _mm_cvtss_f32(s);
    for (; i < k; i++) sum += w[i] * x[i];
    return sum;
}
#else
static float dot(const float *w, const float *x, int k) {
    float s = 0.f;
    for (int j = 0; j < k; j++) s += w[j] * x[j];
    return s;
}
#endif

#if defined(__AVX512F__)
/* expf of 16 floats, within 2 ulp over [-87.3, 88.7] (x is clamped to that range, so a
 * far-negative x gives ~1e-38, not 0, and a far-positive one ~3e38, not inf): x =
 * n ln2 + r with |r| <= ln2/2 (ln2 split in two so r keeps its low bits), e^r = 1 + r +
 * r^2 P(r) with P the classic degree-5 minimax fit, then scaled by 2^n. NaN in, NaN out.
 * Softmax and SiLU call this for 16 values at once instead of 16 scalar expf calls. */
static inline __m512 exp16(__m512 x) {
    /* x second: min/max return their second operand when either is NaN, so a NaN stays NaN
     * (clamped to 88.7 it became e^88.7, and a NaN score won its softmax outright) */
    x = _mm512_max_ps(_mm512_set1_ps(-87.3f), _mm512_min_ps(_mm512_set1_ps(88.7f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* The 16 sums of v[i] (i < 16) into out[i]: a transpose-add tree (45 ops instead of 16
 * separate horizontal reductions). */
static inline void reduce16(const __m512 *v, float *out) {
    __m512 s[8], u[4];
    for (int p = 0; p < 8; p++) /* per 128-bit lane: [v0a+v0c, v1a+v1c, v0b+v0d, v1b+v1d] */
        s[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int q = 0; q < 4; q++) { /* per 128-bit lane: [v0, v1, v2, v3] partial sums */
        __m512d a = _mm512_castps_pd(s[2 * q]), b = _mm512_castps_pd(s[2 * q + 1]);
        u[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp16's AVX2 twin: expf of 8 floats, the same reduction and polynomial, within 2 ulp over
 * [-87.3, 88.3]. AVX2 has no scalef, so 2^n is built in the exponent field, which holds n up
 * to 127: x is clamped to 88.3 (e^88.3 ~ 2.1e38), not 88.7. NaN in, NaN out (x second in
 * min/max, as in exp16; the exponent bits built from a NaN's n multiply a NaN p). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.3f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lanes [0, n) set: the mask _mm256_maskload_ps / _mm256_maskstore_ps take. */
static inline __m256i mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* The 8 sums of v[i] (i < 8) as one vector, in order: a hadd tree (7 ops instead of 8
 * separate horizontal reductions). */
static inline __m256 reduce8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, num_layers;
    int32_t block_size, num_blocks;
    float eps, scale;
    const float *embed;       /* [vocab, hidden] */
    const float *final_norm;  /* [hidden] */
    const float *lm_head;     /* [vocab, hidden] (the embedding when tied) */
    const float *cos, *sin;   /* [max_positions, head_dim] */
    /* per layer, arrays of num_layers pointers (bias pointers may be NULL) */
    const float *const *input_norm;  /* [hidden] */
    const float *const *qkv;         /* [q_dim + 2 * kv_dim, hidden] */
    const float *const *qkv_bias;    /* [q_dim + 2 * kv_dim] or NULL */
    const float *const *o;           /* [hidden, q_dim] */
    const float *const *o_bias;      /* [hidden] or NULL */
    const float *const *post_norm;   /* [hidden] */
    const float *const *gate_up;     /* [2 * intermediate, hidden] */
    const float *const *down;        /* [hidden, intermediate] */
    float *const *kv_cache;          /* [2, num_blocks, block_size, num_kv_heads, head_dim] */
    /* the same weights packed for gemm.c (gemm_packed.h), or NULL where not packed: read by
     * decode_batch.c's steps of more than STREAM_MAX_ROWS rows (the arrays hold num_layers
     * pointers when set) */
    const float *lm_head_p;
    const float *const *qkv_p, *const *o_p, *const *gate_up_p, *const *down_p;
} weft_model;

/* HF's LlamaRMSNorm in fp32: x / sqrt(mean(x^2) + eps) * w. One thread. */
static void rms_norm(const float *x, const float *w, float *y, int n, float eps) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* HF's x * cos + rotate_half(x) * sin over `heads` vectors of head_dim d, in place. */
static void rope(float *x, int heads, int d, const float *cos, const float *sin) {
    int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (size_t)h * d;
        for (int j = 0; j < half; j++) {
            float x1 = v[j], x2 = v[j + half];
            v[j] = x1 * cos[j] + (-x2) * sin[j];
            v[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
        }
    }
}

/* tok[t] = the cache slot of token t (t < seq_len), from the block table: the attention
 * kernels look each slot up once instead of dividing by block_size per load. */
static inline void token_slots(int64_t *tok, const int32_t *block_table, int bs, int seq_len) {
    for (int t = 0, blk = 0; t < seq_len; blk++)
        for (int j = 0; j < bs && t < seq_len; j++) tok[t++] = (int64_t)block_table[blk] * bs + j;
}

/* One query head over its sequence's keys/values (read through the block table). */
static void attend_head(const weft_model *m, const float *cache, const float *q, float *out, float *scores,
                        int kv_head, const int32_t *block_table, int seq_len) {
    int d = m->head_dim, kvh = m->num_kv_heads, bs = m->block_size;
    size_t v_offset = (size_t)m->num_blocks * bs * kvh * d;
    float mx = -INFINITY;
    for (int t = 0; t < seq_len; t++) {
        const float *k = cache + ((size_t)block_table[t / bs] * bs + t % bs) * kvh * d + (size_t)kv_head * d;
        float s = dot(q, k, d) * m->scale;
        scores[t] = s;
        if (s > mx) mx = s;
    }
    float sum = 0.f;
    for (int t = 0; t < seq_len; t++) { scores[t] = expf(scores[t] - mx); sum += scores[t]; }
    float inv = 1.f / sum;
    for (int j = 0; j < d; j++) out[j] = 0.f;
    for (int t = 0; t < seq_len; t++) {
        const float *v = cache + v_offset + ((size_t)block_table[t / bs] * bs + t % bs) * kvh * d + (size_t)kv_head * d;
        float p = scores[t] * inv;
        for (int j = 0; j < d; j++) out[j] += p * v[j];
    }
}

#if defined(__AVX512F__)
/* out[i] = sum_t p[i, t] v[t] for HB query heads sharing one KV head, NC chunks of 16 of
 * head_dim (the last one masked by `tail`): each token's value row is loaded once for all
 * HB heads (HB * NC accumulators: 16 at most), where a head at a time loaded it HB times
 * from L2 and ran NC FMA chains, latency-bound at 4. Each head's sum runs over t in order,
 * exactly as the head-at-a-time loop summed it: the same bits. Always inlined with
 * constant HB / NC so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_heads(const float *vb, const float *sc, float *oh, const int64_t *tok,
                                                           int row_floats, int seq_len, int d, const int HB, const int NC,
                                                           __mmask16 tail) {
    __m512 acc[16];
    for (int i = 0; i < HB * NC; i++) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < seq_len; t++) {
        const float *v = vb + (size_t)tok[t] * row_floats;
        __m512 vv[8];
        for (int c = 0; c < NC; c++) vv[c] = _mm512_maskz_loadu_ps(c + 1 == NC ? tail : (__mmask16)0xFFFF, v + c * 16);
        for (int i = 0; i < HB; i++) {
            const __m512 p = _mm512_set1_ps(sc[(size_t)i * seq_len + t]);
            for (int c = 0; c < NC; c++) acc[i * NC + c] = _mm512_fmadd_ps(p, vv[c], acc[i * NC + c]);
        }
    }
    for (int i = 0; i < HB; i++)
        for (int c = 0; c < NC; c++)
            _mm512_mask_storeu_ps(oh + (size_t)i * d + c * 16, c + 1 == NC ? tail : (__mmask16)0xFFFF, acc[i * NC + c]);
}

/* The `group` query heads of one KV head (scores: their [group, seq_len] probabilities,
 * out: their [group, head_dim] outputs; vb: the KV head's first value) in passes of 16 / NC
 * heads. chunks: 4 or 8. */
static void pv_kv_head(const float *vb, const float *sc, float *oh, const int64_t *tok, int row_floats, int group,
                       int d, int chunks, __mmask16 tail, int seq_len) {
    const int per = 16 / chunks;
    for (int i = 0; i < group; i += per) {
        const int hb = imin(per, group - i);
        const float *s = sc + (size_t)i * seq_len;
        float *o = oh + (size_t)i * d;
#define PV_CASE(HB_, NC_) \
        if (hb == HB_ && chunks == NC_) { pv_heads(vb, s, o, tok, row_floats, seq_len, d, HB_, NC_, tail); continue; }
        PV_CASE(4, 4) PV_CASE(3, 4) PV_CASE(2, 4) PV_CASE(1, 4) PV_CASE(2, 8) PV_CASE(1, 8)
#undef PV_CASE
    }
}

/* One row's attention for the query heads of KV heads [g0, g1) (GQA: `group` query heads
 * per KV head, contiguous in q and out), token blocks outermost so the row's cache is read
 * in address order (one token's K for all KV heads is one run of kv_heads * head_dim):
 *
 *   scores  per block of 16 tokens: the next block's keys and this block's values are
 *           prefetched; per query head the 16 dots sum into 16 accumulators and one
 *           transpose-add tree (reduce16) makes one vector of 16 scores
 *   softmax exp16 over 16 scores at a time
 *   values  token by token with the outputs in registers; at head_dim 64 / 128 every query
 *           head of a KV head at once (pv_kv_head: each value row loaded once), else one
 *           head at a time (up to 8 chunks of 16 at a
 *           time: one sequential read of each token's value row; the values are in cache)
 *
 * Each token's cache slot is looked up once (tok: [seq_len] int64 scratch): a lookup per
 * token per chunk, with its divide by block_size, made the whole step 1.05-1.12x slower at
 * 16 rows and batch-1 decode 1.16-1.33x slower at 1-2 K tokens of context (docs/
 * architecture.md, "Seventh pass"). q, out: [num_heads, d] (the row's); scores:
 * [(g1 - g0) * group, seq_len] scratch. Any head_dim: the last 16-float chunk of a head is
 * masked. Same sums as attend_head up to fp32 rounding order. */
static void attend_kv_heads(const weft_model *m, const float *cache, const float *q, float *out, float *scores,
                            int64_t *tok, int g0, int g1, int group, const int32_t *block_table,
                            int seq_len) {
    const int d = m->head_dim, kvh = m->num_kv_heads, bs = m->block_size, chunks = (d + 15) / 16;
    const int heads = (g1 - g0) * group, h0 = g0 * group, row_floats = kvh * d;
    const size_t v_offset = (size_t)m->num_blocks * bs * row_floats;
    const __mmask16 tail = (d % 16) ? (__mmask16)((1u << (d % 16)) - 1u) : (__mmask16)0xFFFF;
    token_slots(tok, block_table, bs, seq_len);
#define KV_ROW(t) (cache + (size_t)tok[t] * row_floats) /* token t, all heads */
    for (int t0 = 0; t0 < seq_len; t0 += 16) {
        const int nt = imin(16, seq_len - t0);
        const float *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = KV_ROW(t0 + (j < nt ? j : 0));
        for (int j = 0; j < nt; j++) { /* this block's values to L2, the next block's keys to L1,
                                         * keys and values KV_AHEAD tokens on to L2 */
            const float *v = rows[j] + v_offset, *kn = t0 + 16 + j < seq_len ? KV_ROW(t0 + 16 + j) : NULL;
            const float *kf = t0 + KV_AHEAD + j < seq_len ? KV_ROW(t0 + KV_AHEAD + j) : NULL;
            for (int f = g0 * d; f < g1 * d; f += 16) {
                __builtin_prefetch(v + f, 0, 2);
                if (kn) __builtin_prefetch(kn + f, 0, 3);
                if (kf) { __builtin_prefetch(kf + f, 0, 2); __builtin_prefetch(kf + v_offset + f, 0, 2); }
            }
        }
        for (int hd = 0; hd < heads; hd++) {
            const float *qh = q + (size_t)(h0 + hd) * d;
            const size_t koff = (size_t)((h0 + hd) / group) * d;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const __mmask16 mk = c + 1 == chunks ? tail : (__mmask16)0xFFFF;
                const __m512 qv = _mm512_maskz_loadu_ps(mk, qh + c * 16);
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, rows[j] + koff + c * 16), qv, acc[j]);
            }
            float s[16];
            reduce16(acc, s);
            _mm512_mask_storeu_ps(scores + (size_t)hd * seq_len + t0, (__mmask16)((1u << nt) - 1u),
                                  _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m->scale)));
        }
    }
    for (int hd = 0; hd < heads; hd++) { /* softmax in place: scores -> probabilities */
        float *sc = scores + (size_t)hd * seq_len;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int t = 0; t < seq_len; t += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, (__mmask16)(seq_len - t >= 16 ? 0xFFFF : (1u << (seq_len - t)) - 1u), sc + t));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int t = 0; t < seq_len; t += 16) {
            const __mmask16 mt = (__mmask16)(seq_len - t >= 16 ? 0xFFFF : (1u << (seq_len - t)) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(mt, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mt, sc + t), top)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(sc + t, mt, e);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(sum);
        for (int t = 0; t < seq_len; t++) sc[t] *= inv;
    }
    if (chunks == 4 || chunks == 8) { /* head_dim 64 or 128 (every model measured) */
        for (int g = g0; g < g1; g++)
            pv_kv_head(cache + v_offset + (size_t)g * d, scores + (size_t)(g - g0) * group * seq_len,
                       out + (size_t)g * group * d, tok, row_floats, group, d, chunks, tail, seq_len);
        return;
    }
    for (int hd = 0; hd < heads; hd++) { /* out[hd] = sum_t p[hd, t] v[t], 8 chunks at a time */
        const float *sc = scores + (size_t)hd * seq_len, *vb = cache + v_offset + (size_t)((h0 + hd) / group) * d;
        float *oh = out + (size_t)(h0 + hd) * d;
        for (int c0 = 0; c0 < chunks; c0 += 8) {
            const int nc = imin(8, chunks - c0);
            __mmask16 mk[8];
            __m512 acc[8];
            for (int c = 0; c < 8; c++) {
                mk[c] = c0 + c + 1 == chunks ? tail : (__mmask16)0xFFFF;
                acc[c] = _mm512_setzero_ps();
            }
            for (int t = 0; t < seq_len; t++) { /* one sequential read of the token's value row */
                const __m512 p = _mm512_set1_ps(sc[t]);
                const float *v = vb + (size_t)tok[t] * row_floats + c0 * 16;
                for (int c = 0; c < nc; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mk[c], v + c * 16), acc[c]);
            }
            for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(oh + (c0 + c) * 16, mk[c], acc[c]);
        }
    }
#undef KV_ROW
}
#elif defined(__AVX2__) && defined(__FMA__)
/* One row's attention for the query heads of KV heads [g0, g1) in AVX2 (decode_batch.c's
 * attend_row, decode.c's per KV head; the AVX-512 version is above):
 * each token's cache slot looked up once (tok: [seq_len] int64 scratch; a lookup per
 * token per chunk, with its divide by block_size, cost more than the
 * arithmetic), keys in blocks of 8 tokens (8 score accumulators + q + a key: 10 of the 16
 * registers), exp8, then the values token by token with the head's output in registers
 * (up to 8 chunks of 8 at a time: one sequential read of each token's value row). The
 * head's last chunk is masked when head_dim is not a multiple of 8. Same sums up to fp32
 * rounding order. */
static void attend_kv_heads(const weft_model *m, const float *cache, const float *q, float *out, float *scores,
                            int64_t *tok, int g0, int g1, int group, const int32_t *block_table,
                            int seq_len) {
    const int d = m->head_dim, kvh = m->num_kv_heads, bs = m->block_size, full = d / 8, chunks = (d + 7) / 8;
    const int heads = (g1 - g0) * group, h0 = g0 * group, row_floats = kvh * d;
    const size_t v_offset = (size_t)m->num_blocks * bs * row_floats;
    const __m256i tail = mask8(d - full * 8);
    const __m256 scale = _mm256_set1_ps(m->scale);
    token_slots(tok, block_table, bs, seq_len);
#define KV_ROW(t) (cache + (size_t)tok[t] * row_floats) /* token t, all heads */
    for (int t0 = 0; t0 < seq_len; t0 += 8) {
        const int nt = imin(8, seq_len - t0);
        const float *rows[8];
        for (int j = 0; j < 8; j++) rows[j] = KV_ROW(t0 + (j < nt ? j : 0));
        for (int j = 0; j < nt; j++) { /* this block's values to L2, the next block's keys to L1 */
            const float *v = rows[j] + v_offset, *kn = t0 + 8 + j < seq_len ? KV_ROW(t0 + 8 + j) : NULL;
            for (int f = g0 * d; f < g1 * d; f += 16) {
                __builtin_prefetch(v + f, 0, 2);
                if (kn) __builtin_prefetch(kn + f, 0, 3);
            }
        }
        for (int hd = 0; hd < heads; hd++) {
            const float *qh = q + (size_t)(h0 + hd) * d;
            const size_t koff = (size_t)((h0 + hd) / group) * d;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int c = 0; c < full; c++) {
                const __m256 qv = _mm256_loadu_ps(qh + c * 8);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[j] + koff + c * 8), qv, acc[j]);
            }
            if (full < chunks) {
                const __m256 qv = _mm256_maskload_ps(qh + full * 8, tail);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(_mm256_maskload_ps(rows[j] + koff + full * 8, tail), qv, acc[j]);
            }
            _mm256_maskstore_ps(scores + (size_t)hd * seq_len + t0, mask8(nt), _mm256_mul_ps(reduce8(acc), scale));
        }
    }
    for (int hd = 0; hd < heads; hd++) { /* softmax in place: scores -> probabilities */
        float *sc = scores + (size_t)hd * seq_len;
        __m256 mx = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        int t = 0;
        for (; t + 8 <= seq_len; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
        float top = hmax8(mx);
        for (; t < seq_len; t++) top = sc[t] > top ? sc[t] : top;
        const __m256 topv = _mm256_set1_ps(top);
        for (t = 0; t + 8 <= seq_len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), topv));
            sum = _mm256_add_ps(sum, e);
            _mm256_storeu_ps(sc + t, e);
        }
        float total = hsum8(sum);
        for (; t < seq_len; t++) total += (sc[t] = expf(sc[t] - top));
        const float inv = 1.f / total;
        for (t = 0; t < seq_len; t++) sc[t] *= inv;
    }
    for (int hd = 0; hd < heads; hd++) { /* out[hd] = sum_t p[hd, t] v[t], 8 chunks at a time */
        const float *sc = scores + (size_t)hd * seq_len, *vb = cache + v_offset + (size_t)((h0 + hd) / group) * d;
        float *oh = out + (size_t)(h0 + hd) * d;
        for (int c0 = 0; c0 < chunks; c0 += 8) {
            const int nc = imin(8, chunks - c0);
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
            if (c0 + nc <= full) {
                for (int t = 0; t < seq_len; t++) {
                    const __m256 p = _mm256_set1_ps(sc[t]);
                    const float *v = vb + (size_t)tok[t] * row_floats + c0 * 8;
                    for (int c = 0; c < nc; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c * 8), acc[c]);
                }
            } else { /* this group holds the masked last chunk */
                for (int t = 0; t < seq_len; t++) {
                    const __m256 p = _mm256_set1_ps(sc[t]);
                    const float *v = vb + (size_t)tok[t] * row_floats + c0 * 8;
                    for (int c = 0; c < nc; c++)
                        acc[c] = _mm256_fmadd_ps(p, c0 + c < full ? _mm256_loadu_ps(v + c * 8)
                                                                  : _mm256_maskload_ps(v + c * 8, tail), acc[c]);
                }
            }
            for (int c = 0; c < nc; c++) {
                if (c0 + c < full) _mm256_storeu_ps(oh + (c0 + c) * 8, acc[c]);
                else _mm256_maskstore_ps(oh + (c0 + c) * 8, tail, acc[c]);
            }
        }
    }
#undef KV_ROW
}
#endif

#endif
