/* llmc.PagedAttention's inputs, read and checked before paged_attention.c runs (the op:
 * paged_attention_op.c): shapes against the attributes and each other, then the lengths. */
#include "paged_attention_checks.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const REFUSED[] = {"q_norm_weight", "k_norm_weight"}; /* inputs 12 and 13 */
const char *const paged_cache_names[] = {"float", "float16", "int8"};

OrtStatus *paged_bad(const char *format, ...) {
  char message[320] = "llmc.PagedAttention: "; /* CreateStatus copies it */
  va_list args;
  va_start(args, format);
  vsnprintf(message + strlen(message), sizeof message - strlen(message), format, args);
  va_end(args);
  return llmc_fail(ORT_INVALID_ARGUMENT, message);
}

OrtStatus *paged_tensor(OrtKernelContext *context, size_t count, size_t index, Tensor *t) {
  memset(t, 0, sizeof *t);
  if (index >= count) return NULL;
  TRY(CALL(KernelContext_GetInput, fn_input, context, index, &t->value));
  if (!t->value) return NULL;
  OrtShape *shape;
  TRY(CALL(GetTensorTypeAndShape, fn_shape, t->value, &shape));
  OrtStatus *status = CALL(GetDimensionsCount, fn_dim_count, shape, &t->rank);
  if (!status && t->rank <= 4) status = CALL(GetDimensions, fn_dims, shape, t->dims, t->rank);
  if (!status) status = CALL(GetTensorElementType, fn_element_type, shape, &t->type);
  CALL(ReleaseTensorTypeAndShapeInfo, fn_release_shape, shape);
  if (!status) status = CALL(GetTensorMutableData, fn_data, t->value, &t->data);
  return status;
}

/* whether t has exactly these dimensions (rank = how many) */
static int shaped(const Tensor *t, size_t rank, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  const int64_t want[4] = {d0, d1, d2, d3};
  if (t->rank != rank) return 0;
  for (size_t i = 0; i < rank; i++)
    if (t->dims[i] != want[i]) return 0;
  return 1;
}

