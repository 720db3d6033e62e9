/* Weft's native CPU decode: a streaming fp32 GEMV and one whole Llama decode step for
 * one sequence, in plain C (no torch headers), loaded with ctypes (native/library.py).
 *
 * NOTE: a batch-1 decode step reads every weight once and does ~2 flops per weight, so it
 * is bound by memory bandwidth, not compute. The GEMV below gives each OpenMP thread one
 * contiguous range of rows, read row after row (one sequential stream per thread, with a
 * software prefetch 1 KiB ahead), four FMA accumulators per row. (Four rows at a time,
 * interleaved, measured ~10 % slower: four short streams defeat the prefetchers.) The whole step runs inside ONE parallel region: the 5 hand-offs
 * per layer are barriers (spinning briefly under GOMP_SPINCOUNT) instead of the ~4
 * parallel regions per layer torch opens, and no Python runs between the ops.
 *
 * Layouts (all row-major fp32, the tensors torch already holds):
 *   weights        [out_features, in_features]
 *   kv cache       [2, num_blocks, block_size, num_kv_heads, head_dim]   ([0] K, [1] V)
 *                  slot = block_id * block_size + offset_in_block
 *   cos / sin      [max_positions, head_dim]  (HF's cat(freqs, freqs) tables, sin unsigned)
 *   gate_up        [2 * intermediate, hidden]: gate rows first, then up rows
 *
 * Built with the system gcc `-O3 -march=native -fopenmp`; it links the same libgomp.so.1
 * soname torch loads, so both share one OpenMP runtime and thread pool.
 */
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

/* y = W @ x (+ b): W [n, k], x [k], y [n]. Opens its own parallel region. */
void weft_gemv(const float *W, const float *b, const float *x, float *y, int n, int k, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    gemv_for(W, b, x, y, n, k, 0);
}

/* ---- the decode step ----------------------------------------------------------------- */

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
    /* scratch: h [H] | qkv [qkv_dim] | attn [q_dim] | act [inter] | scores [nh, seq_len] | x [threads, H] */
    size_t n_scratch = (size_t)H + qkv_dim + q_dim + inter + (size_t)nh * seq_len + (size_t)num_threads * H;
    float *buf = (float *)malloc(n_scratch * sizeof(float));
    if (!buf) return -1;
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
                for (int hd = g * group; hd < (g + 1) * group; hd++)
                    attend_head(m, cache, qkv + (size_t)hd * d, attn + (size_t)hd * d, scores + (size_t)hd * seq_len,
                                g, block_table, seq_len);
            }
            gemv_for(m->o[l], m->o_bias[l], attn, h, H, q_dim, 1); /* h += o(attn) */
            rms_norm(h, m->post_norm[l], x, H, m->eps);
            /* act[i] = silu(gate[i]) * up[i]: the gate row and its up row in one pass */
            const float *gu = m->gate_up[l];
            #pragma omp for schedule(static)
            for (int i = 0; i < inter; i++) {
                float g = dot(gu + (size_t)i * H, x, H), u = dot(gu + (size_t)(inter + i) * H, x, H);
                act[i] = g / (1.f + expf(-g)) * u;
            }
            gemv_for(m->down[l], NULL, act, h, H, inter, 1); /* h += down(act) */
        }
        rms_norm(h, m->final_norm, x, H, m->eps);
        gemv_for(m->lm_head, NULL, x, logits, m->vocab, H, 0);
    }
    free(buf);
    return 0;
}
