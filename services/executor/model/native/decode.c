/* Weft's native CPU decode: a streaming fp32 GEMV and one whole Llama decode step for
 * one sequence, in plain C (no torch headers), loaded with ctypes (native/library.py).
 *
 * NOTE: a batch-1 decode step reads every weight once and does ~2 flops per weight, so it
 * is bound by memory bandwidth, not compute. The GEMV below gives each OpenMP thread one
 * contiguous range of rows. On AVX-512 builds a thread reads it row after row (one
 * sequential stream, with a software prefetch 1 KiB ahead), four FMA accumulators per row;
 * four adjacent rows at a time, interleaved, measured ~10 % slower there (four short
 * streams defeat the prefetchers). On AVX2 builds a thread reads its range as four long
 * streams, one per quarter (dot4): a 2-core Zen 2 without AVX-512 kept more DRAM reads in
 * flight that way, a SmolLM2 step 1.33x faster (docs/architecture.md, "Fifth pass").
 * The whole step runs inside ONE parallel region: the 5 hand-offs per layer are barriers
 * (spinning briefly under GOMP_SPINCOUNT) instead of the ~4 parallel regions per layer
 * torch opens, and no Python runs between the ops.
 *
 * Layouts and the helpers shared with the multi-row step (decode_batch.c): llama_step.h.
 *
 * Built with the system gcc `-O3 -march=native -fopenmp`; it links the same libgomp.so.1
 * soname torch loads, so both share one OpenMP runtime and thread pool.
 */
#include "llama_step.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* out[j] = w[j] . x for the 4 rows w[0..3] (anywhere in memory), in one pass over x. */
static inline void dot4(const float *const w[4], const float *x, int k, float out[4]) {
    __m256 a[4], c[4];
    for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + i), x0, a[j]);
            c[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + i + 8), x1, c[j]);
        }
    }
    if (i + 8 <= k) {
        const __m256 x0 = _mm256_loadu_ps(x + i);
        for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + i), x0, a[j]);
        i += 8;
    }
    if (i < k) {
        const __m256i m = mask8(k - i);
        const __m256 x0 = _mm256_maskload_ps(x + i, m);
        for (int j = 0; j < 4; j++) c[j] = _mm256_fmadd_ps(_mm256_maskload_ps(w[j] + i, m), x0, c[j]);
    }
    for (int j = 0; j < 4; j++) out[j] = hsum8(_mm256_add_ps(a[j], c[j]));
}

/* Inside a parallel region: y[o] (+)= W[o, :] . x + b[o] for o in [0, n). Each thread
 * owns one contiguous range of rows and reads it as four streams, one per quarter, a row
 * of each at a time (dot4): four distant streams keep more DRAM reads in flight than one
 * (a 2-core Zen 2 read ~16-24 GB/s with one stream per core, ~25-28 with four; standalone
 * C loop over 212 MB of weights). accumulate != 0 adds into y (a residual). Ends with a
 * barrier. */
static void gemv_for(const float *W, const float *b, const float *x, float *y, int n, int k, int accumulate) {
    int lo, hi;
    thread_rows(n, &lo, &hi);
    const int q = (hi - lo) / 4;
    for (int i = lo; i < lo + q; i++) {
        const float *rows[4] = {W + (size_t)i * k, W + (size_t)(i + q) * k, W + (size_t)(i + 2 * q) * k,
                                W + (size_t)(i + 3 * q) * k};
        float v[4];
        dot4(rows, x, k, v);
        for (int j = 0; j < 4; j++) {
            const int o = i + j * q;
            v[j] += b ? b[o] : 0.f;
            y[o] = accumulate ? y[o] + v[j] : v[j];
        }
    }
    for (int o = lo + 4 * q; o < hi; o++) {
        float v = dot(W + (size_t)o * k, x, k) + (b ? b[o] : 0.f);
        y[o] = accumulate ? y[o] + v : v;
    }
    #pragma omp barrier
}

/* Inside a parallel region: act[i] = silu(gate[i]) * up[i] for i < inter. gu [2 * inter, H]:
 * each thread's range of gate rows and its up rows, as four streams (two of each). */
static void gate_up_for(const float *gu, const float *x, float *act, int inter, int H) {
    int lo, hi;
    thread_rows(inter, &lo, &hi);
    const int q = (hi - lo) / 2;
    for (int i = lo; i < lo + q; i++) {
        const float *rows[4] = {gu + (size_t)i * H, gu + (size_t)(i + q) * H, gu + (size_t)(inter + i) * H,
                                gu + (size_t)(inter + i + q) * H};
        float v[4];
        dot4(rows, x, H, v);
        act[i] = v[0] / (1.f + expf(-v[0])) * v[2];
        act[i + q] = v[1] / (1.f + expf(-v[1])) * v[3];
    }
    for (int i = lo + 2 * q; i < hi; i++) {
        const float g = dot(gu + (size_t)i * H, x, H), u = dot(gu + (size_t)(inter + i) * H, x, H);
        act[i] = g / (1.f + expf(-g)) * u;
    }
    #pragma omp barrier
}
#else
/* Inside a parallel region: y[o] (+)= W[o, :] . x + b[o] for o in [0, n), each thread
 * owning one contiguous range of rows (one sequential stream). accumulate != 0 adds into
 * y (a residual). Ends with the loop's barrier. */
