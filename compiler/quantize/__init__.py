"""Quantize stage: the exported graph made smaller and faster, and a measured quality report.

Weight-only modes (`int8-weight-only`, `int4-weight-only`) go through ONNX Runtime's own
`MatMulNBitsQuantizer`: every MatMul with constant weights becomes a `com.microsoft.MatMulNBits`
(block-wise, `accuracy_level` 4 = int8 activations in the kernel, the fast CPU path). With
`algorithm: rtn` ORT rounds (symmetric, round to nearest); with `awq` (the default) llmc first
scales the weights (awq.py), then chooses each block's scale (and at 4 bits its zero point:
SYMMETRIC) against the activation-weighted error (blockwise.py) and hands ORT's quantizer those
codes to pack. Blocks are 128 weights at 8 bits and 32 at 4 unless the spec says (spec.block). Sibling
layers (the MLP's gate and up) are then merged into one MatMulNBits (graph_passes.py). Also
written here, because the quantizer lacks it: tied embeddings reach the LM head as
`Transpose(embedding)`, which the quantizer skips as "no constant weight"; `untie_lm_head` folds
that transpose into its own initializer first, so the LM head (a fifth of SmolLM2's weights) is quantized too while the
embedding Gather keeps the original table.

Static modes (`int8`, `fp8`: Q/DQ for TensorRT, W8A8) calibrate activation ranges on the spec's
calibration text (calibrate.py) and place Q/DQ with NVIDIA ModelOpt (qdq.py). They quantize the
reference lowering (plain ONNX: TensorRT reads it, and ONNX Runtime runs it to calibrate and to
measure quality); fp8 is measured with ONNX Runtime's graph optimizations off, as a reference path.

Every mode ends with the same quality report (quality.py) against the unquantized graph.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from llmc.compiler.artifacts import ExportedModel, QuantizedModel, hash_outputs
from llmc.compiler.quantize.awq import awq
from llmc.compiler.quantize.blockwise import BlockCodes, pack, search
from llmc.compiler.quantize.calibrate import Calibration, calibrate, calibration_key, mean_squares
from llmc.compiler.graph_passes import deduplicate_initializers, merge_sibling_matmul_nbits
from llmc.compiler.hashing import hash_json
from llmc.compiler.export import EXTERNAL_DATA_NAME, ONNX_NAME, PROTOBUF_LIMIT, save_model, tool_versions
from llmc.compiler.quantize.quality import compare
from llmc.compiler.quantize.smoothquant import smooth
from llmc.compiler.spec import QuantizationSpec, QuantMode, WeightOnlyAlgorithm
from llmc.compiler.quantize.textdata import builtin_documents, load_documents, token_windows
from llmc.compiler.verify import PROMPTS
from llmc.errors import QuantizationError
from llmc.runtime.layout import KVLayout

BITS = {QuantMode.int8_weight_only: 8, QuantMode.int4_weight_only: 4, QuantMode.int8: 8, QuantMode.fp8: 8}
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: the fast CPU kernels
# Zero points, by bits (SmolLM2, measured): MatMulNBits' 8-bit kernel decodes ~4% slower with them and
# 8-bit codes need none (perplexity +0.05% symmetric, +0.2% asymmetric); 4-bit codes need them
# (+21.7% symmetric, +11.1% asymmetric) and cost at most ~2% there.
SYMMETRIC = {8: True, 4: False}
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


def weight_only(model, bits: int, block_size: int, codes: dict[str, BlockCodes] | None = None):
    """`model` (untied) with every constant-weight MatMul replaced by ORT's MatMulNBits: rounded by
    ORT (symmetric) when `codes` is None, else with `codes` [weight name -> codes]."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    kinds = {c.symmetric for c in codes.values()} if codes is not None else {True}
    if len(kinds) > 1:
        raise ValueError("codes mix symmetric and asymmetric weights; MatMulNBitsQuantizer takes one kind")
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=kinds.pop(),
                                     accuracy_level=ACCURACY_LEVEL, quant_format=QuantFormat.QOperator,
                                     op_types_to_quantize=("MatMul",))
    if codes is not None:
        quantizer.node_quantizer = _preset_quantizer(quantizer.algo_config, codes)
    quantizer.process()
    return quantizer.model.model


