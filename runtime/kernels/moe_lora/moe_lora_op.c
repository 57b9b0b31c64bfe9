/* llmc.MoeLora: a mixture layer's expert-LoRA branch as one CPU op (moe_lora.c is the kernel), what the nodes
 * compiler/lora/experts.py writes compute for the step's adapter tokens, over each token's routed experts only.
 * runtime/kernels/moe_lora_fusion.py puts it in place of those nodes when a session opens.
 *
 * Inputs (float32): y_base [N, H] (the MoE node's output), x [N, H] and router logits [N, E] (its inputs), fc1
 * [E, 2I, H], fc1_bias [E, 2I] (optional), fc2 [E, H, I], fc2_bias [E, H] (optional): its weights; mask [N, W] (the
 * token mask, lora_mask), A1 [E, H, W], B1 [E, W, 2I], A2 [E, I, W], B2 [E, W, H]: the expert sites' stacks (W = S*R).
 * Output y, y_base's shape; it may take y_base's buffer (MayInplace, as llmc.LoraDelta).
 * Attributes: the MoE node's routing (`k`, `normalize_routing_weights`, `activation_alpha`, `activation_beta`,
 * `swiglu_limit`), `threads` (the session's intra-op threads), `site` (the layer, for error messages) and `isa`
 * (as llmc.LoraDelta's: "portable" also keeps llmc.MoeLoraQ's 4-bit codes off moe_lora_q4.c's integer dots).
 * A bad shape is an error naming the layer and the input at fault.
 *
 * llmc.MoeLoraQ: the same over QMoE's quantized experts (the quantized graph's node, compiler/lora/graph.py writes it
 * into the stored graph: the branch in standard ops cannot read QMoE's codes). Its inputs put fc1's codes (uint8),
 * scales and zero points (uint8, optional) where fc1 is, and fc2's likewise: y_base, x, logits, fc1, fc1_scales,
 * fc1_zero_points, fc1_bias, fc2, fc2_scales, fc2_zero_points, fc2_bias, mask, A1, B1, A2, B2; attributes
 * `expert_weight_bits` (4 or 8) and `block_size` (0 or absent: one block a row) as QMoE's (moe_lora.h). */
#include "moe_lora_op.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_delta.h"
#include "moe_lora.h"

enum { PARALLEL_WORK = 1 << 18 }; /* below this many multiply-adds a call runs inline (lora_delta_op.c's reason) */

typedef struct {
  int64_t threads, k, normalize, bits, block; /* bits 0: llmc.MoeLora (float experts); 4 or 8: llmc.MoeLoraQ */
  float alpha, beta, limit;
  int isa;
  char site[128];
} MoeLoraOp;

static const char *op_name(const OrtCustomOp *op);
static const char *op_name_q(const OrtCustomOp *op);

static OrtStatus *bad(const char *site, const char *text) {
  char message[720]; /* CreateStatus copies it */
  snprintf(message, sizeof message, "llmc.MoeLora (%s): %s", *site ? site : "?", text);
  return llmc_fail(ORT_INVALID_ARGUMENT, message);
}

static OrtStatus *create_kernel(const OrtCustomOp *custom, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)custom, (void)table;
  const int quantized = custom->GetName == op_name_q;
  MoeLoraOp op = {llmc_attr_int(info, "threads", 1), llmc_attr_int(info, "k", 0),
                  llmc_attr_int(info, "normalize_routing_weights", 0),
                  quantized ? llmc_attr_int(info, "expert_weight_bits", 4) : 0, llmc_attr_int(info, "block_size", 0),
                  llmc_attr_float(info, "activation_alpha", 1.f), llmc_attr_float(info, "activation_beta", 0.f),
                  llmc_attr_float(info, "swiglu_limit", 0.f), 0, ""};
  llmc_attr_string(info, "site", op.site, sizeof op.site, "");
  if (op.threads < 1) return bad(op.site, "threads must be at least 1");
  if (op.k < 1) return bad(op.site, "k (experts a token picks) must be at least 1");
  if (quantized && op.bits != 4 && op.bits != 8) return bad(op.site, "expert_weight_bits must be 4 or 8");
  if (op.block < 0 || (op.block & (op.block - 1))) return bad(op.site, "block_size must be a power of two, or 0");
  char isa[32];
  llmc_attr_string(info, "isa", isa, sizeof isa, "");
  for (op.isa = 0; op.isa < LORA_ISA_COUNT; op.isa++) /* the one asked for, or the best this CPU runs */
    if ((!*isa || !strcmp(isa, lora_isa_name(op.isa))) && lora_isa_supported(op.isa)) break;
  if (op.isa == LORA_ISA_COUNT) return bad(op.site, "isa is not one this CPU runs (avx512, avx2, portable)");
  MoeLoraOp *kernel = (MoeLoraOp *)malloc(sizeof(MoeLoraOp));
  if (!kernel) return llmc_fail(ORT_FAIL, "llmc.MoeLora: out of memory");
  *kernel = op;
  *out = kernel;
  return NULL;
}

