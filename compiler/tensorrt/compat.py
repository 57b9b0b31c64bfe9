"""Does a Q/DQ graph follow the rules TensorRT's explicit quantization (strongly typed networks) sets?

Checked on the ONNX alone, so it runs anywhere; the TensorRT build (issue 6) is the final word.
`qdq_problems(model)` returns one line per violation (empty: compatible):

- only QuantizeLinear / DequantizeLinear carry quantization: ONNX Runtime's operator formats
  (QLinearMatMul, MatMulInteger, MatMulNBits, DynamicQuantizeLinear) do not parse in TensorRT;
- quantized types are int8 or float8e4m3fn, symmetric: a zero point, where given, is all zeros;
- scales are positive, finite float constants (fp32, or the network's fp16/bf16): one value (per
  tensor) for activations, one per output channel (axis 1 of a MatMul weight [K, N]) for weights;
  no block-wise int8/fp8;
- placement: a QuantizeLinear feeds only DequantizeLinear; a DequantizeLinear feeds only MatMuls;
  a weight's DequantizeLinear reads a constant stored quantized; a MatMul quantized on one input is
  quantized on both (otherwise TensorRT runs it in high precision);
- opset >= 19 when float8 is used (the first with float8 Q/DQ), >= 13 otherwise (per-axis).
"""

from __future__ import annotations

import numpy as np

ORT_QUANT_OPS = {"QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "MatMulNBits", "DynamicQuantizeLinear",
                 "QLinearConv", "QGemm", "QAttention", "DynamicQuantizeMatMul"}
QUANT_TYPES = {"INT8", "FLOAT8E4M3FN"}
SCALE_TYPES = {1, 10, 16}  # FLOAT, FLOAT16, BFLOAT16: a DequantizeLinear's output takes its scale's type


def qdq_problems(model) -> list[str]:
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    consts.update({n.output[0]: next(a.t for a in n.attribute if a.name == "value")
                   for n in graph.node if n.op_type == "Constant" and any(a.name == "value" for a in n.attribute)})
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    problems: list[str] = []
    uses_fp8 = False

    def type_name(t: int) -> str:
        return TensorProto.DataType.Name(t)

    for n in graph.node:
        where = f"{n.op_type} {n.name or n.output[0]}"
        if n.op_type in ORT_QUANT_OPS:
            problems.append(f"{where}: ONNX Runtime quantized operator; TensorRT takes QuantizeLinear/DequantizeLinear")
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("block_size", 0):
            problems.append(f"{where}: block-wise quantization (block_size {attrs['block_size']})")
        scale = consts.get(n.input[1])
        if scale is None:
            problems.append(f"{where}: scale {n.input[1]} is not a constant")
            continue
        values = numpy_helper.to_array(scale)
        if scale.data_type not in SCALE_TYPES:
            problems.append(f"{where}: scale is {type_name(scale.data_type)}, not FLOAT, FLOAT16 or BFLOAT16")
        if not (np.isfinite(values).all() and (values > 0).all()):
            problems.append(f"{where}: scale has values that are not positive and finite")
        zero = consts.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        qtype = zero.data_type if zero is not None else attrs.get("output_dtype")
        if n.op_type == "DequantizeLinear" and n.input[0] in consts:
            qtype = consts[n.input[0]].data_type
        if qtype is None:
            problems.append(f"{where}: no zero point or output_dtype says the quantized type (uint8 by default)")
        elif type_name(qtype) not in QUANT_TYPES:
            problems.append(f"{where}: quantized type {type_name(qtype)}; TensorRT takes INT8 or FLOAT8E4M3FN")
        uses_fp8 |= qtype == TensorProto.FLOAT8E4M3FN
        if zero is not None and np.any(numpy_helper.to_array(zero).astype(np.float32) != 0):
            problems.append(f"{where}: zero point is not 0 (TensorRT quantization is symmetric)")
        readers = consumers.get(n.output[0], [])
        if n.op_type == "QuantizeLinear":
            if n.input[0] in consts:
                problems.append(f"{where}: quantizes a constant at run time; store the weight quantized behind a "
                                "DequantizeLinear")
            if values.size != 1:
                problems.append(f"{where}: activation scale has {values.size} values; TensorRT takes one per tensor")
            if any(r.op_type != "DequantizeLinear" for r in readers):
                problems.append(f"{where}: feeds {sorted({r.op_type for r in readers})}, not only DequantizeLinear")
            continue
        if any(r.op_type != "MatMul" for r in readers):
            problems.append(f"{where}: feeds {sorted({r.op_type for r in readers})}; Q/DQ belongs on MatMul inputs")
        source = producers.get(n.input[0])
        if n.input[0] in consts:
            weight = consts[n.input[0]]
            if values.size != 1 and (attrs.get("axis", 1) not in (1, -1) or values.size != weight.dims[-1]):
                problems.append(f"{where}: weight scale is not per output channel (axis 1 of [K, N])")
        elif source is None or source.op_type != "QuantizeLinear":
            problems.append(f"{where}: reads {n.input[0]}, neither a constant nor a QuantizeLinear output")
    for n in graph.node:
        if n.op_type != "MatMul":
            continue
        quantized = [(producers.get(i) is not None and producers[i].op_type == "DequantizeLinear") for i in n.input]
        if any(quantized) and not all(quantized):
            problems.append(f"MatMul {n.name}: only one input is quantized; TensorRT would run it in high precision")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    needed = 19 if uses_fp8 else 13
    if opset < needed:
        problems.append(f"opset {opset}: Q/DQ{' with float8' if uses_fp8 else ' per axis'} needs opset >= {needed}")
    return problems
