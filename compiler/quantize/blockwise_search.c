/* blockwise.search (and minmax) in C: the same candidates, the same arithmetic in float32, the same
 * choice (the first candidate of least weighted error), about 50x faster than the NumPy loop, which
 * made a 0.5B model's int4 build take 12 minutes. Written by hand: no library searches MatMulNBits'
 * block codes against an importance weighting (ONNX Runtime's quantizer rounds to nearest).
 *
 * w [K, N] row-major float32. A block is `block` consecutive rows of one column, padded with zeros past K
 * (as MatMulNBits pads). Outputs, in blockwise.BlockCodes' layout: codes [nblocks, block, N] uint8,
 * scales and zero points [nblocks, N]. Columns [n0, n1) only, so callers can split the columns over
 * threads. h [K] (the importance, E[x_k^2]) or NULL: then only the first candidate (minmax) is taken.
 *
 * Candidates per block and column, in blockwise._candidates' order:
 *   asymmetric: (base, round(-lo / base)), then for each factor f: scale = base * f and zero points
 *               round(-lo / scale) + {-1, 0, 1}, clipped to [0, qmax];
 *   symmetric:  zero point (qmax + 1) / 2, scales base, then base * f for each factor.
 * Every scale is first made an fp16 value where it is a normal one (half_scale, blockwise.half_scales).
 * A candidate's codes are clip(round(w / scale) + zero, 0, qmax) (round half to even, as np.round), its
 * error sum_k h_k ((code - zero) * scale - w_k)^2 summed in k order. Compile with -ffp-contract=off:
 * a fused multiply-add would round differently from NumPy.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define COLS 64 /* columns searched together: the inner loops run across them (vectorized) */

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* s as the nearest fp16 value where that is a normal fp16 number (round half to even, as NumPy's astype), else
 * s: llmc's 4-bit kernel stores a layer's scales in half the bytes when every one is an fp16 value. In integer
 * arithmetic on the bits (the mantissa rounded to fp16's 10 bits), which the compiler vectorizes where a
 * conversion to _Float16 and back cost the search a quarter of its time. */
static inline float half_scale(float s) {
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    u = (u + 0x0FFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    float h;
    memcpy(&h, &u, sizeof h);
    return fabsf(h) >= 0x1p-14f && fabsf(h) <= 65504.0f ? h : s;
}

int llmc_block_codes(const float *w, int64_t K, int64_t N, int64_t n0, int64_t n1, const float *h, int bits,
                     int block, int symmetric, const float *factors, int nfactors, uint8_t *codes, float *scales,
                     uint8_t *zeros) {
    if (block <= 0 || block > 256 || bits < 1 || bits > 8) return 1;
    const float qmax = (float)((1 << bits) - 1), mid = (float)(1 << (bits - 1));
    const int64_t nblocks = (K + block - 1) / block;
    float b[256][COLS], r[256][COLS];
    float lo[COLS], base[COLS], best_err[COLS], best_scale[COLS], best_zero[COLS];
    float scale[COLS], zero0[COLS], err[COLS];
    for (int64_t bi = 0; bi < nblocks; bi++) {
        const float *hb = h ? h + bi * block : NULL;
        int rows = (int)(K - bi * block < block ? K - bi * block : block);
        for (int64_t c0 = n0; c0 < n1; c0 += COLS) {
            int cols = (int)(n1 - c0 < COLS ? n1 - c0 : COLS);
            for (int k = 0; k < block; k++)
                for (int j = 0; j < cols; j++) b[k][j] = k < rows ? w[(bi * block + k) * N + c0 + j] : 0.0f;
            for (int j = 0; j < cols; j++) {
                float mn = b[0][j], mx = b[0][j];
                for (int k = 1; k < block; k++) {
                    mn = b[k][j] < mn ? b[k][j] : mn;
                    mx = b[k][j] > mx ? b[k][j] : mx;
                }
                lo[j] = mn;
                if (symmetric) {
                    float amax = -mn > mx ? -mn : mx;
                    base[j] = half_scale(amax > 0 ? amax / (float)((int)(qmax + 1) / 2) : 1.0f);
                } else {
                    base[j] = half_scale(mx > mn ? (mx - mn) / qmax : 1.0f);
                }
                best_err[j] = INFINITY;
                best_scale[j] = base[j];
                best_zero[j] = symmetric ? mid : clampf(nearbyintf(-mn / base[j]), 0.0f, qmax);
            }
            if (hb) {
                /* candidate -1 is (base, its zero point); then the grid: per factor, up to 3 zero points */
                for (int f = -1; f < nfactors; f++) {
                    for (int j = 0; j < cols; j++) {
                        scale[j] = f < 0 ? base[j] : half_scale(base[j] * factors[f]);
                        zero0[j] = symmetric ? mid : nearbyintf(-lo[j] / scale[j]);
                    }
                    for (int k = 0; k < block; k++)
                        for (int j = 0; j < cols; j++) r[k][j] = nearbyintf(b[k][j] / scale[j]);
                    int steps = symmetric || f < 0 ? 1 : 3;
                    for (int s = 0; s < steps; s++) {
                        float z[COLS];
                        for (int j = 0; j < cols; j++) {
                            z[j] = symmetric ? mid : clampf(zero0[j] + (f < 0 ? 0.0f : (float)(s - 1)), 0.0f, qmax);
                            err[j] = 0.0f;
                        }
                        for (int k = 0; k < block; k++) {
                            float hk = k < rows ? hb[k] : 0.0f;
                            for (int j = 0; j < cols; j++) {
                                float d = (clampf(r[k][j] + z[j], 0.0f, qmax) - z[j]) * scale[j] - b[k][j];
                                float sq = d * d;
                                err[j] = err[j] + hk * sq;
                            }
                        }
                        for (int j = 0; j < cols; j++)
                            if (err[j] < best_err[j]) {
                                best_err[j] = err[j];
                                best_scale[j] = scale[j];
                                best_zero[j] = z[j];
                            }
                    }
                }
            }
            for (int j = 0; j < cols; j++) {
                scales[bi * N + c0 + j] = best_scale[j];
                zeros[bi * N + c0 + j] = (uint8_t)best_zero[j];
            }
            for (int k = 0; k < block; k++)
                for (int j = 0; j < cols; j++)
                    codes[(bi * block + k) * N + c0 + j] =
                        (uint8_t)clampf(nearbyintf(b[k][j] / best_scale[j]) + best_zero[j], 0.0f, qmax);
        }
    }
    return 0;
}

/* AWQ's inner step (awq.search_scale), fused: out = minmax_round(w * s[k]) / s[k], each row k of w [K, N]
 * scaled by row_scale[k] (NULL: 1) before its blocks are rounded to the nearest codes of their range, and
 * scaled back after, so that x @ out is (x / s) @ Q(w * s). One pass over w instead of NumPy's eight. */
int llmc_block_fake_quantize(const float *w, const float *row_scale, int64_t K, int64_t N, int64_t n0, int64_t n1,
                             int bits, int block, int symmetric, float *out) {
    if (block <= 0 || block > 256 || bits < 1 || bits > 8) return 1;
    const float qmax = (float)((1 << bits) - 1), mid = (float)(1 << (bits - 1));
    const int64_t nblocks = (K + block - 1) / block;
    float b[256][COLS], scale[COLS], zero[COLS];
    for (int64_t bi = 0; bi < nblocks; bi++) {
        int rows = (int)(K - bi * block < block ? K - bi * block : block);
        for (int64_t c0 = n0; c0 < n1; c0 += COLS) {
            int cols = (int)(n1 - c0 < COLS ? n1 - c0 : COLS);
            for (int k = 0; k < block; k++) {
                float s = k < rows && row_scale ? row_scale[bi * block + k] : 1.0f;
                for (int j = 0; j < cols; j++) b[k][j] = k < rows ? w[(bi * block + k) * N + c0 + j] * s : 0.0f;
            }
            for (int j = 0; j < cols; j++) {
                float mn = b[0][j], mx = b[0][j];
                for (int k = 1; k < block; k++) {
                    mn = b[k][j] < mn ? b[k][j] : mn;
                    mx = b[k][j] > mx ? b[k][j] : mx;
                }
                if (symmetric) {
                    float amax = -mn > mx ? -mn : mx;
                    scale[j] = half_scale(amax > 0 ? amax / (float)((int)(qmax + 1) / 2) : 1.0f);
                    zero[j] = mid;
                } else {
                    scale[j] = half_scale(mx > mn ? (mx - mn) / qmax : 1.0f);
                    zero[j] = clampf(nearbyintf(-mn / scale[j]), 0.0f, qmax);
                }
            }
            for (int k = 0; k < rows; k++) {
                float s = row_scale ? row_scale[bi * block + k] : 1.0f;
                for (int j = 0; j < cols; j++)
                    out[(bi * block + k) * N + c0 + j] =
                        (clampf(nearbyintf(b[k][j] / scale[j]) + zero[j], 0.0f, qmax) - zero[j]) * scale[j] / s;
            }
        }
    }
    return 0;
}
