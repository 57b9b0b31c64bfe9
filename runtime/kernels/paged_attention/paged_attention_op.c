/* llmc.PagedAttention: ONNX Runtime's com.microsoft.PagedAttention (1.32) as a CPU custom op over
 * paged_attention.c — the same 17 inputs, 3 outputs and attributes (plugins/op/paged_schema.py lists
 * what it runs and what it refuses), plus two of llmc's: `threads` (the session's intra-op threads,
 * set by runtime/kernels/cpu_kernels.py; default: the CPU count) and `isa` ("avx512", "avx2" or "portable";
 * default: the best this CPU runs). Float32 query, key, value and rotary tables; float32, float16 or
 * int8 caches (a kernel for each; int8 takes k_scale/v_scale, PER_TENSOR or PER_CHANNEL); float32 head_sink
 * [num_heads] (attention sinks). Caches update in place: when ONNX Runtime hands over output buffers that
 * are the input caches' memory (IO binding one buffer to both), only the new tokens are written;
 * otherwise the input caches are copied to the outputs first. Shapes and values are checked in
 * paged_attention_checks.c, each error naming the input or attribute at fault. */
#include "paged_attention_op.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <math.h>

#include "paged_attention.h"
#include "paged_attention_checks.h"

static char isa_names[64];
static pthread_once_t isa_names_once = PTHREAD_ONCE_INIT;
static void list_isas(void) { llmc_list_isas(isa_names, PAGED_ISA_COUNT, paged_isa_supported, paged_isa_name); }
const char *llmc_paged_attention_isas(void) {
  pthread_once(&isa_names_once, list_isas);
  return isa_names;
}

/* the quant types: NONE for float caches; PER_TENSOR or PER_CHANNEL for int8 ones (per_channel set) */
static OrtStatus *quant_types(const OrtKernelInfo *info, PagedOp *op) {
  char text[64];
  const char *names[] = {"k_quant_type", "v_quant_type"};
  for (int i = 0; i < 2; i++) {
    llmc_attr_string(info, names[i], text, sizeof text, "NONE");
    op->per_channel[i] = !strcmp(text, "PER_CHANNEL");
    if (op->cache != PAGED_CACHE_I8 && strcmp(text, "NONE"))
      return paged_bad("%s '%s' needs an int8 cache (this one holds %s)", names[i], text, paged_cache_names[op->cache]);
    if (op->cache == PAGED_CACHE_I8 && !op->per_channel[i] && strcmp(text, "PER_TENSOR"))
      return paged_bad("%s '%s': an int8 cache takes PER_TENSOR or PER_CHANNEL scales", names[i], text);
  }
  return NULL;
}

static OrtStatus *refuse_unsupported(const OrtKernelInfo *info, PagedOp *op) {
  char text[64];
  llmc_attr_string(info, "kv_cache_layout", text, sizeof text, "SEPARATE");
  if (strcmp(text, "SEPARATE"))
    return paged_bad("kv_cache_layout '%s' is not implemented on CPU (only SEPARATE: MLA's LATENT layout is not)", text);
  if (llmc_attr_int(info, "v_head_size", 0)) return paged_bad("v_head_size (MLA) is not implemented on CPU");
  TRY(quant_types(info, op));
  for (const char *const *name = (const char *const[]){"k_cache_dtype", "v_cache_dtype", NULL}; *name; name++) {
    llmc_attr_string(info, *name, text, sizeof text, "");
    if (*text && (op->cache == PAGED_CACHE_F32 || strcmp(text, paged_cache_names[op->cache])))
      return paged_bad("%s '%s' does not name this cache's element type (%s)", *name, text, paged_cache_names[op->cache]);
  }
  return NULL;
}

