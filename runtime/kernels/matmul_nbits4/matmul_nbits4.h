/* llmc's 4-bit matmul (matmul_nbits4.c): y[m][n] = A[m][k] x B, B given in ONNX Runtime's MatMulNBits
 * layout — bits 4, blocks of 32 x share weights (share 1, 2 or 4: block_size 32, 64 or 128): B [n][k/32][16]
 * bytes (low nibble first), scales [n][k/(32 share)] floats, zero points [n][(k/(32 share) + 1) / 2] bytes
 * (low nibble first; NULL for 8) — and repacked once by q4_pack into the kernel's own, with A quantized to int8
 * per block of 32 on the fly. k must be a multiple of 64 and of the block size. Kernels
 * for two instruction sets: AVX512-VNNI and AVX2 (with FMA); a call runs on one that q4_isa_supported()
 * says this CPU has. */
#ifndef LLMC_MATMUL_NBITS4_H
#define LLMC_MATMUL_NBITS4_H

#include <stddef.h>
#include <stdint.h>

typedef struct Q4Matmul Q4Matmul; /* one call: A quantized, and where the packed weights and y are */

/* the instruction sets, best first */
enum { Q4_ISA_AVX512VNNI = 0, Q4_ISA_AVX2 = 1, Q4_ISA_COUNT = 2 };

/* the name of an instruction set ("avx512vnni", "avx2"), or NULL past the last */
const char *q4_isa_name(int isa);

/* whether this CPU has what that instruction set's kernel needs */
int q4_isa_supported(int isa);

/* whether every one of `count` scales is an fp16 value, on a CPU that converts them (F16C): q4_pack can then
 * store them in half the bytes, and the products are the same */
int q4_half_scales(const float *scales, int64_t count);

/* bytes q4_pack writes for a layer of k x n */
size_t q4_packed_bytes(int64_t k, int64_t n, int zero_points, int half_scales, int share);

/* B, its scales and zero points (NULL for none) in ONNX Runtime's layout, rewritten into `packed`
 * (q4_packed_bytes, 64-byte aligned at best): the kernel's layout, in which a decode tile reads one stream
 * (matmul_nbits4_isa.h, Q4Layout). Once per layer, when a session opens. */
void q4_pack(int64_t k, int64_t n, const uint8_t *b, const float *scales, const uint8_t *zero_points,
             int half_scales, int share, uint8_t *packed);

/* bytes of memory q4_prepare needs for m rows of k */
size_t q4_memory(int64_t m, int64_t k);

/* Quantizes A into `memory` (q4_memory bytes) and returns the call on a supported `isa`; *tasks is
 * how many independent pieces it splits into (for `threads` threads): run q4_run(call, 0 .. *tasks
 * - 1) in any order, in parallel, then free `memory`. `packed`: q4_pack's (`zero_points`: whether it was
 * given some; `half_scales`: whether it was told to store them as fp16; `share` as it was given); `bias` ([n],
 * or NULL) is added to every row of y. */
Q4Matmul *q4_prepare(void *memory, int isa, const float *a, int64_t m, int64_t k, int64_t n, int64_t threads,
                     const uint8_t *packed, int zero_points, int half_scales, int share, const float *bias,
                     float *y, size_t *tasks);

/* one piece of a prepared call: a void * so it fits a thread pool's callback */
void q4_run(void *call, size_t task);

/* whether a piece of the call failed (out of memory for its scratch): y is then incomplete */
int q4_failed(const Q4Matmul *call);

#endif
