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
 * Layouts and the helpers shared with the multi-row step (decode_batch.c): llama_step.h.
 *
 * Built with the system gcc `-O3 -march=native -fopenmp`; it links the same libgomp.so.1
 * soname torch loads, so both share one OpenMP runtime and thread pool.
 */
#include "llama_step.h"

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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
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
