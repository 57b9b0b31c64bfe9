/* llmc's 4-bit matmul: y = A x dequant(B) with B in ONNX Runtime's MatMulNBits layout (bits 4,
 * blocks of 32, 64 or 128, uint8 zero points or none), repacked when a session opens (q4_pack: each column
 * group's weights, scales and zero points in one stream, matmul_nbits4_isa.h), and A quantized to int8 per
 * block of 32 on the fly (as MLAS does at accuracy_level 4; scaled per weight block, as MLAS scales it). The
 * API is matmul_nbits4.h; cpu_kernels.c wraps it as an ONNX Runtime custom op.
 *
 * Why it exists: batch-1 decode is a stream over the weights, and MLAS's 4-bit kernel leaves memory
 * bandwidth unused there (SmolLM2's 151 linear layers of a decode step, 2 threads, AVX512-VNNI host:
 * 2.9 ms with MLAS, 2.2 ms here). This file is the part every instruction set shares: the rows of A
 * quantized once per call, the columns split into tasks — decode (fewer rows than the ISA's
 * prefill_rows): one contiguous run of columns per thread, each one stream of weights, walked by the
 * ISA's decode tile a few columns at a time; prefill: panels of COLS_PER_TASK columns dealt out as
 * the threads free up, each unpacked once so every dot product serves many columns of a row. The
 * kernels themselves are matmul_nbits4_avx512.c and matmul_nbits4_avx2.c (matmul_nbits4_isa.h is
 * what they share).
 */
#include "matmul_nbits4.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul_nbits4_isa.h"

enum { TILE_CHUNK_BYTES = 128 << 10 }; /* a decode chunk's weights: within L2 on the x86 CPUs the kernel targets */

static const Q4Isa *const ISAS[Q4_ISA_COUNT] = {&q4_avx512vnni, &q4_avx2};

const char *q4_isa_name(int isa) { return isa >= 0 && isa < Q4_ISA_COUNT ? ISAS[isa]->name : NULL; }

int q4_isa_supported(int isa) { return isa >= 0 && isa < Q4_ISA_COUNT && ISAS[isa]->supported(); }

typedef struct {
  const Q4Isa *isa;
  Q4Layout layout;
  int64_t m, k, n, span; /* span: columns per task, a multiple of 4 (a task's columns start a column group) */
  int64_t chunk; /* decode: columns the row groups take in turns (all of a task's when one group) */
  int failed;            /* a task could not allocate its panel */
  const QRow *rows;
  const uint8_t *packed; /* q4_pack's records */
  const float *bias;     /* [n] or NULL, added once a task's columns are computed */
  float *y;
} Work;

/* Prefill: the columns [c0, c1) a panel at a time, every row against each panel */
static void panels(const Work *w, int64_t c0, int64_t c1, uint32_t *panel, float *wscale, float *wzero) {
  for (int64_t p = c0; p < c1; p += COLS_PER_TASK) {
    int64_t cols = c1 - p < COLS_PER_TASK ? c1 - p : COLS_PER_TASK;
    float *y = w->y + p;
    q4_unpack_panel(&w->layout, w->packed, p, cols, panel, wscale, wzero);
    int64_t r = 0;
    for (; r + ROWS <= w->m; r += ROWS)
      w->isa->panel_rows(w->k, w->rows + r, panel, wscale, wzero, y + r * w->n, w->n, cols);
    for (; r < w->m; r++) w->isa->panel_row(w->k, w->rows + r, panel, wscale, wzero, y + r * w->n, w->n, cols);
  }
}

static void add_bias(const Work *w, int64_t c0, int64_t c1) {
  if (!w->bias) return;
  for (int64_t r = 0; r < w->m; r++)
    for (int64_t c = c0; c < c1; c++) w->y[r * w->n + c] += w->bias[c];
}

