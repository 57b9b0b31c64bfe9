/* llmc's mixture-of-experts layer for a step's adapter tokens on CPU (moe_lora.c), the kernel of the op llmc.MoeLora
 * (moe_lora_op.c): what compiler/lora/experts.py's branch computes, running each adapter token's routed experts only.
 *
 * For every token n whose mask row has a nonzero run c (its slot's R columns of the flat stacks, runtime/lora/
 * sites.py): its router logits go through a softmax, the k largest probabilities pick its experts (renormalized when
 * `normalize`: plugins/op/moe.py's routing), and
 *     g_e = fc1[e] x + b1[e] + ((x A1[e][:, c]) * mask[n, c]) B1[e][c, :]          [2I], gate/up interleaved
 *     h_e = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + beta)       (limit > 0; else
 *           g * sigmoid(alpha g) * (u + beta)), g = g_e[0::2], u = g_e[1::2]                     [I]
 *     o_e = fc2[e] h_e + b2[e] + ((h_e A2[e][:, c]) * mask[n, c]) B2[e][c, :]       [H]
 *     y[n] = sum over its k experts of weight_e * o_e
 * A token with no slot gets y[n] = y_base[n] (the MoE node's output for it), copied bit for bit unless in place. */
#ifndef LLMC_MOE_LORA_H
#define LLMC_MOE_LORA_H

#include <stddef.h>
#include <stdint.h>

/* An expert weight [experts, rows, cols] as ONNX Runtime's QMoE keeps it (compiler/quantize/experts.py): `bits`-bit
 * codes (4: two a byte, the first in the low nibble) [experts, rows, cols * bits / 8], scales [experts, rows,
 * cols / block] and zero points [experts, rows, ceil(cols / block * bits / 8)] (4 bits: two blocks a byte); `block`
 * 0: one block a row, scales [experts, rows] and zero points [experts, ceil(rows * bits / 8)] (two rows a byte). No
 * zero points: 2^(bits - 1). bits 0: not quantized (the float weight of MoeLoraArgs). */
typedef struct {
  const uint8_t *codes, *zero_points;
  const float *scales;
  int bits;
  int64_t block;
} MoeQuantized;

typedef struct {
  const float *y_base, *x, *logits;   /* [rows, hidden], [rows, hidden], [rows, experts] */
  const float *fc1, *fc1_bias;        /* [experts, 2 * inter, hidden], [experts, 2 * inter] or NULL */
  const float *fc2, *fc2_bias;        /* [experts, hidden, inter], [experts, hidden] or NULL */
  const float *mask;                  /* [rows, width] */
  const float *a1, *b1, *a2, *b2;     /* [experts, hidden, width], [experts, width, 2 * inter], [experts, inter,
                                         width], [experts, width, hidden] */
  MoeQuantized fc1_q, fc2_q;          /* the experts' codes where fc1 / fc2 are NULL (llmc.MoeLoraQ) */
  float *y;                           /* [rows, hidden] */
  int64_t rows, hidden, inter, experts, width, k;
  int normalize;
  float alpha, beta, limit;
  int isa; /* lora_delta.h's: the LoRA loops' instruction set, and the experts' */
} MoeLoraArgs;

/* moe_lora_q4.c: expert e's 4-bit rows against n <= 16 tokens with int8 activations (accuracy_level 4's), straight
 * over the codes, on AVX2; usable where the codes are 4-bit, cols a multiple of 32 (and the block of 32) and the
 * CPU has AVX2. -1 when out of memory. */
int moe_lora_q4_usable(const MoeQuantized *w, int64_t cols);
int moe_lora_q4_rows(const MoeQuantized *w, int64_t e, int64_t rows, int64_t cols, const float *bias,
                     const float *const *xs, int n, float *const *ys);

typedef struct MoeLoraCall MoeLoraCall;
/* Route the adapter tokens, group their (token, expert) pairs by expert and slot into tiles (rows without a slot are
 * copied here); NULL when out of memory. Then run moe_lora_tile over `tiles` tasks (in parallel), then
 * moe_lora_finish once. */
MoeLoraCall *moe_lora_prepare(const MoeLoraArgs *args, size_t *tiles);
int64_t moe_lora_multiply_adds(const MoeLoraCall *call);
void moe_lora_tile(void *call, size_t task);
/* 0, or -1 when a task ran out of memory (its rows unwritten: the call failed) */
int moe_lora_finish(MoeLoraCall *call);
void moe_lora_free(MoeLoraCall *call);

#endif