/* llmc.MoeLora's inputs; llmc.MoeLoraQ's put codes, scales and zero points where the weights are (Q_*) */
enum { IN_Y_BASE, IN_X, IN_LOGITS, IN_FC1, IN_FC1_BIAS, IN_FC2, IN_FC2_BIAS, IN_MASK, IN_A1, IN_B1, IN_A2, IN_B2,
       IN_COUNT };
enum { Q_FC1 = 3, Q_FC1_SCALES, Q_FC1_ZP, Q_FC1_BIAS, Q_FC2, Q_FC2_SCALES, Q_FC2_ZP, Q_FC2_BIAS, Q_MASK, Q_A1, Q_B1,
       Q_A2, Q_B2, Q_COUNT };
static const char *const NAMES[Q_COUNT] = {"y_base", "x", "logits", "fc1", "fc1_bias", "fc2", "fc2_bias", "mask",
                                           "A1", "B1", "A2", "B2"};
static const char *const Q_NAMES[Q_COUNT] = {"y_base", "x", "logits", "fc1", "fc1_scales", "fc1_zero_points",
                                             "fc1_bias", "fc2", "fc2_scales", "fc2_zero_points", "fc2_bias", "mask",
                                             "A1", "B1", "A2", "B2"};

typedef struct {
  int64_t dims[3];
  size_t rank;
  void *data; /* NULL: an optional input left out */
} Input;

static OrtStatus *input(OrtKernelContext *context, const MoeLoraOp *op, size_t index, Input *in) {
  const OrtValue *value;
  TRY(CALL(KernelContext_GetInput, fn_input, context, index, &value));
  in->data = NULL, in->rank = 0;
  if (!value) return NULL;
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, &in->rank);
  if (!status && in->rank > 3) {
    CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
    char text[80];
    snprintf(text, sizeof text, "%s has more than 3 dimensions", (op->bits ? Q_NAMES : NAMES)[index]);
    return bad(op->site, text);
  }
  if (!status) status = CALL(GetDimensions, fn_dims, shape, in->dims, in->rank);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  if (status) return status;
  return CALL(GetTensorMutableData, fn_data, value, &in->data);
}

/* in's shape is {d0, d1[, d2]} (`rank` of them) */
static int is(const Input *in, size_t rank, int64_t d0, int64_t d1, int64_t d2) {
  return in->rank == rank && in->dims[0] == d0 && in->dims[1] == d1 && (rank < 3 || in->dims[2] == d2);
}

/* a shape check: input `index` is as `want` says, or `ok` is 0 */
typedef struct {
  int index, ok;
  const char *want;
} Check;

static OrtStatus *failed_check(const MoeLoraOp *op, const Input *in, const Check *c, const MoeLoraArgs *a) {
  const Input *bad_in = &in[c->index];
  char text[320];
  snprintf(text, sizeof text, "%s is [%lld, %lld, %lld] (rank %zu), not %s with N %lld, H %lld, E %lld, I %lld, "
           "W %lld", (op->bits ? Q_NAMES : NAMES)[c->index], (long long)bad_in->dims[0], (long long)bad_in->dims[1],
           (long long)(bad_in->rank > 2 ? bad_in->dims[2] : 0), bad_in->rank, c->want, (long long)a->rows,
           (long long)a->hidden, (long long)a->experts, (long long)a->inter, (long long)a->width);
  return bad(op->site, text);
}

