/* llmc.AllReduce and llmc.AllGather, the ONNX Runtime custom ops around collective.c (collective_op.c):
 * four kernels, each op for float32 and for float16 (in COLL_* order: op * 2 + type); cpu_kernels.c adds
 * each to its domain. */
#ifndef LLMC_COLLECTIVE_OP_H
#define LLMC_COLLECTIVE_OP_H

#include "ort_abi.h"

enum { COLLECTIVE_OPS = 4 };
extern const OrtCustomOp collective_ops[COLLECTIVE_OPS];

#endif
