"""SmoothQuant (Xiao et al., 2023) on the ONNX graph, before int8 calibration.

Activation outliers sit in a few channels, which a per-tensor int8 scale cannot cover without
crushing the rest. For every normalization whose output feeds only linear layers, each channel j is
divided by s_j in the norm's weight and multiplied back into row j of every consumer's weight:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

so the fp32 function is unchanged and the difficulty moves from activations into the (per-channel
quantized) weights. Besides the norms, a gated MLP's up projection plays the norm's part for the
down projection (its output columns take 1/s; `Mul(act(gate), up)` is linear in `up`). Written
here because neither ModelOpt's ONNX quantizer nor ONNX Runtime's (without Intel Neural
Compressor) offers it. Per-channel activation maxima come from the same calibration windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from llmc.compiler.quantize.calibrate import run_tensors
from llmc.compiler.quantize.channel_scales import ChannelScales
from llmc.runtime.layout import KVLayout

# normalizations and the input slots of their per-channel constants (scale, bias); output 0 is normalized
NORMS = {"RMSNormalization": (1,), "LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,),
         "SkipSimplifiedLayerNormalization": (2,), "SkipLayerNormalization": (2, 3)}


@dataclass
class Site:
    """A tensor whose channels can be divided by s upstream and multiplied back in its readers."""

    tensor: str  # what the readers (linear layers) take
    readers: list  # MatMul nodes with constant weights [K, N]: row j multiplied by s_j
    divide: list  # (node, input slot, axis, start): constants whose `axis` entries start.. are divided by s


def smoothable(graph) -> list[Site]:
    """The sites of a decoder graph:
    - a normalization with constant scale (and bias) read only by linear layers (attention QKV, MLP
      gate/up, LM head): divide the norm's scale;
    - a gated MLP's `Mul(act(gate), up)` read only by the down projection, where `up` is a linear
      layer read only by that Mul, or its own slice of one (Phi-3's `gate_up_proj`, `Split` along
      the channels): divide the up projection's output columns. This is where SmolLM2's and
      Llama's largest activations (thousands) live, out of a norm's reach.
    Either may reach its linear layers through a flattening `Reshape` (read_by_linears). Nothing else
    is a site: a norm read by a residual Add (Gemma's sandwich norms, OLMo 2's post-norms) or by
    attention (q/k norms) keeps its scale, since dividing it would change the function."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in graph.initializer}
    constants = {**initializers, **{n.output[0]: a.t for n in graph.node if n.op_type == "Constant"
                                    for a in n.attribute if a.name == "value"}}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def linear_readers(tensor: str) -> list:
        users = readers.get(tensor, [])
        ok = users and tensor not in outputs and all(
            u.op_type == "MatMul" and u.input[0] == tensor and u.input[1] in initializers for u in users)
        return users if ok else []

    def read_by_linears(tensor: str) -> tuple[str, list]:
        """(what the linear layers read, those layers): `tensor` itself, or its flattened copy where its
        only reader is a `Reshape` to a constant shape [.., C] (GPT-2's Conv1D views [.., C] as
        [-1, C]: rows move, channels stay; the caller checks that C is the producer's width)."""
        users = linear_readers(tensor)
        only = readers.get(tensor, [])
        if users or len(only) != 1 or only[0].op_type != "Reshape" or only[0].input[1] not in constants:
            return tensor, users
        shape = numpy_helper.to_array(constants[only[0].input[1]])
        flat, width = only[0].output[0], int(shape[-1]) if shape.ndim == 1 and len(shape) else 0
        users = linear_readers(flat)
        return (flat, users) if width > 0 and all(initializers[u.input[1]].dims[0] == width for u in users) \
            else (tensor, [])

    def up_columns(tensor: str, channels: int) -> tuple | None:
        """(MatMul, 1, 1, first column) where `tensor` is `channels` output columns of a linear layer
        read only by this path: the whole layer, or one output of a `Split` of it (equal parts or
        constant sizes) as wide as `channels`, which it can only be when the split is along them."""
        node = producers.get(tensor)
        if node is not None and node.op_type == "MatMul" and node.input[1] in initializers:
            return (node, 1, 1, 0) if initializers[node.input[1]].dims[-1] == channels else None
        if node is None or node.op_type != "Split" or len(readers.get(node.input[0], [])) != 1:
            return None
        matmul = producers.get(node.input[0])
        if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in initializers:
            return None
        width = initializers[matmul.input[1]].dims[-1]
        if len(node.input) > 1 and node.input[1]:
            if node.input[1] not in constants:
                return None
            sizes = [int(v) for v in numpy_helper.to_array(constants[node.input[1]])]
        else:
            part = -(-width // len(node.output))
            sizes = [min(part, width - k * part) for k in range(len(node.output))]
        k = list(node.output).index(tensor)
        return (matmul, 1, 1, sum(sizes[:k])) if sum(sizes) == width and sizes[k] == channels else None

    sites = []
    for node in graph.node:
        tensor, users = read_by_linears(node.output[0])
        if not users:
            continue
        channels = initializers[users[0].input[1]].dims[0]  # what s must have: the readers' input width
        slots = [i for i in NORMS.get(node.op_type, ()) if i < len(node.input) and node.input[i]]
        if slots and node.input[slots[0]] in initializers:
            divide = [(node, i, 0, 0) for i in slots if node.input[i] in initializers]
            if all(list(initializers[n.input[i]].dims) == [channels] for n, i, _, _ in divide):  # not a broadcast scalar
                sites.append(Site(tensor, users, divide))
        elif node.op_type == "Mul":
            up = next((u for u in (up_columns(i, channels) for i in node.input if len(readers.get(i, [])) == 1) if u), None)
            if up is not None:
                sites.append(Site(tensor, users, [up]))
    return sites


def channel_amax(model, layout: KVLayout, windows: list[np.ndarray], tensors: list[str], num_threads: int,
                 progress: Callable[[int, int], None] | None) -> dict[str, np.ndarray]:
    """max |x| per channel (last axis) of each tensor over all windows."""
    amax: dict[str, np.ndarray] = {}
    for values in run_tensors(model, layout, windows, tensors, num_threads, progress):
        for name, value in values.items():
            here = np.abs(value).max(0)
            amax[name] = np.maximum(amax[name], here) if name in amax else here
    return amax


def apply_scales(model, sites: list[Site], scales: list[np.ndarray], weights=None) -> ChannelScales:
    """Multiply each site's readers' weight rows by s and divide its producer constants by s (in place); returns
    what that did to the graph's activations (channel_scales.py: what a LoRA branch must read them by).
    A constant read by other nodes too (the export deduplicates equal tensors, e.g. norm weights
    that are all ones) is copied first, so only this site's readers see the change. `weights`: where the
    weights lie (quantize/weight_file.py: read and written a tensor at a time); default: in the proto."""
    from llmc.compiler.quantize.weight_file import WeightFile

    graph = model.graph
    weights = weights or WeightFile.of(graph)
    initializers = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1

    def own(node, slot: int) -> str:
        name = node.input[slot]
        if uses[name] > 1:
            uses[name] -= 1
            copy = f"{name}.smooth.{node.name or node.output[0]}"
            initializers[copy] = weights.add(copy, weights.array(initializers[name]))
            uses[copy] = 1
            node.input[slot] = copy
        return node.input[slot]

    done = ChannelScales()
    for site, s in zip(sites, scales):
        for node, slot, axis, start in site.divide:
            weights.divide(initializers[own(node, slot)], s, axis, start)
            if node.op_type == "MatMul":  # a linear layer's output columns (up_columns): its reader took the s
                done.outputs[node.output[0]] = (start, s)
        for reader in site.readers:
            weights.scale_rows(initializers[own(reader, 1)], s)
        done.inputs[site.tensor] = s
    return done


def smooth(model, layout: KVLayout, windows: list[np.ndarray], alpha: float, *, num_threads: int = 0,
           progress: Callable[[int, int], None] | None = None) -> int:
    """Migrate activation outliers into the weights of `model` (in place); returns how many sites were smoothed."""
    from onnx import numpy_helper

    sites = smoothable(model.graph)
    if not sites:
        return 0
    act = channel_amax(model, layout, windows, [site.tensor for site in sites], num_threads, progress)
    initializers = {t.name: t for t in model.graph.initializer}
    scales = []
    for site in sites:
        w_amax = np.max([np.abs(numpy_helper.to_array(initializers[r.input[1]])).max(1) for r in site.readers], axis=0)
        s = np.power(np.maximum(act[site.tensor], 1e-5), alpha) / np.power(np.maximum(w_amax, 1e-5), 1 - alpha)
        scales.append(np.clip(s, 1e-5, None).astype(np.float32))
    apply_scales(model, sites, scales)
    return len(sites)
