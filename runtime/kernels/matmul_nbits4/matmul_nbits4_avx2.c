/* llmc's 4-bit matmul kernels for CPUs with AVX2 and FMA (the driver, and why the kernel exists:
 * matmul_nbits4.c). AVX2 has no int8 dot product into int32 (VNNI): a u8 x s8 product pair goes
 * through vpmaddubsw into int16 (4-bit weights times int8 codes: at most 2 x 15 x 127 = 3810 a lane,
 * so eight such sums still fit int16) and vpmaddwd into int32.
 *
 * Decode walks the columns four at a time, a pair of blocks (64 values, 32 packed bytes a column)
 * per step: one 32-byte load per column unpacks to the pair's even k (low nibbles) and odd k (high
 * nibbles), which meet the row's codes in the same order; the four columns' int32 sums are folded
 * into one vector [block A: columns 0-3 | block B: columns 0-3], so the scales and zero points of
 * four columns and two blocks apply in one vector operation. Scales and zero points come with the weights
 * in the column group's records, already in that lane order; each record asks for the one 4 KiB further
 * down the stream.
 * Prefill (20 rows and more) reads the 16-column panel (matmul_nbits4_isa.h) two rows at a time, each
 * row's broadcast codes meeting both 8-column halves, each block's eight dot products summed in
 * int16 before one widening.
 */
#include <string.h>

#include <immintrin.h>

#include "matmul_nbits4_isa.h"

#define KERNEL_ISA __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

KERNEL_ISA INLINE float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

KERNEL_ISA INLINE int32_t hsum8(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
}

/* lane_scale / lane_sum here: 8 floats per pair of blocks (2p, 2p + 1), lanes 0-3 block 2p's and
 * lanes 4-7 block 2p + 1's, as the decode tile's folded sums lay them out. */
KERNEL_ISA static void quantize_row(const float *a, int64_t k, const float *wide_amax, QRow *q) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t start = 0; start < k;) {
    int blocks = k - start >= 128 ? 4 : 2;
    int8_t *out = q->codes + start;
    for (int j = 0; j < blocks; j++) {
      const int64_t blk = start / 32 + j;
      const float *x = a + 32 * blk;
      __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
             x3 = _mm256_loadu_ps(x + 24);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                               _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
      float scale = (wide_amax ? wide_amax[blk] : hmax8(m)) / 127.f; /* and its inverse, as MLAS computes them */
      __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv)),
              q2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
      int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
      /* packs work per 128-bit lane: the dwords come out as k 0-3, 8-11, 16-19, 24-27 | 4-7, ... */
      __m256i codes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
      codes = _mm256_permutevar8x32_epi32(codes, order);
      store_block_codes(codes, out, j, blocks);
      q->block_scale[blk] = scale;
      q->block_sum[blk] = sum;
      for (int lane = 0; lane < 4; lane++) {
        q->lane_scale[blk * 4 + lane] = scale;
        q->lane_sum[blk * 4 + lane] = (float)sum;
      }
    }
    start += 32 * blocks;
  }
}

/* a column's unpacked pair (lo: even k, hi: odd k) against a row's codes: 16 int16 partial sums,
 * 8 per block, each of four products (at most 4 x 15 x 127 = 7620) */
KERNEL_ISA INLINE __m256i pair_dot(__m256i lo, __m256i hi, __m256i even, __m256i odd) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
}

/* Four columns' pair_dot folded into [block A: columns 0-3 | block B: columns 0-3] int32: two rounds
 * of pairwise int16 sums (at most 4 x 7620 = 30480: still int16) and one widening pairwise sum. */
