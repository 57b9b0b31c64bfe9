/* llmc.LoraDelta: one site's LoRA branch as one CPU op (lora_delta.c is the kernel), what the four nodes
 * compiler/lora/graph.py writes compute (MatMul(x, A), Mul by the mask, MatMul by B, Add to y_base), reading only each
 * token's own slot. runtime/kernels/lora_fusion.py puts it in place of those four nodes when a session opens.
 *
 * Inputs (float32): y_base [.., N, out] (the projection's output), x [.., N, in] (its input: the paged graph's
 * [1, N, in] or [N, in]; a slot graph's [B, S, in]), A [in, W], mask [N, W] (or [1, W]; it broadcasts over x's
 * leading dims as the branch's Mul does; a slot graph's [B, S, W], a row per token), B [W, out]; W = S*M*R, both S and
 * R dynamic. Output y, y_base's shape.
 * Attributes: `threads` (the session's intra-op threads, set by the fusion; default 1: no parallel passes; a call
 * below PARALLEL_WORK runs inline whatever it says), `isa`
 * ("avx512", "avx2" or "portable"; default: the best this CPU runs), `site` (the site's name, for error messages).
 * A bad shape is an error naming the site and the input at fault. */
#include "lora_delta_op.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lora_delta.h"

/* Below this many multiply-adds a call runs on the calling thread. Timed alone (`python -m llmc.bench lora-delta`),
 * a site's stacks stay in cache from run to run, and splitting its tasks over ONNX Runtime's 2 threads was no faster
 * (16 tokens on 4 rank-16 slots at SmolLM2's sites: gate 0.034 ms split, 0.032 inline; q/k/v at 256 tokens 0.52 /
 * 0.43 ms). Served, a step reads every site's stacks from memory once (92 MB for 4 SmolLM2 adapters at rank 16),
 * and two threads read them faster than one: 16 streams on 4 adapters (`python -m llmc.bench lora`, lockstep,
 * medians of 5) went from 0.82x to 0.86x the base model's throughput with every call split, and 4 adapters against
 * 1 from 0.94x to 0.95x. A 16-token call at those sites is 0.3-0.8 M; a batch-1 step's (34-50 K) stays inline,
 * where the pool's round trip would be most of the call. */
enum { PARALLEL_WORK = 1 << 18 };

typedef struct {
  int64_t threads;
  int isa;
  char site[128];
} LoraOp;

static char isa_names[64];
static pthread_once_t isa_names_once = PTHREAD_ONCE_INIT;
static void list_isas(void) { llmc_list_isas(isa_names, LORA_ISA_COUNT, lora_isa_supported, lora_isa_name); }
const char *llmc_lora_delta_isas(void) {
  pthread_once(&isa_names_once, list_isas);
  return isa_names;
}

static OrtStatus *bad(const char *site, const char *text) {
  char message[720]; /* CreateStatus copies it */
  snprintf(message, sizeof message, "llmc.LoraDelta (site %s): %s", *site ? site : "?", text);
  return llmc_fail(ORT_INVALID_ARGUMENT, message);
}

static OrtStatus *create_kernel(const OrtCustomOp *custom, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)custom, (void)table;
  LoraOp op = {llmc_attr_int(info, "threads", 1), 0, ""};
  llmc_attr_string(info, "site", op.site, sizeof op.site, "");
  if (op.threads < 1) return bad(op.site, "threads must be at least 1");
  char isa[32];
  llmc_attr_string(info, "isa", isa, sizeof isa, "");
  for (op.isa = 0; op.isa < LORA_ISA_COUNT; op.isa++)
    if ((!*isa || !strcmp(isa, lora_isa_name(op.isa))) && lora_isa_supported(op.isa)) break;
  if (op.isa == LORA_ISA_COUNT) {
    char text[160];
    snprintf(text, sizeof text, "isa '%s' is not one this CPU runs (%s)", isa, llmc_lora_delta_isas());
    return bad(op.site, text);
  }
  LoraOp *kernel = (LoraOp *)malloc(sizeof(LoraOp));
  if (!kernel) return llmc_fail(ORT_FAIL, "llmc.LoraDelta: out of memory");
  *kernel = op;
  *out = kernel;
  return NULL;
}

enum { MAX_RANK = 8, IN_Y_BASE = 0, IN_X, IN_A, IN_MASK, IN_B, IN_COUNT };
static const char *const NAMES[IN_COUNT] = {"y_base", "x", "A", "mask", "B"};

typedef struct {
  const OrtValue *value;
  int64_t dims[MAX_RANK];
  size_t rank;
  float *data;
} Input;

static OrtStatus *input(OrtKernelContext *context, const LoraOp *op, size_t index, Input *in) {
  TRY(CALL(KernelContext_GetInput, fn_input, context, index, &in->value));
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, in->value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, &in->rank);
  if (!status && in->rank > MAX_RANK) {
    CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
    char text[80];
    snprintf(text, sizeof text, "%s has more than %d dimensions", NAMES[index], MAX_RANK);
    return bad(op->site, text);
  }
  if (!status) status = CALL(GetDimensions, fn_dims, shape, in->dims, in->rank);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  if (status) return status;
  return CALL(GetTensorMutableData, fn_data, in->value, (void **)&in->data);
}

static void shape_text(const Input *in, char *out, size_t size) {
  int used = snprintf(out, size, "[");
  for (size_t i = 0; i < in->rank && used > 0 && (size_t)used < size; i++)
    used += snprintf(out + used, size - (size_t)used, i ? ", %lld" : "%lld", (long long)in->dims[i]);
  if (used > 0 && (size_t)used < size) snprintf(out + used, size - (size_t)used, "]");
}

