/* llmc.PagedAttention's inputs read from ONNX Runtime and checked (paged_attention_checks.c): what the op
 * (paged_attention_op.c) hands paged_attention.c has the shapes and lengths paged_attention.h assumes.
 * Every error names the input or attribute at fault. */
#ifndef LLMC_PAGED_ATTENTION_CHECKS_H
#define LLMC_PAGED_ATTENTION_CHECKS_H

#include "ort_abi.h"
#include "paged_attention.h"

enum { IN_QUERY, IN_KEY, IN_VALUE, IN_KEY_CACHE, IN_VALUE_CACHE, IN_CUMULATIVE, IN_PAST, IN_BLOCK_TABLE, IN_COS,
       IN_SIN, IN_SLOT_MAPPING, IN_HEAD_SINK, IN_COUNT = 17 };
enum { IN_K_SCALE = 14, IN_V_SCALE = 15 };
extern const char *const paged_cache_names[]; /* PAGED_CACHE_* order, as the node's *_cache_dtype names them */

/* the node's attributes */
typedef struct {
  int64_t heads, kv_heads, window, rotary_offset, threads;
  int cache, per_channel[2], do_rotary, interleaved, causal, isa; /* per_channel: k_scale's, v_scale's */
  float scale, softcap;
} PagedOp;

typedef struct {
  const OrtValue *value; /* NULL: absent */
  int64_t dims[4];
  size_t rank;
  int type; /* its element type (TYPE_*) */
  void *data;
} Tensor;

/* an INVALID_ARGUMENT status, its message "llmc.PagedAttention: " + the formatted text */
OrtStatus *paged_bad(const char *format, ...);
/* input `index` of the context's `count` (absent: value NULL), its dimensions and data */
OrtStatus *paged_tensor(OrtKernelContext *context, size_t count, size_t index, Tensor *t);
/* the head size and the shapes the others must have; PagedArgs' sizes filled in */
OrtStatus *paged_check_shapes(const PagedOp *op, const Tensor *in, PagedArgs *a);
/* the lengths: rows in order, each inside its block table (and the rotary tables); slots inside the cache */
OrtStatus *paged_check_values(const Tensor *in, const PagedArgs *a);

#endif