/* the head size and the shapes the others must have; PagedArgs' sizes filled in */
OrtStatus *paged_check_shapes(const PagedOp *op, const Tensor *in, PagedArgs *a) {
  for (int i = 0; i < 2; i++)
    if (in[IN_HEAD_SINK + 1 + i].value) return paged_bad("%s is not implemented on CPU", REFUSED[i]);
  for (int i = IN_K_SCALE; i <= IN_V_SCALE; i++)
    if (!in[i].value != (op->cache != PAGED_CACHE_I8))
      return paged_bad("%s comes with an int8 cache and only then (this one holds %s)", i == IN_K_SCALE ? "k_scale" : "v_scale",
                 paged_cache_names[op->cache]);
  if (!in[IN_VALUE_CACHE].value) return paged_bad("value_cache is absent (the LATENT layout) and not implemented on CPU");
  if (!in[IN_KEY].value != !in[IN_VALUE].value) return paged_bad("key and value come together, or neither (packed QKV)");
  const Tensor *q = &in[IN_QUERY], *kc = &in[IN_KEY_CACHE];
  int64_t packed = !in[IN_KEY].value, across = op->heads + (packed ? 2 * op->kv_heads : 0);
  if (q->rank != 2 || q->dims[1] % across || !q->dims[1]) return paged_bad("query is not [tokens, %lld * head_size]", (long long)across);
  a->tokens = q->dims[0], a->d = q->dims[1] / across, a->heads = op->heads, a->kv_heads = op->kv_heads;
  a->q_stride = q->dims[1], a->kv_stride = packed ? q->dims[1] : a->kv_heads * a->d;
  for (int i = IN_KEY; !packed && i <= IN_VALUE; i++)
    if (!shaped(&in[i], 2, a->tokens, a->kv_heads * a->d, 0, 0))
      return paged_bad("%s is not [tokens %lld, kv_num_heads * head_size %lld]", i == IN_KEY ? "key" : "value",
                 (long long)a->tokens, (long long)(a->kv_heads * a->d));
  if (kc->rank != 4 || kc->dims[2] != a->kv_heads || kc->dims[3] != a->d || kc->dims[0] < 1 || kc->dims[1] < 1)
    return paged_bad("key_cache is not [num_blocks, block_size, kv_num_heads %lld, head_size %lld]", (long long)a->kv_heads,
               (long long)a->d);
  if (!shaped(&in[IN_VALUE_CACHE], 4, kc->dims[0], kc->dims[1], kc->dims[2], kc->dims[3]))
    return paged_bad("value_cache's shape is not key_cache's");
  a->blocks = kc->dims[0], a->block_size = kc->dims[1];
  const Tensor *sink = &in[IN_HEAD_SINK];
  if (sink->value && (sink->type != TYPE_FLOAT || !shaped(sink, 1, a->heads, 0, 0, 0)))
    return paged_bad("head_sink is not float32 [num_heads %lld]", (long long)a->heads);
  const Tensor *cu = &in[IN_CUMULATIVE], *table = &in[IN_BLOCK_TABLE];
  if (cu->rank != 1 || cu->dims[0] < 2) return paged_bad("cumulative_sequence_length is not [batch_size + 1]");
  a->batch = cu->dims[0] - 1;
  if (!shaped(&in[IN_PAST], 1, a->batch, 0, 0, 0)) return paged_bad("past_seqlens is not [batch_size %lld]", (long long)a->batch);
  if (table->rank != 2 || table->dims[0] != a->batch) return paged_bad("block_table is not [batch_size %lld, max_blocks]", (long long)a->batch);
  a->max_blocks = table->dims[1];
  if (in[IN_SLOT_MAPPING].value && !shaped(&in[IN_SLOT_MAPPING], 1, a->tokens, 0, 0, 0))
    return paged_bad("slot_mapping is not [tokens %lld]", (long long)a->tokens);
  for (int i = 0; op->cache == PAGED_CACHE_I8 && i < 2; i++)
    if (op->per_channel[i] ? !shaped(&in[IN_K_SCALE + i], 3, a->kv_heads, 1, a->d, 0) : !shaped(&in[IN_K_SCALE + i], 1, 1, 0, 0, 0))
      return paged_bad("%s is not %s", i ? "v_scale" : "k_scale", op->per_channel[i] ? "[kv_num_heads, 1, head_size] (PER_CHANNEL)" : "[1] (PER_TENSOR)");
  if (!op->do_rotary) return NULL;
  const Tensor *cos = &in[IN_COS], *sin = &in[IN_SIN];
  if (!cos->value || !sin->value) return paged_bad("do_rotary=1 needs cos_cache and sin_cache");
  if (cos->rank != 2 || !shaped(sin, 2, cos->dims[0], cos->dims[1], 0, 0) || cos->dims[1] < 1 ||
      op->rotary_offset + 2 * cos->dims[1] > a->d)
    return paged_bad("cos_cache and sin_cache are not both [positions, rotary_dim / 2] with rotary_offset + rotary_dim <= "
               "head_size %lld", (long long)a->d);
  a->rotary_dim = 2 * cos->dims[1], a->rotary_offset = op->rotary_offset;
  return NULL;
}

/* the lengths: rows in order, each inside its block table (and the rotary tables); slots inside the cache */
OrtStatus *paged_check_values(const Tensor *in, const PagedArgs *a) {
  const int32_t *cu = a->cumulative, *slots = a->slot_mapping;
  if (cu[0] != 0 || cu[a->batch] != a->tokens)
    return paged_bad("cumulative_sequence_length runs from %d to %d, not from 0 to the %lld tokens", cu[0], cu[a->batch],
               (long long)a->tokens);
  int64_t positions = a->cos ? in[IN_COS].dims[0] : INT64_MAX;
  for (int64_t b = 0; b < a->batch; b++) {
    int64_t end = (int64_t)a->past[b] + cu[b + 1] - cu[b];
    if (cu[b + 1] < cu[b] || a->past[b] < 0 || end > a->max_blocks * a->block_size || end > positions)
      return paged_bad("row %lld: %d past and %d new tokens do not fit its block table (%lld tokens) or the rotary tables "
                 "(%lld positions)", (long long)b, a->past[b], cu[b + 1] - cu[b],
                 (long long)(a->max_blocks * a->block_size), (long long)(positions == INT64_MAX ? -1 : positions));
  }
  for (int64_t t = 0; slots && t < a->tokens; t++)
    if (slots[t] < -1 || slots[t] >= a->blocks * a->block_size)
      return paged_bad("slot_mapping[%lld] = %d is outside the cache's %lld slots", (long long)t, slots[t],
                 (long long)(a->blocks * a->block_size));
  return NULL;
}