static void gemv_for(const float *W, const float *b, const float *x, float *y, int n, int k, int accumulate) {
    #pragma omp for schedule(static)
    for (int o = 0; o < n; o++) {
        float v = dot(W + (size_t)o * k, x, k) + (b ? b[o] : 0.f);
        y[o] = accumulate ? y[o] + v : v;
    }
}

/* Inside a parallel region: act[i] = silu(gate[i]) * up[i]: the gate row and its up row in
 * one pass. gu [2 * inter, H]. Ends with the loop's barrier. */
static void gate_up_for(const float *gu, const float *x, float *act, int inter, int H) {
    #pragma omp for schedule(static)
    for (int i = 0; i < inter; i++) {
        float g = dot(gu + (size_t)i * H, x, H), u = dot(gu + (size_t)(inter + i) * H, x, H);
        act[i] = g / (1.f + expf(-g)) * u;
    }
}
#endif

/* y = W @ x (+ b): W [n, k], x [k], y [n]. Opens its own parallel region (num_threads < 1: one). */
void weft_gemv(const float *W, const float *b, const float *x, float *y, int n, int k, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    #pragma omp parallel num_threads(num_threads)
    gemv_for(W, b, x, y, n, k, 0);
}

/* ---- the decode step ----------------------------------------------------------------- */

/* One decode step of one sequence: token `token_id` at `position`, whose K/V go to cache
 * slot `slot`; `block_table` [ceil(seq_len / block_size)] lists the sequence's blocks and
 * seq_len counts its tokens including this one. Writes the K/V slot of every layer and
 * logits [vocab]; reads nothing else it does not own. Returns 0, or -1 when out of memory. */
int weft_decode_step(const weft_model *m, int64_t token_id, int64_t position, int64_t slot,
                     const int32_t *block_table, int seq_len, float *logits, int num_threads) {
    const int H = m->hidden, d = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    const int q_dim = nh * d, kv_dim = nkv * d, qkv_dim = q_dim + 2 * kv_dim, inter = m->intermediate;
    const int group = nh / nkv;
    if (num_threads < 1) num_threads = 1;
    /* scratch: h [H] | qkv [qkv_dim] | attn [q_dim] | act [inter] | scores [nh, seq_len] | x [threads, H]
     *          | token slots [nkv, seq_len] (int64, attend_kv_heads's, one per KV head) */
    size_t n_scratch = (size_t)H + qkv_dim + q_dim + inter + (size_t)nh * seq_len + (size_t)num_threads * H;
    n_scratch += n_scratch & 1; /* the int64 slots after the floats start 8-byte aligned */
    float *buf = (float *)malloc(n_scratch * sizeof(float) + (size_t)nkv * seq_len * sizeof(int64_t));
    if (!buf) return -1;
    int64_t *toks = (int64_t *)(buf + n_scratch);
    (void)toks;
    float *h = buf, *qkv = h + H, *attn = qkv + qkv_dim, *act = attn + q_dim, *scores = act + inter;
    float *xs = scores + (size_t)nh * seq_len;
    const float *cos = m->cos + (size_t)position * d, *sin = m->sin + (size_t)position * d;
    memcpy(h, m->embed + (size_t)token_id * H, (size_t)H * sizeof(float));
    size_t k_slot = (size_t)slot * kv_dim, v_offset = (size_t)m->num_blocks * m->block_size * kv_dim;

    #pragma omp parallel num_threads(num_threads)
    {
        /* Each thread normalises h into its own x (576 floats: cheaper than a barrier). */
        float *x = xs + (size_t)omp_get_thread_num() * H;
        for (int l = 0; l < m->num_layers; l++) {
            float *cache = m->kv_cache[l];
            rms_norm(h, m->input_norm[l], x, H, m->eps);
            gemv_for(m->qkv[l], m->qkv_bias[l], x, qkv, qkv_dim, H, 0);
            /* one KV head per iteration: rope its key and query heads, write its K/V slot,
             * then attend its query heads (no other iteration reads this KV head) */
            #pragma omp for schedule(static)
            for (int g = 0; g < nkv; g++) {
                float *k = qkv + q_dim + (size_t)g * d, *v = k + kv_dim, *q = qkv + (size_t)g * group * d;
                rope(k, 1, d, cos, sin);
                rope(q, group, d, cos, sin);
                memcpy(cache + k_slot + (size_t)g * d, k, (size_t)d * sizeof(float));
                memcpy(cache + v_offset + k_slot + (size_t)g * d, v, (size_t)d * sizeof(float));
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
                attend_kv_heads(m, cache, qkv, attn, scores + (size_t)g * group * seq_len, toks + (size_t)g * seq_len,
                                g, g + 1, group, block_table, seq_len);
#else
                for (int hd = g * group; hd < (g + 1) * group; hd++)
                    attend_head(m, cache, qkv + (size_t)hd * d, attn + (size_t)hd * d, scores + (size_t)hd * seq_len,
                                g, block_table, seq_len);
#endif
            }
            gemv_for(m->o[l], m->o_bias[l], attn, h, H, q_dim, 1); /* h += o(attn) */
            rms_norm(h, m->post_norm[l], x, H, m->eps);
            gate_up_for(m->gate_up[l], x, act, inter, H);
            gemv_for(m->down[l], NULL, act, h, H, inter, 1); /* h += down(act) */
        }
        rms_norm(h, m->final_norm, x, H, m->eps);
        gemv_for(m->lm_head, NULL, x, logits, m->vocab, H, 0);
    }
    free(buf);
    return 0;
}
