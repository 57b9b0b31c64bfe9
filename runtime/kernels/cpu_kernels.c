/* llmc's CPU kernels for ONNX Runtime, loaded as a custom-op library (runtime/kernels/cpu_kernels.py builds
 * and registers it).
 *
 * llmc.MatMulNBits4: a drop-in for com.microsoft.MatMulNBits with bits=4, block_size 32, 64 or 128 and
 * accuracy_level=4 (int8 activations) — the same inputs (A, B, scales, optional zero_points, no g_idx,
 * optional bias), the
 * same attributes plus `threads` (the session's intra-op threads) and `isa` (which instruction
 * set's kernel: "avx512vnni" or "avx2"), the same packed layout, so a graph swaps one op type for
 * the other and back. B, its scales and zero points must be initializers: the kernel repacks them when
 * the session creates it (q4_pack) and reads only its copy after that.
 * The kernel itself is matmul_nbits4.c (why it exists, how it works); this file is the op around it.
 *
 * llmc.PagedAttention: ONNX Runtime's com.microsoft.PagedAttention contract on CPU (float32 activations,
 * float32 or float16 caches), paged_attention_op.c; it runs on every x86 CPU (a portable path
 * besides AVX2), so the library registers it whatever the CPU, and MatMulNBits4 only where the CPU
 * has the 4-bit kernel's instruction sets (its kernels refuse the rest).
 *
 * llmc.AllReduce and llmc.AllGather: tensor parallelism's collectives between rank processes over shared
 * memory (collective/collective.h: the segment, the barrier; collective_op.c: the ops), float32 and float16;
 * plain C, so registered whatever the CPU, like PagedAttention.
 *
 * llmc.LoraDelta: one LoRA site's four-node branch (compiler/lora/graph.py) as one op that reads each token's own
 * adapter slot only (lora_delta/: lora_delta.c the kernel, lora_delta_op.c the op); runtime/kernels/lora_fusion.py
 * swaps it in when a session opens. Portable C besides AVX2 and AVX512 builds of the same loops, so registered
 * whatever the CPU.
 *
 * llmc.MoeLora: a mixture layer's expert-LoRA branch (compiler/lora/experts.py) as one op running each adapter token's
 * routed experts only (moe_lora/: moe_lora.c the kernel, over lora_delta's loops; moe_lora_op.c the op);
 * runtime/kernels/moe_lora_fusion.py swaps it in, registered whatever the CPU like LoraDelta.
 *
 * ONNX Runtime's C ABI, the parts used: ort_abi.h, written by hand (the wheel ships no headers).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "collective_op.h"
#include "lora_delta_op.h"
#include "matmul_nbits4.h"
#include "moe_lora_op.h"
#include "ort_abi.h"
#include "paged_attention_op.h"

/* ---- for the Python side (runtime/kernels/cpu_kernels.py, through ctypes) ---- */
static char isa_names[64];
static pthread_once_t isa_names_once = PTHREAD_ONCE_INIT;

static void list_isas(void) { llmc_list_isas(isa_names, Q4_ISA_COUNT, q4_isa_supported, q4_isa_name); }

/* the instruction sets this CPU runs the kernel on, best first, comma-separated ("" for none) */
const char *llmc_cpu_kernels_isas(void) {
  pthread_once(&isa_names_once, list_isas);
  return isa_names;
}

OrtApiTable llmc_ort_api;
static OrtStatus *fail(int code, const char *msg) { return llmc_fail(code, msg); }

/* ---- the custom op ---- */
typedef struct {
  int64_t k, n, threads;
  int isa, zero_points, half_scales; /* half_scales: q4_pack stored the scales as fp16 (q4_half_scales) */
  int share;                         /* blocks of 32 to a scale: the node's block_size / 32 */
  uint8_t *packed; /* B, scales and zero points in the kernel's layout (q4_pack), from the node's initializers */
  size_t packed_bytes; /* its mapping's */
} Kernel;


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

static OrtStatus *shape_of(const OrtValue *value, int64_t *dims, size_t *count) {
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, count);
  if (!status && *count > 8) status = fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: an input has more than 8 dimensions");
  if (!status) status = CALL(GetDimensions, fn_dims, shape, dims, *count);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  return status;
}

/* Input `index`'s data if the node's input is a constant initializer with `elements` elements (NULL, and
 * *data NULL, for an optional input that is absent or not constant: the caller says which may be) */
static OrtStatus *constant_input(const OrtKernelInfo *info, size_t index, const char *name, int64_t elements,
                                 const void **data) {
  const OrtValue *value = NULL;
  int constant = 0;
  *data = NULL;
  TRY(CALL(KernelInfoGetConstantInput_tensor, fn_constant_input, info, index, &constant, &value));
  if (!constant || !value) return NULL;
  int64_t dims[8], count = 1;
  size_t rank;
  TRY(shape_of(value, dims, &rank));
  for (size_t i = 0; i < rank; i++) count *= dims[i];
  if (count != elements) {
    char message[160];
    snprintf(message, sizeof message, "llmc.MatMulNBits4: %s has %lld elements, not the %lld K and N make", name,
             (long long)count, (long long)elements);
    return fail(ORT_INVALID_ARGUMENT, message);
  }
  return CALL(GetTensorMutableData, fn_data, value, (void **)data);
}

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21 /* Linux 5.4; older kernels refuse it, and nothing changes */
#endif