static void run_task(Work *w, size_t task) {
  int64_t c0 = (int64_t)task * w->span, c1 = c0 + w->span < w->n ? c0 + w->span : w->n;
  if (w->m >= w->isa->prefill_rows) {
    const int64_t blocks = w->k / 32;
    char *scratch = (char *)malloc((size_t)w->k * 16 + 2 * sizeof(float) * COLS_PER_TASK * (size_t)blocks);
    if (!scratch) { /* reported by q4_failed once every task has run */
      __atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
      return;
    }
    float *wscale = (float *)(scratch + w->k * 16);
    panels(w, c0, c1, (uint32_t *)scratch, wscale, wscale + COLS_PER_TASK * blocks);
    free(scratch);
    add_bias(w, c0, c1);
    return;
  }
  for (int64_t s = c0; s < c1; s += w->chunk) {
    const int64_t e = s + w->chunk < c1 ? s + w->chunk : c1;
    for (int64_t r = 0; r < w->m; r += ROWS) {
      int64_t rows = w->m - r < ROWS ? w->m - r : ROWS;
      w->isa->tile[rows - 1](&w->layout, w->rows + r, w->packed, s, e, w->y + r * w->n + s, w->n);
    }
  }
  add_bias(w, c0, c1);
}

struct Q4Matmul {
  Work work;
};

static size_t row_bytes(int64_t k) { return (size_t)k + sizeof(float) * (size_t)(2 * (k / 4) + 2 * (k / 32)); }

size_t q4_memory(int64_t m, int64_t k) {
  return sizeof(Q4Matmul) + (size_t)m * (sizeof(QRow) + row_bytes(k)) + sizeof(float) * (size_t)(k / 32);
}

/* each block of 32's largest |a| over the weights' block of 32 x share it lies in (MLAS quantizes A per weight
 * block, so its scale does) */
static void wide_amax(const float *a, int64_t k, int share, float *amax) {
  for (int64_t w = 0; w < k; w += 32 * share) {
    float m = 0.f;
    for (int64_t i = w; i < w + 32 * share; i++) m = fabsf(a[i]) > m ? fabsf(a[i]) : m;
    for (int j = 0; j < share; j++) amax[w / 32 + j] = m;
  }
}

Q4Matmul *q4_prepare(void *memory, int isa, const float *a, int64_t m, int64_t k, int64_t n, int64_t threads,
                     const uint8_t *packed, int zero_points, int half_scales, int share, const float *bias,
                     float *y, size_t *tasks) {
  Q4Matmul *call = (Q4Matmul *)memory;
  QRow *rows = (QRow *)(call + 1);
  char *data = (char *)(rows + m);
  float *amax = share > 1 ? (float *)(data + (size_t)m * row_bytes(k)) : NULL;
  for (int64_t r = 0; r < m; r++) {
    char *base = data + (size_t)r * row_bytes(k);
    rows[r].lane_scale = (float *)base;
    rows[r].lane_sum = (float *)base + k / 4;
    rows[r].block_scale = (float *)base + 2 * (k / 4);
    rows[r].block_sum = (int32_t *)base + 2 * (k / 4) + k / 32;
    rows[r].codes = (int8_t *)(base + sizeof(float) * (size_t)(2 * (k / 4) + 2 * (k / 32)));
    if (amax) wide_amax(a + r * k, k, share, amax);
    ISAS[isa]->quantize_row(a + r * k, k, amax, &rows[r]);
  }
  /* decode: one run of columns per thread, each one stream of records (2.3 ms a SmolLM2 step's layers,
   * 2.5 in 8 runs, on AVX512-VNNI); prefill: panels of 16 columns, dealt out as the threads free up */
  int64_t span = m < ISAS[isa]->prefill_rows ? ((n + threads - 1) / threads + 3) & ~(int64_t)3 : COLS_PER_TASK;
  /* decode with more rows than a tile takes: the row groups pass over a chunk of columns in turns, its records
   * (k / 2 bytes a column and k / 8 of scales) read from memory by the first group and from the cache by the
   * rest, instead of each group streaming the task's columns again (at 5-11 rows over a 1B model's layers,
   * 1.1-1.2x) */
  int64_t chunk = m > ROWS ? (TILE_CHUNK_BYTES / (k / 2 + k / 8)) & ~(int64_t)3 : span;
  if (chunk < 4) chunk = 4;
  Work work = {ISAS[isa], q4_layout(k, zero_points, half_scales, share), m, k, n, span, chunk, 0, rows, packed, bias,
               y};
  call->work = work;
  *tasks = (size_t)((n + span - 1) / span);
  return call;
}

