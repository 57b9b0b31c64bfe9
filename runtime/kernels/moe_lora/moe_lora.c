/* llmc.MoeLora's kernel (moe_lora.h): a mixture layer recomputed for a step's adapter tokens, each with its slot's
 * LoRA deltas on its routed experts only.
 *
 * Written by hand because nothing does it: ONNX Runtime's MoE/QMoE ops take fixed expert weights and no LoRA, and the
 * portable branch in standard ops (compiler/lora/experts.py) runs every expert for every adapter token: E/k times
 * this op's work.
 *
 * moe_lora_prepare routes each adapter token (softmax, top k by selection, renormalized when asked: ties go to the
 * lower expert, as ONNX Runtime's and PyTorch's top-k keep them), makes one pair per (token, chosen expert), sorts the
 * pairs by (expert, slot columns), and cuts each expert's run into tiles of up to TILE pairs, whatever their slots.
 * moe_lora_tile (one task a tile, in parallel) runs the tile's tokens through that expert: fc1 (dot_rows: each block
 * of the expert's rows read once for the whole tile), each slot's fc1 delta on its own tokens (LoRA's shrink and
 * expand loops, a run of one slot at a time), the SwiGLU, fc2 and its deltas, into each pair's own output row.
 * (Tiles of one expert and one slot read an expert's weights once a slot: four adapters ran 0.85x one adapter.) moe_lora_finish sums each token's pairs, weighed by the
 * routing, in expert-rank order. An expert no adapter token picked is never read. Quantized experts (QMoE's codes:
 * llmc.MoeLoraQ): 4-bit codes go through moe_lora_q4.c's integer dots (int8 activations, AVX2); others, and the
 * portable instruction set, are dequantized DEQUANT_ROWS rows at a time within a tile, each block used for all its
 * tokens. */
#include "moe_lora.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lora_delta.h"

enum { TILE = 16 };

typedef struct {
  int64_t row, expert, c0, c1, pair; /* pair: the output row of (token, its j-th expert), row * k + j in `out` */
} Pair;

typedef struct {
  int64_t first, count;
} Tile;

struct MoeLoraCall {
  MoeLoraArgs a;
  const LoraIsa *isa;
  Pair *pairs;
  Tile *tiles;
  int64_t *active;  /* the adapter tokens' rows, in order */
  float *weights;   /* [active, k]: each token's routing weights, by its pairs' j */
  float *out;       /* [active * k, hidden]: each pair's expert output */
  float *scratch;   /* per pair: its fc1 output [2I], SwiGLU [I] and shrunk [width], for its tile to use */
  int64_t num_active, num_pairs, num_tiles, multiply_adds;
  volatile int failed; /* a task ran out of memory */
};

int64_t moe_lora_multiply_adds(const MoeLoraCall *call) { return call->multiply_adds; }

static int by_expert(const void *p, const void *q) {
  const Pair *x = (const Pair *)p, *y = (const Pair *)q;
  if (x->expert != y->expert) return x->expert < y->expert ? -1 : 1;
  if (x->c0 != y->c0) return x->c0 < y->c0 ? -1 : 1;
  if (x->c1 != y->c1) return x->c1 < y->c1 ? -1 : 1;
  return x->pair < y->pair ? -1 : x->pair > y->pair;
}

/* probs = softmax(logits); the k largest (first index on ties) into experts / weights, renormalized if asked */
static void route(const float *logits, int64_t e, int64_t k, int normalize, float *probs, int64_t *experts,
                  float *weights) {
  float top = logits[0], sum = 0.f;
  for (int64_t i = 1; i < e; i++) top = logits[i] > top ? logits[i] : top;
  for (int64_t i = 0; i < e; i++) sum += probs[i] = expf(logits[i] - top);
  for (int64_t i = 0; i < e; i++) probs[i] /= sum;
  float kept = 0.f;
  for (int64_t j = 0; j < k; j++) {
    int64_t best = -1;
    for (int64_t i = 0; i < e; i++)
      if (probs[i] >= 0.f && (best < 0 || probs[i] > probs[best])) best = i;
    for (int64_t i = 0; best < 0 && i < e; i++) /* NaN logits: any expert not taken, never out of bounds */
      if (probs[i] != -1.f) best = i;
    experts[j] = best, weights[j] = probs[best], kept += probs[best];
    probs[best] = -1.f; /* taken */
  }
  if (normalize)
    for (int64_t j = 0; j < k; j++) weights[j] /= kept;
}

