/* llmc.LoraDelta's kernel (lora_delta.h): what the four-node LoRA branch computes, reading each token's own slot only.
 *
 * Written by hand because nothing does it: ONNX Runtime has no per-token multi-LoRA op on CPU (its MatMuls see the
 * stacks as dense matrices, so every token pays every bound slot), and onnxruntime-genai's adapters swap one
 * adapter's weights per generator, not per token.
 *
 * lora_prepare scans each row's mask for its first and last nonzero column (its slot's block: K = M*R columns, but
 * neither S nor R is an input, so the run itself says where and how wide), copies y_base to y for rows with none
 * (unless ONNX Runtime runs the op in place: y is then y_base, lora_delta_op.c),
 * and sorts the others by their run, so the rows of one slot form a group. A group is cut into tiles of up to TILE
 * rows. Then two parallel passes:
 *   lora_shrink  one task a tile: h = (x A[:, run]) * mask[run], [tile rows, K], into a scratch buffer;
 *   lora_expand  one task a (tile, chunk of output columns): y = y_base + h B[run, chunk].
 * A slot's block of A (and a chunk of its block of B) is read once per tile, not once per row; rows of other slots
 * never touch it. The sums run in another order than ONNX Runtime's MatMuls (the same values to float rounding). */
#include "lora_delta.h"

#include <stdlib.h>
#include <string.h>

enum { TILE = 8, CHUNK = 256 }; /* rows a tile; output columns a chunk at most (a tile's chunk of B: 48 KB at K 48) */

extern const LoraIsa lora_avx512, lora_avx2, lora_portable;
const LoraIsa *const lora_isas[LORA_ISA_COUNT] = {&lora_avx512, &lora_avx2, &lora_portable};
#define ISAS lora_isas

const char *lora_isa_name(int isa) { return isa >= 0 && isa < LORA_ISA_COUNT ? ISAS[isa]->name : NULL; }
int lora_isa_supported(int isa) { return isa >= 0 && isa < LORA_ISA_COUNT && ISAS[isa]->supported(); }

typedef struct {
  int64_t row, c0, c1; /* the row's mask run: columns c0 .. c1 - 1 */
} Run;

typedef struct {
  int64_t first, count, c0, k, h; /* runs[first ..] (sorted), their run's first column and width, offset in h */
} Tile;

struct LoraCall {
  LoraArgs a;
  const LoraIsa *isa;
  Run *runs;
  Tile *tiles;
  float *h;
  int64_t chunk, chunks; /* output columns per expand task, tasks per tile */
  int64_t multiply_adds;
};

int64_t lora_multiply_adds(const LoraCall *call) { return call->multiply_adds; }

static int by_run(const void *p, const void *q) {
  const Run *x = (const Run *)p, *y = (const Run *)q;
  if (x->c0 != y->c0) return x->c0 < y->c0 ? -1 : 1;
  if (x->c1 != y->c1) return x->c1 < y->c1 ? -1 : 1;
  return x->row < y->row ? -1 : x->row > y->row;
}

LoraCall *lora_prepare(const LoraArgs *args, size_t *shrinks, size_t *expands) {
  const LoraArgs *a = args;
  LoraCall *call = (LoraCall *)calloc(1, sizeof(LoraCall));
  if (!call) return NULL;
  call->a = *a;
  call->isa = ISAS[a->isa];
  call->runs = (Run *)malloc((size_t)(a->rows ? a->rows : 1) * sizeof(Run));
  call->tiles = (Tile *)malloc((size_t)(a->rows ? a->rows : 1) * sizeof(Tile));
  if (!call->runs || !call->tiles) return lora_free(call), NULL;
  int64_t active = 0;
  for (int64_t r = 0; r < a->rows; r++) {
    const float *m = a->mask + (r % a->mask_rows) * a->width;
    int64_t c0 = 0, c1 = a->width;
    while (c0 < a->width && m[c0] == 0.f) c0++;
    if (c0 == a->width) { /* no slot: y_base as it is (the branch's + 0 would turn a -0 into +0); in place, nothing */
      if (a->y != a->y_base) memcpy(a->y + r * a->out, a->y_base + r * a->out, (size_t)a->out * sizeof(float));
      continue;
    }
    while (m[c1 - 1] == 0.f) c1--;
    call->runs[active++] = (Run){r, c0, c1};
  }
  qsort(call->runs, (size_t)active, sizeof(Run), by_run);
  int64_t tiles = 0, floats = 0;
  for (int64_t i = 0; i < active; i++) {
    const Run *run = &call->runs[i];
    Tile *last = tiles ? &call->tiles[tiles - 1] : NULL;
    if (last && last->count < TILE && last->c0 == run->c0 && last->c0 + last->k == run->c1) {
      last->count++;
    } else {
      call->tiles[tiles++] = (Tile){i, 1, run->c0, run->c1 - run->c0, floats};
    }
    floats += run->c1 - run->c0;
  }
  call->multiply_adds = floats * (a->in + a->out);
  call->h = (float *)malloc((size_t)(floats ? floats : 1) * sizeof(float));
  if (!call->h) return lora_free(call), NULL;
  call->chunks = (a->out + CHUNK - 1) / CHUNK;
  call->chunk = ((a->out + call->chunks - 1) / call->chunks + 15) / 16 * 16; /* even chunks, whole vectors */
  call->chunks = call->chunk ? (a->out + call->chunk - 1) / call->chunk : 0;
  *shrinks = (size_t)tiles;
  *expands = (size_t)(tiles * call->chunks);
  return call;
}

void lora_shrink(void *state, size_t task) {
  const LoraCall *call = (const LoraCall *)state;
  const LoraArgs *a = &call->a;
  const Tile *tile = &call->tiles[task];
  const float *xs[TILE], *masks[TILE];
  for (int64_t t = 0; t < tile->count; t++) {
    const int64_t row = call->runs[tile->first + t].row;
    xs[t] = a->x + row * a->in;
    masks[t] = a->mask + (row % a->mask_rows) * a->width + tile->c0;
  }
  call->isa->shrink(xs, masks, (int)tile->count, a->a + tile->c0, a->width, a->in, tile->k, call->h + tile->h);
}

void lora_expand(void *state, size_t task) {
  const LoraCall *call = (const LoraCall *)state;
  const LoraArgs *a = &call->a;
  const Tile *tile = &call->tiles[task / (size_t)call->chunks];
  const int64_t o0 = (int64_t)(task % (size_t)call->chunks) * call->chunk;
  const int64_t o1 = o0 + call->chunk < a->out ? o0 + call->chunk : a->out;
  const float *bases[TILE];
  float *ys[TILE];
  for (int64_t t = 0; t < tile->count; t++) {
    const int64_t row = call->runs[tile->first + t].row;
    bases[t] = a->y_base + row * a->out;
    ys[t] = a->y + row * a->out;
  }
  call->isa->expand(call->h + tile->h, (int)tile->count, tile->k, a->b + tile->c0 * a->out, a->out, bases, ys, o0,
                    o1);
}

void lora_free(LoraCall *call) {
  if (!call) return;
  free(call->runs);
  free(call->tiles);
  free(call->h);
  free(call);
}
