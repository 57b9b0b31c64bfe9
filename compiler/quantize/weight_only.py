"""Weight-only modes (`int8-weight-only`, `int4-weight-only`): ONNX Runtime's `MatMulNBits`.

Made: with `algorithm: rtn` nothing is chosen here (ORT rounds: symmetric, round to nearest); with
`awq` (the default) the weights are scaled first (awq.py), then each block's scale (and at 4 bits its
zero point: SYMMETRIC) is searched against the activation-weighted error (blockwise.py).
Converted: ONNX Runtime's own `MatMulNBitsQuantizer` turns every MatMul with constant weights into a
`com.microsoft.MatMulNBits` (block-wise, `accuracy_level` 4 = int8 activations in the kernel, the
fast CPU path), packing the searched codes when there are some. Blocks are 128 weights at 8 bits and
32 at 4 unless the spec says (spec.block). Sibling layers (the MLP's gate and up) are then merged into
one MatMulNBits (compiler/graph/passes.py). A mixture's expert layers become `QMoE` nodes, their codes
searched per expert on the calibration tokens routed to it, and its routers stay fp32 (experts.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from llmc.compiler.graph.passes import merge_sibling_matmul_nbits
from llmc.compiler.quantize.awq import awq
from llmc.compiler.quantize.blockwise import BlockCodes, pack, search
from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.compiler.quantize.experts import (ExpertStatistics, expert_block, expert_statistics, moe_nodes,
                                           quantize_experts, routers)
from llmc.compiler.quantize.handler import Job, Quantized, calibration_windows, gemms_as_matmuls, untie_lm_head
from llmc.compiler.quantize.weight_file import WeightFile
from llmc.compiler.spec import QuantizationSpec, WeightOnlyAlgorithm
from llmc.errors import QuantizationError

ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: the fast CPU kernels
# Zero points, by bits (SmolLM2, measured): MatMulNBits' 8-bit kernel decodes ~4% slower with them and
# 8-bit codes need none (perplexity +0.05% symmetric, +0.2% asymmetric); 4-bit codes need them
# (+21.7% symmetric, +11.1% asymmetric) and cost at most ~2% there.
SYMMETRIC = {8: True, 4: False}


@dataclass
class WeightCodes:
    """The untied (and AWQ-scaled) graph with the codes chosen for it (None: ORT rounds), in words."""

    model: object  # onnx.ModelProto
    codes: Mapping[str, BlockCodes] | None  # SearchedCodes: each searched as its node is packed
    windows: list[np.ndarray]
    kernel: str
    how: str
    experts: ExpertStatistics | None = None  # a mixture's, from the calibration tokens routed to each expert
    weights: WeightFile | None = None  # where `model`'s weights lie (WeightOnly.make_quantized always says)
    channel_scales: ChannelScales | None = None  # AWQ's, on the activations (channel_scales.py)


@dataclass(frozen=True)
class WeightOnly:
    bits: int

    def check(self, spec: QuantizationSpec) -> None:
        """Nothing beyond onnxruntime, which every build has."""

    def calibrates(self, spec: QuantizationSpec) -> bool:
        return spec.algorithm is not WeightOnlyAlgorithm.rtn

    def tools(self) -> dict[str, str | None]:
        return {"cpu_kernel": cpu_kernel()}

    def make_quantized(self, job: Job) -> WeightCodes:
        import onnx

        spec, bits = job.spec, self.bits
        # a mixture's experts' statistics and codes read the proto itself: its weights loaded whole
        whole = bool(moe_nodes(onnx.load(str(job.source), load_external_data=False).graph))
        weights = WeightFile.open(job.source, job.work, whole=whole)
        model = weights.model
        untie_lm_head(model.graph, weights)
        gemms_as_matmuls(model.graph, weights)
        if not self.calibrates(spec):
            return WeightCodes(model, None, [], f"{bits}-bit symmetric weights",
                               "round to nearest by onnxruntime's MatMulNBitsQuantizer", weights=weights)
        symmetric = SYMMETRIC[bits]
        windows = calibration_windows(spec, job.tokenizer)
        layout = job.exported.kv_layout
        scaled = awq(model, layout, windows, bits, spec.block, symmetric=symmetric, num_threads=job.num_threads,
                     progress=job.progress, graph_file=job.source, weights=weights, segmented=job.segmented)
        alphas = scaled.alphas
        codes = SearchedCodes(model, scaled.importance, bits, spec.block, symmetric=symmetric, progress=job.progress,
                              weights=weights)
        kernel = f"{bits}-bit " + ("symmetric weights" if symmetric else "asymmetric weights (uint8 zero points)")
        how = (f"AWQ scaling on {len(alphas)} layer inputs (alpha median {np.median(alphas):.1f}), then per-block "
               + ("scales" if symmetric else "scales and zero points")
               + " searched against activation-weighted error (llmc), packed into onnxruntime's MatMulNBitsQuantizer")
        experts = None
        if moe_nodes(model.graph):
            experts = expert_statistics(model, layout, windows, num_threads=job.num_threads, graph_file=job.source)
            how += (f"; experts' codes searched against the calibration tokens routed to each (no AWQ scaling: "
                    f"their input is the router's too), {experts.unreached} of {experts.experts} expert(s) "
                    f"reached by no token rounded to nearest")
        return WeightCodes(model, codes, windows, kernel, how, experts, weights, scaled.scales)

    def convert_for_runtime(self, made: WeightCodes, job: Job) -> Quantized:
        spec = job.spec
        kept = routers(made.model.graph)  # a mixture's routers stay in full precision
        weights = made.weights
        model = weight_only(made.model, self.bits, spec.block, made.codes, exclude=kept, weights=weights)
        weights.model, weights.graph = model, model.graph
        merged = merge_sibling_matmul_nbits(model.graph, weights)
        mixture = ""
        if moe_nodes(model.graph):
            block = expert_block(model.graph, spec.block)
            symmetric = made.codes is None or SYMMETRIC[self.bits]
            done = quantize_experts(model, self.bits, block, symmetric, made.experts)
            mixture = (f"; {done} mixture-of-experts layer(s) as onnxruntime QMoE ({self.bits}-bit, "
                       f"{f'blocks of {block}' if block else 'per-channel scales (no common block)'}, "
                       f"accuracy_level 4), {len(kept)} router(s) in fp32")
        kernel = (f"onnxruntime MatMulNBits: {made.kernel}, blocks of {spec.block}, accuracy_level "
                  f"{ACCURACY_LEVEL} (int8 activations), LM head untied and quantized"
                  + (f"; layers sharing an input (gate/up) merged into one node in {merged} place(s)" if merged else "")
                  + mixture + _runs_on(model))
        windows = made.windows
        note = (f"{spec.algorithm.value} over {len(windows)} sample(s) of {len(windows[0])} tokens from "
                f"{spec.calibration.data}" if windows else "none (round to nearest needs no calibration data)")
        return Quantized(model, f"{kernel}; {made.how}", note, weights=weights, channel_scales=made.channel_scales)


def weight_only(model, bits: int, block_size: int, codes: Mapping[str, BlockCodes] | None = None,
                exclude: list[str] | None = None, weights: WeightFile | None = None):
    """`model` (untied) with every constant-weight MatMul but those named in `exclude` replaced by ORT's
    MatMulNBits: rounded by ORT (symmetric) when `codes` is None, else with `codes` [weight name -> codes].
    `weights`: where the weights lie (weight_file.py); each is read into the proto only while its node is
    quantized, and the packed codes go back out to the file."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line per node
    kinds = ({codes.symmetric} if isinstance(codes, SearchedCodes) else {c.symmetric for c in codes.values()}
             if codes is not None else {True})
    if len(kinds) > 1:
        raise ValueError("codes mix symmetric and asymmetric weights; MatMulNBitsQuantizer takes one kind")
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=kinds.pop(),
                                     accuracy_level=ACCURACY_LEVEL, quant_format=QuantFormat.QOperator,
                                     op_types_to_quantize=("MatMul",), nodes_to_exclude=exclude or [])
    if codes is not None or (weights is not None and weights.external):
        quantizer.node_quantizer = _preset_quantizer(quantizer.algo_config, codes, weights)
    quantizer.process()
    return quantizer.model.model


