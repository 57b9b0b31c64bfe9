/* Inside llmc's 4-bit matmul: what matmul_nbits4.c (the ISA-independent driver: the call, its
 * tasks, the prefill/decode split) shares with the kernels of each instruction set
 * (matmul_nbits4_avx512.c, matmul_nbits4_avx2.c). Not part of the API (matmul_nbits4.h). */
#ifndef LLMC_MATMUL_NBITS4_ISA_H
#define LLMC_MATMUL_NBITS4_ISA_H

#include <stdint.h>
#include <string.h>

#include <immintrin.h> /* SSE2 here, and AVX2 in the functions marked for it (every kernel's CPU has it) */

/* ROWS: rows a decode tile or a prefill panel pass computes at once; COLS_PER_TASK: columns of a
 * prefill panel (calls of Q4Isa.prefill_rows rows and more unpack panels instead of streaming the
 * packed weights through decode tiles) */
enum { ROWS = 4, COLS_PER_TASK = 16 };

/* One row of A quantized to int8 per block of 32 (scale amax/127, as MLAS does at accuracy_level 4; with weights
 * in wider blocks, amax over the weights' block, as MLAS quantizes A per weight block: each block of 32 then
 * shares its wide block's scale).
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

/* The kernel's own layout of a layer's weights, scales and zero points (q4_pack writes it from ONNX
 * Runtime's when a session opens): the columns in groups of four (the last group padded with copies of
 * its last column), K in groups of four blocks of 32 (a quad; a final pair when K is an odd number of 64s),
 * and one record per column group and block group, so a decode tile reads one stream where ONNX
 * Runtime's layout makes it three:
 *   weights      [4 columns][16 x blocks bytes]  each column's packed bytes as ONNX Runtime packs them
 *   scales       [blocks / share][4 columns]    scale j of column i at 4 j + i: the tiles' lane order; `share`
 *                                               blocks of 32 to a scale (a node's block_size / 32: 1, 2 or 4);
 *                                               fp16 when every scale of the layer is an fp16 value
 *                                               (q4_half_scales: llmc's quantizer rounds them so), else fp32
 *   zero points  [4 columns][blocks / 2] bytes  one nibble a block of 32 (a wider block's repeated), only when
 *                                               the layer has them
 * A quad's record is 296 bytes with fp16 scales and zero points in blocks of 32 (328 with fp32 scales; 8 fewer
 * without zero points; 280 in blocks of 64, 272 in blocks of 128), a pair's half that. Scales take a fifth of
 * fp32 records' bytes, and a decode step is a stream over them: fp16 scales make it 10% shorter with the same
 * products (`python -m llmc.bench q4-stream` times both). Within a tile, scales are always per block of 32
 * (a wider block's repeated as they are read: scales8), as the activations' blocks are. */
typedef struct {
  int64_t blocks, quads, groups; /* groups: quads, and the final pair if any */
  int zero_points, half_scales, share;
  int64_t quad_bytes, column_group_bytes; /* a quad's record; a column group's records, all of K */
} Q4Layout;

/* bytes of the scales of a record of `blocks` (4 or 2) blocks; where its scales and zero points start; its bytes */
static inline int64_t record_scale_bytes(const Q4Layout *l, int64_t blocks) {
  return (l->half_scales ? 8 : 16) * (blocks / l->share);
}
static inline int64_t record_scales(int64_t blocks) { return 64 * blocks; }
static inline int64_t record_zero_points(const Q4Layout *l, int64_t blocks) {
  return 64 * blocks + record_scale_bytes(l, blocks);
}
static inline int64_t record_bytes(const Q4Layout *l, int64_t blocks) {
  return record_zero_points(l, blocks) + (l->zero_points ? 2 * blocks : 0);
}

/* `share`: blocks of 32 to a scale (1, 2 or 4); K a multiple of 32 x max(2, share), so a pair has one scale a
 * column at most */
static inline Q4Layout q4_layout(int64_t k, int zero_points, int half_scales, int share) {
  Q4Layout l = {k / 32, k / 128, (k / 32 + 3) / 4, zero_points, half_scales, share, 0, 0};
  l.quad_bytes = record_bytes(&l, 4);
  l.column_group_bytes = l.quads * l.quad_bytes + (l.groups > l.quads ? record_bytes(&l, 2) : 0);
  return l;
}

/* column group cg's record for block group g (the final pair's record follows the quads') */
static inline const uint8_t *record(const Q4Layout *l, const uint8_t *packed, int64_t cg, int64_t g) {
  return packed + cg * l->column_group_bytes + g * l->quad_bytes;
}

/* Lanes `first` .. `first + 7` (lane 4 j + i: block j of column i; `first` a multiple of 8) of a record whose
 * scales start at `scales`, as floats, in either width: with blocks of 32 (share 1) lanes and scales are one to
 * one; a wider block's scale fills the lanes of each of its blocks of 32 (share 2: scales 4 (first / 8) + i
 * twice; share 4: scales i, twice) */
