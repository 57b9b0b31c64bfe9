/* llmc's paged attention on CPU: ONNX Runtime's com.microsoft.PagedAttention semantics (the API is
 * paged_attention.h; paged_attention_op.c is the op around it; plugins/op/attention.py's
 * reference_paged_attention is the definition the tests hold it to).
 *
 * A call runs in two parallel passes. paged_write: each new token's queries are rotated (rotary
 * tables) and scaled into a scratch copy, its key rotated and written with its value into its slot
 * of the block cache. paged_attend: the tasks are (row, heads, chunk of up to CHUNK of the row's new
 * tokens); the heads are a query head's whole GQA group (their keys and values read once for all) or,
 * when that leaves fewer tasks than threads, one head. A task walks its row's positions a
 * tile of TILE at a time through the block table (one pointer per position: blocks of any size,
 * anywhere in the pool), and keeps an online softmax per query (running max, sum and weighted sum of
 * values): no [queries, positions] score matrix, however long the row. Tasks are dealt out longest
 * first, since a chunk late in a long row costs more than one early.
 *
 * int8 caches (symmetric, a dequantization scale per kv head and channel, ONNX Runtime's PER_CHANNEL;
 * a PER_TENSOR scale comes expanded): a key or value is stored as x / scale rounded to nearest even and
 * saturated to [-128, 127]. The loops read the codes as they are: the key scales are folded into the
 * scratch queries (q . (s * k) = (q * s) . k) and the value scales into the finished output, so int8
 * costs the attention loops nothing beyond widening a byte.
 *
 * Attention sinks (head_sink [heads]) change only the softmax's denominator, once per query when its
 * online softmax is finished (`normalizer`): the same for every instruction set's loops. */
#include "paged_attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64
#define CHUNK 16

extern const PagedIsa paged_avx512, paged_avx2, paged_portable;
static const PagedIsa *const ISAS[PAGED_ISA_COUNT] = {&paged_avx512, &paged_avx2, &paged_portable};

const char *paged_isa_name(int isa) { return isa >= 0 && isa < PAGED_ISA_COUNT ? ISAS[isa]->name : NULL; }
int paged_isa_supported(int isa) { return isa >= 0 && isa < PAGED_ISA_COUNT && ISAS[isa]->supported(); }

typedef struct {
  int32_t row, first, last, head, heads; /* the row's new tokens first .. last - 1; query heads head .. + heads */
  int64_t cost;
} Task;

struct PagedCall {
  PagedArgs a;
  const PagedLoops *loops;
  float *queries;    /* [tokens, heads, d]: rotated and scaled */
  int32_t *row_of;   /* [tokens] */
  void *zero_row;    /* what an unmapped position reads (masked out anyway) */
  Task *tasks;
  size_t write_tasks, attend_tasks;
  int failed;
};

static int cost_order(const void *x, const void *y) {
  int64_t a = ((const Task *)x)->cost, b = ((const Task *)y)->cost;
  return a < b ? 1 : a > b ? -1 : 0;
}

static size_t plan_tasks(PagedCall *call, int per_head) {
  const PagedArgs *a = &call->a;
  int64_t step = per_head ? 1 : a->heads / a->kv_heads;
  size_t count = 0;
  for (int64_t b = 0; b < a->batch; b++) {
    int32_t n = a->cumulative[b + 1] - a->cumulative[b];
    for (int32_t first = 0; first < n; first += CHUNK)
      for (int64_t h = 0; h < a->heads; h += step) {
        int32_t last = first + CHUNK < n ? first + CHUNK : n;
        if (call->tasks)
          call->tasks[count] = (Task){(int32_t)b, first, last, (int32_t)h, (int32_t)step,
                                      (int64_t)(last - first) * step * (a->past[b] + last)};
        count++;
      }
  }
  return count;
}

