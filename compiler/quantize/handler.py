"""The shape every quantization mode has (gpt-fast's QuantHandler): make the quantized weights, then
convert them into the graph the runtime runs. One handler object serves a family of modes; the
package's `HANDLERS` maps each `QuantMode` to its handler.

Also here: the steps the handlers share (the LM head untied, Gemm layers as MatMul for the weight-only
modes, the calibration samples).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.quantize.calibrate import Calibration
from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.compiler.quantize.weight_file import WeightFile
from llmc.compiler.textdata import load_documents, token_windows
from llmc.compiler.spec import QuantizationSpec


@dataclass(frozen=True)
class Job:
    """What a handler quantizes and with what: the exported graph, the spec's section, the tokenizer
    (for the calibration text), a scratch folder, and the last build's quantize folder (or None)."""

    source: Path  # the exported model.onnx
    exported: ExportedModel
    spec: QuantizationSpec
    tokenizer: Any
    work: Path
    previous: Path | None
    num_threads: int
    progress: Callable[[int, int], None] | None
    segmented: bool = False  # calibration runs the export a segment of weights at a time (graph/segments.py)


@dataclass
class Quantized:
    """A handler's result: the graph the runtime runs, and how it was made in words."""

    model: Any  # onnx.ModelProto
    method: str  # QuantizedModel.method
    calibration_note: str  # QuantizedModel.calibration
    calibration: Calibration | None = None  # written next to the graph, reused by the next build
    optimize: bool = True  # whether the quality report runs it with ONNX Runtime's graph optimizations
    weights: WeightFile | None = None  # where `model`'s weights lie, when not all in the proto
    channel_scales: ChannelScales | None = None  # what a per-channel scaling did to the activations (LoRA reads it)


class QuantHandler(Protocol):
    bits: int

    def check(self, spec: QuantizationSpec) -> None:
        """Raise UnsupportedError when a tool the mode runs on is missing."""

    def calibrates(self, spec: QuantizationSpec) -> bool:
        """Whether the mode reads calibration samples (so they must exist before the build starts)."""

    def tools(self) -> dict[str, str | None]:
        """Versions of what the mode runs on, beside onnxruntime (part of the stage's cache key)."""

    def make_quantized(self, job: Job) -> Any:
        """The quantized weights (or ranges), in the handler's own form."""

    def convert_for_runtime(self, made: Any, job: Job) -> Quantized:
        """`made` turned into the graph the runtime runs."""


def untie_lm_head(graph, weights: WeightFile | None = None) -> int:
    """Fold `Transpose(initializer)` into a transposed initializer; returns how many were folded.

    Tied embeddings reach the LM head as `Transpose(embedding)`, which the quantizers skip as "no
    constant weight"; folded, the LM head (a fifth of SmolLM2's weights) is quantized too while the
    embedding Gather keeps the original table. `weights`: where the graph's weights lie (weight_file.py;
    default: in the proto)."""
    import torch

    weights = weights or WeightFile.of(graph)
    initializers = {t.name: t for t in graph.initializer}
    folded = 0
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in initializers:
            continue
        with warnings.catch_warnings():  # the array is the tensor's read-only bytes; torch only reads it here
            warnings.simplefilter("ignore", UserWarning)
            weight = torch.from_numpy(weights.array(initializers[node.input[0]]))
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None) or range(weight.ndim)[::-1]
        # torch's blocked copy: numpy's transposing copy of a 0.5B model's LM head took 1.5-3x as long here
        weights.add(node.output[0], weight.permute(*perm).contiguous().numpy())
        graph.node.remove(node)
        folded += 1
    return folded


def gemms_as_matmuls(graph, weights: WeightFile | None = None) -> int:
    """Rewrite every `Gemm(A, W, C)` with a constant W (alpha 1, A not transposed) as `MatMul(A, W)`
    (+ `Add(C)`), W transposed first under `transB`; returns how many were rewritten.

    GPT-2's Conv1D exports as Gemm, which the weight-only quantizer, the calibration and AWQ's sites
    all skip (they take `MatMul`): without this only its LM head would be quantized."""
    from onnx import helper

    weights = weights or WeightFile.of(graph)
    initializers = {t.name: t for t in graph.initializer}
    done, replaced = 0, set()
    for node in list(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or node.input[1] not in initializers \
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("transA", 0) or attrs.get("beta", 1.0) != 1.0:
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            transposed = np.ascontiguousarray(weights.array(initializers[weight]).T)
            replaced.add(weight)
            weight = f"{weight}.transposed"
            weights.add(weight, transposed)
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        out = node.output[0]
        at = list(graph.node).index(node)
        matmul = helper.make_node("MatMul", [node.input[0], weight], [f"{out}.matmul" if bias else out],
                                  name=f"{node.name or out}_matmul")
        graph.node.remove(node)
        graph.node.insert(at, matmul)
        if bias:
            graph.node.insert(at + 1, helper.make_node("Add", [matmul.output[0], bias], [out], name=f"{matmul.name}_bias"))
        done += 1
    used = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name in replaced - used]:
        graph.initializer.remove(tensor)
    return done


def calibration_windows(spec: QuantizationSpec, tokenizer) -> list[np.ndarray]:
    """The calibration samples: `num_samples` windows of `seq_len` tokens (fewer if the text runs out)."""
    cal = spec.calibration
    origin = "the built-in corpus" if cal.data == "builtin" else cal.data
    return token_windows(tokenizer, load_documents(cal.data, "quantization.calibration.data"), cal.seq_len,
                         cal.num_samples, "quantization.calibration", origin)