/* N, H, E, W from y_base, logits and the mask; I from fc2 (its last dimension, codes unpacked) */
static OrtStatus *check_shapes(const MoeLoraOp *op, const Input *in, MoeLoraArgs *a) {
  const int q = op->bits != 0;
  const Input *y = &in[IN_Y_BASE], *lg = &in[IN_LOGITS], *fc2 = &in[q ? Q_FC2 : IN_FC2], *m = &in[q ? Q_MASK : IN_MASK];
  if (y->rank != 2 || lg->rank != 2 || fc2->rank != 3 || m->rank != 2)
    return bad(op->site, "takes y_base [N, H], logits [N, E], fc2 [E, H, I] and mask [N, W]");
  a->rows = y->dims[0], a->hidden = y->dims[1], a->experts = lg->dims[1], a->width = m->dims[1];
  a->inter = q ? fc2->dims[2] * 8 / op->bits : fc2->dims[2];
  const int64_t n = a->rows, h = a->hidden, e = a->experts, i = a->inter, w = a->width;
  const int at = q ? Q_MASK - IN_MASK : 0; /* where the mask and stacks moved to */
  Check checks[16] = {
      {IN_X, is(&in[IN_X], 2, n, h, 0), "[N, H]"},
      {IN_LOGITS, lg->dims[0] == n, "[N, E]"},
      {IN_MASK + at, m->dims[0] == n, "[N, W]"},
      {IN_A1 + at, is(&in[IN_A1 + at], 3, e, h, w), "[E, H, W]"},
      {IN_B1 + at, is(&in[IN_B1 + at], 3, e, w, 2 * i), "[E, W, 2I]"},
      {IN_A2 + at, is(&in[IN_A2 + at], 3, e, i, w), "[E, I, W]"},
      {IN_B2 + at, is(&in[IN_B2 + at], 3, e, w, h), "[E, W, H]"},
  };
  int count = 7;
  const int fc1_bias = q ? Q_FC1_BIAS : IN_FC1_BIAS, fc2_bias = q ? Q_FC2_BIAS : IN_FC2_BIAS;
  checks[count++] = (Check){fc1_bias, !in[fc1_bias].data || is(&in[fc1_bias], 2, e, 2 * i, 0), "[E, 2I]"};
  checks[count++] = (Check){fc2_bias, !in[fc2_bias].data || is(&in[fc2_bias], 2, e, h, 0), "[E, H]"};
  if (!q) {
    checks[count++] = (Check){IN_FC1, is(&in[IN_FC1], 3, e, 2 * i, h), "[E, 2I, H]"};
    checks[count++] = (Check){IN_FC2, is(fc2, 3, e, h, i), "[E, H, I]"};
  } else {
    const int64_t b = op->block;
    for (int f = 0; f < 2; f++) { /* fc1 [E, 2I, H], fc2 [E, H, I] as codes */
      const int64_t rows = f ? h : 2 * i, cols = f ? i : h, base = f ? Q_FC2 : Q_FC1;
      const int blockwise = b > 0, fits = !blockwise || cols % b == 0;
      checks[count++] = (Check){(int)base, fits && is(&in[base], 3, e, rows, cols * op->bits / 8),
                                f ? "codes [E, H, I * bits / 8], I a multiple of block_size"
                                  : "codes [E, 2I, H * bits / 8], H a multiple of block_size"};
      checks[count++] = (Check){(int)base + 1, blockwise ? is(&in[base + 1], 3, e, rows, fits ? cols / b : 0)
                                                         : is(&in[base + 1], 2, e, rows, 0),
                                blockwise ? "scales [E, rows, cols / block_size]" : "scales [E, rows]"};
      const Input *zp = &in[base + 2];
      checks[count++] = (Check){(int)base + 2, !zp->data || (blockwise
                                    ? is(zp, 3, e, rows, fits ? (cols / b * op->bits + 7) / 8 : 0)
                                    : is(zp, 2, e, (rows * op->bits + 7) / 8, 0)),
                                blockwise ? "zero points [E, rows, ceil(blocks * bits / 8)]"
                                          : "zero points [E, ceil(rows * bits / 8)]"};
    }
  }
  for (int c = 0; c < count; c++)
    if (!checks[c].ok) return failed_check(op, in, &checks[c], a);
  if (op->k > e) return bad(op->site, "k is above the number of experts");
  return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const MoeLoraOp *op = (const MoeLoraOp *)state;
  Input in[Q_COUNT];
  const int q = op->bits != 0, at = q ? Q_MASK - IN_MASK : 0;
  for (size_t i = 0; i < (size_t)(q ? Q_COUNT : IN_COUNT); i++) TRY(input(context, op, i, &in[i]));
  MoeLoraArgs a = {0};
  TRY(check_shapes(op, in, &a));
  OrtValue *output;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, in[IN_Y_BASE].dims, 2, &output));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)output, (void **)&a.y));
  if (!a.rows || !a.hidden) return NULL;
  a.y_base = in[IN_Y_BASE].data, a.x = in[IN_X].data, a.logits = in[IN_LOGITS].data;
  if (!q) {
    a.fc1 = in[IN_FC1].data, a.fc1_bias = in[IN_FC1_BIAS].data, a.fc2 = in[IN_FC2].data;
    a.fc2_bias = in[IN_FC2_BIAS].data;
  } else {
    a.fc1_q = (MoeQuantized){in[Q_FC1].data, in[Q_FC1_ZP].data, in[Q_FC1_SCALES].data, (int)op->bits, op->block};
    a.fc2_q = (MoeQuantized){in[Q_FC2].data, in[Q_FC2_ZP].data, in[Q_FC2_SCALES].data, (int)op->bits, op->block};
    a.fc1_bias = in[Q_FC1_BIAS].data, a.fc2_bias = in[Q_FC2_BIAS].data;
  }
  a.mask = in[IN_MASK + at].data;
  a.a1 = in[IN_A1 + at].data, a.b1 = in[IN_B1 + at].data, a.a2 = in[IN_A2 + at].data, a.b2 = in[IN_B2 + at].data;
  a.k = op->k, a.normalize = op->normalize != 0, a.alpha = op->alpha, a.beta = op->beta, a.limit = op->limit;
  a.isa = op->isa;
  size_t tiles;
  MoeLoraCall *call = moe_lora_prepare(&a, &tiles);
  if (!call) return llmc_fail(ORT_FAIL, "llmc.MoeLora: out of memory");
  OrtStatus *status = NULL;
  if (op->threads <= 1 || moe_lora_multiply_adds(call) < PARALLEL_WORK) {
    for (size_t t = 0; t < tiles; t++) moe_lora_tile(call, t);
  } else if (tiles) {
    status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, moe_lora_tile, tiles, 0, call);
  }
  if (!status && moe_lora_finish(call)) status = llmc_fail(ORT_FAIL, "llmc.MoeLora: out of memory");
  moe_lora_free(call);
  return status;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MoeLora"; }
