/* llmc.MoeLora: a mixture layer's expert-LoRA branch as one CPU op (moe_lora.c is the kernel), what the nodes
 * compiler/lora/experts.py writes compute for the step's adapter tokens, over each token's routed experts only.
 * runtime/kernels/moe_lora_fusion.py puts it in place of those nodes when a session opens.
 *
 * Inputs (float32): y_base [N, H] (the MoE node's output), x [N, H] and router logits [N, E] (its inputs), fc1
 * [E, 2I, H], fc1_bias [E, 2I] (optional), fc2 [E, H, I], fc2_bias [E, H] (optional): its weights; mask [N, W] (the
 * token mask, lora_mask), A1 [E, H, W], B1 [E, W, 2I], A2 [E, I, W], B2 [E, W, H]: the expert sites' stacks (W = S*R).
 * Output y, y_base's shape; it may take y_base's buffer (MayInplace, as llmc.LoraDelta).
 * Attributes: the MoE node's routing (`k`, `normalize_routing_weights`, `activation_alpha`, `activation_beta`,
 * `swiglu_limit`), `threads` (the session's intra-op threads) and `site` (the layer, for error messages).
 * A bad shape is an error naming the layer and the input at fault. */
#include "moe_lora_op.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_delta.h"
#include "moe_lora.h"

enum { PARALLEL_WORK = 1 << 18 }; /* below this many multiply-adds a call runs inline (lora_delta_op.c's reason) */

typedef struct {
  int64_t threads, k, normalize;
  float alpha, beta, limit;
  int isa;
  char site[128];
} MoeLoraOp;

static OrtStatus *bad(const char *site, const char *text) {
  char message[720]; /* CreateStatus copies it */
  snprintf(message, sizeof message, "llmc.MoeLora (%s): %s", *site ? site : "?", text);
  return llmc_fail(ORT_INVALID_ARGUMENT, message);
}

static float attr_float(const OrtKernelInfo *info, const char *name, float fallback) {
  float value;
  OrtStatus *status = CALL(KernelInfoGetAttribute_float, fn_attr_float, info, name, &value);
  if (!status) return value;
  CALL(ReleaseStatus, fn_release_status, status);
  return fallback;
}

static OrtStatus *create_kernel(const OrtCustomOp *custom, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)custom, (void)table;
  MoeLoraOp op = {llmc_attr_int(info, "threads", 1), llmc_attr_int(info, "k", 0),
                  llmc_attr_int(info, "normalize_routing_weights", 0), attr_float(info, "activation_alpha", 1.f),
                  attr_float(info, "activation_beta", 0.f), attr_float(info, "swiglu_limit", 0.f), 0, ""};
  llmc_attr_string(info, "site", op.site, sizeof op.site, "");
  if (op.threads < 1) return bad(op.site, "threads must be at least 1");
  if (op.k < 1) return bad(op.site, "k (experts a token picks) must be at least 1");
  while (op.isa < LORA_ISA_COUNT && !lora_isa_supported(op.isa)) op.isa++; /* the best this CPU runs */
  MoeLoraOp *kernel = (MoeLoraOp *)malloc(sizeof(MoeLoraOp));
  if (!kernel) return llmc_fail(ORT_FAIL, "llmc.MoeLora: out of memory");
  *kernel = op;
  *out = kernel;
  return NULL;
}

enum { IN_Y_BASE, IN_X, IN_LOGITS, IN_FC1, IN_FC1_BIAS, IN_FC2, IN_FC2_BIAS, IN_MASK, IN_A1, IN_B1, IN_A2, IN_B2,
       IN_COUNT };
static const char *const NAMES[IN_COUNT] = {"y_base", "x", "logits", "fc1", "fc1_bias", "fc2", "fc2_bias", "mask",
                                            "A1", "B1", "A2", "B2"};

typedef struct {
  int64_t dims[3];
  size_t rank;
  float *data; /* NULL: an optional input left out */
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
    snprintf(text, sizeof text, "%s has more than 3 dimensions", NAMES[index]);
    return bad(op->site, text);
  }
  if (!status) status = CALL(GetDimensions, fn_dims, shape, in->dims, in->rank);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  if (status) return status;
  return CALL(GetTensorMutableData, fn_data, value, (void **)&in->data);
}

/* in's shape is {d0, d1[, d2]} (`rank` of them) */
static int is(const Input *in, size_t rank, int64_t d0, int64_t d1, int64_t d2) {
  return in->rank == rank && in->dims[0] == d0 && in->dims[1] == d1 && (rank < 3 || in->dims[2] == d2);
}