def _preset_quantizer(config, codes: dict[str, BlockCodes]):
    """ORT's node quantizer (which rewrites MatMul -> MatMulNBits) taking its codes from `codes`."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    class PresetCodes(DefaultWeightOnlyQuantizer):
        weight = ""

        def quantize_matmul(self, node, graph_stack):
            self.weight = node.input[1]
            return super().quantize_matmul(node, graph_stack)

        def qbits_block_quant(self, fp32weight):
            q = codes[self.weight]
            if fp32weight.shape[0] != q.k:
                raise QuantizationError(f"{self.weight}: codes for K={q.k}, weight has K={fp32weight.shape[0]}")
            return pack(q)

    return PresetCodes(config)


def searched_codes(model, layout: KVLayout, windows: list[np.ndarray], bits: int, block: int, *, symmetric: bool,
                   num_threads: int, progress) -> dict[str, BlockCodes]:
    """blockwise.search's codes for every linear layer of `model`, weighted by its input's E[x^2] on `windows`."""
    from onnx import numpy_helper

    importance = mean_squares(model, layout, windows, num_threads=num_threads)
    initializers = {t.name: t for t in model.graph.initializer}
    layers = [(n.input[1], n.input[0]) for n in model.graph.node
              if n.op_type == "MatMul" and n.input[1] in initializers and n.input[0] in importance]
    codes = {}
    for done, (weight, activation) in enumerate(layers, 1):
        codes[weight] = search(numpy_helper.to_array(initializers[weight]), importance[activation], bits, block,
                               symmetric)
        if progress:
            progress(done, len(layers))
    return codes


def weight_only_model(source: Path, exported: ExportedModel, spec: QuantizationSpec, bits: int, tokenizer, *,
                      num_threads: int, progress) -> tuple[object, str, str]:
    """The MatMulNBits graph, how it was made, and what calibrated it."""
    import onnx

    model = onnx.load(str(source))
    untie_lm_head(model.graph)
    if spec.algorithm is WeightOnlyAlgorithm.rtn:
        kernel = f"{bits}-bit symmetric weights"
        how = "round to nearest by onnxruntime's MatMulNBitsQuantizer"
        windows = []
        model = weight_only(model, bits, spec.block)
    else:
        symmetric = SYMMETRIC[bits]
        kernel = f"{bits}-bit " + ("symmetric weights" if symmetric else "asymmetric weights (uint8 zero points)")
        windows = calibration_windows(spec, tokenizer)
        alphas = awq(model, exported.kv_layout, windows, bits, spec.block, symmetric=symmetric,
                     num_threads=num_threads, progress=progress)
        codes = searched_codes(model, exported.kv_layout, windows, bits, spec.block, symmetric=symmetric,
                               num_threads=num_threads, progress=progress)
        how = (f"AWQ scaling on {len(alphas)} layer inputs (alpha median {np.median(alphas):.1f}), then per-block "
               + ("scales" if symmetric else "scales and zero points")
               + " searched against activation-weighted error (llmc), packed into onnxruntime's MatMulNBitsQuantizer")
        model = weight_only(model, bits, spec.block, codes)
    merged = merge_sibling_matmul_nbits(model.graph)
    kernel = (f"onnxruntime MatMulNBits: {kernel}, blocks of {spec.block}, accuracy_level "
              f"{ACCURACY_LEVEL} (int8 activations), LM head untied and quantized"
              + (f"; layers sharing an input (gate/up) merged into one node in {merged} place(s)" if merged else "")
              + _runs_on(model))
    note = (f"{spec.algorithm.value} over {len(windows)} sample(s) of {len(windows[0])} tokens from "
            f"{spec.calibration.data}" if windows else "none (round to nearest needs no calibration data)")
    return model, f"{kernel}; {how}", note


def _runs_on(model) -> str:
    """Which kernel the report's measurements (and serving on a host like this one) run 4-bit nodes on."""
    from llmc.runtime import cpu_kernels

    taken = len(cpu_kernels.swappable(model))
    if not taken:
        return ""
    kernels = cpu_kernels.load()
    if kernels is None:
        return "; measured on onnxruntime's kernel (llmc's MatMulNBits4 needs AVX2 + FMA or AVX512-VNNI and a C compiler)"
    return (f"; {taken} node(s) measured on llmc's MatMulNBits4 kernel (runtime/matmul_nbits4.c, {kernels.isa}), as "
            f"served on such CPUs")


def calibration_windows(spec: QuantizationSpec, tokenizer) -> list[np.ndarray]:
    """The calibration samples: `num_samples` windows of `seq_len` tokens (fewer if the text runs out)."""
    cal = spec.calibration
    origin = "the built-in corpus" if cal.data == "builtin" else cal.data
    return token_windows(tokenizer, load_documents(cal.data, "quantization.calibration.data"), cal.seq_len,
                         cal.num_samples, "quantization.calibration", origin)