KERNEL_ISA INLINE __m256i four_column_sums(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  __m256i s = _mm256_hadd_epi16(_mm256_hadd_epi16(d0, d1), _mm256_hadd_epi16(d2, d3));
  return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* Rows r < R, columns n0 <= c < n1 into y[r * ystride + c - n0], a column group (four columns: q4_pack's
 * records) at a time, the last group's padding computed and not stored; R is a constant at each call site. */
KERNEL_ISA INLINE void tile(int R, const Q4Layout *l, const QRow *rows, const uint8_t *packed, int64_t n0, int64_t n1,
                            float *y, int64_t ystride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), mask4 = _mm256_set1_epi32(15);
  for (int64_t col = n0; col < n1; col += 4) {
    __m256 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < l->groups; g++) {
      const int quad = g < l->quads;
      const int64_t blocks = quad ? 4 : 2;
      const uint8_t *at = record(l, packed, col / 4, g);
      prefetch_ahead(at, record_bytes(l, blocks));
      /* zero points: the group's nibbles per column, lane i column i's (8 in every nibble without) */
      __m256i z8 = l->zero_points ? _mm256_broadcastsi128_si256(record_zero_point_lanes(l, at, quad))
                                  : _mm256_set1_epi32((int)0x88888888);
      for (int pair = 0; pair < blocks / 2; pair++) {
        const int64_t p = g * 2 + pair; /* pairs of blocks so far */
        /* lanes 0-3: block 2 pair of the four columns, lanes 4-7: block 2 pair + 1 (the record's order) */
        __m256 wscale = scales8(l, at + record_scales(blocks), 8 * pair);
        const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4); /* block A's nibble, block B's */
        __m256i nibbles = _mm256_srlv_epi32(z8, _mm256_add_epi32(shift, _mm256_set1_epi32(8 * pair)));
        __m256 wzero = _mm256_cvtepi32_ps(_mm256_and_si256(nibbles, mask4));
        __m256i lo[4], hi[4];
        for (int i = 0; i < 4; i++) {
          __m256i packed_at = _mm256_loadu_si256((const __m256i *)(at + 16 * blocks * i + 32 * pair));
          lo[i] = _mm256_and_si256(packed_at, low4);
          hi[i] = _mm256_and_si256(_mm256_srli_epi16(packed_at, 4), low4);
        }
        const int64_t even = g * 128 + pair * 32, odd = even + 16 * blocks;
        for (int r = 0; r < R; r++) {
          __m256i e = _mm256_loadu_si256((const __m256i *)(rows[r].codes + even));
          __m256i o = _mm256_loadu_si256((const __m256i *)(rows[r].codes + odd));
          __m256i sums = four_column_sums(pair_dot(lo[0], hi[0], e, o), pair_dot(lo[1], hi[1], e, o),
                                          pair_dot(lo[2], hi[2], e, o), pair_dot(lo[3], hi[3], e, o));
          __m256 v = _mm256_fnmadd_ps(wzero, _mm256_loadu_ps(rows[r].lane_sum + p * 8), _mm256_cvtepi32_ps(sums));
          acc[r] = _mm256_fmadd_ps(v, _mm256_mul_ps(wscale, _mm256_loadu_ps(rows[r].lane_scale + p * 8)), acc[r]);
        }
      }
    }
    const int64_t kept = n1 - col < 4 ? n1 - col : 4;
    for (int r = 0; r < R; r++) {
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      float *out = y + r * ystride + (col - n0);
      if (kept == 4) {
        _mm_storeu_ps(out, t);
      } else {
        float lanes[4];
        _mm_storeu_ps(lanes, t);
        memcpy(out, lanes, sizeof(float) * (size_t)kept);
      }
    }
  }
}

/* The prefill panel (layout: matmul_nbits4_isa.h) from the packed records, every ISA's prefill reads it.
 * Four packed bytes of a column (8 k) hold two of its panel words: the low nibbles (word t) and the high
 * nibbles (word t + 16, or + 8 in a final pair of blocks). A gather brings those four bytes of 8 columns at
 * once, so two gathers fill two panel rows of 16 columns (four 32-byte stores). (Column by column,
 * the words went out one at a time 64 bytes apart: a 16-row step of a 1B model's layers spent most of its
 * time here, 309 ms against 168 through the decode tiles.) */
KERNEL_ISA void q4_unpack_panel(const Q4Layout *l, const uint8_t *packed, int64_t n0, int64_t cols, uint32_t *panel,
                                float *wscale, float *wzero) {
  for (int64_t c = 0; c < COLS_PER_TASK; c++) {
    for (int64_t blk = 0; blk < l->blocks; blk++) {
      const int64_t g = blk / 4, blocks = g < l->quads ? 4 : 2, j = blk - 4 * g, i = (n0 + c) % 4;
      const uint8_t *at = record(l, packed, (n0 + c) / 4, g);
      wscale[blk * COLS_PER_TASK + c] = c < cols ? scale_at(l, at + record_scales(blocks), 4 * j + i) : 0.f;
      const int64_t zero_at = record_zero_points(l, blocks) + i * (blocks / 2) + j / 2;
      uint8_t z = c < cols && l->zero_points ? at[zero_at] : 0x88;
      wzero[blk * COLS_PER_TASK + c] = (float)(blk % 2 ? z >> 4 : z & 15);
    }
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i live[2], group_of[2], within[2]; /* per half: which columns exist (others read 0), column group, place in it */
  for (int h = 0; h < 2; h++) {
    __m256i col = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h));
    live[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), col);
    group_of[h] = _mm256_mullo_epi32(_mm256_srli_epi32(col, 2), _mm256_set1_epi32((int)l->column_group_bytes));
    within[h] = _mm256_and_si256(col, _mm256_set1_epi32(3));
  }
  for (int64_t g = 0; g < l->groups; g++) { /* packed bytes of a column: 64 (four blocks) or 32 (a pair) */
    const int64_t bytes = g < l->quads ? 64 : 32;
    const uint8_t *base = record(l, packed, n0 / 4, g);
    __m256i offset[2]; /* per half: the columns' byte offsets from base */
    for (int h = 0; h < 2; h++) offset[h] = _mm256_add_epi32(group_of[h], _mm256_mullo_epi32(within[h], _mm256_set1_epi32((int)bytes)));
    uint32_t *words = panel + g * 32 * COLS_PER_TASK;
    for (int64_t t = 0; t < bytes / 4; t++) {
      for (int h = 0; h < 2; h++) {
        __m256i x = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(base + 4 * t), offset[h],
                                                live[h], 1);
        _mm256_storeu_si256((__m256i *)(words + t * COLS_PER_TASK + 8 * h), _mm256_and_si256(x, low4));
        _mm256_storeu_si256((__m256i *)(words + (t + bytes / 4) * COLS_PER_TASK + 8 * h),
                            _mm256_and_si256(_mm256_srli_epi16(x, 4), low4));
      }
    }
  }
}

