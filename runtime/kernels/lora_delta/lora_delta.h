/* llmc's per-token multi-LoRA delta on CPU (lora_delta.c), the kernel of the op llmc.LoraDelta (lora_delta_op.c).
 *
 * For every token n of a step: y[n] = y_base[n] + ((x[n] A[:, c]) * mask[n, c]) B[c, :], where c are the columns
 * of its mask row from the first nonzero one to the last (its own slot's block of the flat stacks, runtime/lora/
 * sites.py); a token whose mask row is all zero gets y[n] = y_base[n], copied bit for bit. Only the token's own
 * columns of A and rows of B are read: 1/S of what the four-node branch (compiler/lora/graph.py) multiplies. */
#ifndef LLMC_LORA_DELTA_H
#define LLMC_LORA_DELTA_H

#include <stddef.h>
#include <stdint.h>

enum { LORA_ISA_AVX512, LORA_ISA_AVX2, LORA_ISA_PORTABLE, LORA_ISA_COUNT };

/* The inner loops of one instruction set (lora_delta_isa.c): the same portable C compiled for each target. */
typedef struct {
  const char *name;
  int (*supported)(void);
  /* h[t*k + j] = mask_t[j] * sum_i x_t[i] a[i*lda + j] for t < n (x_t = xs[t], mask_t = masks[t]) */
  void (*shrink)(const float *const *xs, const float *const *masks, int n, const float *a, int64_t lda,
                 int64_t in, int64_t k, float *h);
  /* y_t[o] = base_t[o] + sum_j h[t*k + j] b[j*ldb + o] for o0 <= o < o1, t < n */
  void (*expand)(const float *h, int n, int64_t k, const float *b, int64_t ldb, const float *const *bases,
                 float *const *ys, int64_t o0, int64_t o1);
  /* ys[t][o] = bias[o] (0 without) + sum_i w[o*ldw + i] xs[t][i] for o0 <= o < o1, t < n (moe_lora.c's experts) */
  void (*dot_rows)(const float *w, int64_t ldw, int64_t o0, int64_t o1, const float *const *xs, int n, int64_t in,
                   const float *bias, float *const *ys);
} LoraIsa;

extern const LoraIsa *const lora_isas[LORA_ISA_COUNT]; /* by isa: avx512, avx2, portable */

const char *lora_isa_name(int isa);
int lora_isa_supported(int isa);

typedef struct {
  const float *y_base, *x, *a, *mask, *b; /* [rows, out], [rows, in], [in, width], [mask_rows, width], [width, out] */
  float *y;                               /* [rows, out] */
  int64_t rows, in, out, width, mask_rows; /* row r reads mask row r % mask_rows (a leading batch dim broadcasts) */
  int isa;
} LoraArgs;

typedef struct LoraCall LoraCall;
/* Group the rows by their mask's column run and plan the tasks (rows with none are copied here); NULL when out of
 * memory. Then run lora_shrink over `shrinks` tasks, then lora_expand over `expands` (in parallel within each). */
LoraCall *lora_prepare(const LoraArgs *args, size_t *shrinks, size_t *expands);
void lora_shrink(void *call, size_t task);
int64_t lora_multiply_adds(const LoraCall *call); /* the call's work: sum over its rows of K * (in + out) */
void lora_expand(void *call, size_t task);
void lora_free(LoraCall *call);

#endif