/* The shapes the four-node branch accepts: x [.., N, in], y_base [.., N, out] (x's leading dims), A [in, W],
 * mask [N or 1, W] or x's leading dims and W (a slot graph's [B, S, W]: row r's mask is row r of it), B [W, out]. */
static OrtStatus *check_shapes(const LoraOp *op, const Input *in, LoraArgs *a) {
  const Input *y = &in[IN_Y_BASE], *x = &in[IN_X], *at = &in[IN_A], *m = &in[IN_MASK], *b = &in[IN_B];
  char text[512], s[5][64];
  for (int i = 0; i < IN_COUNT; i++) shape_text(&in[i], s[i], sizeof s[i]);
  int per_row = m->rank > 2 && m->rank == x->rank; /* the mask has x's leading dims: one row per token */
  for (size_t i = 0; per_row && i + 1 < x->rank; i++) per_row = m->dims[i] == x->dims[i];
  if (x->rank < 2 || y->rank != x->rank || at->rank != 2 || (m->rank != 2 && !per_row) || b->rank != 2) {
    snprintf(text, sizeof text, "takes x [.., N, in], y_base [.., N, out], A [in, W], mask [N, W] or [.., N, W], "
             "B [W, out]; got y_base %s, x %s, A %s, mask %s, B %s", s[0], s[1], s[2], s[3], s[4]);
    return bad(op->site, text);
  }
  a->rows = 1;
  for (size_t i = 0; i + 1 < x->rank; i++) {
    if (y->dims[i] != x->dims[i]) {
      snprintf(text, sizeof text, "y_base %s does not have x's leading dimensions (x %s)", s[0], s[1]);
      return bad(op->site, text);
    }
    a->rows *= x->dims[i];
  }
  a->in = x->dims[x->rank - 1], a->out = y->dims[y->rank - 1], a->width = at->dims[1];
  a->mask_rows = per_row ? a->rows : m->dims[0];
  const int64_t mask_tokens = per_row ? x->dims[x->rank - 2] : m->dims[0];
  const char *wrong = at->dims[0] != a->in ? "A's rows are not x's last dimension"
                      : m->dims[m->rank - 1] != a->width ? "mask's columns are not A's"
                      : b->dims[0] != a->width ? "B's rows are not A's columns"
                      : b->dims[1] != a->out ? "B's columns are not y_base's last dimension"
                      : mask_tokens != x->dims[x->rank - 2] && mask_tokens != 1 ? "mask's rows are not x's tokens (N)"
                                                                               : NULL;
  if (wrong) {
    snprintf(text, sizeof text, "%s: y_base %s, x %s, A %s, mask %s, B %s", wrong, s[0], s[1], s[2], s[3], s[4]);
    return bad(op->site, text);
  }
  return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const LoraOp *op = (const LoraOp *)state;
  Input in[IN_COUNT];
  for (size_t i = 0; i < IN_COUNT; i++) TRY(input(context, op, i, &in[i]));
  LoraArgs a = {0};
  TRY(check_shapes(op, in, &a));
  OrtValue *output;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, in[IN_Y_BASE].dims, in[IN_Y_BASE].rank, &output));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)output, (void **)&a.y));
  if (!a.rows || !a.out) return NULL;
  a.y_base = in[IN_Y_BASE].data, a.x = in[IN_X].data, a.a = in[IN_A].data, a.mask = in[IN_MASK].data;
  a.b = in[IN_B].data, a.isa = op->isa;
  size_t shrinks, expands;
  LoraCall *call = lora_prepare(&a, &shrinks, &expands);
  if (!call) return llmc_fail(ORT_FAIL, "llmc.LoraDelta: out of memory");
  OrtStatus *status = NULL;
  if (op->threads <= 1 || lora_multiply_adds(call) < PARALLEL_WORK) { /* inline: no thread pool round trip */
    for (size_t t = 0; t < shrinks; t++) lora_shrink(call, t);
    for (size_t t = 0; t < expands; t++) lora_expand(call, t);
  } else {
    if (shrinks) status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, lora_shrink, shrinks, 0, call);
    if (!status && expands)
      status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, lora_expand, expands, 0, call);
  }
  lora_free(call);
  return status;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "LoraDelta"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return IN_COUNT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op, (void)i; return 0; /* OrtMemTypeDefault */ }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }

/* MayInplace (OrtCustomOp version 18): y may take y_base's buffer. ONNX Runtime's planner then runs the op in place
 * (y_base is the projection's output, read by the op alone), and a row without a slot costs nothing: what a
 * base-only step on a LoRA session (runtime/runners/paged.py) would otherwise pay in copies. The kernel reads each
 * element of y_base before it writes that element of y, so it is right either way (llmc_output_over_input0). */

#define LORA_DELTA_OP(version)                                                                                   \
  {version, NULL, op_name, op_provider, float_type, input_count, float_type, output_count, NULL, destroy_kernel,     \
   required, required, memory_type, min_arity, homogeneous, min_arity, homogeneous, create_kernel, compute, NULL,    \
   NULL, NULL, llmc_output_over_input0, llmc_release_inplace, NULL, NULL}
const OrtCustomOp lora_delta_op = LORA_DELTA_OP(18);
const OrtCustomOp lora_delta_op_v16 = LORA_DELTA_OP(16); /* an ONNX Runtime without API 18 reads none past compute */
