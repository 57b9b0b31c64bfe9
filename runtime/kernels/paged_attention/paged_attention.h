/* llmc's paged attention on CPU (paged_attention.c): ONNX Runtime's com.microsoft.PagedAttention
 * semantics over float32 activations and a float32, float16 or int8 block cache (int8: symmetric codes,
 * one dequantization scale per kv head and channel). paged_attention_op.c is
 * the ONNX Runtime op around it (it checks shapes and values before calling in here). */
#ifndef LLMC_PAGED_ATTENTION_H
#define LLMC_PAGED_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* the vector loops, for one cache element type: keys and values come as pointers to their D elements */
typedef struct {
  /* s[t] = dot(q, keys[t]) for t < n */
  void (*dots)(const float *q, const void *const *keys, int n, int d, float *s);
  /* acc[c] += sum over t < n of p[t] * values[t][c] */
  void (*accumulate)(float *acc, const float *p, const void *const *values, int n, int d);
  /* p[t] = exp(s[t] - max) for t < n; returns their sum */
  float (*exp_sum)(const float *s, float *p, int n, float max);
} PagedLoops;

typedef struct {
  const char *name;
  int (*supported)(void);
  int (*takes)(int d); /* whether its loops take this head size (else the portable ones run) */
  PagedLoops f32, f16, i8;
} PagedIsa;

/* what a cache element is */
enum { PAGED_CACHE_F32 = 0, PAGED_CACHE_F16 = 1, PAGED_CACHE_I8 = 2 };

/* the instruction sets, best first; the portable one runs everywhere */
enum { PAGED_ISA_AVX512 = 0, PAGED_ISA_AVX2 = 1, PAGED_ISA_PORTABLE = 2, PAGED_ISA_COUNT = 3 };
const char *paged_isa_name(int isa);
int paged_isa_supported(int isa);

typedef struct {
  int64_t tokens, batch, heads, kv_heads, d;          /* d: head size */
  int64_t blocks, block_size, max_blocks;             /* the caches' blocks, the block table's width */
  const float *query, *key, *value;                   /* token t, head h at query + t * q_stride + h * d */
  int64_t q_stride, kv_stride;                        /* elements from one token to the next (packed QKV) */
  void *key_cache, *value_cache;                      /* [blocks, block_size, kv_heads, d], updated */
  int cache;                                          /* PAGED_CACHE_*: the caches' element type */
  const float *k_scale, *v_scale;                     /* int8: [kv_heads, d] dequantization scales, else NULL */
  const int32_t *cumulative, *past, *block_table;     /* [batch + 1], [batch], [batch, max_blocks] */
  const int32_t *slot_mapping;                        /* [tokens] or NULL */
  const float *cos, *sin;                             /* [positions, rotary_dim / 2] or NULL: no rotary */
  int64_t rotary_dim, rotary_offset;
  int interleaved, causal;
  float scale, softcap;
  int64_t window;                                     /* > 0: attend to at most this many positions */
  const float *head_sink;                             /* [heads] or NULL: each head's sink logit joins its
                                                         softmax's denominator (attention sinks) */
  float *output;                                      /* [tokens, heads * d] */
  int64_t threads;                                    /* the session's intra-op threads */
  int isa;
} PagedArgs;

typedef struct PagedCall PagedCall;

/* Plans a call (the arguments already checked: positions inside the block table and the rotary
 * tables, slots inside the cache): NULL when out of memory. Run paged_write(call, 0 .. write_tasks - 1),
 * then paged_attend(call, 0 .. attend_tasks - 1), each set in any order and in parallel, then
 * paged_free(call). */
PagedCall *paged_prepare(const PagedArgs *args, size_t *write_tasks, size_t *attend_tasks);
void paged_write(void *call, size_t task);  /* rotate the new tokens' queries, write their keys and values */
void paged_attend(void *call, size_t task); /* attention for one (row, heads, chunk of tokens) */
int paged_failed(const PagedCall *call);    /* a task ran out of memory: the output is incomplete */
void paged_free(PagedCall *call);

/* x / scale rounded to nearest even and saturated to int8: what an int8 cache stores */
int8_t paged_quantize(float x, float scale);

/* IEEE half <-> float, round to nearest even (the portable path's conversions) */
float paged_half_to_float(uint16_t h);
uint16_t paged_float_to_half(float f);

#endif
