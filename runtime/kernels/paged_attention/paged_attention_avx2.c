/* llmc's paged attention loops (paged_attention.h) for CPUs with AVX2, FMA and F16C; head sizes a
 * multiple of 8. The dot products take eight keys at a time (eight accumulators over the head's
 * channels, one query load each step, folded by a tree of horizontal adds into one vector of eight
 * logits); the weighted sum of values keeps 32 output channels in registers across every key of the
 * tile; exp is a vector polynomial (below), written by hand as no library offers one for C. */
#include <immintrin.h>

#include "paged_attention.h"

#define ISA __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

ISA INLINE __m256 load_f32(const void *p, int c) { return _mm256_loadu_ps((const float *)p + c); }
ISA INLINE __m256 load_f16(const void *p, int c) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + c)));
}
ISA INLINE __m256 load_i8(const void *p, int c) { /* int8 codes widened; their scales are applied outside */
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + c))));
}

ISA INLINE float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* [sum(a[0]), ..., sum(a[7])] */
ISA INLINE __m256 fold8(const __m256 *a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define AVX2_LOOPS(SUFFIX, LOAD)                                                                   \
  ISA static void dots_##SUFFIX(const float *q, const void *const *keys, int n, int d, float *s) { \
    int t = 0;                                                                                     \
    for (; t + 8 <= n; t += 8) {                                                                   \
      __m256 acc[8];                                                                               \
      for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();                                    \
      for (int c = 0; c < d; c += 8) {                                                             \
        __m256 qv = _mm256_loadu_ps(q + c);                                                        \
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, LOAD(keys[t + j], c), acc[j]);    \
      }                                                                                            \
      _mm256_storeu_ps(s + t, fold8(acc));                                                         \
    }                                                                                              \
    for (; t < n; t++) {                                                                           \
      __m256 acc = _mm256_setzero_ps();                                                            \
      for (int c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), LOAD(keys[t], c), acc); \
      s[t] = hsum(acc);                                                                            \
    }                                                                                              \
  }                                                                                                \
  ISA static void accumulate_##SUFFIX(float *acc, const float *p, const void *const *values, int n, int d) { \
    int c = 0;                                                                                     \
    for (; c + 32 <= d; c += 32) {                                                                 \
      __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);                     \
      __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);               \
      for (int t = 0; t < n; t++) {                                                                \
        __m256 w = _mm256_broadcast_ss(p + t);                                                     \
        a0 = _mm256_fmadd_ps(w, LOAD(values[t], c), a0);                                           \
        a1 = _mm256_fmadd_ps(w, LOAD(values[t], c + 8), a1);                                       \
        a2 = _mm256_fmadd_ps(w, LOAD(values[t], c + 16), a2);                                      \
        a3 = _mm256_fmadd_ps(w, LOAD(values[t], c + 24), a3);                                      \
      }                                                                                            \
      _mm256_storeu_ps(acc + c, a0);                                                               \
      _mm256_storeu_ps(acc + c + 8, a1);                                                           \
      _mm256_storeu_ps(acc + c + 16, a2);                                                          \
      _mm256_storeu_ps(acc + c + 24, a3);                                                          \
    }                                                                                              \
    for (; c < d; c += 8) {                                                                        \
      __m256 a0 = _mm256_loadu_ps(acc + c);                                                        \
      for (int t = 0; t < n; t++) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), LOAD(values[t], c), a0); \
      _mm256_storeu_ps(acc + c, a0);                                                               \
    }                                                                                              \
  }

AVX2_LOOPS(f32, load_f32)
AVX2_LOOPS(f16, load_f16)
AVX2_LOOPS(i8, load_i8)

/* exp(x) for x <= 0 (a logit minus the running max): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
 * expf polynomial, 2^n built in the exponent bits; below -87 (under float's normal range) it returns
 * ~1e-38 instead of 0, which no sum of weights notices. Relative error ~2 ulp. */
ISA INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

ISA static float exp_sum(const float *s, float *p, int n, float max) {
  __m256 m = _mm256_set1_ps(max), sum = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(p + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < n) { /* the tail through a padded copy */
    float in[8], out[8];
    for (int j = 0; j < 8; j++) in[j] = t + j < n ? s[t + j] - max : -100.f;
    __m256 e = exp8(_mm256_loadu_ps(in));
    e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(in), _mm256_set1_ps(-99.f), _CMP_GT_OQ));
    _mm256_storeu_ps(out, e);
    sum = _mm256_add_ps(sum, e);
    for (int j = 0; t + j < n; j++) p[t + j] = out[j];
  }
  return hsum(sum);
}

static int supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static int takes(int d) { return d > 0 && d % 8 == 0; }

const PagedIsa paged_avx2 = {"avx2", supported, takes, {dots_f32, accumulate_f32, exp_sum},
                             {dots_f16, accumulate_f16, exp_sum}, {dots_i8, accumulate_i8, exp_sum}};