static OrtStatus *check_shapes(const MoeLoraOp *op, const Input *in, MoeLoraArgs *a) {
  const Input *y = &in[IN_Y_BASE], *fc1 = &in[IN_FC1], *m = &in[IN_MASK];
  if (y->rank != 2 || fc1->rank != 3 || m->rank != 2 || fc1->dims[1] % 2)
    return bad(op->site, "takes y_base [N, H], fc1 [E, 2I, H] and mask [N, W]");
  a->rows = y->dims[0], a->hidden = y->dims[1], a->experts = fc1->dims[0], a->inter = fc1->dims[1] / 2;
  a->width = m->dims[1];
  const int64_t n = a->rows, h = a->hidden, e = a->experts, i = a->inter, w = a->width;
  const struct {
    int index, ok;
    const char *want;
  } checks[] = {
      {IN_X, is(&in[IN_X], 2, n, h, 0), "[N, H]"},
      {IN_LOGITS, is(&in[IN_LOGITS], 2, n, e, 0), "[N, E]"},
      {IN_FC1, fc1->dims[2] == h, "[E, 2I, H]"},
      {IN_FC1_BIAS, !in[IN_FC1_BIAS].data || is(&in[IN_FC1_BIAS], 2, e, 2 * i, 0), "[E, 2I]"},
      {IN_FC2, is(&in[IN_FC2], 3, e, h, i), "[E, H, I]"},
      {IN_FC2_BIAS, !in[IN_FC2_BIAS].data || is(&in[IN_FC2_BIAS], 2, e, h, 0), "[E, H]"},
      {IN_MASK, m->dims[0] == n, "[N, W]"},
      {IN_A1, is(&in[IN_A1], 3, e, h, w), "[E, H, W]"},
      {IN_B1, is(&in[IN_B1], 3, e, w, 2 * i), "[E, W, 2I]"},
      {IN_A2, is(&in[IN_A2], 3, e, i, w), "[E, I, W]"},
      {IN_B2, is(&in[IN_B2], 3, e, w, h), "[E, W, H]"},
  };
  for (size_t c = 0; c < sizeof checks / sizeof *checks; c++) {
    if (checks[c].ok) continue;
    const Input *bad_in = &in[checks[c].index];
    char text[256];
    snprintf(text, sizeof text, "%s is [%lld, %lld, %lld] (rank %zu), not %s with N %lld, H %lld, E %lld, I %lld, "
             "W %lld", NAMES[checks[c].index], (long long)bad_in->dims[0], (long long)bad_in->dims[1],
             (long long)(bad_in->rank > 2 ? bad_in->dims[2] : 0), bad_in->rank, checks[c].want, (long long)n,
             (long long)h, (long long)e, (long long)i, (long long)w);
    return bad(op->site, text);
  }
  if (op->k > e) return bad(op->site, "k is above the number of experts");
  return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const MoeLoraOp *op = (const MoeLoraOp *)state;
  Input in[IN_COUNT];
  for (size_t i = 0; i < IN_COUNT; i++) TRY(input(context, op, i, &in[i]));
  MoeLoraArgs a = {0};
  TRY(check_shapes(op, in, &a));
  OrtValue *output;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, in[IN_Y_BASE].dims, 2, &output));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)output, (void **)&a.y));
  if (!a.rows || !a.hidden) return NULL;
  a.y_base = in[IN_Y_BASE].data, a.x = in[IN_X].data, a.logits = in[IN_LOGITS].data;
  a.fc1 = in[IN_FC1].data, a.fc1_bias = in[IN_FC1_BIAS].data, a.fc2 = in[IN_FC2].data;
  a.fc2_bias = in[IN_FC2_BIAS].data, a.mask = in[IN_MASK].data;
  a.a1 = in[IN_A1].data, a.b1 = in[IN_B1].data, a.a2 = in[IN_A2].data, a.b2 = in[IN_B2].data;
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
  if (!status) moe_lora_finish(call);
  moe_lora_free(call);
  return status;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MoeLora"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return IN_COUNT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int input_characteristic(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == IN_FC1_BIAS || i == IN_FC2_BIAS ? IO_OPTIONAL : IO_REQUIRED;
}
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; /* OrtMemTypeDefault */ }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }

/* MayInplace: y may take y_base's buffer; moe_lora_prepare copies or leaves a row without a slot before any row is
 * written, and an adapter token's row is written by moe_lora_finish alone, from its own pairs' outputs. */
static size_t may_inplace(int **inputs, int **outputs) {
  *inputs = (int *)calloc(1, sizeof(int)), *outputs = (int *)calloc(1, sizeof(int));
  if (!*inputs || !*outputs) {
    free(*inputs), free(*outputs);
    *inputs = *outputs = NULL;
    return 0;
  }
  return 1;
}
static void release_inplace(int *inputs, int *outputs) { free(inputs), free(outputs); }

#define MOE_LORA_OP(version)                                                                                     \
  {version, NULL, op_name, op_provider, float_type, input_count, float_type, output_count, NULL, destroy_kernel,     \
   input_characteristic, required, memory_type, min_arity, homogeneous, min_arity, homogeneous, create_kernel,       \
   compute, NULL, NULL, NULL, may_inplace, release_inplace, NULL, NULL}
const OrtCustomOp moe_lora_op = MOE_LORA_OP(18);
const OrtCustomOp moe_lora_op_v16 = MOE_LORA_OP(16);
