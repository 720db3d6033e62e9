/* Weft's packed fp32 GEMM for AVX2 CPUs (gemm.c): Y = X W^T over a weight copy laid out
 * for an outer-product register tile, used by long prefills (model/linear.py,
 * PackedLinear) and by decode steps of more than a few rows (decode_batch.c).
 *
 * Packed layout ("panels"): the weight's n output rows in panels of 16, each panel
 * k-major, so the 16 weights one column of X meets are 64 contiguous bytes:
 *     P[p][c][j] = W[16 p + j][c]   (p < ceil(n / 16), c < k, j < 16; rows >= n are 0)
 * gate_up's panels interleave: a panel's first 8 columns are 8 gate rows, its last 8 the
 * same 8 up rows, so one tile's two halves give silu(gate) * up in registers:
 *     P[p][c][j] = W_gate[8 p + j][c], P[p][c][8 + j] = W_up[8 p + j][c]   (j < 8)
 *
 * The *_for functions run inside an OpenMP parallel region, each thread on its share of
 * the panels, and end WITHOUT a barrier (the caller places it). Built only where
 * weft_gemm_packed_available() says so (AVX2 + FMA, no AVX-512: where it was measured
 * ahead of oneDNN and of decode_batch.c's dot-product tiles); elsewhere the functions
 * exist but do nothing and the library's users keep their other paths. */
#ifndef WEFT_GEMM_PACKED_H
#define WEFT_GEMM_PACKED_H
#include <stdint.h>

#define PACK_NR 16 /* output rows per panel */

int weft_gemm_packed_available(void);

/* Y[r, o] (+)= X[r, :] . W[o, :] + bias[o] for r < R, o < n; P is W packed (n rows, k
 * columns); bias may be NULL; accumulate != 0 adds into Y. */
void gemm_packed_for(const float *P, const float *bias, const float *X, int ldx, float *Y, int ldy, int n, int k,
                     int R, int accumulate);

/* act[r, i] = silu(X[r] . W_gate[i]) * (X[r] . W_up[i]) for r < R, i < inter; P is gate_up
 * packed interleaved (weft_pack_gate_up). */
void gate_up_packed_for(const float *P, const float *X, int ldx, float *act, int ld_act, int inter, int k, int R);

#endif
