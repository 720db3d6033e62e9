/* The row-wise ops of the torch forward (model/llama.py) for many rows at once: RMSNorm
 * and RoPE of a prefill, each one C call over every row instead of torch's chain of
 * elementwise ops (F.rms_norm is pow, mean, add, rsqrt and two muls over [rows, hidden],
 * each a pass over memory; RoPE a flip copy, two muls and an add). Rows go to threads in
 * contiguous ranges and each row is computed by one thread alone, so a row's bits depend on
 * neither its batch nor the thread count.
 *
 * RoPE is bit-identical to the torch path (apply_rope_ in llama.py: x * cos, then plus
 * swap_halves(x) * sin_signed, two roundings per element): this function is compiled without
 * FMA contraction, so the two products and the sum round exactly as torch's mul and add do.
 * RMSNorm sums its squares in 8 lanes, not in torch's order, so it agrees with F.rms_norm to
 * fp32 rounding, not bitwise (the native decode steps' rms_norm already differs the same way).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* this thread's share [lo, hi) of n rows (inside a parallel region) */
static inline void share(int n, int *lo, int *hi) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    *lo = (int)((int64_t)n * t / nt);
    *hi = (int)((int64_t)n * (t + 1) / nt);
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of n floats (HF's LlamaRMSNorm in
 * fp32: (x * r) * w). x and y: [rows, n] contiguous; they may be the same buffer. */
void weft_rms_norm_rows(const float *x, const float *w, float *y, int rows, int n, float eps, int num_threads) {
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        int lo, hi;
        share(rows, &lo, &hi);
        for (int r = lo; r < hi; r++) {
            const float *xr = x + (size_t)r * n;
            float *yr = y + (size_t)r * n;
            int i = 0;
            float ss = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (; i + 16 <= n; i += 16) {
                const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
                a0 = _mm256_fmadd_ps(v0, v0, a0);
                a1 = _mm256_fmadd_ps(v1, v1, a1);
            }
            const __m256 a = _mm256_add_ps(a0, a1);
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            ss = _mm_cvtss_f32(s);
#endif
            for (; i < n; i++) ss += xr[i] * xr[i];
            const float inv = 1.f / sqrtf(ss / (float)n + eps);
            i = 0;
#if defined(__AVX2__)
            const __m256 iv = _mm256_set1_ps(inv);
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv), _mm256_loadu_ps(w + i)));
#endif
            for (; i < n; i++) yr[i] = xr[i] * inv * w[i];
        }
    }
}

/* In place, for each row r: its first `heads` head vectors of d floats (row stride ldx
 * floats) become x * cos[p] + swap_halves(x) * sin_signed[p], p = positions[r]; cos and
 * sin_signed are [max_positions, d] tables (sin_signed: the sin table with its first half
 * negated). The caller checks 0 <= p < max_positions. */
__attribute__((optimize("fp-contract=off")))
void weft_rope_rows(float *x, int ldx, const int64_t *positions, const float *cos, const float *sin_signed,
                    int heads, int d, int rows, int num_threads) {
    const int half = d / 2;
    #pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        int lo, hi;
        share(rows, &lo, &hi);
        for (int r = lo; r < hi; r++) {
            const float *c = cos + (size_t)positions[r] * d, *s = sin_signed + (size_t)positions[r] * d;
            for (int h = 0; h < heads; h++) {
                float *v = x + (size_t)r * ldx + (size_t)h * d;
                int j = 0;
#if defined(__AVX2__)
                for (; j + 8 <= half; j += 8) {
                    const __m256 x1 = _mm256_loadu_ps(v + j), x2 = _mm256_loadu_ps(v + half + j);
                    const __m256 lo1 = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + j)),
                                                     _mm256_mul_ps(x2, _mm256_loadu_ps(s + j)));
                    const __m256 hi2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + j)),
                                                     _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + j)));
                    _mm256_storeu_ps(v + j, lo1);
                    _mm256_storeu_ps(v + half + j, hi2);
                }
#endif
                for (; j < half; j++) {
                    const float x1 = v[j], x2 = v[half + j];
                    v[j] = x1 * c[j] + x2 * s[j];
                    v[half + j] = x2 * c[half + j] + x1 * s[half + j];
                }
            }
        }
    }
}