static OrtStatus *create_kernel(const OrtCustomOp *custom, OrtApiTable table, const OrtKernelInfo *info, void **out) {
  (void)table;
  PagedOp op = {0};
  op.cache = (int)(custom - paged_attention_ops); /* the kernels are registered in PAGED_CACHE_* order */
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "num_heads", &op.heads));
  TRY(CALL(KernelInfoGetAttribute_int64, fn_attr_int64, info, "kv_num_heads", &op.kv_heads));
  if (op.heads <= 0 || op.kv_heads <= 0 || op.heads % op.kv_heads)
    return paged_bad("num_heads (%lld) must be a positive multiple of kv_num_heads (%lld)", (long long)op.heads,
               (long long)op.kv_heads);
  TRY(refuse_unsupported(info, &op));
  op.scale = llmc_attr_float(info, "scale", 0.f);
  op.softcap = llmc_attr_float(info, "softcap", 0.f);
  op.window = llmc_attr_int(info, "local_window_size", -1);
  op.do_rotary = llmc_attr_int(info, "do_rotary", 0) == 1;
  op.interleaved = llmc_attr_int(info, "rotary_interleaved", 0) == 1;
  op.causal = llmc_attr_int(info, "is_causal", 1) == 1;
  op.rotary_offset = llmc_attr_int(info, "rotary_offset", 0);
  if (op.rotary_offset < 0 || op.rotary_offset % 8)
    return paged_bad("rotary_offset (%lld) must be a non-negative multiple of 8", (long long)op.rotary_offset);
  op.threads = llmc_attr_int(info, "threads", sysconf(_SC_NPROCESSORS_ONLN));
  char isa[32];
  llmc_attr_string(info, "isa", isa, sizeof isa, "");
  for (op.isa = 0; op.isa < PAGED_ISA_COUNT; op.isa++)
    if ((!*isa || !strcmp(isa, paged_isa_name(op.isa))) && paged_isa_supported(op.isa)) break;
  if (op.isa == PAGED_ISA_COUNT)
    return paged_bad("isa '%s' is not one this CPU runs (%s)", isa, llmc_paged_attention_isas());
  PagedOp *kernel = (PagedOp *)malloc(sizeof(PagedOp));
  if (!kernel) return llmc_fail(ORT_FAIL, "llmc.PagedAttention: out of memory");
  *kernel = op;
  *out = kernel;
  return NULL;
}

/* the cache output `index` (or the input cache itself when the node has no such output), holding the input's
 * contents: the same memory when ONNX Runtime bound both to one buffer, else a copy */
static OrtStatus *cache_output(OrtKernelContext *context, size_t outputs, size_t index, const Tensor *cache,
                               size_t element, void **data) {
  *data = cache->data;
  if (index >= outputs) return NULL;
  OrtValue *value;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, index, cache->dims, 4, &value));
  if (!value) return NULL;
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)value, data));
  if (*data != cache->data)
    memcpy(*data, cache->data, element * (size_t)(cache->dims[0] * cache->dims[1] * cache->dims[2] * cache->dims[3]));
  return NULL;
}

/* int8: k_scale and v_scale as [kv_heads, d] each (a PER_TENSOR scale repeated), one allocation; NULL: no memory */
static float *expand_scales(const PagedOp *op, const Tensor *in, PagedArgs *a) {
  size_t n = (size_t)(a->kv_heads * a->d);
  float *scales = (float *)malloc(2 * n * sizeof(float));
  for (size_t i = 0; scales && i < 2; i++)
    for (size_t j = 0; j < n; j++) scales[i * n + j] = ((const float *)in[IN_K_SCALE + i].data)[op->per_channel[i] ? j : 0];
  a->k_scale = scales, a->v_scale = scales ? scales + n : NULL;
  return scales;
}