def static_qdq(source: Path, exported: ExportedModel, spec: QuantizationSpec, tokenizer, work: Path, *,
               previous: Path | None, num_threads: int, progress) -> tuple[object, Calibration]:
    """The Q/DQ graph and the calibration behind it (reused from `previous` when its key matches)."""
    import onnx

    from llmc.compiler.quantize.qdq import place_qdq, set_activation_scales

    cal = spec.calibration
    windows = calibration_windows(spec, tokenizer)
    model = onnx.load(str(source))
    untie_lm_head(model.graph)
    if spec.smoothed:
        smooth(model, exported.kv_layout, windows, spec.smoothquant_alpha, num_threads=num_threads, progress=progress)
    external = save_model(model, work)
    graph = hash_json({"export": exported.files, "smoothquant": spec.smoothed and spec.smoothquant_alpha})
    key = calibration_key(graph, windows, cal.method.value)
    calibration = Calibration.load_cached(previous, key) if previous is not None else None
    if calibration is None:
        calibration = calibrate(model, exported.kv_layout, windows, cal.method.value, key=key,
                                num_threads=num_threads, progress=progress)
    del model
    proto = deduplicate_initializers(place_qdq(work / ONNX_NAME, spec.mode, exported.kv_layout, windows[0], external))
    if set_activation_scales(proto.graph, calibration, spec.mode) == 0:
        raise QuantizationError(f"quantization.mode {spec.mode.value}: no activation was quantized "
                                f"(the graph has no linear layer ModelOpt could place Q/DQ on)")
    return proto, calibration


def quantize(exported: ExportedModel, export_dir: Path, out_dir: Path, spec: QuantizationSpec, tokenizer, *,
             inputs_hash: str, num_threads: int = 0, external_threshold: int = PROTOBUF_LIMIT,
             previous: Path | None = None, progress: Callable[[int, int], None] | None = None) -> QuantizedModel:
    """Quantize the export in `export_dir` into `out_dir`; `previous` is the last build's quantize
    folder, whose calibration is reused when the graph, the samples and the method are the same."""
    bits = BITS[spec.mode]
    out_dir.mkdir(parents=True, exist_ok=True)
    source = export_dir / exported.onnx
    calibration = None
    if spec.weight_only:
        proto, method, calibration_note = weight_only_model(source, exported, spec, bits, tokenizer,
                                                            num_threads=num_threads, progress=progress)
    else:
        with tempfile.TemporaryDirectory(prefix="llmc-quantize-", dir=out_dir.parent) as work:
            proto, calibration = static_qdq(source, exported, spec, tokenizer, Path(work), previous=previous,
                                            num_threads=num_threads, progress=progress)
        kind = "int8" if spec.mode is QuantMode.int8 else "float8e4m3fn"
        method = (f"ModelOpt Q/DQ ({kind}): weights per output channel, symmetric, stored quantized behind "
                  f"DequantizeLinear; activations per tensor, symmetric (zero point 0); on both inputs of every "
                  f"linear-layer MatMul, LM head included"
                  + (f"; SmoothQuant alpha {spec.smoothquant_alpha}" if spec.smoothed else ""))
        calibration_note = (f"{calibration.method} over {calibration.samples} sample(s) of {calibration.seq_len} "
                            f"tokens from {spec.calibration.data}")
    external = save_model(proto, out_dir, external_threshold)
    del proto
    if calibration is not None:
        calibration.save(out_dir)
    files = [ONNX_NAME] + ([EXTERNAL_DATA_NAME] if external else [])
    windows = token_windows(tokenizer, builtin_documents("heldout"), EVAL_SEQ_LEN, EVAL_WINDOWS,
                            "quantization", "the built-in held-out text")
    report = compare(source, out_dir / ONNX_NAME, exported.kv_layout, windows=windows,
                     eval_text="built-in held-out corpus (not used for calibration)",
                     prompts=[tokenizer(p)["input_ids"] for p in PROMPTS], steps=AGREEMENT_STEPS,
                     vocab_size=exported.model.vocab_size, num_threads=num_threads, progress=progress,
                     optimize_quantized=spec.mode is not QuantMode.fp8,
                     sizes=(sum((export_dir / f).stat().st_size for f in exported.files),
                            sum((out_dir / f).stat().st_size for f in files)))
    art = QuantizedModel(
        inputs_hash=inputs_hash, files=hash_outputs(out_dir, files), onnx=ONNX_NAME, mode=spec.mode, bits=bits,
        method=method, calibration=calibration_note, kv_layout=exported.kv_layout, report=report,
        versions=tool_versions())
    art.save(out_dir)
    return art
