/* llmc.AllReduce and llmc.AllGather: the tensor-parallel collectives as CPU custom ops over collective.c.
 *
 * AllReduce: X (float32 or float16, any shape, 0-d included) -> Y, same type and shape: the elementwise sum
 * of X over the group's ranks (float16 summed in float32 and rounded once; every rank gets the same bits).
 * AllGather: X [..., w] -> Y [..., world_size * w]: the ranks' X concatenated along the last axis in rank
 * order (every rank passes the same shape).
 * Attributes: `rank` and `world_size` (int, in the stored graph), `group` (string, set at session time by
 * runtime/kernels/cpu_kernels.py's prepare: the shared-memory group's name, runtime/kernels/collective.py).
 * The group is mapped and the rank claimed when ONNX Runtime creates the kernel, so a node whose rank or
 * world_size disagrees with the group's, or a group that does not exist, fails the session's creation.
 * The wait's limit is read then too: LLMC_COLLECTIVE_TIMEOUT_S (seconds, default 60). */
#include "collective_op.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collective.h"

typedef struct {
  CollGroup *group;
  int op, type;
  double timeout_s;
} CollKernel;

static int op_of(const OrtCustomOp *custom) { return (int)(custom - collective_ops) / 2; }
static int type_of(const OrtCustomOp *custom) { return (int)(custom - collective_ops) % 2; }

/* an error status, its message "llmc.<op>: " + the text */
static OrtStatus *coll_bad(int code, int op, const char *text) {
  char message[768]; /* CreateStatus copies it */
  snprintf(message, sizeof message, "llmc.%s: %s", coll_op_names[op], text);
  return llmc_fail(code, message);
}

/* the limit on one wait, from LLMC_COLLECTIVE_TIMEOUT_S: 0, or -1 when it is not a positive number */
static int timeout_from_env(double *seconds) {
  const char *text = getenv("LLMC_COLLECTIVE_TIMEOUT_S");
  *seconds = COLL_DEFAULT_TIMEOUT_S;
  if (!text || !*text) return 0;
  char *end;
  *seconds = strtod(text, &end);
  return *end || !(*seconds > 0) ? -1 : 0;
}

static OrtStatus *create_kernel(const OrtCustomOp *custom, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)table;
  int op = op_of(custom);
  int64_t rank, world;
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "rank", &rank));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "world_size", &world));
  char name[256], text[512];
  size_t size = 0;
  OrtStatus *status = CALL(KernelInfoGetAttribute_string, fn_attr_string, info, "group", NULL, &size);
  if (!status && size <= sizeof name)
    status = CALL(KernelInfoGetAttribute_string, fn_attr_string, info, "group", name, &size);
  if (status || size > sizeof name) {
    if (status) CALL(ReleaseStatus, fn_release_status, status);
    return coll_bad(ORT_INVALID_ARGUMENT, op, size > sizeof name ? "the group attribute is too long" :
                    "the node has no group attribute: a tensor-parallel graph runs only inside a rank group "
                    "(runtime/kernels/cpu_kernels.py's prepare(..., group=Group.name))");
  }
  double timeout_s;
  if (timeout_from_env(&timeout_s))
    return coll_bad(ORT_INVALID_ARGUMENT, op, "LLMC_COLLECTIVE_TIMEOUT_S is not a positive number of seconds");
  char err[400];
  CollGroup *group = coll_attach(name, rank, world, err, sizeof err);
  if (!group) {
    snprintf(text, sizeof text, "rank %lld of %lld: %s", (long long)rank, (long long)world, err);
    return coll_bad(ORT_INVALID_ARGUMENT, op, text);
  }
  CollKernel *kernel = (CollKernel *)malloc(sizeof(CollKernel));
  if (!kernel) {
    coll_detach(group);
    return coll_bad(ORT_FAIL, op, "out of memory");
  }
  *kernel = (CollKernel){group, op, type_of(custom), timeout_s};
  *out = kernel;
  return NULL;
}

/* ONNX Runtime's ParallelFor over the session's intra-op threads, for collective.c */
static int parallel_for(void *context, void (*task)(void *, size_t), size_t tasks, void *arg) {
  OrtStatus *status = CALL(KernelContext_ParallelFor, fn_parallel_for, (OrtKernelContext *)context, task, tasks, 0, arg);
  if (status) CALL(ReleaseStatus, fn_release_status, status);
  return status ? -1 : 0;
}

enum { MAX_RANK = 16 }; /* tensor dimensions */

static OrtStatus *shape_of(const OrtValue *value, int op, int64_t *dims, size_t *count) {
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, count);
  if (!status && *count > MAX_RANK) status = coll_bad(ORT_INVALID_ARGUMENT, op, "X has more than 16 dimensions");
  if (!status) status = CALL(GetDimensions, fn_dims, shape, dims, *count);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  return status;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const CollKernel *kernel = (const CollKernel *)state;
  const OrtValue *x_value;
  int64_t dims[MAX_RANK];
  size_t rank;
  TRY(CALL(KernelContext_GetInput, fn_input, context, 0, &x_value));
  TRY(shape_of(x_value, kernel->op, dims, &rank));
  if (kernel->op == COLL_ALL_GATHER && rank == 0)
    return coll_bad(ORT_INVALID_ARGUMENT, kernel->op, "X is 0-d: AllGather concatenates along the last axis");
  CollCall call = {kernel->op, kernel->type, NULL, NULL, 1, 1, kernel->timeout_s, parallel_for, context};
  for (size_t i = 0; i < rank; i++) call.count *= dims[i];
  if (kernel->op == COLL_ALL_GATHER) {
    call.width = dims[rank - 1];
    dims[rank - 1] *= coll_world_size(kernel->group);
  }
  OrtValue *y_value;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, dims, rank, &y_value));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)y_value, &call.y));
  void *x;
  TRY(CALL(GetTensorMutableData, fn_data, x_value, &x));
  call.x = x;
  char err[512], text[640];
  if (!coll_run(kernel->group, &call, err, sizeof err)) return NULL;
  snprintf(text, sizeof text, "rank %lld of %lld, group '%s': %s", (long long)coll_rank(kernel->group),
           (long long)coll_world_size(kernel->group), coll_name(kernel->group), err);
  return coll_bad(ORT_FAIL, kernel->op, text);
}

static void destroy_kernel(void *state) {
  coll_detach(((CollKernel *)state)->group);
  free(state);
}
static const char *op_name(const OrtCustomOp *op) { return coll_op_names[op_of(op)]; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int io_type(const OrtCustomOp *op, size_t i) {
  (void)i;
  return type_of(op) == COLL_F16 ? TYPE_FLOAT16 : TYPE_FLOAT;
}
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }

#define COLLECTIVE_OP                                                                                     \
  {16, NULL, op_name, op_provider, io_type, one, io_type, one, NULL, destroy_kernel, required, required, \
   memory_type, min_arity, homogeneous, min_arity, homogeneous, create_kernel, compute}
/* AllReduce float32, float16; AllGather float32, float16 */
const OrtCustomOp collective_ops[COLLECTIVE_OPS] = {COLLECTIVE_OP, COLLECTIVE_OP, COLLECTIVE_OP, COLLECTIVE_OP};