static OrtStatus *compute(void *state, OrtKernelContext *context) {
  const PagedOp *op = (const PagedOp *)state;
  size_t inputs, outputs;
  Tensor in[IN_COUNT];
  TRY(CALL(KernelContext_GetInputCount, fn_input_count, context, &inputs));
  TRY(CALL(KernelContext_GetOutputCount, fn_input_count, context, &outputs));
  for (size_t i = 0; i < IN_COUNT; i++) TRY(paged_tensor(context, inputs, i, &in[i]));
  PagedArgs a = {0};
  TRY(paged_check_shapes(op, in, &a));
  a.query = (const float *)in[IN_QUERY].data;
  a.key = in[IN_KEY].value ? (const float *)in[IN_KEY].data : a.query + a.heads * a.d;
  a.value = in[IN_VALUE].value ? (const float *)in[IN_VALUE].data : a.key + a.kv_heads * a.d;
  a.cumulative = (const int32_t *)in[IN_CUMULATIVE].data, a.past = (const int32_t *)in[IN_PAST].data;
  a.block_table = (const int32_t *)in[IN_BLOCK_TABLE].data, a.slot_mapping = (const int32_t *)in[IN_SLOT_MAPPING].data;
  a.cos = op->do_rotary ? (const float *)in[IN_COS].data : NULL, a.sin = op->do_rotary ? (const float *)in[IN_SIN].data : NULL;
  a.head_sink = in[IN_HEAD_SINK].value ? (const float *)in[IN_HEAD_SINK].data : NULL;
  TRY(paged_check_values(in, &a));
  a.cache = op->cache, a.interleaved = op->interleaved, a.causal = op->causal, a.window = op->window;
  a.scale = op->scale != 0.f ? op->scale : 1.f / sqrtf((float)a.d), a.softcap = op->softcap;
  a.threads = op->threads, a.isa = op->isa;
  int64_t dims[2] = {a.tokens, a.heads * a.d};
  OrtValue *output;
  TRY(CALL(KernelContext_GetOutput, fn_output, context, 0, dims, 2, &output));
  TRY(CALL(GetTensorMutableData, fn_data, (const OrtValue *)output, (void **)&a.output));
  size_t element = op->cache == PAGED_CACHE_I8 ? 1 : op->cache == PAGED_CACHE_F16 ? 2 : 4;
  TRY(cache_output(context, outputs, 1, &in[IN_KEY_CACHE], element, &a.key_cache));
  TRY(cache_output(context, outputs, 2, &in[IN_VALUE_CACHE], element, &a.value_cache));
  if (!a.tokens) return NULL;
  float *scales = op->cache == PAGED_CACHE_I8 ? expand_scales(op, in, &a) : NULL;
  size_t writes, attends;
  PagedCall *call = (scales || op->cache != PAGED_CACHE_I8) ? paged_prepare(&a, &writes, &attends) : NULL;
  if (!call) {
    free(scales);
    return llmc_fail(ORT_FAIL, "llmc.PagedAttention: out of memory");
  }
  OrtStatus *status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, paged_write, writes, 0, call);
  if (!status) status = CALL(KernelContext_ParallelFor, fn_parallel_for, context, paged_attend, attends, 0, call);
  if (!status && paged_failed(call)) status = llmc_fail(ORT_FAIL, "llmc.PagedAttention: out of memory");
  paged_free(call);
  free(scales);
  return status;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "PagedAttention"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return IN_COUNT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 3; }
static int is_cache(size_t i) { return i == IN_KEY_CACHE || i == IN_VALUE_CACHE; }
static int cache_type(const OrtCustomOp *op) {
  static const int types[] = {TYPE_FLOAT, TYPE_FLOAT16, TYPE_INT8}; /* PAGED_CACHE_* order */
  return types[op - paged_attention_ops];
}
static int input_type(const OrtCustomOp *op, size_t i) {
  if (is_cache(i)) return cache_type(op);
  if (i == IN_HEAD_SINK) return 0; /* UNDEFINED: any type reaches compute, which names head_sink if not float32 */
  return i == IN_CUMULATIVE || i == IN_PAST || i == IN_BLOCK_TABLE || i == IN_SLOT_MAPPING || i == 16 ? TYPE_INT32
                                                                                                       : TYPE_FLOAT;
}
static int output_type(const OrtCustomOp *op, size_t i) { return i ? cache_type(op) : TYPE_FLOAT; }
static int input_characteristic(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == IN_QUERY || i == IN_KEY_CACHE || (i >= IN_CUMULATIVE && i <= IN_BLOCK_TABLE) ? IO_REQUIRED : IO_OPTIONAL;
}
static int output_characteristic(const OrtCustomOp *op, size_t i) { (void)op; return i ? IO_OPTIONAL : IO_REQUIRED; }
static int memory_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int min_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp *op) { (void)op; return 1; }

#define PAGED_OP                                                                                                \
  {16, NULL, op_name, op_provider, input_type, input_count, output_type, output_count, NULL, destroy_kernel, \
   input_characteristic, output_characteristic, memory_type, min_arity, homogeneous, min_arity, homogeneous, \
   create_kernel, compute}
const OrtCustomOp paged_attention_ops[PAGED_ATTENTION_OPS] = {PAGED_OP, PAGED_OP, PAGED_OP}; /* float32, float16, int8 caches */
