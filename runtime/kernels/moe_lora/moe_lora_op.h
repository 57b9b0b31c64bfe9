/* llmc.MoeLora, the ONNX Runtime custom op around moe_lora.c (moe_lora_op.c); cpu_kernels.c adds it to its domain. */
#ifndef LLMC_MOE_LORA_OP_H
#define LLMC_MOE_LORA_OP_H

#include "ort_abi.h"

extern const OrtCustomOp moe_lora_op;     /* version 18: y may take y_base's buffer (MayInplace) */
extern const OrtCustomOp moe_lora_op_v16; /* the same op for an ONNX Runtime without API 18 */
extern const OrtCustomOp moe_lora_q_op;     /* llmc.MoeLoraQ: over QMoE's quantized experts */
extern const OrtCustomOp moe_lora_q_op_v16;

#endif