/* Once packed, a node's B, scales and zero points are not read again. ONNX Runtime maps initializers stored as
 * external data from the file, so their pages are the file's: MADV_PAGEOUT hands the whole pages inside one
 * back (the packed copy is what stays resident: a 1B int4 session opened 1.53 GiB larger without, 0.79 with). It
 * never discards data: a page read again is read back from the file, and pages that are not a file's (inline
 * initializers) go to swap where the host has one and otherwise stay. */
static void page_out(const void *data, size_t bytes) {
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), start = ((uintptr_t)data + page - 1) / page * page,
                  end = ((uintptr_t)data + bytes) / page * page;
  if (end > start) madvise((void *)start, end - start, MADV_PAGEOUT);
}

static size_t page_multiple(size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return (bytes + page - 1) / page * page;
}

/* Memory for a packed copy (`bytes` a page multiple): a mapping of its own that starts on a 2 MiB boundary and
 * asks for transparent huge pages (where the host has them on `madvise`, the common default), so the stream
 * crosses a 2 MiB page where it crossed 512 small ones: a 1B model's decode step 1.05-1.06x faster (two runs of
 * 8 and 10 alternating passes, every pass faster). NULL when out of memory. */
static uint8_t *map_copy(size_t bytes) {
  const size_t huge = 2u << 20, size = bytes + huge;
  uint8_t *at = (uint8_t *)mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED) return NULL;
  uint8_t *start = (uint8_t *)(((uintptr_t)at + huge - 1) & ~(uintptr_t)(huge - 1)), *end = start + bytes;
  if (start > at) munmap(at, (size_t)(start - at)); /* the slack either side goes back */
  if (at + size > end) munmap(end, (size_t)(at + size - end));
  madvise(start, bytes, MADV_HUGEPAGE); /* a hint: refused where the kernel has no THP, and the pages stay small */
  return start;
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
  if (bits != 4 || (block != 32 && block != 64 && block != 128) || level != 4 || k <= 0 || k % 64 || k % block ||
      n <= 0 || threads < 1)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4 takes bits=4, block_size 32, 64 or 128, accuracy_level=4 "
                                      "and K a multiple of 64 and of the block size (leave other MatMulNBits nodes "
                                      "as they are)");
  const int share = (int)(block / 32);
  /* the weights are repacked once, here, so B and its scales must be initializers (graph_edits swaps only such
   * nodes); zero points, when the node has them, too: compute refuses any that were not packed */
  const int64_t b_bytes = n * (k / 32) * 16, scale_count = n * (k / block);
  const int64_t zero_point_bytes = n * ((k / block + 1) / 2);
  const void *b, *scales, *zero_points;
  TRY(constant_input(info, 1, "B", b_bytes, &b));
  TRY(constant_input(info, 2, "scales", scale_count, &scales));
  TRY(constant_input(info, 3, "zero_points", zero_point_bytes, &zero_points));
  if (!b || !scales)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: B and scales must be initializers (the kernel repacks "
                                      "them when the session opens)");
  Kernel *kernel = (Kernel *)malloc(sizeof(Kernel));
  const int half_scales = q4_half_scales((const float *)scales, scale_count);
  size_t bytes = page_multiple(q4_packed_bytes(k, n, zero_points != NULL, half_scales, share));
  uint8_t *packed = map_copy(bytes);
  if (!kernel || !packed) {
    free(kernel);
    if (packed) munmap(packed, bytes);
    return fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory for the repacked weights");
  }
  q4_pack(k, n, (const uint8_t *)b, (const float *)scales, (const uint8_t *)zero_points, half_scales, share, packed);
  page_out(b, (size_t)b_bytes);
  page_out(scales, (size_t)scale_count * sizeof(float));
  if (zero_points) page_out(zero_points, (size_t)zero_point_bytes);
  kernel->k = k;
  kernel->n = n;
  kernel->threads = threads;
  kernel->isa = isa;
  kernel->zero_points = zero_points != NULL;
  kernel->half_scales = half_scales;
  kernel->share = share;
  kernel->packed = packed;
  kernel->packed_bytes = bytes;
  *out = kernel;
  return NULL;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const Kernel *kernel = (const Kernel *)state;
  const OrtValue *a_value, *z_value = NULL, *g_value = NULL, *bias_value = NULL;
  size_t inputs;
  TRY(CALL(KernelContext_GetInputCount, fn_input_count, context, &inputs));
  TRY(CALL(KernelContext_GetInput, fn_input, context, 0, &a_value));
  if (inputs > 3) TRY(CALL(KernelContext_GetInput, fn_input, context, 3, &z_value));
  if (inputs > 4) TRY(CALL(KernelContext_GetInput, fn_input, context, 4, &g_value));
  if (inputs > 5) TRY(CALL(KernelContext_GetInput, fn_input, context, 5, &bias_value));
  if (g_value) return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: g_idx is not supported (leave the node as it is)");
  if (z_value && !kernel->zero_points)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: zero_points must be an initializer (the kernel repacks "
                                      "them when the session opens)");
  int64_t dims[8];
  size_t rank;
  TRY(shape_of(a_value, dims, &rank));
  if (rank < 1 || dims[rank - 1] != kernel->k)
    return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: A's last dimension is not K");
  if (bias_value) {
    int64_t vdims[8];
    size_t vrank;
    TRY(shape_of(bias_value, vdims, &vrank));
    if (vrank != 1 || vdims[0] != kernel->n) return fail(ORT_INVALID_ARGUMENT, "llmc.MatMulNBits4: bias is not [N]");
  }
  int64_t m = 1;
  for (size_t i = 0; i + 1 < rank; i++) m *= dims[i];
  dims[rank - 1] = kernel->n;
  OrtValue *y_value;
  void *a, *bias = NULL, *y;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, dims, rank, &y_value));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)y_value, &y));
  if (m == 0) return NULL;
  TRY(CALL(GetTensorMutableData, fn_data, a_value, &a));
  if (bias_value) TRY(CALL(GetTensorMutableData, fn_data, bias_value, &bias));

  void *memory = malloc(q4_memory(m, kernel->k));
  if (!memory) return fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory");
  size_t tasks;
  Q4Matmul *call = q4_prepare(memory, kernel->isa, (const float *)a, m, kernel->k, kernel->n, kernel->threads,
                              kernel->packed, kernel->zero_points, kernel->half_scales, kernel->share,
                              (const float *)bias, (float *)y, &tasks);
  OrtStatus *status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, q4_run, tasks, 0, call);
  if (!status && q4_failed(call)) status = fail(ORT_FAIL, "llmc.MatMulNBits4: out of memory");
  free(memory);
  return status;
}