def _preset_quantizer(config, codes: Mapping[str, BlockCodes] | None, weights: WeightFile | None = None):
    """ORT's node quantizer (which rewrites MatMul -> MatMulNBits) taking its codes from `codes` (None: its own
    rounding), each weight read from `weights` for its node alone and its packed codes moved back out."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    class PresetCodes(DefaultWeightOnlyQuantizer):
        weight = ""

        def quantize_matmul(self, node, graph_stack):
            self.weight = node.input[1]
            tensor = None
            if weights is not None and weights.external:
                tensor = next((t for t in graph_stack[-1].initializer if t.name == self.weight), None)
            if tensor is None or len(tensor.dims) != 2 or tensor.data_type != onnx.TensorProto.FLOAT:
                return super().quantize_matmul(node, graph_stack)
            return [_matmul_nbits(node, tensor, self.qbits_block_quant(weights.array(tensor)), config, weights)]

        def qbits_block_quant(self, fp32weight):
            if codes is None:
                return super().qbits_block_quant(fp32weight)
            q = codes.of(self.weight, fp32weight) if isinstance(codes, SearchedCodes) else codes[self.weight]
            if fp32weight.shape[0] != q.k:
                raise QuantizationError(f"{self.weight}: codes for K={q.k}, weight has K={fp32weight.shape[0]}")
            return pack(q)

    return PresetCodes(config)


def _matmul_nbits(node, tensor, quantized, config, weights: WeightFile):
    """The `MatMulNBits` node ONNX Runtime's quantizer makes of `node` (QOperator form, a 2-D fp32 weight), its
    packed codes, scales and zero points written to `weights`' file. Written here for a weight that lies in the
    file: ORT's `quantize_matmul` reads it from the proto, and a tensor's bytes put into the proto stay in the
    model's protobuf arena after they are cleared (an 8-bit 1B graph's weights, held to the end)."""
    from onnx import helper

    packed, scales, zero_points = quantized
    bits, (k, n) = config.bits, tuple(tensor.dims)
    names = [weights.add(f"{tensor.name}_Q{bits}", packed).name, weights.add(f"{tensor.name}_scales", scales).name]
    if not config.is_symmetric:
        names.append(weights.add(f"{tensor.name}_zero_points", zero_points).name)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": config.block_size}
    if config.accuracy_level:
        attrs["accuracy_level"] = config.accuracy_level
    return helper.make_node("MatMulNBits", [node.input[0], *names], [node.output[0]],
                            name=f"{node.name}_Q{bits}" if node.name else "", domain="com.microsoft", **attrs)


class SearchedCodes(Mapping):
    """blockwise.search's codes for every linear layer of `model` (weight name -> BlockCodes), weighted by its input's
    E[x^2] (`importance`, by input tensor: awq's), each searched when asked (as the node quantizer packs that node)
    and not kept: all held at once, they were a byte a weight (7 GB at 8B) until the last node was packed.
    `weights`: where the weights lie (default: in the proto)."""

    def __init__(self, model, importance: dict[str, np.ndarray], bits: int, block: int, *, symmetric: bool,
                 progress, weights: WeightFile | None = None):
        self.bits, self.block, self.symmetric, self.progress = bits, block, symmetric, progress
        self.weights = weights or WeightFile.of(model.graph)
        self.importance = importance
        self._initializers = {t.name: t for t in model.graph.initializer}
        self._inputs = {n.input[1]: n.input[0] for n in model.graph.node
                        if n.op_type == "MatMul" and n.input[1] in self._initializers and n.input[0] in importance}
        self._done = 0

    def __getitem__(self, weight: str) -> BlockCodes:
        return self.of(weight, self.weights.array(self._initializers[weight]))

    def of(self, weight: str, value: np.ndarray) -> BlockCodes:
        """The codes of `weight`, whose value (read by the caller for its node) is `value`."""
        codes = search(value, self.importance[self._inputs[weight]], self.bits, self.block, self.symmetric)
        self._done += 1
        if self.progress:
            self.progress(self._done, len(self._inputs), "block codes searched and packed (weights)")
        return codes

    def __iter__(self) -> Iterator[str]:
        return iter(self._inputs)

    def __len__(self) -> int:
        return len(self._inputs)


def cpu_kernel() -> str | None:
    """The llmc CPU kernel the quality report's measurements run 4-bit nodes on here (its file name
    carries its source's hash, then the instruction set), or None for ONNX Runtime's own."""
    from llmc.runtime.kernels import cpu_kernels

    kernels = cpu_kernels.load()
    return f"{kernels.library.name} {kernels.isa}" if kernels else None


def _runs_on(model) -> str:
    """Which kernel the report's measurements (and serving on a host like this one) run 4-bit nodes on."""
    from llmc.runtime.kernels import cpu_kernels, graph_edits

    taken = len(graph_edits.swappable(model))
    if not taken:
        return ""
    kernels = cpu_kernels.load()
    if kernels is None:
        return "; measured on onnxruntime's kernel (llmc's MatMulNBits4 needs AVX2 + FMA or AVX512-VNNI and a C compiler)"
    return (f"; {taken} node(s) measured on llmc's MatMulNBits4 kernel (runtime/kernels/matmul_nbits4/matmul_nbits4.c, {kernels.isa}), as "
            f"served on such CPUs")
