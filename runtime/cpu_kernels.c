/* llmc's CPU kernels for ONNX Runtime, loaded as a custom-op library (runtime/cpu_kernels.py builds
 * and registers it).
 *
 * llmc.MatMulNBits4: a drop-in for com.microsoft.MatMulNBits with bits=4, block_size=32 and
 * accuracy_level=4 (int8 activations) — the same inputs (A, B, scales, optional zero_points), the
 * same attributes plus `threads` (the session's intra-op threads) and `isa` (which instruction
 * set's kernel: "avx512vnni" or "avx2"), the same packed layout, so a graph swaps one op type for
 * the other and back.
 * The kernel itself is matmul_nbits4.c (why it exists, how it works); this file is the op around it.
 *
 * Written by hand (ONNX Runtime's headers are not installed with its wheel): the few parts of the
 * ONNX Runtime C ABI used here — OrtApiBase, the OrtApi function-table slots called, and the
 * OrtCustomOp struct up to KernelComputeV2 (version 16). The table is append-only and versioned, so
 * the slot numbers hold for every release at or above the version asked for (17, ONNX Runtime 1.17).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "matmul_nbits4.h"

/* ---- for the Python side (runtime/cpu_kernels.py, through ctypes) ---- */
static char isa_names[64];
static pthread_once_t isa_names_once = PTHREAD_ONCE_INIT;

static void list_isas(void) {
  for (int isa = 0; isa < Q4_ISA_COUNT; isa++) {
    if (!q4_isa_supported(isa)) continue;
    if (*isa_names) strcat(isa_names, ",");
    strcat(isa_names, q4_isa_name(isa));
  }
}

/* the instruction sets this CPU runs the kernel on, best first, comma-separated ("" for none) */
const char *llmc_cpu_kernels_isas(void) {
  pthread_once(&isa_names_once, list_isas);
  return isa_names;
}

/* ---- ONNX Runtime C ABI (the parts used) ---- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef void *const *OrtApiTable; /* OrtApi: a table of function pointers */
typedef struct {
  OrtApiTable (*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_API_VERSION_USED = 17, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2 };                /* ONNXTensorElementDataType */
enum { IO_REQUIRED = 0, IO_OPTIONAL = 1, IO_VARIADIC = 2 }; /* OrtCustomOpInputOutputCharacteristic */
/* OrtApi slots (index = byte offset / pointer size) */
enum {
  SLOT_CreateStatus = 0,
  SLOT_CreateCustomOpDomain = 26,
  SLOT_CustomOpDomain_Add = 27,
  SLOT_AddCustomOpDomain = 28,
  SLOT_GetTensorMutableData = 51,
  SLOT_GetDimensionsCount = 61,
  SLOT_GetDimensions = 62,
  SLOT_GetTensorTypeAndShape = 65,
  SLOT_KernelInfoGetAttribute_int64 = 86,
  SLOT_KernelInfoGetAttribute_string = 87,
  SLOT_KernelContext_GetInputCount = 88,
  SLOT_KernelContext_GetInput = 90,
  SLOT_KernelContext_GetOutput = 91,
  SLOT_ReleaseStatus = 93,
  SLOT_ReleaseTensorTypeAndShapeInfo = 99,
  SLOT_KernelContext_ParallelFor = 274,
};

typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *);
  const char *(*GetName)(const struct OrtCustomOp *);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *);
  int (*GetInputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *);
  int (*GetOutputType)(const struct OrtCustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *);
  void (*KernelCompute)(void *, OrtKernelContext *);
  void (*KernelDestroy)(void *);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp *, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *);
  OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *, void **);
  OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
} OrtCustomOp;

static OrtApiTable api;
#define CALL(slot, type, ...) (((type)api[SLOT_##slot])(__VA_ARGS__))
#define TRY(expr)                        \
  do {                                   \
    OrtStatus *status_ = (expr);         \
    if (status_) return status_;         \
  } while (0)
typedef OrtStatus *(*fn_create_status)(int, const char *);
static OrtStatus *fail(int code, const char *msg) { return CALL(CreateStatus, fn_create_status, code, msg); }

/* ---- the custom op ---- */
typedef struct {
  int64_t k, n, threads;
  int isa;
} Kernel;

typedef OrtStatus *(*fn_attr_int64)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*fn_attr_string)(const OrtKernelInfo *, const char *, char *, size_t *);
typedef OrtStatus *(*fn_input_count)(const OrtKernelContext *, size_t *);
typedef OrtStatus *(*fn_input)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*fn_output)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef OrtStatus *(*fn_data)(const OrtValue *, void **);
typedef OrtStatus *(*fn_shape)(const OrtValue *, OrtShape **);
typedef OrtStatus *(*fn_dim_count)(const OrtShape *, size_t *);
typedef OrtStatus *(*fn_dims)(const OrtShape *, int64_t *, size_t);
typedef void (*fn_release_shape)(OrtShape *);
typedef OrtStatus *(*fn_parallel_for)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

