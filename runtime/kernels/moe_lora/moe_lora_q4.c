/* llmc.MoeLoraQ's 4-bit expert rows on AVX2 (moe_lora.c calls it where the CPU has AVX2 and the expert's widths
 * are whole 32s): integer dot products straight over QMoE's packed codes, no dequantized copy.
 *
 * Each token's activations are quantized to int8 per 32 values (scale amax / 127, as ONNX Runtime's QMoE and
 * MatMulNBits do at accuracy_level 4, the level the served QMoE node runs at), stored per 32 as [the 16 even k |
 * the 16 odd k]: the order a 16-byte run of codes unpacks to (low nibbles, then high). Then for a row o and 32
 * values c of it, with the weights' scale s and zero point z of the block holding c:
 *     sum_k w[o][k] x[k] ~= s * xscale[c] * (sum_j code_j * xq_j - z * sum_j xq_j)
 * maddubs multiplies the unsigned codes (0..15) by the signed activations; the zero point comes off through the
 * activations' sum. Four tokens share each unpacked run of codes. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe_lora.h"

typedef struct {
  int8_t *codes; /* [cols]: per 32, the even k then the odd k */
  float *scale;  /* [cols / 32] */
  int32_t *sum;  /* [cols / 32]: the codes' sum */
} QTokens;

static void quantize_token(const float *x, int64_t cols, int8_t *codes, float *scale, int32_t *sum) {
  for (int64_t c = 0; c < cols / 32; c++) {
    const float *v = x + 32 * c;
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int j = 0; j < 16; j++) {
      const int even = (int)lrintf(v[2 * j] * inv), odd = (int)lrintf(v[2 * j + 1] * inv);
      codes[32 * c + j] = (int8_t)even, codes[32 * c + 16 + j] = (int8_t)odd;
      total += even + odd;
    }
    scale[c] = s, sum[c] = total;
  }
}

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The lanes of each 32's integer dot go into float accumulators scaled by that 32's scales (one horizontal sum a
 * row, not one a 32: that was 2.5 times the instructions); the zero point's term, a scalar per 32, apart. */
__attribute__((target("avx2,fma"))) static void rows_avx2(const MoeQuantized *w, int64_t e, int64_t rows,
                                                            int64_t cols, const float *bias, const QTokens *q, int n,
                                                            float *const *ys) {
  const int64_t block = w->block ? w->block : cols, blocks = cols / block, chunks = cols / 32;
  const int64_t zp_row = w->block ? (blocks + 1) / 2 : 0, zp_expert = (rows + 1) / 2;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int t0 = 0; t0 < n; t0 += 4) {
    const int m = n - t0 < 4 ? n - t0 : 4;
    for (int64_t o = 0; o < rows; o++) {
      const int64_t r = e * rows + o;
      const uint8_t *codes = w->codes + r * (cols / 2);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float zero_term[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t b = c * 32 / block;
        const float s = w->scales[w->block ? r * blocks + b : r];
        int zero = 8;
        if (w->zero_points) {
          const uint8_t *zp = w->block ? w->zero_points + r * zp_row : w->zero_points + e * zp_expert;
          const int64_t at = w->block ? b : o;
          zero = (zp[at / 2] >> (4 * (at & 1))) & 15;
        }
        const __m128i packed = _mm_loadu_si128((const __m128i *)(codes + 16 * c));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        const __m256i unpacked = _mm256_and_si256(both, low); /* [low nibbles: even k | high: odd k] */
        for (int t = 0; t < m; t++) {
          const QTokens *x = &q[t0 + t];
          const float scale = s * x->scale[c];
          const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->codes + 32 * c));
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(unpacked, xv), ones);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale), acc[t]);
          zero_term[t] += scale * (float)(zero * x->sum[c]);
        }
      }
      for (int t = 0; t < m; t++) ys[t0 + t][o] = hsum(acc[t]) - zero_term[t] + (bias ? bias[o] : 0.f);
    }
  }
}

int moe_lora_q4_usable(const MoeQuantized *w, int64_t cols) {
  return w->bits == 4 && cols % 32 == 0 && (!w->block || w->block % 32 == 0) && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}

int moe_lora_q4_rows(const MoeQuantized *w, int64_t e, int64_t rows, int64_t cols, const float *bias,
                     const float *const *xs, int n, float *const *ys) {
  QTokens q[16];
  const int64_t chunks = cols / 32;
  void *memory = malloc((size_t)n * ((size_t)cols + (size_t)chunks * (sizeof(float) + sizeof(int32_t))));
  if (!memory) return -1;
  char *at = (char *)memory;
  for (int t = 0; t < n; t++) {
    q[t].codes = (int8_t *)at, at += cols;
    q[t].scale = (float *)at, at += chunks * sizeof(float);
    q[t].sum = (int32_t *)at, at += chunks * sizeof(int32_t);
    quantize_token(xs[t], cols, q[t].codes, q[t].scale, q[t].sum);
  }
  rows_avx2(w, e, rows, cols, bias, q, n, ys);
  free(memory);
  return 0;
}