size_t q4_packed_bytes(int64_t k, int64_t n, int zero_points, int half_scales, int share) {
  return (size_t)((n + 3) / 4 * q4_layout(k, zero_points, half_scales, share).column_group_bytes);
}

__attribute__((target("f16c"))) static uint16_t to_half(float x) {
  return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("f16c"))) static int is_half(float x) { return _cvtsh_ss(to_half(x)) == x; }

int q4_half_scales(const float *scales, int64_t count) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) return 0;
  for (int64_t i = 0; i < count; i++)
    if (!is_half(scales[i])) return 0; /* NaN too: it equals nothing */
  return 1;
}

/* ONNX Runtime's layout into the records (matmul_nbits4_isa.h): a copy, plain C, once per layer a session. ONNX
 * Runtime's blocks are `share` x 32 weights: their codes lie as those of blocks of 32 do (a column's K / 2 bytes in
 * k order), their scales and zero points one a block (a column's zero points (K / (32 share) + 1) / 2 bytes) */
void q4_pack(int64_t k, int64_t n, const uint8_t *b, const float *scales, const uint8_t *zero_points,
             int half_scales, int share, uint8_t *packed) {
  const Q4Layout l = q4_layout(k, zero_points != NULL, half_scales, share);
  const int64_t wide = l.blocks / share, zero_stride = (wide + 1) / 2; /* ONNX Runtime's blocks a column */
  for (int64_t cg = 0; cg < (n + 3) / 4; cg++) {
    for (int64_t g = 0; g < l.groups; g++) {
      const int64_t blocks = g < l.quads ? 4 : 2;
      uint8_t *at = (uint8_t *)record(&l, packed, cg, g);
      uint8_t *s = at + record_scales(blocks), *z = at + record_zero_points(&l, blocks);
      for (int64_t i = 0; i < 4; i++) {
        const int64_t c = 4 * cg + i < n ? 4 * cg + i : n - 1; /* the padding repeats the last column */
        memcpy(at + 16 * blocks * i, b + (c * l.blocks + 4 * g) * 16, (size_t)(16 * blocks));
        for (int64_t j = 0; j < blocks; j += share) {
          const float scale = scales[c * wide + (4 * g + j) / share];
          if (half_scales) {
            const uint16_t h = to_half(scale);
            memcpy(s + 2 * (4 * (j / share) + i), &h, sizeof h);
          } else {
            memcpy(s + 4 * (4 * (j / share) + i), &scale, sizeof scale);
          }
        }
        if (!zero_points) continue;
        for (int64_t j = 0; j < blocks; j += 2) { /* a byte: blocks j and j + 1 of 32, low nibble first */
          uint8_t byte = 0;
          for (int64_t h = 0; h < 2; h++) {
            const int64_t w = (4 * g + j + h) / share; /* the ONNX Runtime block holding it */
            byte |= (uint8_t)(((zero_points[c * zero_stride + w / 2] >> (4 * (w % 2))) & 15) << (4 * h));
          }
          z[i * (blocks / 2) + j / 2] = byte;
        }
      }
    }
  }
}

void q4_run(void *call, size_t task) { run_task(&((Q4Matmul *)call)->work, task); }

int q4_failed(const Q4Matmul *call) { return __atomic_load_n(&call->work.failed, __ATOMIC_RELAXED); }
