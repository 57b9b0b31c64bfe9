/* The inner loops of llmc.LoraDelta (lora_delta.h's LoraIsa), written once in portable C over GCC's vector
 * extension, one register of the target a vector (16 floats for AVX512, 8 for AVX2, 4 for the portable SSE2
 * baseline), and compiled for each instruction set through a target attribute, so no intrinsics: the compiler
 * picks the instructions. (16-float vectors everywhere, two or four registers each on AVX2 and SSE, spilled the
 * accumulators to the stack: AVX2 2.3-2.8x slower than the four-node branch, where 8 floats make it faster.)
 *
 * shrink: a tile's tokens four at a time (the last one repeated where fewer are left, its sums discarded), W of
 * the slot's columns a pass: each row of A's block is loaded once for the four tokens, the four sums stay in
 * registers over the whole input dimension. Columns beyond the last multiple of W (a slot width K = M*R not a multiple of W)
 * are summed one at a time.
 * expand: the same four tokens, W output columns at a time: each row of B's block loaded once for four, the four
 * deltas in registers over the slot's columns, then y = y_base + delta (the four-node branch's Add).
 * dot_rows (llmc.MoeLora's expert projections, moe_lora.c: weights [out, in] as ONNX Runtime's MoE keeps them): the
 * same four tokens against each row of a block of w, W inputs a step, the four sums in registers over the row. */
#include <string.h>

#include "lora_delta.h"

enum { DOT_BLOCK = 32 }; /* dot_rows: rows of w a block (32 rows of 4 KB: 128 KB, within L2) */

/* aligned(4): loads and stores may be unaligned */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
#define LOAD(p) (*(const V *)(p))
#define STORE(p, v) (*(V *)(p) = (v))