static void destroy_kernel(void *state) {
  Kernel *kernel = (Kernel *)state;
  munmap(kernel->packed, kernel->packed_bytes);
  free(kernel);
}
static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulNBits4"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 || i == 3 ? TYPE_UINT8 : i == 4 ? TYPE_INT32 : TYPE_FLOAT;
}
static size_t input_count(const OrtCustomOp *op) { (void)op; return 6; } /* A, B, scales, zero points, g_idx, bias */
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static int input_characteristic(const OrtCustomOp *op, size_t i) { (void)op; return i >= 3 ? IO_OPTIONAL : IO_REQUIRED; }
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
static int domain_failed, in_place; /* in_place: this ONNX Runtime has API 18 (custom ops' MayInplace) */
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;
typedef OrtStatus *(*fn_create_domain)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*fn_domain_add)(OrtCustomOpDomain *, const OrtCustomOp *);
typedef OrtStatus *(*fn_add_domain)(OrtSessionOptions *, OrtCustomOpDomain *);

static void make_domain(void) {
  OrtStatus *status = CALL(CreateCustomOpDomain, fn_create_domain, "llmc", &domain);
  if (!status) status = CALL(CustomOpDomain_Add, fn_domain_add, domain, &matmul_nbits4);
  for (int i = 0; !status && i < PAGED_ATTENTION_OPS; i++)
    status = CALL(CustomOpDomain_Add, fn_domain_add, domain, &paged_attention_ops[i]);
  for (int i = 0; !status && i < COLLECTIVE_OPS; i++)
    status = CALL(CustomOpDomain_Add, fn_domain_add, domain, &collective_ops[i]);
  if (!status) status = CALL(CustomOpDomain_Add, fn_domain_add, domain, in_place ? &lora_delta_op : &lora_delta_op_v16);
  if (!status) status = CALL(CustomOpDomain_Add, fn_domain_add, domain, in_place ? &moe_lora_op : &moe_lora_op_v16);
  if (!status) status = CALL(CustomOpDomain_Add, fn_domain_add, domain, in_place ? &moe_lora_q_op : &moe_lora_q_op_v16);
  domain_failed = status != NULL; /* ONNX Runtime owns a returned status: report a fresh one each call */
  if (status) CALL(ReleaseStatus, fn_release_status, status);
}

/* called by ONNX Runtime's SessionOptions.register_custom_ops_library */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  OrtApiTable table = base->GetApi(ORT_API_VERSION_USED);
  if (!table) return NULL; /* older than 1.17: nothing registered (cpu_kernels.py checks the version first) */
  llmc_ort_api = table;
  in_place = base->GetApi(18) != NULL; /* read by make_domain, once */
  pthread_once(&domain_once, make_domain);
  if (domain_failed) return fail(ORT_FAIL, "llmc: could not create the custom-op domain");
  return CALL(AddCustomOpDomain, fn_add_domain, options, domain);
}
