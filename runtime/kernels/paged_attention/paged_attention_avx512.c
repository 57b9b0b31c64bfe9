/* llmc's paged attention loops (paged_attention.h) for CPUs with AVX512F (and AVX2, FMA, F16C);
 * head sizes a multiple of 16. The same loops as paged_attention_avx2.c over 16 channels a register:
 * eight keys' dot products at a time (each accumulator halved to 8 lanes before the fold), 64 output
 * channels in registers across a tile's values, and the same exp polynomial 16 lanes at a time. */
#include <immintrin.h>

#include "paged_attention.h"

#define ISA __attribute__((target("avx512f,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

ISA INLINE __m512 load_f32(const void *p, int c) { return _mm512_loadu_ps((const float *)p + c); }
ISA INLINE __m512 load_f16(const void *p, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + c)));
}
ISA INLINE __m512 load_i8(const void *p, int c) { /* int8 codes widened; their scales are applied outside */
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + c))));
}

ISA INLINE __m256 halve(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* [sum(a[0]), ..., sum(a[7])] */
ISA INLINE __m256 fold8(const __m512 *a) {
  __m256 t0 = _mm256_hadd_ps(halve(a[0]), halve(a[1])), t1 = _mm256_hadd_ps(halve(a[2]), halve(a[3]));
  __m256 t2 = _mm256_hadd_ps(halve(a[4]), halve(a[5])), t3 = _mm256_hadd_ps(halve(a[6]), halve(a[7]));
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define AVX512_LOOPS(SUFFIX, LOAD)                                                                 \
  ISA static void dots_##SUFFIX(const float *q, const void *const *keys, int n, int d, float *s) { \
    int t = 0;                                                                                     \
    for (; t + 8 <= n; t += 8) {                                                                   \
      __m512 acc[8];                                                                               \
      for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();                                    \
      for (int c = 0; c < d; c += 16) {                                                            \
        __m512 qv = _mm512_loadu_ps(q + c);                                                        \
        for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_ps(qv, LOAD(keys[t + j], c), acc[j]);    \
      }                                                                                            \
      _mm256_storeu_ps(s + t, fold8(acc));                                                         \
    }                                                                                              \
    for (; t < n; t++) {                                                                           \
      __m512 acc = _mm512_setzero_ps();                                                            \
      for (int c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), LOAD(keys[t], c), acc); \
      s[t] = _mm512_reduce_add_ps(acc);                                                            \
    }                                                                                              \
  }                                                                                                \
  ISA static void accumulate_##SUFFIX(float *acc, const float *p, const void *const *values, int n, int d) { \
    int c = 0;                                                                                     \
    for (; c + 64 <= d; c += 64) {                                                                 \
      __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);                    \
      __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);               \
      for (int t = 0; t < n; t++) {                                                                \
        __m512 w = _mm512_set1_ps(p[t]);                                                           \
        a0 = _mm512_fmadd_ps(w, LOAD(values[t], c), a0);                                           \
        a1 = _mm512_fmadd_ps(w, LOAD(values[t], c + 16), a1);                                      \
        a2 = _mm512_fmadd_ps(w, LOAD(values[t], c + 32), a2);                                      \
        a3 = _mm512_fmadd_ps(w, LOAD(values[t], c + 48), a3);                                      \
      }                                                                                            \
      _mm512_storeu_ps(acc + c, a0);                                                               \
      _mm512_storeu_ps(acc + c + 16, a1);                                                          \
      _mm512_storeu_ps(acc + c + 32, a2);                                                          \
      _mm512_storeu_ps(acc + c + 48, a3);                                                          \
    }                                                                                              \
    for (; c < d; c += 16) {                                                                       \
      __m512 a0 = _mm512_loadu_ps(acc + c);                                                        \
      for (int t = 0; t < n; t++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), LOAD(values[t], c), a0); \
      _mm512_storeu_ps(acc + c, a0);                                                               \
    }                                                                                              \
  }

AVX512_LOOPS(f32, load_f32)
AVX512_LOOPS(f16, load_f16)
AVX512_LOOPS(i8, load_i8)

/* exp(x) for x <= 0: paged_attention_avx2.c's exp8, 16 lanes */
ISA INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

ISA static float exp_sum(const float *s, float *p, int n, float max) {
  __m512 m = _mm512_set1_ps(max), sum = _mm512_setzero_ps();
  int t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(p + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) { /* the tail under a mask */
    __mmask16 k = (__mmask16)((1u << (n - t)) - 1);
    __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m)));
    _mm512_mask_storeu_ps(p + t, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

static int supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

static int takes(int d) { return d > 0 && d % 16 == 0; }

const PagedIsa paged_avx512 = {"avx512", supported, takes, {dots_f32, accumulate_f32, exp_sum},
                               {dots_f16, accumulate_f16, exp_sum}, {dots_i8, accumulate_i8, exp_sum}};