static const char *op_name_q(const OrtCustomOp *op) { (void)op; return "MoeLoraQ"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return IN_COUNT; }
static size_t input_count_q(const OrtCustomOp *op) { (void)op; return Q_COUNT; }
static int input_type_q(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == Q_FC1 || i == Q_FC1_ZP || i == Q_FC2 || i == Q_FC2_ZP ? TYPE_UINT8 : TYPE_FLOAT;
}
static int input_characteristic_q(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == Q_FC1_ZP || i == Q_FC1_BIAS || i == Q_FC2_ZP || i == Q_FC2_BIAS ? IO_OPTIONAL : IO_REQUIRED;
}
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int input_characteristic(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == IN_FC1_BIAS || i == IN_FC2_BIAS ? IO_OPTIONAL : IO_REQUIRED;
}
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; /* OrtMemTypeDefault */ }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }

/* MayInplace (llmc_output_over_input0): y may take y_base's buffer; moe_lora_prepare copies or leaves a row without a
 * slot before any row is written, and an adapter token's row is written by moe_lora_finish alone, from its own
 * pairs' outputs. */

#define MOE_LORA_OP(version, name, types, count, characteristic)                                                 \
  {version, NULL, name, op_provider, types, count, float_type, output_count, NULL, destroy_kernel, characteristic,   \
   required, memory_type, min_arity, homogeneous, min_arity, homogeneous, create_kernel, compute, NULL, NULL, NULL,  \
   llmc_output_over_input0, llmc_release_inplace, NULL, NULL}
const OrtCustomOp moe_lora_op = MOE_LORA_OP(18, op_name, float_type, input_count, input_characteristic);
const OrtCustomOp moe_lora_op_v16 = MOE_LORA_OP(16, op_name, float_type, input_count, input_characteristic);
const OrtCustomOp moe_lora_q_op = MOE_LORA_OP(18, op_name_q, input_type_q, input_count_q, input_characteristic_q);
const OrtCustomOp moe_lora_q_op_v16 = MOE_LORA_OP(16, op_name_q, input_type_q, input_count_q, input_characteristic_q);
