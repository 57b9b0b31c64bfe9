/* llmc.LoraDelta, the ONNX Runtime custom op around lora_delta.c (lora_delta_op.c); cpu_kernels.c adds it to its
 * domain. */
#ifndef LLMC_LORA_DELTA_OP_H
#define LLMC_LORA_DELTA_OP_H

#include "ort_abi.h"

extern const OrtCustomOp lora_delta_op;     /* version 18: y may take y_base's buffer (MayInplace) */
extern const OrtCustomOp lora_delta_op_v16; /* the same op for an ONNX Runtime without API 18 */

/* the instruction sets this CPU runs the op's loops on, best first, comma-separated ("portable" last) */
const char *llmc_lora_delta_isas(void);

#endif