__attribute__((target("avx2,f16c"))) static inline __m256 scales8(const Q4Layout *l, const uint8_t *scales,
                                                                 int64_t first) {
  if (l->share == 1) {
    if (l->half_scales) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * first)));
    return _mm256_loadu_ps((const float *)scales + first);
  }
  const int64_t at = 4 * (first / 4 / l->share);
  const __m128 four = l->half_scales ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + 2 * at)))
                                     : _mm_loadu_ps((const float *)scales + at);
  return _mm256_set_m128(four, four);
}

/* One of them, lane `index` (block index / 4 of column index % 4) */
__attribute__((target("f16c"))) static inline float scale_at(const Q4Layout *l, const uint8_t *scales, int64_t index) {
  index = 4 * (index / 4 / l->share) + index % 4;
  if (!l->half_scales) return ((const float *)scales)[index];
  uint16_t h;
  memcpy(&h, scales + 2 * index, sizeof h);
  return _cvtsh_ss(h);
}

/* A record's zero points as four lanes, lane i column i's: its two bytes (four nibbles, low first) in a quad's
 * record (`quad`), its one byte in a pair's */
__attribute__((target("avx2"))) static inline __m128i record_zero_point_lanes(const Q4Layout *l, const uint8_t *at,
                                                                             int quad) {
  if (quad) return _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(at + record_zero_points(l, 4))));
  int32_t z;
  memcpy(&z, at + record_zero_points(l, 2), sizeof z);
  return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(z));
}

/* Columns n0 <= c < n1 (n0 a multiple of 4) of `rows` rows go to y[r * ystride + c - n0]. */
typedef void (*TileFn)(const Q4Layout *l, const QRow *rows, const uint8_t *packed, int64_t n0, int64_t n1, float *y,
                       int64_t ystride);

/* The prefill panel, the same for every ISA (and unpacked by the AVX2 code, which every CPU the
 * kernel runs on has): `cols` (<= COLS_PER_TASK) columns from n0 (a multiple of 4) unpacked to panel[t][c]
 * (uint32: the 4 weight codes of column c that meet codes bytes 4t..4t+3 of a row), their scales and zero
 * points as [block][COLS_PER_TASK] floats (columns past `cols` scale 0). */
void q4_unpack_panel(const Q4Layout *l, const uint8_t *packed, int64_t n0, int64_t cols, uint32_t *panel,
                     float *wscale, float *wzero);

enum { PREFETCH_BYTES = 4096 };

/* Asks for the record PREFETCH_BYTES further down the stream than the one at `at` (`bytes` long): the tiles ask
 * for a few lines a record, as far ahead as they read, where the hardware prefetcher alone left a third of the
 * stream unused (scripts/bench_q4_stream.py: 74% of a plain read on AVX512-VNNI, 67% on AVX2). A column group's
 * records at once, two groups ahead, was 78-93% (AVX512-VNNI) and 67-76% (AVX2), worst at K 8192, whose
 * column groups are 21 KiB of prefetches at a time; a record at a time 4 KiB ahead, 99-110% and 92-98% of a
 * read without prefetches (2 KiB: 95-98%, 8 KiB: 92-103%, 16 KiB: 94-98%), and a 1B model's decode step 1.13x
 * faster. */
static inline void prefetch_ahead(const uint8_t *at, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(at + PREFETCH_BYTES + offset, 0, 3);
}

/* `rows` rows (ROWS, or 1 for the tail) against an unpacked panel, `cols` columns into y (stride ystride) */
typedef void (*PanelFn)(int64_t k, const QRow *rows, const uint32_t *panel, const float *wscale,
                        const float *wzero, float *y, int64_t ystride, int64_t cols);

/* tile1 .. tile4, the TileFn entries of an ISA file: its `INLINE void tile(int R, ...)` compiled for
 * each row count, R a constant (ATTRIBUTES: the file's target attribute) */
#define Q4_TILES(ATTRIBUTES) Q4_TILE(1, ATTRIBUTES) Q4_TILE(2, ATTRIBUTES) Q4_TILE(3, ATTRIBUTES) Q4_TILE(4, ATTRIBUTES)
#define Q4_TILE(R, ATTRIBUTES)                                                                                \
  ATTRIBUTES static void tile##R(const Q4Layout *l, const QRow *rows, const uint8_t *packed, int64_t n0,      \
                                 int64_t n1, float *y, int64_t ystride) {                                     \
    tile(R, l, rows, packed, n0, n1, y, ystride);                                                            \
  }

typedef struct {
  const char *name;
  int64_t prefill_rows; /* from how many rows the prefill panel pays for its unpacking */
  int (*supported)(void);
  /* `amax`: NULL, each block of 32 scaled by its own largest |a|; else amax[block] is the one to scale by (the
   * largest over the weights' wider block, as ONNX Runtime quantizes A per weight block: q4_prepare) */
  void (*quantize_row)(const float *a, int64_t k, const float *amax, QRow *q);
  TileFn tile[ROWS]; /* tile[r - 1] computes r rows */
  PanelFn panel_rows, panel_row; /* ROWS rows, one row */
} Q4Isa;

extern const Q4Isa q4_avx512vnni, q4_avx2;

#endif