MoeLoraCall *moe_lora_prepare(const MoeLoraArgs *args, size_t *tiles) {
  const MoeLoraArgs *a = args;
  MoeLoraCall *call = (MoeLoraCall *)calloc(1, sizeof(MoeLoraCall));
  if (!call) return NULL;
  call->a = *a;
  call->isa = lora_isas[a->isa];
  const size_t rows = (size_t)(a->rows ? a->rows : 1), k = (size_t)a->k;
  call->active = (int64_t *)malloc(rows * sizeof(int64_t));
  call->pairs = (Pair *)malloc(rows * k * sizeof(Pair));
  call->tiles = (Tile *)malloc(rows * k * sizeof(Tile));
  call->weights = (float *)malloc(rows * k * sizeof(float));
  float *probs = (float *)malloc((size_t)a->experts * sizeof(float));
  int64_t *experts = (int64_t *)malloc(k * sizeof(int64_t));
  if (!call->active || !call->pairs || !call->tiles || !call->weights || !probs || !experts) {
    free(probs), free(experts);
    return moe_lora_free(call), NULL;
  }
  for (int64_t r = 0; r < a->rows; r++) {
    const float *m = a->mask + r * a->width;
    int64_t c0 = 0, c1 = a->width;
    while (c0 < a->width && m[c0] == 0.f) c0++;
    if (c0 == a->width) { /* no slot: the MoE node's row as it is; in place, nothing */
      if (a->y != a->y_base) memcpy(a->y + r * a->hidden, a->y_base + r * a->hidden, (size_t)a->hidden * sizeof(float));
      continue;
    }
    while (m[c1 - 1] == 0.f) c1--;
    const int64_t n = call->num_active++;
    call->active[n] = r;
    route(a->logits + r * a->experts, a->experts, a->k, a->normalize, probs, experts, call->weights + n * a->k);
    for (int64_t j = 0; j < a->k; j++)
      call->pairs[call->num_pairs++] = (Pair){r, experts[j], c0, c1, n * a->k + j};
  }
  free(probs), free(experts);
  qsort(call->pairs, (size_t)call->num_pairs, sizeof(Pair), by_expert);
  for (int64_t i = 0; i < call->num_pairs; i++) {
    const Pair *p = &call->pairs[i];
    Tile *last = call->num_tiles ? &call->tiles[call->num_tiles - 1] : NULL;
    const Pair *head = last ? &call->pairs[last->first] : NULL;
    if (last && last->count < TILE && head->expert == p->expert)
      last->count++;
    else
      call->tiles[call->num_tiles++] = (Tile){i, 1};
    call->multiply_adds += 3 * a->inter * a->hidden + (p->c1 - p->c0) * (3 * a->hidden + 3 * a->inter);
  }
  const size_t pairs = (size_t)(call->num_pairs ? call->num_pairs : 1);
  call->out = (float *)malloc(pairs * (size_t)a->hidden * sizeof(float));
  call->scratch = (float *)malloc(pairs * (size_t)(3 * a->inter + a->width) * sizeof(float));
  if (!call->out || !call->scratch) return moe_lora_free(call), NULL;
  *tiles = (size_t)call->num_tiles;
  return call;
}

