/* The portable loops of llmc's paged attention (paged_attention.h), plain C for any CPU, and the
 * IEEE half conversions every path uses to write a float16 cache (int8 codes load as themselves: their
 * scales are folded into the queries and the output by paged_attention.c). */
#include <math.h>
#include <string.h>

#include "paged_attention.h"

float paged_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13); /* inf, nan */
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa) { /* subnormal: normalize */
    int shift = 0;
    while (!(mantissa & 0x400)) mantissa <<= 1, shift++;
    bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  } else {
    bits = sign;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t paged_float_to_half(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
  uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude >= 0x7f800000) return sign | 0x7c00 | (magnitude > 0x7f800000 ? 0x200 : 0); /* inf, nan */
  if (magnitude >= 0x477ff000) return sign | 0x7c00;                                         /* rounds past 65504 */
  if (magnitude < 0x38800000) { /* subnormal half (or zero): round the scaled value */
    if (magnitude < 0x33000000) return sign;
    uint32_t mantissa = (magnitude & 0x7fffff) | 0x800000, shift = 126 - (magnitude >> 23);
    uint32_t half = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), midpoint = 1u << (shift - 1);
    return sign | (uint16_t)(half + (rest > midpoint || (rest == midpoint && (half & 1))));
  }
  uint32_t half = ((magnitude >> 13) - (112 << 10)), rest = magnitude & 0x1fff;
  return sign | (uint16_t)(half + (rest > 0x1000 || (rest == 0x1000 && (half & 1))));
}

#define PORTABLE_LOOPS(SUFFIX, TYPE, LOAD)                                                       \
  static void dots_##SUFFIX(const float *q, const void *const *keys, int n, int d, float *s) {   \
    for (int t = 0; t < n; t++) {                                                                \
      const TYPE *k = (const TYPE *)keys[t];                                                     \
      float sum = 0.f;                                                                           \
      for (int c = 0; c < d; c++) sum += q[c] * LOAD(k[c]);                                      \
      s[t] = sum;                                                                                \
    }                                                                                            \
  }                                                                                              \
  static void accumulate_##SUFFIX(float *acc, const float *p, const void *const *values, int n, int d) { \
    for (int t = 0; t < n; t++) {                                                                \
      const TYPE *v = (const TYPE *)values[t];                                                   \
      for (int c = 0; c < d; c++) acc[c] += p[t] * LOAD(v[c]);                                   \
    }                                                                                            \
  }

#define AS_FLOAT(x) (x)
PORTABLE_LOOPS(f32, float, AS_FLOAT)
PORTABLE_LOOPS(f16, uint16_t, paged_half_to_float)
PORTABLE_LOOPS(i8, int8_t, AS_FLOAT)

static float exp_sum(const float *s, float *p, int n, float max) {
  float sum = 0.f;
  for (int t = 0; t < n; t++) sum += p[t] = expf(s[t] - max);
  return sum;
}

static int always(void) { return 1; }
static int any_size(int d) { return d > 0; }

const PagedIsa paged_portable = {
    "portable", always, any_size, {dots_f32, accumulate_f32, exp_sum}, {dots_f16, accumulate_f16, exp_sum},
    {dots_i8, accumulate_i8, exp_sum}};
