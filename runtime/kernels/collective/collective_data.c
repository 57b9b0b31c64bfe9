/* The data movement of one collective step (collective.c runs the steps): the ranks' slots summed into the
 * output (AllReduce), or placed side by side along its last axis (AllGather). */
#include "collective_data.h"

#include <immintrin.h>
#include <string.h>

#include "paged_attention.h" /* paged_half_to_float, paged_float_to_half: the library's IEEE half conversions */

/* ---- the sum ---- */

/* elements: a block's sum stays in L1 across the ranks; a task is one thread's share of a large sum */
enum { BLOCK = 1024, TASK = 16384 };

typedef struct {
  const unsigned char *const *src; /* each rank's chunk, in rank order */
  void *y;
  int64_t len;
  int world, type;
} Sum;

static void sum_f32(float *restrict y, const Sum *s, int64_t at, int64_t n) {
  memcpy(y, (const float *)s->src[0] + at, sizeof(float) * (size_t)n);
  for (int q = 1; q < s->world; q++) {
    const float *restrict x = (const float *)s->src[q] + at;
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
  }
}

/* float16 summed in float32 in rank order, rounded once; F16C converts 8 at a time where the CPU has it */
__attribute__((target("avx,f16c"))) static int64_t sum_f16_f16c(uint16_t *y, const Sum *s, int64_t at, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s->src[0] + at + i)));
    for (int q = 1; q < s->world; q++) {
      const __m128i *x = (const __m128i *)((const uint16_t *)s->src[q] + at + i);
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(x)));
    }
    _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}

static void sum_f16(uint16_t *y, const Sum *s, int64_t at, int64_t n) {
  int f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  for (int64_t i = f16c ? sum_f16_f16c(y, s, at, n) : 0; i < n; i++) {
    float acc = paged_half_to_float(((const uint16_t *)s->src[0])[at + i]);
    for (int q = 1; q < s->world; q++) acc += paged_half_to_float(((const uint16_t *)s->src[q])[at + i]);
    y[i] = paged_float_to_half(acc);
  }
}

static void sum_task(void *arg, size_t task) {
  const Sum *s = (const Sum *)arg;
  int64_t end = ((int64_t)task + 1) * TASK < s->len ? ((int64_t)task + 1) * TASK : s->len;
  for (int64_t at = (int64_t)task * TASK; at < end; at += BLOCK) {
    int64_t n = end - at < BLOCK ? end - at : BLOCK;
    if (s->type == COLL_F32) sum_f32((float *)s->y + at, s, at, n);
    else sum_f16((uint16_t *)s->y + at, s, at, n);
  }
}

/* tasks over the caller's threads when worth it (big enough: a hand-off costs some microseconds), else
 * here (also when ParallelFor fails) */
static void run_tasks(const CollCall *c, void (*task)(void *, size_t), size_t tasks, void *arg, int big) {
  if (big && tasks > 1 && c->parallel_for && !c->parallel_for(c->parallel_context, task, tasks, arg)) return;
  for (size_t t = 0; t < tasks; t++) task(arg, t);
}

/* ---- the gather ---- */

typedef struct {
  const unsigned char *const *src;
  unsigned char *y;
  int64_t at, len, width;
  int world;
  size_t element;
} Gather;

/* rank q's elements [at, at + len) of its flat [rows, width] input to their places in y [rows, world * width] */
static void gather_task(void *arg, size_t q) {
  const Gather *g = (const Gather *)arg;
  for (int64_t e = g->at, end = g->at + g->len; e < end;) {
    int64_t row = e / g->width, column = e % g->width;
    int64_t run = g->width - column < end - e ? g->width - column : end - e;
    memcpy(g->y + ((row * g->world + (int64_t)q) * g->width + column) * (int64_t)g->element,
           g->src[q] + (e - g->at) * (int64_t)g->element, (size_t)run * g->element);
    e += run;
  }
}

void coll_sum(const CollCall *c, const unsigned char *const *src, int world, int64_t at, int64_t len) {
  size_t element = c->type == COLL_F16 ? 2 : 4;
  Sum sum = {.src = src, .y = (unsigned char *)c->y + at * (int64_t)element, .len = len, .world = world,
             .type = c->type};
  run_tasks(c, sum_task, (size_t)((len + TASK - 1) / TASK), &sum, 1);
}

void coll_gather(const CollCall *c, const unsigned char *const *src, int world, int64_t at, int64_t len) {
  size_t element = c->type == COLL_F16 ? 2 : 4;
  Gather gather = {.src = src, .y = (unsigned char *)c->y, .at = at, .len = len, .width = c->width, .world = world,
                   .element = element};
  run_tasks(c, gather_task, (size_t)world, &gather, len * (int64_t)element >= 4 * TASK); /* a task a rank */
}