/* rows o0 .. o1 of expert e's quantized weight [rows, cols], dequantized into out [o1 - o0, cols] */
static void dequantize(const MoeQuantized *w, int64_t e, int64_t rows, int64_t cols, int64_t o0, int64_t o1,
                       float *out) {
  const int64_t block = w->block ? w->block : cols, blocks = cols / block, row_bytes = cols * w->bits / 8;
  const int64_t zp_row = w->block ? (blocks * w->bits + 7) / 8 : 0, zp_expert = (rows * w->bits + 7) / 8;
  const int center = 1 << (w->bits - 1);
  for (int64_t o = o0; o < o1; o++) {
    const int64_t r = e * rows + o;
    const uint8_t *codes = w->codes + r * row_bytes;
    float *dst = out + (o - o0) * cols;
    for (int64_t b = 0; b < blocks; b++) {
      const float scale = w->scales[w->block ? r * blocks + b : r];
      int zero = center;
      if (w->zero_points) {
        const uint8_t *zp = w->block ? w->zero_points + r * zp_row : w->zero_points + e * zp_expert;
        const int64_t at = w->block ? b : o; /* the block's (blockwise) or the row's (per channel) zero point */
        zero = w->bits == 8 ? zp[at] : (zp[at / 2] >> (4 * (at & 1))) & 15;
      }
      const float offset = -(float)zero * scale; /* w = code * scale - zero * scale: no branch in the loops */
      float *out_block = dst + b * block;
      if (w->bits == 8) {
        const uint8_t *in = codes + b * block;
        for (int64_t c = 0; c < block; c++) out_block[c] = (float)in[c] * scale + offset;
      } else { /* two codes a byte, the first in the low nibble (block is even: a power of two, or a whole row) */
        const uint8_t *in = codes + b * block / 2;
        for (int64_t c = 0; c < block / 2; c++) {
          out_block[2 * c] = (float)(in[c] & 15) * scale + offset;
          out_block[2 * c + 1] = (float)(in[c] >> 4) * scale + offset;
        }
      }
    }
  }
}

enum { DEQUANT_ROWS = 32 }; /* a quantized expert's rows dequantized a block at a time, reused for the whole tile */

/* ys[t][o] = bias[o] + w[o] . xs[t] for every row o of expert e's weight (float or quantized) [rows, cols] */
static int expert_rows(const LoraIsa *isa, const float *w, const MoeQuantized *q, int64_t e, int64_t rows,
                       int64_t cols, const float *bias, const float *const *xs, int n, float *const *ys) {
  if (w) {
    isa->dot_rows(w + e * rows * cols, cols, 0, rows, xs, n, cols, bias, ys);
    return 0;
  }
  if (isa != lora_isas[LORA_ISA_PORTABLE] && moe_lora_q4_usable(q, cols))
    return moe_lora_q4_rows(q, e, rows, cols, bias, xs, n, ys);
  float *block = (float *)malloc((size_t)DEQUANT_ROWS * (size_t)cols * sizeof(float));
  if (!block) return -1;
  float *shifted[TILE];
  for (int64_t o0 = 0; o0 < rows; o0 += DEQUANT_ROWS) {
    const int64_t o1 = o0 + DEQUANT_ROWS < rows ? o0 + DEQUANT_ROWS : rows;
    dequantize(q, e, rows, cols, o0, o1, block);
    for (int t = 0; t < n; t++) shifted[t] = ys[t] + o0;
    isa->dot_rows(block, cols, 0, o1 - o0, xs, n, cols, bias ? bias + o0 : NULL, shifted);
  }
  free(block);
  return 0;
}

