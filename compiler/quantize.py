"""Quantize stage: the exported graph made smaller and faster, and a measured quality report.

Weight-only modes (`int8-weight-only`, `int4-weight-only`) are ONNX Runtime's own
`MatMulNBitsQuantizer`: every MatMul with constant weights becomes a `com.microsoft.MatMulNBits`
(symmetric, block-wise round-to-nearest, `accuracy_level` 4 = int8 activations in the kernel, the
fast CPU path). Written here, because the quantizer lacks it: tied embeddings reach the LM head as
`Transpose(embedding)`, which the quantizer skips as "no constant weight"; `untie_lm_head` folds
that transpose into its own initializer first, so the LM head (a fifth of SmolLM2's weights) is
quantized too while the embedding Gather keeps the original table.

`int8` and `fp8` (static Q/DQ for TensorRT, with calibration) are not implemented yet; the
pipeline's preflight refuses them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from llmc.compiler.artifacts import ExportedModel, QuantizedModel, hash_outputs
from llmc.compiler.export import EXTERNAL_DATA_NAME, ONNX_NAME, PROTOBUF_LIMIT, save_model, tool_versions
from llmc.compiler.quality import compare
from llmc.compiler.spec import QuantizationSpec, QuantMode
from llmc.compiler.textdata import builtin_documents, token_windows
from llmc.compiler.verify import PROMPTS

WEIGHT_ONLY_BITS = {QuantMode.int8_weight_only: 8, QuantMode.int4_weight_only: 4}
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: the fast CPU kernels
EVAL_SEQ_LEN, EVAL_WINDOWS, AGREEMENT_STEPS = 256, 8, 32


def untie_lm_head(graph) -> int:
    """Fold `Transpose(initializer)` into a transposed initializer; returns how many were folded."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    folded = 0
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in initializers:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        weight = numpy_helper.to_array(initializers[node.input[0]])
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)), node.output[0]))
        graph.node.remove(node)
        folded += 1
    return folded


def weight_only(source: Path, bits: int, block_size: int):
    import onnx
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    model = onnx.load(str(source))
    untie_lm_head(model.graph)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=ACCURACY_LEVEL, quant_format=QuantFormat.QOperator,
                                     op_types_to_quantize=("MatMul",))
    quantizer.process()
    return quantizer.model.model


def quantize(exported: ExportedModel, export_dir: Path, out_dir: Path, spec: QuantizationSpec, tokenizer, *,
             inputs_hash: str, num_threads: int = 0, external_threshold: int = PROTOBUF_LIMIT,
             progress: Callable[[int, int], None] | None = None) -> QuantizedModel:
    bits = WEIGHT_ONLY_BITS[spec.mode]
    out_dir.mkdir(parents=True, exist_ok=True)
    proto = weight_only(export_dir / exported.onnx, bits, spec.block_size)
    external = save_model(proto, out_dir, external_threshold)
    files = [ONNX_NAME] + ([EXTERNAL_DATA_NAME] if external else [])
    windows = token_windows(tokenizer, builtin_documents("heldout"), EVAL_SEQ_LEN, EVAL_WINDOWS,
                            "quantization", "the built-in held-out text")
    report = compare(export_dir / exported.onnx, out_dir / ONNX_NAME, exported.kv_layout, windows=windows,
                     eval_text="built-in held-out corpus (not used for calibration)",
                     prompts=[tokenizer(p)["input_ids"] for p in PROMPTS], steps=AGREEMENT_STEPS,
                     vocab_size=exported.model.vocab_size, num_threads=num_threads, progress=progress,
                     sizes=(sum((export_dir / f).stat().st_size for f in exported.files),
                            sum((out_dir / f).stat().st_size for f in files)))
    art = QuantizedModel(
        inputs_hash=inputs_hash, files=hash_outputs(out_dir, files), onnx=ONNX_NAME, mode=spec.mode, bits=bits,
        method=(f"onnxruntime MatMulNBits: {bits}-bit symmetric weights, blocks of {spec.block_size}, round to "
                f"nearest, accuracy_level {ACCURACY_LEVEL} (int8 activations); LM head untied and quantized"),
        calibration="none (weight-only round to nearest needs no calibration data)",
        kv_layout=exported.kv_layout, report=report, versions=tool_versions())
    art.save(out_dir)
    return art