PagedCall *paged_prepare(const PagedArgs *args, size_t *write_tasks, size_t *attend_tasks) {
  PagedCall *call = (PagedCall *)calloc(1, sizeof(PagedCall));
  if (!call) return NULL;
  call->a = *args;
  int at = args->isa; /* that one, else the next one down this CPU runs that takes the head size */
  while (at + 1 < PAGED_ISA_COUNT && !(ISAS[at]->supported() && ISAS[at]->takes((int)args->d))) at++;
  const PagedIsa *isa = ISAS[at];
  call->loops = args->cache == PAGED_CACHE_I8 ? &isa->i8 : args->cache == PAGED_CACHE_F16 ? &isa->f16 : &isa->f32;
  call->queries = (float *)malloc(sizeof(float) * (size_t)(args->tokens * args->heads * args->d) + 1);
  call->row_of = (int32_t *)malloc(sizeof(int32_t) * (size_t)args->tokens + 1);
  call->zero_row = calloc((size_t)args->d, sizeof(float));
  /* a task per GQA group unless that leaves a thread idle: a group's heads share each key and value
   * read (the tile from L1). At batch-1 decode (2 threads, 24 layers, one switched call to the other
   * in the same session): Qwen2.5-0.5B's 14/2 heads 1.18-1.22x faster grouped than split per head,
   * SmolLM2's 9/3 1.09-1.12x (three groups on two threads); splitting from fewer than four tasks a
   * thread, as before, cost that. */
  int per_head = plan_tasks(call, 0) < (size_t)args->threads && args->heads > args->kv_heads;
  call->attend_tasks = plan_tasks(call, per_head);
  call->tasks = (Task *)malloc(sizeof(Task) * call->attend_tasks + 1);
  if (!call->queries || !call->row_of || !call->zero_row || !call->tasks) {
    paged_free(call);
    return NULL;
  }
  plan_tasks(call, per_head);
  qsort(call->tasks, call->attend_tasks, sizeof(Task), cost_order);
  for (int64_t b = 0; b < args->batch; b++)
    for (int32_t t = args->cumulative[b]; t < args->cumulative[b + 1]; t++) call->row_of[t] = (int32_t)b;
  call->write_tasks = (size_t)((args->tokens + CHUNK - 1) / CHUNK);
  *write_tasks = call->write_tasks;
  *attend_tasks = call->attend_tasks;
  return call;
}

/* x's rotary channels rotated at table row `at` (the rest copied), times `scale`, into out */
static void rotate(const PagedArgs *a, const float *x, int64_t at, float scale, float *out) {
  for (int64_t c = 0; c < a->d; c++) out[c] = x[c] * scale;
  if (!a->cos) return;
  int64_t half = a->rotary_dim / 2;
  const float *cos = a->cos + at * half, *sin = a->sin + at * half;
  float *r = out + a->rotary_offset;
  for (int64_t i = 0; i < half; i++) {
    int64_t i1 = a->interleaved ? 2 * i : i, i2 = a->interleaved ? 2 * i + 1 : i + half;
    float x1 = r[i1], x2 = r[i2];
    r[i1] = x1 * cos[i] - x2 * sin[i];
    r[i2] = x2 * cos[i] + x1 * sin[i];
  }
}

int8_t paged_quantize(float x, float scale) {
  float q = rintf(x / scale); /* the current rounding mode: to nearest even */
  return (int8_t)(q > 127.f ? 127 : q < -128.f ? -128 : q);
}

/* x into the cache at (slot, kv_head); scale: that head's int8 scales (NULL for float caches) */
static void store(const PagedArgs *a, void *cache, int64_t slot, int64_t kv_head, const float *x, const float *scale) {
  int64_t at = (slot * a->kv_heads + kv_head) * a->d;
  if (a->cache == PAGED_CACHE_F32)
    memcpy((float *)cache + at, x, sizeof(float) * (size_t)a->d);
  else if (a->cache == PAGED_CACHE_F16)
    for (int64_t c = 0; c < a->d; c++) ((uint16_t *)cache)[at + c] = paged_float_to_half(x[c]);
  else
    for (int64_t c = 0; c < a->d; c++) ((int8_t *)cache)[at + c] = paged_quantize(x[c], scale[c]);
}

