"""Weight-only quantization of a mixture's experts: `com.microsoft.MoE` -> `com.microsoft.QMoE`.

Each expert's fc1 [2I, H] and fc2 [H, I] become block-wise codes in `MatMulNBits`' format (blockwise.py),
which is QMoE's too (weights [E, N, K * bits / 8], scales [E, N, K / block], zero points
[E, N, ceil(K / block * bits / 8)]). Where no power-of-two block of 16 or more divides every expert's input
width (QMoE's smallest, and one `block_size` serves fc1 and fc2), the experts are quantized per channel
instead: each output row of an expert is one block, QMoE's form without `block_size` (scales [E, N], zero
points [E, ceil(N * bits / 8)], packed along N). The router stays in full precision: its MatMul is kept out of the
linear layers' quantizer (`routers`).

The codes of an expert are searched against the activations of the calibration tokens routed to it
(`expert_statistics`: E[x^2] of its input for fc1 and of its SwiGLU output for fc2, per channel), the
statistics AWQ's importance gives a dense layer. AWQ's channel scaling itself is not applied to experts:
their input is also the router's, and a scale folded into the norm would move the routing. An expert that
no calibration token reached is rounded to nearest, and the report says how many were.

Written here because ONNX Runtime's quantization tools have no QMoE quantizer (its tests pack weights by
hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.compiler.quantize.blockwise import BlockCodes, minmax, pack, search
from llmc.errors import QuantizationError
from llmc.plugins.op.moe import MICROSOFT_DOMAIN, OP_TYPE, QUANTIZED_OP_TYPE, route, swiglu

QMOE_ACCURACY_LEVEL = 4  # int8 activations in QMoE's CPU kernel: ~6x its fp32-activation path at batch 1
PER_CHANNEL = 0  # expert_block's answer where no block fits: one scale (and zero point) per expert row
QMOE_SMALLEST_BLOCK = 16


@dataclass
class ExpertStatistics:
    """Per MoE node (by its fc1 initializer): per expert, E[x^2] of fc1's and fc2's inputs over the
    calibration tokens routed to it (None where no token was), and how many tokens that was."""

    fc1: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    fc2: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def unreached(self) -> int:
        return sum(n == 0 for counts in self.tokens.values() for n in counts)

    @property
    def experts(self) -> int:
        return sum(len(counts) for counts in self.tokens.values())


def moe_nodes(graph) -> list:
    return [n for n in graph.node if n.op_type == OP_TYPE and n.domain == MICROSOFT_DOMAIN]


def routers(graph) -> list[str]:
    """The names of the MatMul nodes computing a MoE node's router logits (through a bias Add or a Reshape):
    kept in full precision."""
    producers = {o: n for n in graph.node for o in n.output}
    names = []
    for node in moe_nodes(graph):
        tensor = node.input[1]
        while tensor in producers and producers[tensor].op_type in ("Add", "Reshape", "Cast"):
            tensor = producers[tensor].input[0]
        producer = producers.get(tensor)
        if producer is not None and producer.op_type in ("MatMul", "Gemm"):
            names.append(producer.name)
    return names


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def expert_statistics(model, layout, windows: list[np.ndarray], *, num_threads: int = 0,
                      graph_file: Path | None = None) -> ExpertStatistics:
    """One calibration pass recording each MoE node's input and router logits; the routing is replayed
    here (the op's own: plugins/op/moe.py), so each expert's statistics come from the tokens routed to it."""
    import torch
    from onnx import numpy_helper

    from llmc.compiler.quantize.calibrate import run_tensors

    nodes = moe_nodes(model.graph)
    initializers = {t.name: t for t in model.graph.initializer}
    tensors = list(dict.fromkeys(t for n in nodes for t in n.input[:2]))
    sums1: dict[str, np.ndarray] = {}
    sums2: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    weights = {n.input[2]: numpy_helper.to_array(initializers[n.input[2]]) for n in nodes}
    biases = {n.input[2]: numpy_helper.to_array(initializers[n.input[3]]) if len(n.input) > 3 and n.input[3] else None
              for n in nodes}
    for values in run_tensors(model, layout, windows, tensors, num_threads, None, graph_file=graph_file):
        for node in nodes:
            a, fc1 = _attrs(node), node.input[2]
            x = values[node.input[0]].astype(np.float32)
            _, picked = route(torch.from_numpy(values[node.input[1]]), int(a["k"]),
                              bool(a.get("normalize_routing_weights", 0)))
            experts = picked.numpy()
            w = weights[fc1]
            sums1.setdefault(fc1, np.zeros((w.shape[0], w.shape[2])))
            sums2.setdefault(fc1, np.zeros((w.shape[0], w.shape[1] // 2)))
            counts.setdefault(fc1, np.zeros(w.shape[0], dtype=np.int64))
            for e in np.unique(experts):
                rows = x[np.any(experts == e, axis=-1)]
                gate_up = rows @ w[e].T + (0 if biases[fc1] is None else biases[fc1][e])
                act = swiglu(torch.from_numpy(gate_up), a.get("activation_alpha", 1.0),
                             a.get("activation_beta", 0.0), a.get("swiglu_limit", 0.0)).numpy()
                sums1[fc1][e] += np.square(rows.astype(np.float64)).sum(0)
                sums2[fc1][e] += np.square(act.astype(np.float64)).sum(0)
                counts[fc1][e] += len(rows)
    stats = ExpertStatistics()
    for fc1, n in counts.items():
        stats.tokens[fc1] = n.tolist()
        stats.fc1[fc1] = [s / c if c else None for s, c in zip(sums1[fc1], n)]
        stats.fc2[fc1] = [s / c if c else None for s, c in zip(sums2[fc1], n)]
    return stats


def expert_codes(w: np.ndarray, importance: list | None, bits: int, block: int, symmetric: bool) -> list[BlockCodes]:
    """Codes for each expert of w [E, N, K] (as [K, N] weights): searched where it has statistics, else
    rounded to nearest. `block` PER_CHANNEL: a whole row (K) is one block."""
    block = block or w.shape[2]
    out = []
    for e in range(w.shape[0]):
        h = importance[e] if importance is not None else None
        weight = np.ascontiguousarray(w[e].T)
        out.append(minmax(weight, bits, block, symmetric) if h is None else
                   search(weight, h.astype(np.float32), bits, block, symmetric))
    return out


def _packed(codes: list[BlockCodes], per_channel: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """QMoE's (weights [E, N, K * bits / 8], scales [E, N, blocks], zero points [E, N, packed blocks]); per
    channel (one block a row), scales [E, N] and zero points [E, ceil(N * bits / 8)]."""
    parts = [pack(c) for c in codes]
    weights = np.stack([p[0].reshape(p[0].shape[0], -1) for p in parts])
    if not per_channel:
        return weights, np.stack([p[1] for p in parts]), np.stack([p[2] for p in parts])
    return weights, np.stack([p[1][:, 0] for p in parts]), np.stack([_rows_packed(c.zero_points[0, 0], c.bits)
                                                                      for c in codes])


def _rows_packed(zero_points: np.ndarray, bits: int) -> np.ndarray:
    """One zero point per row [N] as QMoE reads them per channel: 4 bits two rows a byte, the first in the low
    nibble (checked against its CPU kernel on onnxruntime 1.32)."""
    if bits == 8:
        return np.ascontiguousarray(zero_points)
    z = np.pad(zero_points, (0, len(zero_points) % 2))
    return np.ascontiguousarray(z[0::2] | (z[1::2] << 4))


def expert_block(graph, block: int) -> int:
    """The block size for the experts: `block` (quantization.block_size), or the largest power of two
    below it that divides every expert's input width, as QMoE needs (at least 16); PER_CHANNEL where none
    does (widths such as 120 and 200: the dense layers' MatMulNBits pads a row to its block, QMoE cannot)."""
    initializers = {t.name: t for t in graph.initializer}
    widths = {initializers[n.input[i]].dims[2] for n in moe_nodes(graph) for i in (2, 4)}
    size = block
    while size >= QMOE_SMALLEST_BLOCK and any(w % size for w in widths):
        size //= 2
    return size if size >= QMOE_SMALLEST_BLOCK else PER_CHANNEL


def quantize_experts(model, bits: int, block: int, symmetric: bool, stats: ExpertStatistics | None) -> int:
    """Replace every MoE node of `model` by a QMoE node over `bits`-bit codes in blocks of `block` (PER_CHANNEL:
    one per row); returns how many. The fp32 expert weights leave the graph."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = moe_nodes(graph)
    for node in nodes:
        fc1_name, fc2_name = node.input[2], node.input[4]
        fc1, fc2 = (numpy_helper.to_array(initializers[n]) for n in (fc1_name, fc2_name))
        for name, w in ((fc1_name, fc1), (fc2_name, fc2)):
            if block and w.shape[2] % block:
                raise QuantizationError(f"{name}: QMoE needs each expert's input width ({w.shape[2]}) to be a "
                                        f"multiple of quantization.block_size ({block})")
            if w.shape[2] * bits % 8:
                raise QuantizationError(f"{name}: QMoE packs each expert row into whole bytes, and an input width of "
                                        f"{w.shape[2]} at {bits} bits does not fill them; int8-weight-only does")
        inputs = {}
        for tag, name, w, importance in (("fc1", fc1_name, fc1, stats.fc1.get(fc1_name) if stats else None),
                                         ("fc2", fc2_name, fc2, stats.fc2.get(fc1_name) if stats else None)):
            q, scales, zeros = _packed(expert_codes(w, importance, bits, block, symmetric), block == PER_CHANNEL)
            inputs[tag] = [f"{name}.q{bits}", f"{name}.scales"] + ([] if symmetric else [f"{name}.zero_points"])
            graph.initializer.extend([numpy_helper.from_array(q, inputs[tag][0]),
                                      numpy_helper.from_array(scales, inputs[tag][1])]
                                     + ([] if symmetric else [numpy_helper.from_array(zeros, inputs[tag][2])]))
            graph.initializer.remove(initializers[name])
        bias = lambda i: node.input[i] if len(node.input) > i else ""  # noqa: E731
        zero_points = [] if symmetric else ["", "", "", inputs["fc1"][2], inputs["fc2"][2]]
        qmoe = helper.make_node(
            QUANTIZED_OP_TYPE, [node.input[0], node.input[1], *inputs["fc1"][:2], bias(3), *inputs["fc2"][:2], bias(5),
                     *zero_points], list(node.output), name=node.name or f"{fc1_name}.qmoe", domain=MICROSOFT_DOMAIN,
            **_attrs(node), expert_weight_bits=bits, accuracy_level=QMOE_ACCURACY_LEVEL,
            **({"block_size": block} if block else {}))  # no block_size: per-channel scales
        index = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(index, qmoe)
    return len(nodes)
