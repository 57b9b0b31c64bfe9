/* Inside llmc's 4-bit matmul: what matmul_nbits4.c (the ISA-independent driver: the call, its
 * tasks, the prefill/decode split) shares with the kernels of each instruction set
 * (matmul_nbits4_avx512.c, matmul_nbits4_avx2.c). Not part of the API (matmul_nbits4.h). */
#ifndef LLMC_MATMUL_NBITS4_ISA_H
#define LLMC_MATMUL_NBITS4_ISA_H

#include <stdint.h>

#include <immintrin.h> /* SSE2 here, and AVX2 in the functions marked for it (every kernel's CPU has it) */

/* ROWS: rows a decode tile or a prefill panel pass computes at once; COLS_PER_TASK: columns of a
 * prefill panel (calls of Q4Isa.prefill_rows rows and more unpack panels instead of streaming the
 * packed weights through decode tiles) */
enum { ROWS = 4, COLS_PER_TASK = 16, PREFETCH_GROUPS = 2 /* see prefetch_column_group */ };

/* One row of A quantized to int8 per block of 32 (scale amax/127, as MLAS does at accuracy_level 4).
 * The codes follow the weights' grouping: groups of four blocks (128 values, the 64 packed bytes of
 * a column) and, when K is an odd number of 64s, one final pair; per group the codes of the even k
 * of each block, then those of the odd k (the order the low and high nibbles unpack to). Every
 * kernel reads this same order. lane_scale / lane_sum: each block's scale and code sum laid out as
 * the ISA's decode tile lays out its lanes (each ISA's quantize_row says how); block_scale /
 * block_sum: the same per block, plain, for the prefill panel. */
typedef struct {
  int8_t *codes;
  float *lane_scale, *lane_sum; /* k / 4 floats each */
  float *block_scale;           /* k / 32 */
  int32_t *block_sum;           /* k / 32 */
} QRow;

/* Block j of a group of `blocks` (4, or 2 for the final pair) into a row's codes from the group's
 * start: `codes` its 32 int8 codes in k order, stored as the even k at 16 j and the odd k at
 * 16 (blocks + j). */
__attribute__((target("avx2"))) static inline void store_block_codes(__m256i codes, int8_t *group, int j,
                                                                      int blocks) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  codes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(codes, split), 0xD8); /* [even k | odd k] */
  _mm_storeu_si128((__m128i *)(group + 16 * j), _mm256_castsi256_si128(codes));
  _mm_storeu_si128((__m128i *)(group + 16 * (blocks + j)), _mm256_extracti128_si256(codes, 1));
}

/* Where block blk's codes lie in a row's codes (of k / 32 = `blocks` blocks): its 16 even-k codes
 * from *even, its 16 odd-k codes from *odd (16 or 32 codes later: a group's even half) */
static inline void block_codes(int64_t blk, int64_t blocks, int64_t *even, int64_t *odd) {
  const int64_t group = blk / 4 * 4, size = blocks - group >= 4 ? 4 : 2;
  *even = group * 32 + (blk - group) * 16;
  *odd = *even + size * 16;
}

/* Weights in ONNX Runtime's MatMulNBits layout (bits 4, blocks of 32): b [n][k/32][16] bytes,
 * scales [n][k/32], zero points [n][k/64] bytes or NULL (8). Columns n0 <= c < n1 of `rows` rows go
 * to y[r * ystride + c - n0]. */
typedef void (*TileFn)(int64_t k, const QRow *rows, const uint8_t *b, const float *scales, const uint8_t *zp,
                       int64_t n0, int64_t n1, float *y, int64_t ystride);

/* The prefill panel, the same for every ISA (and unpacked by the AVX2 code, which every CPU the
 * kernel runs on has): `cols` (<= COLS_PER_TASK) columns from n0 unpacked to panel[t][c] (uint32:
 * the 4 weight codes of column c that meet codes bytes 4t..4t+3 of a row), their scales and zero
 * points as [block][COLS_PER_TASK] floats (columns past `cols` scale 0). */
void q4_unpack_panel(int64_t k, const uint8_t *b, const float *scales, const uint8_t *zp, int64_t n0, int64_t cols,
                     uint32_t *panel, float *wscale, float *wzero);

