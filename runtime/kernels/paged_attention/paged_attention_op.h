/* llmc.PagedAttention, the ONNX Runtime custom op around paged_attention.c (paged_attention_op.c):
 * three kernels of one op, for float32, float16 and int8 caches (paged_attention.h's PAGED_CACHE_* order);
 * cpu_kernels.c adds each to its domain. */
#ifndef LLMC_PAGED_ATTENTION_OP_H
#define LLMC_PAGED_ATTENTION_OP_H

#include "ort_abi.h"

enum { PAGED_ATTENTION_OPS = 3 };
extern const OrtCustomOp paged_attention_ops[PAGED_ATTENTION_OPS];

/* the instruction sets this CPU runs the op's loops on, best first, comma-separated ("portable" last) */
const char *llmc_paged_attention_isas(void);

#endif