static int64_t slot_of(const PagedArgs *a, int64_t t, int64_t row, int64_t position) {
  if (a->slot_mapping) return a->slot_mapping[t];
  int32_t block = a->block_table[row * a->max_blocks + position / a->block_size];
  return block < 0 || block >= a->blocks ? -1 : (int64_t)block * a->block_size + position % a->block_size;
}

void paged_write(void *opaque, size_t task) {
  PagedCall *call = (PagedCall *)opaque;
  const PagedArgs *a = &call->a;
  float *key = (float *)malloc(sizeof(float) * (size_t)a->d);
  if (!key) {
    __atomic_store_n(&call->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  int64_t end = ((int64_t)task + 1) * CHUNK < a->tokens ? ((int64_t)task + 1) * CHUNK : a->tokens;
  for (int64_t t = (int64_t)task * CHUNK; t < end; t++) {
    int64_t row = call->row_of[t], position = a->past[row] + t - a->cumulative[row];
    for (int64_t h = 0; h < a->heads; h++) {
      float *q = call->queries + (t * a->heads + h) * a->d;
      rotate(a, a->query + t * a->q_stride + h * a->d, position, a->scale, q);
      const float *ks = a->k_scale ? a->k_scale + h / (a->heads / a->kv_heads) * a->d : NULL;
      for (int64_t c = 0; ks && c < a->d; c++) q[c] *= ks[c]; /* int8 keys: their scales folded into q */
    }
    int64_t slot = slot_of(a, t, row, position);
    if (slot < 0) continue;
    for (int64_t h = 0; h < a->kv_heads; h++) {
      rotate(a, a->key + t * a->kv_stride + h * a->d, position, 1.f, key);
      store(a, a->key_cache, slot, h, key, a->k_scale ? a->k_scale + h * a->d : NULL);
      store(a, a->value_cache, slot, h, a->value + t * a->kv_stride + h * a->d, a->v_scale ? a->v_scale + h * a->d : NULL);
    }
  }
  free(key);
}

typedef struct {
  float max, sum;
} Softmax;

typedef struct {
  const void *keys[TILE], *values[TILE];
  unsigned char unmapped[TILE];
  int any_unmapped;
} Tile;

/* the positions j0 .. j0 + n - 1 of a row's kv head, through the block table */
static void locate(const PagedCall *call, int64_t row, int64_t kv_head, int64_t j0, int n, Tile *tile) {
  const PagedArgs *a = &call->a;
  size_t bytes = a->cache == PAGED_CACHE_I8 ? 1 : a->cache == PAGED_CACHE_F16 ? 2 : 4;
  tile->any_unmapped = 0;
  for (int t = 0; t < n; t++) {
    int64_t j = j0 + t;
    int32_t block = a->block_table[row * a->max_blocks + j / a->block_size];
    tile->unmapped[t] = block < 0 || block >= a->blocks;
    tile->any_unmapped |= tile->unmapped[t];
    size_t at = (size_t)((((int64_t)block * a->block_size + j % a->block_size) * a->kv_heads + kv_head) * a->d) * bytes;
    tile->keys[t] = tile->unmapped[t] ? call->zero_row : (const char *)a->key_cache + at;
    tile->values[t] = tile->unmapped[t] ? call->zero_row : (const char *)a->value_cache + at;
  }
}

/* one query against positions ta .. tb - 1 of the tile: the online softmax's update of (state, out) */
static void attend_tile(const PagedCall *call, const Tile *tile, int ta, int tb, const float *q, Softmax *state,
                        float *out) {
  const PagedArgs *a = &call->a;
  int n = tb - ta, d = (int)a->d;
  float s[TILE], p[TILE], top = -INFINITY;
  call->loops->dots(q, tile->keys + ta, n, d, s);
  if (a->softcap > 0)
    for (int t = 0; t < n; t++) s[t] = a->softcap * tanhf(s[t] / a->softcap);
  if (tile->any_unmapped)
    for (int t = 0; t < n; t++) s[t] = tile->unmapped[ta + t] ? -INFINITY : s[t];
  for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
  if (top == -INFINITY) return;
  float max = state->max > top ? state->max : top, alpha = expf(state->max - max);
  if (alpha != 1.f)
    for (int c = 0; c < d; c++) out[c] *= alpha;
  float sum = call->loops->exp_sum(s, p, n, max);
  if (tile->any_unmapped)
    for (int t = 0; t < n; t++)
      if (tile->unmapped[ta + t]) sum -= p[t], p[t] = 0.f;
  state->sum = state->sum * alpha + sum;
  state->max = max;
  call->loops->accumulate(out, p, tile->values + ta, n, d);
}

/* what a query's accumulated values are multiplied by: 1 / its softmax's denominator, which with attention
 * sinks also holds exp(sink - max) (the max taken over the logits and the sink, so neither overflows); a
 * query that saw nothing (and no sink) gets zeros */
static float normalizer(const PagedArgs *a, const Softmax *state, int64_t head) {
  float sum = state->sum, factor = 1.f;
  if (a->head_sink && a->head_sink[head] > -INFINITY) {
    float sink = a->head_sink[head], max = state->max > sink ? state->max : sink;
    factor = expf(state->max - max); /* 0 when nothing was seen */
    sum = sum * factor + expf(sink - max);
  }
  return sum > 0 ? factor / sum : 0.f;
}

void paged_attend(void *opaque, size_t index) {
  PagedCall *call = (PagedCall *)opaque;
  const PagedArgs *a = &call->a;
  const Task *task = &call->tasks[index];
  int64_t row = task->row, past = a->past[row], start = a->cumulative[row];
  int64_t total = past + a->cumulative[row + 1] - start, kv_head = task->head / (a->heads / a->kv_heads);
  int queries = (task->last - task->first) * task->heads;
  float *acc = (float *)calloc((size_t)(queries * a->d), sizeof(float));
  Softmax *state = (Softmax *)malloc(sizeof(Softmax) * (size_t)queries);
  Tile *tile = (Tile *)malloc(sizeof(Tile));
  if (!acc || !state || !tile) {
    __atomic_store_n(&call->failed, 1, __ATOMIC_RELAXED);
    free(acc), free(state), free(tile);
    return;
  }
  for (int i = 0; i < queries; i++) state[i] = (Softmax){-INFINITY, 0.f};
#define HI(i) (a->causal ? past + (i) + 1 : total)
#define LO(i) (a->window > 0 && past + (i) + 1 - a->window > 0 ? past + (i) + 1 - a->window : 0)
  for (int64_t j0 = LO(task->first); j0 < HI(task->last - 1); j0 += TILE) {
    int n = (int)(HI(task->last - 1) - j0 < TILE ? HI(task->last - 1) - j0 : TILE);
    locate(call, row, kv_head, j0, n, tile);
    for (int64_t i = task->first; i < task->last; i++) {
      int64_t ta = LO(i) > j0 ? LO(i) - j0 : 0, tb = HI(i) - j0 < n ? HI(i) - j0 : n;
      for (int h = 0; ta < tb && h < task->heads; h++) {
        int qi = (int)(i - task->first) * task->heads + h;
        const float *q = call->queries + ((start + i) * a->heads + task->head + h) * a->d;
        attend_tile(call, tile, (int)ta, (int)tb, q, &state[qi], acc + qi * a->d);
      }
    }
  }
#undef HI
#undef LO
  for (int qi = 0; qi < queries; qi++) {
    int64_t i = task->first + qi / task->heads, h = task->head + qi % task->heads;
    float *out = a->output + ((start + i) * a->heads + h) * a->d, scale = normalizer(a, &state[qi], h);
    const float *vs = a->v_scale ? a->v_scale + kv_head * a->d : NULL; /* int8 values: their scales applied once */
    for (int64_t c = 0; c < a->d; c++) out[c] = acc[qi * a->d + c] * scale * (vs ? vs[c] : 1.f);
  }
  free(acc), free(state), free(tile);
}

int paged_failed(const PagedCall *call) { return __atomic_load_n(&call->failed, __ATOMIC_RELAXED); }

void paged_free(PagedCall *call) {
  if (!call) return;
  free(call->queries), free(call->row_of), free(call->zero_row), free(call->tasks);
  free(call);
}
