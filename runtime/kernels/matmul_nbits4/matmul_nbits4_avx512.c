/* llmc's 4-bit matmul kernels for CPUs with AVX512-VNNI (the driver, and why the kernel exists:
 * matmul_nbits4.c). Decode (under 20 rows) walks the columns four at a time: per group of
 * four blocks, one 64-byte load of each column's packed weights, two AVX512-VNNI dot products per
 * column against the activations (laid out in the nibbles' order), the four columns' sums folded
 * into one vector so scales and zero points (read with the weights from the column group's records,
 * the scales already in the sums' lane order) apply to four columns at once; each record asks for the one
 * 4 KiB further down the stream. Prefill unpacks 16 columns at a time into a panel whose
 * dot products serve 16 columns of a row at once (SmolLM2, 512-token prompt: 443 ms with MLAS,
 * 250-275 here).
 */
#include <immintrin.h>

#include "matmul_nbits4_isa.h"

#define KERNEL_ISA __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* lane_scale / lane_sum here: two 16-lane float vectors per group whose lanes follow the four-column
 * sums' lanes (lane group j: block j of a group of four; j % 2 of a pair, whose halves land in
 * groups j and j + 2) — each block's scale, and its code sum (halved for a pair: each half carries
 * half the zero-point correction, exactly). */
KERNEL_ISA static void quantize_row(const float *a, int64_t k, const float *wide_amax, QRow *q) {
  for (int64_t start = 0, group = 0; start < k; group++) {
    int blocks = k - start >= 128 ? 4 : 2;
    int8_t *out = q->codes + start;
    for (int j = 0; j < blocks; j++) {
      const float *x = a + start + 32 * j;
      __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      float amax = wide_amax ? wide_amax[start / 32 + j]
                             : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      float scale = amax / 127.f; /* and its inverse, as MLAS computes them (same codes) */
      __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      q->block_scale[start / 32 + j] = scale;
      q->block_sum[start / 32 + j] = sum;
      __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)), _mm512_cvtepi32_epi8(q1), 1);
      store_block_codes(codes, out, j, blocks);
      for (int lane = 0; lane < 16; lane++) {
        if ((blocks == 4 ? lane / 4 : (lane / 4) % 2) != j) continue;
        q->lane_scale[group * 16 + lane] = scale;
        q->lane_sum[group * 16 + lane] = blocks == 4 ? (float)sum : (float)sum / 2.f;
      }
    }
    start += 32 * blocks;
  }
}

/* Four columns' dot products (one vector each, 128-bit lane j holding four partial sums of block
 * j) summed into one vector whose lane j holds [column 0, 1, 2, 3]: what lets the scales and zero
 * points of four columns apply in one vector operation, and the final sums take two shuffles. */
