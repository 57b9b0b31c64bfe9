/* llmc's 4-bit matmul (matmul_nbits4.c): y[m][n] = A[m][k] x B, B in ONNX Runtime's MatMulNBits
 * layout — bits 4, blocks of 32: B [n][k/32][16] bytes (low nibble first), scales [n][k/32] floats,
 * zero points [n][k/64] bytes (low nibble first; NULL for 8) — with A quantized to int8 per block
 * of 32 on the fly. k must be a multiple of 64. Runs only where q4_supported() says so. */
#ifndef LLMC_MATMUL_NBITS4_H
#define LLMC_MATMUL_NBITS4_H

#include <stddef.h>
#include <stdint.h>

typedef struct Q4Matmul Q4Matmul; /* one call: A quantized, and where B, the scales and y are */

/* whether this CPU has what the kernel needs (AVX512 F/BW/VL with VNNI, FMA) */
int q4_supported(void);

/* bytes of memory q4_prepare needs for m rows of k */
size_t q4_memory(int64_t m, int64_t k);

/* Quantizes A into `memory` (q4_memory bytes) and returns the call; *tasks is how many independent
 * pieces it splits into (for `threads` threads): run q4_run(call, 0 .. *tasks - 1) in any order,
 * in parallel, then free `memory`. */
Q4Matmul *q4_prepare(void *memory, const float *a, int64_t m, int64_t k, int64_t n, int64_t threads,
                     const uint8_t *b, const float *scales, const uint8_t *zero_points, float *y, size_t *tasks);

/* one piece of a prepared call: a void * so it fits a thread pool's callback */
void q4_run(void *call, size_t task);

/* whether a piece of the call failed (out of memory for its scratch): y is then incomplete */
int q4_failed(const Q4Matmul *call);

#endif