/* R (1 or 2) rows against the panel's 16 columns, as two 8-column halves: each row's broadcast codes
 * meet both halves' weights, so a broadcast feeds two multiplies; `cols` of the 16 are stored. */
KERNEL_ISA INLINE void panel_pass(int R, int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                  const float *wzero, float *y, int64_t ystride, int64_t cols) {
  const int64_t blocks = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][2]; /* [row][half] */
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < blocks; blk++) {
    int64_t even, odd;
    block_codes(blk, blocks, &even, &odd);
    __m256i dot[2][2]; /* int16: eight sums of at most 3810 */
    for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int part = 0; part < 2; part++) {
      int64_t at = part ? odd : even;
      for (int64_t d = 0; d < 4; d++) {
        const uint32_t *w = panel + (at / 4 + d) * COLS_PER_TASK;
        __m256i w0 = _mm256_loadu_si256((const __m256i *)w), w1 = _mm256_loadu_si256((const __m256i *)(w + 8));
        for (int r = 0; r < R; r++) {
          __m256i codes = _mm256_set1_epi32(*(const int32_t *)(rows[r].codes + at + 4 * d)); /* 4 k, every column */
          dot[r][0] = _mm256_add_epi16(dot[r][0], _mm256_maddubs_epi16(w0, codes));
          dot[r][1] = _mm256_add_epi16(dot[r][1], _mm256_maddubs_epi16(w1, codes));
        }
      }
    }
    for (int half = 0; half < 2; half++) {
      __m256 ws = _mm256_loadu_ps(wscale + blk * COLS_PER_TASK + 8 * half);
      __m256 wz = _mm256_loadu_ps(wzero + blk * COLS_PER_TASK + 8 * half);
      for (int r = 0; r < R; r++) {
        __m256 v = _mm256_fnmadd_ps(wz, _mm256_set1_ps((float)rows[r].block_sum[blk]),
                                    _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r][half], ones)));
        acc[r][half] = _mm256_fmadd_ps(v, _mm256_mul_ps(ws, _mm256_set1_ps(rows[r].block_scale[blk])), acc[r][half]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float lanes[16];
    _mm256_storeu_ps(lanes, acc[r][0]);
    _mm256_storeu_ps(lanes + 8, acc[r][1]);
    memcpy(y + r * ystride, lanes, sizeof(float) * (size_t)cols);
  }
}

Q4_TILES(KERNEL_ISA)

KERNEL_ISA static void panel_rows4(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                   const float *wzero, float *y, int64_t ystride, int64_t cols) {
  for (int r = 0; r < ROWS; r += 2) panel_pass(2, k, rows + r, panel, wscale, wzero, y + r * ystride, ystride, cols);
}

KERNEL_ISA static void panel_row(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                                 const float *wzero, float *y, int64_t ystride, int64_t cols) {
  panel_pass(1, k, rows, panel, wscale, wzero, y, ystride, cols);
}

static int supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* prefill_rows 20: the panel's unpacking pays from about 20 rows here (one thread, a 576 x 3072 layer:
 * 12 rows 0.53 ms with panels vs 0.46 through decode tiles, 20: 0.72 vs 0.74, 32: 1.03 vs 1.21) */
const Q4Isa q4_avx2 = {"avx2", 20, supported, quantize_row, {tile1, tile2, tile3, tile4}, panel_rows4, panel_row};