/* the LoRA delta of each run of one slot within a tile: ys[t] += ((xs[t] A[:, c]) * mask) B[c, :] for its tokens */
static void slot_deltas(const LoraIsa *isa, const Pair *first, int64_t n, const float *const *xs,
                        const float *const *masks, const float *a, const float *b, int64_t in, int64_t out,
                        int64_t w, float *u, float *const *ys) {
  for (int64_t t0 = 0, t1; t0 < n; t0 = t1) {
    const int64_t c0 = first[t0].c0, kk = first[t0].c1 - c0;
    for (t1 = t0 + 1; t1 < n && first[t1].c0 == c0 && first[t1].c1 == first[t0].c1;) t1++;
    isa->shrink(xs + t0, masks + t0, (int)(t1 - t0), a + c0, w, in, kk, u);
    isa->expand(u, (int)(t1 - t0), kk, b + c0 * out, out, (const float *const *)ys + t0, ys + t0, 0, out);
  }
}

void moe_lora_tile(void *state, size_t task) {
  const MoeLoraCall *call = (const MoeLoraCall *)state;
  const MoeLoraArgs *a = &call->a;
  const Tile *tile = &call->tiles[task];
  const Pair *first = &call->pairs[tile->first];
  const int64_t e = first->expert, n = tile->count;
  const int64_t h = a->hidden, i2 = 2 * a->inter, in = a->inter, w = a->width;
  float *g = call->scratch + tile->first * (i2 + in + w), *act = g + n * i2, *u = act + n * in;
  const float *xs[TILE], *masks[TILE], *acts[TILE];
  float *gs[TILE], *as[TILE], *os[TILE];
  for (int64_t t = 0; t < n; t++) {
    const Pair *p = &first[t];
    xs[t] = a->x + p->row * h, masks[t] = a->mask + p->row * w + p->c0;
    gs[t] = g + t * i2, as[t] = act + t * in, acts[t] = as[t], os[t] = call->out + p->pair * h;
  }
  const LoraIsa *isa = call->isa;
  /* the expert's weights once for the whole tile, whatever slots its tokens are in; each slot's delta on its own */
  if (expert_rows(isa, a->fc1, &a->fc1_q, e, i2, h, a->fc1_bias ? a->fc1_bias + e * i2 : NULL, xs, (int)n, gs)) {
    ((MoeLoraCall *)call)->failed = 1;
    return;
  }
  slot_deltas(isa, first, n, xs, masks, a->a1 + e * h * w, a->b1 + e * w * i2, h, i2, w, u, gs);
  for (int64_t t = 0; t < n; t++)
    for (int64_t j = 0; j < in; j++) {
      float gate = gs[t][2 * j], up = gs[t][2 * j + 1];
      if (a->limit > 0.f) {
        gate = gate < a->limit ? gate : a->limit;
        up = up < -a->limit ? -a->limit : up > a->limit ? a->limit : up;
      }
      as[t][j] = gate / (1.f + expf(-a->alpha * gate)) * (up + a->beta);
    }
  if (expert_rows(isa, a->fc2, &a->fc2_q, e, h, in, a->fc2_bias ? a->fc2_bias + e * h : NULL, acts, (int)n, os)) {
    ((MoeLoraCall *)call)->failed = 1;
    return;
  }
  slot_deltas(isa, first, n, acts, masks, a->a2 + e * in * w, a->b2 + e * w * h, in, h, w, u, os);
}

int moe_lora_finish(MoeLoraCall *call) {
  const MoeLoraArgs *a = &call->a;
  if (call->failed) return -1;
  for (int64_t n = 0; n < call->num_active; n++) {
    float *y = a->y + call->active[n] * a->hidden;
    const float *weights = call->weights + n * a->k;
    for (int64_t o = 0; o < a->hidden; o++) y[o] = 0.f;
    for (int64_t j = 0; j < a->k; j++) {
      const float *out = call->out + (n * a->k + j) * a->hidden;
      for (int64_t o = 0; o < a->hidden; o++) y[o] += weights[j] * out[o];
    }
  }
  return 0;
}

void moe_lora_free(MoeLoraCall *call) {
  if (!call) return;
  free(call->pairs), free(call->tiles), free(call->active), free(call->weights), free(call->out), free(call->scratch);
  free(call);
}