/* the instruction set an `isa` attribute names, if this CPU runs it; else an error saying what does */
static OrtStatus *isa_named(const OrtKernelInfo *info, int *isa) {
  char name[32];
  size_t size = sizeof name;
  TRY(CALL(KernelInfoGetAttribute_string, fn_attr_string, info, "isa", name, &size));
  for (*isa = 0; *isa < Q4_ISA_COUNT; ++*isa)
    if (!strcmp(name, q4_isa_name(*isa)) && q4_isa_supported(*isa)) return NULL;
  char message[160]; /* CreateStatus copies it */
  snprintf(message, sizeof message, "llmc.MatMulNBits4: isa '%s' is not one this CPU runs (%s)", name,
           llmc_cpu_kernels_isas());
  return fail(ORT_INVALID_ARGUMENT, message);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)op;
  (void)table;
  int64_t k, n, bits, block, level, threads;
  int isa;
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "K", &k));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "N", &n));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "bits", &bits));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "block_size", &block));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "accuracy_level", &level));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "threads", &threads)); /* the session's, set by the swap */
  TRY(isa_named(info, &isa));
  if (bits != 4 || block != 32 || level != 4 || k <= 0 || k % 64 || n <= 0 || threads < 1)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4 takes bits=4, block_size=32, accuracy_level=4 and K a "
                                      "multiple of 64 (leave other MatMulNBits nodes as they are)");
  Kernel *kernel = (Kernel *)malloc(sizeof(Kernel));
  if (!kernel) return fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory");
  kernel->k = k;
  kernel->n = n;
  kernel->threads = threads;
  kernel->isa = isa;
  *out = kernel;
  return NULL;
}

static OrtStatus *shape_of(const OrtValue *value, int64_t *dims, size_t *count) {
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, count);
  if (!status && *count > 8) status = fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: A has more than 8 dimensions");
  if (!status) status = CALL(GetDimensions, fn_dims, shape, dims, *count);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  return status;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const Kernel *kernel = (const Kernel *)state;
  const OrtValue *a_value, *b_value, *s_value, *z_value = NULL;
  size_t inputs;
  TRY(CALL(KernelContext_GetInputCount, fn_input_count, context, &inputs));
  TRY(CALL(KernelContext_GetInput, fn_input, context, 0, &a_value));
  TRY(CALL(KernelContext_GetInput, fn_input, context, 1, &b_value));
  TRY(CALL(KernelContext_GetInput, fn_input, context, 2, &s_value));
  if (inputs > 3) TRY(CALL(KernelContext_GetInput, fn_input, context, 3, &z_value));
  int64_t dims[8], bdims[8];
  size_t rank, brank;
  TRY(shape_of(a_value, dims, &rank));
  TRY(shape_of(b_value, bdims, &brank));
  if (rank < 1 || dims[rank - 1] != kernel->k)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: A's last dimension is not K");
  if (brank != 3 || bdims[0] != kernel->n || bdims[1] != kernel->k / 32 || bdims[2] != 16)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: B is not [N, K/32, 16]");
  int64_t m = 1;
  for (size_t i = 0; i + 1 < rank; i++) m *= dims[i];
  dims[rank - 1] = kernel->n;
  OrtValue *y_value;
  void *a, *b, *s, *z = NULL, *y;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, dims, rank, &y_value));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)y_value, &y));
  if (m == 0) return NULL;
  TRY(CALL(GetTensorMutableData, fn_data, a_value, &a));
  TRY(CALL(GetTensorMutableData, fn_data, b_value, &b));
  TRY(CALL(GetTensorMutableData, fn_data, s_value, &s));
  if (z_value) TRY(CALL(GetTensorMutableData, fn_data, z_value, &z));

  void *memory = malloc(q4_memory(m, kernel->k));
  if (!memory) return fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory");
  size_t tasks;
  Q4Matmul *call = q4_prepare(memory, kernel->isa, (const float *)a, m, kernel->k, kernel->n, kernel->threads,
                              (const uint8_t *)b, (const float *)s, (const uint8_t *)z, (float *)y, &tasks);
  OrtStatus *status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, q4_run, tasks, 0, call);
  if (!status && q4_failed(call)) status = fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory");
  free(memory);
  return status;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulNBits4"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 || i == 3 ? TYPE_UINT8 : TYPE_FLOAT; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 4; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int input_characteristic(const OrtCustomOp *op, size_t i) { (void)op; return i == 3 ? IO_OPTIONAL : IO_REQUIRED; }
static int output_characteristic(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int variadic_min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int variadic_homogeneity(const OrtCustomOp *op) { (void)op; return 1; }

static const OrtCustomOp matmul_nbits4 = {
    16, NULL, op_name, op_provider, input_type, input_count, output_type, output_count, NULL, destroy_kernel,
    input_characteristic, output_characteristic, memory_type, variadic_min_arity, variadic_homogeneity,
    variadic_min_arity, variadic_homogeneity, create_kernel, compute,
};

static OrtCustomOpDomain *domain;
static int domain_failed;
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;
typedef OrtStatus *(*fn_create_domain)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*fn_domain_add)(OrtCustomOpDomain *, const OrtCustomOp *);
typedef OrtStatus *(*fn_add_domain)(OrtSessionOptions *, OrtCustomOpDomain *);

static void make_domain(void) {
  OrtStatus *status = CALL(CreateCustomOpDomain, fn_create_domain, "llmc", &domain);
  if (!status) status = CALL(CustomOpDomain_Add, fn_domain_add, domain, &matmul_nbits4);
  domain_failed = status != NULL; /* ONNX Runtime owns a returned status: report a fresh one each call */
  if (status) ((void (*)(OrtStatus *))api[SLOT_ReleaseStatus])(status);
}

/* called by ONNX Runtime's SessionOptions.register_custom_ops_library */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  OrtApiTable table = base->GetApi(ORT_API_VERSION_USED);
  if (!table) return NULL; /* older than 1.17: nothing registered (cpu_kernels.py checks the version first) */
  api = table;
  if (!*llmc_cpu_kernels_isas())
    return fail(ORT_FAIL, "llmc CPU kernels need AVX2 and FMA or AVX512-VNNI, which this CPU lacks");
  pthread_once(&domain_once, make_domain);
  if (domain_failed) return fail(ORT_FAIL, "llmc: could not create the custom-op domain");
  return CALL(AddCustomOpDomain, fn_add_domain, options, domain);
}
