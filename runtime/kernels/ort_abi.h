/* The few parts of ONNX Runtime's C ABI llmc's custom ops use (cpu_kernels.c, the ops' *_op.c files), and the
 * attribute readers and instruction-set listing those ops share (at the end),
 * written by hand because ONNX Runtime's headers are not installed with its wheel: OrtApiBase, the
 * OrtApi function-table slots called, and the OrtCustomOp struct up to ReleaseAliasMap (version 18; the ops that
 * declare 16 end at KernelComputeV2 as far as ONNX Runtime reads).
 * The table is append-only and versioned, so the slot numbers hold for every release at or above the
 * version asked for (17, ONNX Runtime 1.17). */
#ifndef LLMC_ORT_ABI_H
#define LLMC_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

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
enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT8 = 3, TYPE_INT32 = 6, TYPE_FLOAT16 = 10 }; /* ONNXTensorElementDataType */
enum { IO_REQUIRED = 0, IO_OPTIONAL = 1, IO_VARIADIC = 2 };                 /* OrtCustomOpInputOutputCharacteristic */
/* OrtApi slots (index = byte offset / pointer size) */
enum {
  SLOT_CreateStatus = 0,
  SLOT_CreateCustomOpDomain = 26,
  SLOT_CustomOpDomain_Add = 27,
  SLOT_AddCustomOpDomain = 28,
  SLOT_GetTensorMutableData = 51,
  SLOT_GetTensorElementType = 60,
  SLOT_GetDimensionsCount = 61,
  SLOT_GetDimensions = 62,
  SLOT_GetTensorTypeAndShape = 65,
  SLOT_KernelInfoGetAttribute_float = 85,
  SLOT_KernelInfoGetAttribute_int64 = 86,
  SLOT_KernelInfoGetAttribute_string = 87,
  SLOT_KernelContext_GetInputCount = 88,
  SLOT_KernelContext_GetOutputCount = 89,
  SLOT_KernelContext_GetInput = 90,
  SLOT_KernelContext_GetOutput = 91,
  SLOT_ReleaseStatus = 93,
  SLOT_ReleaseTensorTypeAndShapeInfo = 99,
  SLOT_KernelInfoGetConstantInput_tensor = 249,
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
  /* version 18 (ONNX Runtime reads these past KernelComputeV2 only from an op declaring it; NULL: not given) */
  void *InferOutputShapeFn;
  int (*GetStartVersion)(const struct OrtCustomOp *);
  int (*GetEndVersion)(const struct OrtCustomOp *);
  size_t (*GetMayInplace)(int **input_index, int **output_index); /* output i may take input j's buffer */
  void (*ReleaseMayInplace)(int *input_index, int *output_index);
  size_t (*GetAliasMap)(int **input_index, int **output_index);
  void (*ReleaseAliasMap)(int *input_index, int *output_index);
} OrtCustomOp;

extern OrtApiTable llmc_ort_api; /* set by RegisterCustomOps (cpu_kernels.c) */
#define CALL(slot, type, ...) (((type)llmc_ort_api[SLOT_##slot])(__VA_ARGS__))
#define TRY(expr)                        \
  do {                                   \
    OrtStatus *status_ = (expr);         \
    if (status_) return status_;         \
  } while (0)

typedef OrtStatus *(*fn_create_status)(int, const char *);
typedef OrtStatus *(*fn_attr_float)(const OrtKernelInfo *, const char *, float *);
typedef OrtStatus *(*fn_attr_int64)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*fn_attr_string)(const OrtKernelInfo *, const char *, char *, size_t *);
typedef OrtStatus *(*fn_input_count)(const OrtKernelContext *, size_t *);
typedef OrtStatus *(*fn_input)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*fn_constant_input)(const OrtKernelInfo *, size_t, int *, const OrtValue **);
typedef OrtStatus *(*fn_output)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef OrtStatus *(*fn_data)(const OrtValue *, void **);
typedef OrtStatus *(*fn_shape)(const OrtValue *, OrtShape **);
typedef OrtStatus *(*fn_element_type)(const OrtShape *, int *);
typedef OrtStatus *(*fn_dim_count)(const OrtShape *, size_t *);
typedef OrtStatus *(*fn_dims)(const OrtShape *, int64_t *, size_t);
typedef void (*fn_release_shape)(OrtShape *);
typedef void (*fn_release_status)(OrtStatus *);
typedef OrtStatus *(*fn_parallel_for)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

/* an error status ONNX Runtime reports (it copies the message) */
static inline OrtStatus *llmc_fail(int code, const char *msg) { return CALL(CreateStatus, fn_create_status, code, msg); }

/* ---- what llmc's ops share besides the ABI ---- */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the node's int attribute, or fallback when it has none */
static inline int64_t llmc_attr_int(const OrtKernelInfo *info, const char *name, int64_t fallback) {
  int64_t value;
  OrtStatus *status = CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, name, &value);
  if (!status) return value;
  CALL(ReleaseStatus, fn_release_status, status);
  return fallback;
}

/* the node's float attribute, or fallback when it has none */
static inline float llmc_attr_float(const OrtKernelInfo *info, const char *name, float fallback) {
  float value;
  OrtStatus *status = CALL(KernelInfoGetAttribute_float, fn_attr_float, info, name, &value);
  if (!status) return value;
  CALL(ReleaseStatus, fn_release_status, status);
  return fallback;
}

/* OrtCustomOp's GetMayInplace for an op whose output 0 may take input 0's buffer (llmc.LoraDelta, llmc.MoeLora: y
 * over y_base), and its ReleaseMayInplace */
static inline size_t llmc_output_over_input0(int **inputs, int **outputs) {
  *inputs = (int *)calloc(1, sizeof(int)), *outputs = (int *)calloc(1, sizeof(int));
  if (!*inputs || !*outputs) {
    free(*inputs), free(*outputs);
    *inputs = *outputs = NULL;
    return 0;
  }
  return 1;
}
static inline void llmc_release_inplace(int *inputs, int *outputs) { free(inputs), free(outputs); }

/* the node's string attribute (truncated to `size` - 1), or fallback when it has none */
static inline void llmc_attr_string(const OrtKernelInfo *info, const char *name, char *out, size_t size,
                                    const char *fallback) {
  size_t needed = 0;
  OrtStatus *status = CALL(KernelInfoGetAttribute_string, fn_attr_string, info, name, NULL, &needed);
  if (!status && needed <= size) status = CALL(KernelInfoGetAttribute_string, fn_attr_string, info, name, out, &needed);
  else if (!status) snprintf(out, size, "%s", "(too long)");
  if (status) snprintf(out, size, "%s", fallback);
  if (status) CALL(ReleaseStatus, fn_release_status, status);
}

/* a kernel's instruction sets this CPU runs, best first, comma-separated into `out` ("" for none) */
static inline void llmc_list_isas(char *out, int count, int (*supported)(int), const char *(*name)(int)) {
  for (int isa = 0; isa < count; isa++)
    if (supported(isa)) strcat(strcat(out, *out ? "," : ""), name(isa));
}

#endif