KERNEL_ISA INLINE __m512i four_column_sums(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
  __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* Rows r < R, columns n0 <= c < n1 into y[r * n + c - n0], a column group (four columns: q4_pack's records)
 * at a time, the last group's padding computed and not stored; R is a constant at each call site. */
KERNEL_ISA INLINE void tile(int R, const Q4Layout *l, const QRow *rows, const uint8_t *packed, int64_t n0, int64_t n1,
                            float *y, int64_t n) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), mask4 = _mm512_set1_epi32(15);
  /* lane (j, c) <- column c's zero point nibble for the group's block j (a pair's lanes j and j+2 share block j%2) */
  const __m512i quad_shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m512i pair_shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  /* lane (j, c) <- scale (j / 2, c) of a record in blocks of 64 */
  const __m512i twice = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
  for (int64_t col = n0; col < n1; col += 4) {
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < l->groups; g++) {
      const int quad = g < l->quads;
      const uint8_t *at = record(l, packed, col / 4, g);
      prefetch_ahead(at, record_bytes(l, quad ? 4 : 2));
      __m512i lo[4], hi[4];
      __m512 wscale;
      if (quad) {
        for (int i = 0; i < 4; i++) {
          __m512i packed_at = _mm512_loadu_si512((const void *)(at + 64 * i));
          lo[i] = _mm512_and_si512(packed_at, low4);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(packed_at, 4), low4);
        }
        /* lane (j, c): block j of column c (a wider block's scale repeated over the lanes of its blocks of 32) */
        const uint8_t *scales = at + record_scales(4);
        if (l->share == 1) {
          wscale = l->half_scales ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales))
                                  : _mm512_loadu_ps((const float *)scales);
        } else if (l->share == 2) { /* scales [2][4 columns]: each over two blocks' lanes */
          __m256 eight = l->half_scales ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales))
                                        : _mm256_loadu_ps((const float *)scales);
          wscale = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(eight));
        } else { /* share 4: scales [4 columns], over all four blocks' lanes */
          wscale = _mm512_broadcast_f32x4(l->half_scales ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)scales))
                                                         : _mm_loadu_ps((const float *)scales));
        }
      } else { /* a final pair: 32 bytes a column, whose low then high nibbles make the 64 codes */
        for (int i = 0; i < 4; i++) {
          __m256i half = _mm256_loadu_si256((const __m256i *)(at + 32 * i));
          lo[i] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(half), _mm256_srli_epi16(half, 4), 1), low4);
          hi[i] = _mm512_setzero_si512();
        }
        __m512 s8 = _mm512_castps256_ps512(scales8(l, at + record_scales(2), 0));
        wscale = _mm512_shuffle_f32x4(s8, s8, 0x44); /* lanes (j, c) and (j + 2, c): block j of column c */
      }
      __m512 wzero = _mm512_set1_ps(8.f);
      if (l->zero_points) {
        __m512i z4 = _mm512_broadcast_i32x4(record_zero_point_lanes(l, at, quad));
        __m512i shifted = _mm512_srlv_epi32(z4, quad ? quad_shift : pair_shift);
        wzero = _mm512_cvtepi32_ps(_mm512_and_si512(shifted, mask4));
      }
      for (int r = 0; r < R; r++) {
        const int8_t *codes = rows[r].codes + g * 128;
        __m512i even = _mm512_loadu_si512((const void *)codes), dots[4];
        if (quad) {
          __m512i odd = _mm512_loadu_si512((const void *)(codes + 64));
          for (int i = 0; i < 4; i++) dots[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], even), hi[i], odd);
        } else {
          for (int i = 0; i < 4; i++) dots[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], even);
        }
        __m512 dot = _mm512_cvtepi32_ps(four_column_sums(dots[0], dots[1], dots[2], dots[3]));
        __m512 v = _mm512_fnmadd_ps(wzero, _mm512_loadu_ps(rows[r].lane_sum + g * 16), dot);
        acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(wscale, _mm512_loadu_ps(rows[r].lane_scale + g * 16)), acc[r]);
      }
    }
    __mmask16 keep = (__mmask16)((1u << (n1 - col < 4 ? n1 - col : 4)) - 1u);
    for (int r = 0; r < R; r++) {
      __m512 t = _mm512_add_ps(acc[r], _mm512_shuffle_f32x4(acc[r], acc[r], 0x4E));
      t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1));
      _mm512_mask_storeu_ps(y + r * n + (col - n0), keep, t);
    }
  }
}

/* Prefill (12 rows and more): the task's 16 columns are first unpacked into a [K/4][16 columns][4]
 * byte panel (q4_unpack_panel: 4 consecutive codes of every column in one 64-byte vector), so each
 * dot product serves 16 columns of one row with no horizontal sums (the decode path reduces per
 * column instead). */
KERNEL_ISA INLINE void panel_rows(int R, int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                  const float *wzero, float *y, int64_t n, int64_t cols) {
  const int64_t blocks = k / 32;
  __m512 acc[ROWS];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < blocks; blk++) {
    int64_t even, odd;
    block_codes(blk, blocks, &even, &odd);
    __m512i dot[ROWS];
    for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
      int64_t at = half ? odd : even;
      for (int64_t d = 0; d < 4; d++) {
        __m512i w = _mm512_loadu_si512((const void *)(panel + (at / 4 + d) * 16));
        for (int r = 0; r < R; r++)
          dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(*(const int32_t *)(rows[r].codes + at + 4 * d)));
      }
    }
    __m512 ws = _mm512_loadu_ps(wscale + blk * 16), wz = _mm512_loadu_ps(wzero + blk * 16);
    for (int r = 0; r < R; r++) {
      __m512 v = _mm512_fnmadd_ps(wz, _mm512_set1_ps((float)rows[r].block_sum[blk]), _mm512_cvtepi32_ps(dot[r]));
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(rows[r].block_scale[blk])), acc[r]);
    }
  }
  __mmask16 keep = (__mmask16)((1u << cols) - 1u);
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * n, keep, acc[r]);
}

Q4_TILES(KERNEL_ISA)

KERNEL_ISA static void panel_rows4(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                   const float *wzero, float *y, int64_t ystride, int64_t cols) {
  panel_rows(ROWS, k, rows, panel, wscale, wzero, y, ystride, cols);
}

KERNEL_ISA static void panel_row(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                 const float *wzero, float *y, int64_t ystride, int64_t cols) {
  panel_rows(1, k, rows, panel, wscale, wzero, y, ystride, cols);
}

static int supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

/* prefill_rows 20: about where the panel starts to pay for its unpacking (2 threads, all linear layers of a
 * step, the panel's speedup over the decode tiles: SmolLM2's 12 rows 0.88x, 16 1.03x, 20 1.14x, 32 1.27x;
 * a 1B model's 12 rows 0.88x, 16 0.92x, 20 1.06x, 24 0.95x, 32 1.25x) */
const Q4Isa q4_avx512vnni = {"avx512vnni", 20, supported, quantize_row, {tile1, tile2, tile3, tile4},
                             panel_rows4, panel_row};