/* The decode tiles walk four columns at a time: c[i] = the group's columns from `col`, the last one
 * repeated past n1 (its sums computed again and not stored). */
static inline void column_group(int64_t col, int64_t n1, int64_t c[4]) {
  for (int i = 0; i < 4; i++) c[i] = col + i < n1 ? col + i : n1 - 1;
}

/* The four columns' scales for group g of their blocks: s[i] = column c[i]'s four (a quad) or two
 * (the final pair; the upper two lanes 0) */
static inline void group_scales(const float *scales, int64_t blocks, int64_t g, int quad, const int64_t c[4],
                                __m128 s[4]) {
  for (int i = 0; i < 4; i++) {
    const float *at = scales + c[i] * blocks + g * 4;
    s[i] = quad ? _mm_loadu_ps(at) : _mm_castpd_ps(_mm_load_sd((const double *)at));
  }
}

/* The four columns' zero points for group g, lane i column c[i]'s: its two bytes (four nibbles, low
 * first) for a quad, its one byte for the final pair */
static inline __m128i group_zero_points(const uint8_t *zp, int64_t blocks, int64_t g, int quad, const int64_t c[4]) {
  const uint8_t *z = zp + g * 2;
  const int64_t stride = blocks / 2;
  return quad ? _mm_setr_epi32(*(const uint16_t *)(z + c[0] * stride), *(const uint16_t *)(z + c[1] * stride),
                               *(const uint16_t *)(z + c[2] * stride), *(const uint16_t *)(z + c[3] * stride))
              : _mm_setr_epi32(z[c[0] * stride], z[c[1] * stride], z[c[2] * stride], z[c[3] * stride]);
}

/* Asks for the weights, scales and zero points of the four columns from `col` ahead of their use:
 * the tiles request the column group after next (the hardware prefetcher does not follow their
 * interleaved streams well: SmolLM2's layers on AVX512-VNNI, 3.3 ms a step without, 2.4 ms with;
 * one or three groups ahead alike). */
static inline void prefetch_column_group(const uint8_t *b, const float *scales, const uint8_t *zp, int64_t col,
                                         int64_t blocks) {
  for (int64_t at = 0; at < 4 * blocks * 16; at += 64) __builtin_prefetch(b + col * blocks * 16 + at, 0, 3);
  for (int64_t at = 0; at < 4 * blocks * 4; at += 64) __builtin_prefetch((const char *)(scales + col * blocks) + at, 0, 3);
  if (zp) __builtin_prefetch(zp + col * (blocks / 2), 0, 3);
}

/* `rows` rows (ROWS, or 1 for the tail) against an unpacked panel, `cols` columns into y (stride ystride) */
typedef void (*PanelFn)(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                        const float *wzero, float *y, int64_t ystride, int64_t cols);

/* tile1 .. tile4, the TileFn entries of an ISA file: its `INLINE void tile(int R, ...)` compiled for
 * each row count, R a constant (ATTRIBUTES: the file's target attribute) */
#define Q4_TILES(ATTRIBUTES) Q4_TILE(1, ATTRIBUTES) Q4_TILE(2, ATTRIBUTES) Q4_TILE(3, ATTRIBUTES) Q4_TILE(4, ATTRIBUTES)
#define Q4_TILE(R, ATTRIBUTES)                                                                                \
  ATTRIBUTES static void tile##R(int64_t k, const QRow *rows, const uint8_t *b, const float *scales,         \
                                 const uint8_t *zp, int64_t n0, int64_t n1, float *y, int64_t ystride) {      \
    tile(R, k, rows, b, scales, zp, n0, n1, y, ystride);                                                     \
  }

typedef struct {
  const char *name;
  int64_t prefill_rows; /* from how many rows the prefill panel pays for its unpacking */
  int (*supported)(void);
  void (*quantize_row)(const float *a, int64_t k, QRow *q);
  TileFn tile[ROWS]; /* tile[r - 1] computes r rows */
  PanelFn panel_rows, panel_row; /* ROWS rows, one row */
} Q4Isa;

extern const Q4Isa q4_avx512vnni, q4_avx2;

#endif