/* S: the suffix; ATTR: the target; V and W: the vector type and its floats (one register of the target) */
#define LORA_LOOPS(S, ATTR)                                                                                        \
  ATTR static void shrink_##S(const float *const *xs, const float *const *masks, int n, const float *a,           \
                              int64_t lda, int64_t in, int64_t k, float *h) {                                      \
    int64_t j0 = 0;                                                                                                \
    for (; j0 + W <= k; j0 += W)                                                                                 \
      for (int t0 = 0; t0 < n; t0 += 4) {                                                                          \
        const float *x0 = xs[t0], *x1 = xs[t0 + 1 < n ? t0 + 1 : n - 1], *x2 = xs[t0 + 2 < n ? t0 + 2 : n - 1],      \
                    *x3 = xs[t0 + 3 < n ? t0 + 3 : n - 1];                                                         \
        V s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                                \
        for (int64_t i = 0; i < in; i++) {                                                                         \
          const V av = LOAD(a + i * lda + j0);                                                                   \
          s0 += x0[i] * av, s1 += x1[i] * av, s2 += x2[i] * av, s3 += x3[i] * av;                                  \
        }                                                                                                          \
        const V *sums[4] = {&s0, &s1, &s2, &s3};                                                                 \
        for (int t = t0; t < n && t < t0 + 4; t++) STORE(h + t * k + j0, *sums[t - t0] * LOAD(masks[t] + j0));    \
      }                                                                                                            \
    for (; j0 < k; j0++)                                                                                           \
      for (int t = 0; t < n; t++) {                                                                                \
        float s = 0.f;                                                                                             \
        for (int64_t i = 0; i < in; i++) s += xs[t][i] * a[i * lda + j0];                                         \
        h[t * k + j0] = s * masks[t][j0];                                                                          \
      }                                                                                                            \
  }                                                                                                                \
  ATTR static void expand_##S(const float *h, int n, int64_t k, const float *b, int64_t ldb,                      \
                              const float *const *bases, float *const *ys, int64_t o0, int64_t o1) {               \
    for (int t0 = 0; t0 < n; t0 += 4) {                                                                            \
      const int m = n - t0 < 4 ? n - t0 : 4;                                                                       \
      const float *h0 = h + t0 * k, *h1 = h + (t0 + (m > 1)) * k, *h2 = h + (t0 + (m > 2 ? 2 : 0)) * k,             \
                  *h3 = h + (t0 + (m > 3 ? 3 : 0)) * k;                                                            \
      int64_t o = o0;                                                                                              \
      for (; o + W <= o1; o += W) {                                                                              \
        V d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};                                                                \
        for (int64_t j = 0; j < k; j++) {                                                                          \
          const V bv = LOAD(b + j * ldb + o);                                                                    \
          d0 += h0[j] * bv, d1 += h1[j] * bv, d2 += h2[j] * bv, d3 += h3[j] * bv;                                  \
        }                                                                                                          \
        const V *deltas[4] = {&d0, &d1, &d2, &d3};                                                               \
        for (int t = 0; t < m; t++) STORE(ys[t0 + t] + o, LOAD(bases[t0 + t] + o) + *deltas[t]);                  \
      }                                                                                                            \
      for (; o < o1; o++)                                                                                          \
        for (int t = t0; t < t0 + m; t++) {                                                                        \
          float d = 0.f;                                                                                           \
          for (int64_t j = 0; j < k; j++) d += h[t * k + j] * b[j * ldb + o];                                     \
          ys[t][o] = bases[t][o] + d;                                                                              \
        }                                                                                                          \
    }                                                                                                              \
  }                                                                                                                \
  ATTR static void dot_rows_##S(const float *w, int64_t ldw, int64_t o0, int64_t o1, const float *const *xs, int n, \
                                int64_t in, const float *bias, float *const *ys) {                                 \
    for (int64_t ob = o0; ob < o1; ob += DOT_BLOCK) { /* a block of w's rows stays in cache for every token */     \
      const int64_t oe = ob + DOT_BLOCK < o1 ? ob + DOT_BLOCK : o1;                                               \
      for (int t0 = 0; t0 < n; t0 += 4) {                                                                          \
        const int m = n - t0 < 4 ? n - t0 : 4;                                                                     \
        const float *x0 = xs[t0], *x1 = xs[t0 + (m > 1)], *x2 = xs[t0 + (m > 2 ? 2 : 0)],                          \
                    *x3 = xs[t0 + (m > 3 ? 3 : 0)];                                                                \
        for (int64_t o = ob; o < oe; o++) {                                                                        \
          const float *wo = w + o * ldw;                                                                           \
          V s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                              \
          int64_t i = 0;                                                                                           \
          for (; i + W <= in; i += W) {                                                                          \
            const V wv = LOAD(wo + i);                                                                             \
            s0 += wv * LOAD(x0 + i), s1 += wv * LOAD(x1 + i), s2 += wv * LOAD(x2 + i), s3 += wv * LOAD(x3 + i);    \
          }                                                                                                        \
          float r[4] = {0.f, 0.f, 0.f, 0.f};                                                                       \
          for (int l = 0; l < W; l++) r[0] += s0[l], r[1] += s1[l], r[2] += s2[l], r[3] += s3[l];                  \
          for (; i < in; i++) r[0] += wo[i] * x0[i], r[1] += wo[i] * x1[i], r[2] += wo[i] * x2[i],                 \
                              r[3] += wo[i] * x3[i];                                                               \
          const float b = bias ? bias[o] : 0.f;                                                                    \
          for (int t = 0; t < m; t++) ys[t0 + t][o] = r[t] + b;                                                    \
        }                                                                                                          \
      }                                                                                                            \
    }                                                                                                              \
  }

#define V v16
#define W 16
LORA_LOOPS(avx512, __attribute__((target("avx512f,avx2,fma"))))
#undef V
#undef W
#define V v8
#define W 8
LORA_LOOPS(avx2, __attribute__((target("avx2,fma"))))
#undef V
#undef W
#define V v4
#define W 4
LORA_LOOPS(portable, )

static int has_avx512(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
static int has_avx2(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
static int always(void) { return 1; }

const LoraIsa lora_avx512 = {"avx512", has_avx512, shrink_avx512, expand_avx512, dot_rows_avx512};
const LoraIsa lora_avx2 = {"avx2", has_avx2, shrink_avx2, expand_avx2, dot_rows_avx2};
const LoraIsa lora_portable = {"portable", always, shrink_portable, expand_portable, dot_rows_portable};
