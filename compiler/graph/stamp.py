"""Trace a period of the layers, stamp out the rest: torch.export costs about a second a layer (single threaded:
capture, decompositions, translation), and a decoder's layers repeat.

`layer_period(decoder)` finds the shortest period P after which every layer repeats the one P before it (its
LayerAttention, its modules' types, shapes and settings); `period_decoder` is the decoder cut to its first P
layers, each followed by an `llmc::layer_boundary` marker (and one after the embeddings). Traced unoptimized,
that graph is stamped (`stamp`): layer p's nodes are the descendants of boundary p - 1, of layer p's weights
and of its KV inputs, up to boundary p; layer j >= P is a copy of layer j % P's nodes, fed boundary j - 1's
hidden state, layer j's weights (the same module path at index j) and its own KV inputs. Whatever does not
fit that shape (a node two layers read, a layer reading a tensor that is no module's weight) raises
`Unstampable` and the caller traces the whole decoder; the verify stage checks the result against PyTorch
either way. Written here because torch.onnx traces every repetition (its `torch.export` capture has no
notion of repeated blocks) and neither onnx_ir nor onnxscript has a graph stamping pass.
"""

from __future__ import annotations

import copy
import re
from typing import Iterable, Mapping

DOMAIN = "llmc.export"  # the marker's domain: removed from the graph before anything else sees it
MARKER = "LayerBoundary"
# ops whose output is a shape, the same in every layer of a kind (torch.export reads a dim from the first tensor
# that has it, e.g. the first KV input's capacity, and every layer reuses it): shared, not a layer's own
SHAPES = {"Shape", "Size"}
_SCALARS = (bool, int, float, str, type(None))
_PER_LAYER_IGNORED = {"layer_idx", "training"}  # module attributes that differ per layer and do not change its graph


class Unstampable(Exception):
    """The period graph is not a chain of self-contained layers: trace the whole decoder."""


def layerwise(decoder) -> tuple[str, ...]:
    """The decoder's per-layer containers (index i: layer i's), as its class declares them."""
    return tuple(name for name in decoder.LAYERWISE if getattr(decoder, name, None) is not None)


def _entry(container, i: int):
    if hasattr(container, "keys"):  # a ModuleDict keyed by layer index, holding some layers only
        return container[str(i)] if str(i) in container else None
    return container[i]


def _describe(entry):
    """What of a layer's entry shapes its graph: a module's submodules with their types, settings and tensors."""
    import torch

    if isinstance(entry, torch.nn.Module):
        return tuple((name, type(m).__qualname__,
                      tuple(sorted((k, v) for k, v in vars(m).items()
                                   if isinstance(v, _SCALARS) and not k.startswith("_") and k not in _PER_LAYER_IGNORED)),
                      tuple((n, tuple(t.shape), t.dtype) for n, t in [*m.named_parameters(recurse=False),
                                                                      *m.named_buffers(recurse=False)]))
                     for name, m in entry.named_modules())
    if isinstance(entry, torch.Tensor):
        return tuple(entry.shape), entry.dtype
    return entry  # a LayerAttention, None


def layer_period(decoder, *, longest: float = 0.5) -> int | None:
    """The shortest P such that every layer i >= P looks like layer i - P, or None when there is none up to
    `longest` of the layers (the saving is the layers not traced)."""
    n = len(decoder.layers)
    names = layerwise(decoder)
    signatures = [tuple(_describe(_entry(getattr(decoder, name), i)) for name in names) for i in range(n)]
    for p in range(1, int(n * longest) + 1):
        if all(signatures[i] == signatures[i % p] for i in range(n)):
            return p
    return None


def layer_boundary(hidden, layer: int):
    import torch

    _register()
    return torch.ops.llmc.layer_boundary(hidden, layer)


def period_decoder(decoder, period: int):
    """`decoder` cut to its first `period` layers (the same modules, not copies), a boundary marked after its
    embeddings (-1) and after each layer."""
    import torch

    cut = copy.copy(decoder)  # a shallow copy shares the module registries: give it its own before cutting
    cut._modules, cut._parameters, cut._buffers = (dict(decoder._modules), dict(decoder._parameters),
                                                  dict(decoder._buffers))
    for name in layerwise(decoder):
        container = getattr(decoder, name)
        if isinstance(container, torch.nn.ModuleDict):
            setattr(cut, name, torch.nn.ModuleDict({k: m for k, m in container.items() if int(k) < period}))
        else:
            setattr(cut, name, container[:period])
    cut.boundary = layer_boundary
    return cut


def translation() -> dict:
    """The marker's entry for torch.onnx's `custom_translation_table`."""
    import torch
    from onnxscript.values import Opset

    _register()
    marker = Opset(DOMAIN, 1)

    def boundary(hidden, layer: int):
        return getattr(marker, MARKER)(hidden, layer=layer)

    return {torch.ops.llmc.layer_boundary.default: boundary}


_registered = False


def _register() -> None:
    """`llmc::layer_boundary(x, layer) -> x`: a copy in eager mode, a node to cut at in the trace."""
    global _registered
    if _registered:
        return
    import torch

    @torch.library.custom_op("llmc::layer_boundary", mutates_args=(), schema="(Tensor hidden, int layer) -> Tensor")
    def boundary(hidden, layer):
        return hidden.clone()

    @boundary.register_fake
    def _(hidden, layer):
        return torch.empty_like(hidden)

    import onnx
    from onnx.defs import OpSchema

    from llmc.plugins.op.onnx_schema import copy_types, make_schema

    if not onnx.defs.has(MARKER, DOMAIN):  # onnxscript builds a node only of an op it knows
        onnx.defs.register_schema(make_schema(
            MARKER, DOMAIN, [("X", "T")], [("Y", "T")], [OpSchema.Attribute("layer", OpSchema.AttrType.INT, "")],
            "X after layer `layer` (-1: the embeddings); export-time only", copy_types([(0, 0)])))

    _registered = True


def stamp(model, num_layers: int, period: int, tensors: Mapping[str, object], containers: Iterable[str],
          input_names: list[str], output_names: list[str], pools: list[str], presents: list[str]) -> int:
    """Grow `model` (an onnx_ir Model traced from a period decoder, markers in) to `num_layers` layers, in place.
    `tensors`: every weight of the whole decoder's traced module by name (or a function returning it, called
    when the graph is written: a streamed build's layers, compiler/graph/streamed_export.py); `containers`: the module paths whose
    index is the layer (`decoder.layers`, ...); `input_names`/`output_names`: the whole graph's, in order;
    `pools`/`presents`: the whole graph's KV inputs and outputs, two a layer (the period graph has the first
    `2 * period`). Returns how many layers were stamped."""
    import onnx_ir as ir

    graph = model.graph
    markers = {n.attributes["layer"].value: n for n in graph if n.domain == DOMAIN and n.op_type == MARKER}
    if sorted(markers) != list(range(-1, period)):
        raise Unstampable(f"boundary markers {sorted(markers)}, expected -1 .. {period - 1}")
    # a per-layer path: container.index, then the rest of the path inside the entry (none for a list of tensors)
    per_layer = re.compile(r"^(" + "|".join(re.escape(c) for c in containers) + r")\.(\d+)(\..+)?$")
    inputs = {v.name: v for v in graph.inputs}

    def layer_of(value) -> int | None:
        """The layer a graph input or weight belongs to; None when every layer shares it."""
        if value.is_graph_input():
            return pools.index(value.name) // 2 if value.name in pools[:2 * period] else None
        match = per_layer.match(value.name or "") if value.is_initializer() else None
        return int(match[2]) if match else None

    regions = _regions(graph, markers, period, inputs, pools, layer_of)
    for p, nodes in regions.items():
        for node in nodes:
            for value in node.inputs:
                if value is None:
                    continue
                producer = value.producer()
                if producer is not None and producer.domain == DOMAIN and producer is not markers[p - 1]:
                    raise Unstampable(f"node {node.name} of layer {p} reads the hidden state after layer "
                                      f"{producer.attributes['layer'].value}")
                if value.is_initializer() and layer_of(value) is None and value.name not in tensors:
                    raise Unstampable(f"layer {p} reads {value.name}, which is no weight of the decoder")
            if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
                raise Unstampable(f"node {node.name} of layer {p} holds a subgraph")
        outs = {v.name for n in nodes for v in n.outputs if v.is_graph_output()}
        if outs != set(presents[2 * p:2 * p + 2]):
            raise Unstampable(f"layer {p} outputs {sorted(outs)}, expected {presents[2 * p:2 * p + 2]}")

    head_uses = list(markers[period - 1].outputs[0].uses())
    hidden, stamped = markers[period - 1].outputs[0], []
    for j in range(period, num_layers):
        p = j % period
        mapped = {id(markers[p - 1].outputs[0]): hidden}
        for k in range(2):
            pool = _like(inputs[pools[2 * p + k]], pools[2 * j + k])
            graph.inputs.append(pool)
            mapped[id(inputs[pools[2 * p + k]])] = pool

        def value_for(value):
            if value is None or id(value) in mapped or not (value.is_initializer() and layer_of(value) == p):
                return mapped.get(id(value), value)
            name = per_layer.sub(lambda m: f"{m[1]}.{j}{m[3] or ''}", value.name)
            if name not in tensors:
                raise Unstampable(f"layer {j} has no {name}")
            found, cls = tensors[name], type(value.const_value)
            const = (ir.LazyTensor(lambda f=found, n=name: cls(f(), n), dtype=value.const_value.dtype,
                                   shape=value.const_value.shape, name=name) if callable(found) else cls(found, name))
            weight = _like(value, name, const_value=const)
            graph.register_initializer(weight)
            mapped[id(value)] = weight
            return weight

        for node in regions[p] + [markers[p]]:
            clone = ir.Node(node.domain, node.op_type, [value_for(v) for v in node.inputs],
                            list(node.attributes.values()), overload=node.overload, num_outputs=len(node.outputs),
                            version=node.version, name=f"{node.name}.layer{j}", metadata_props=dict(node.metadata_props))
            for old, new in zip(node.outputs, clone.outputs):
                new.name, new.shape, new.type = f"{old.name}.layer{j}", _shape(old), old.type
                if old.is_graph_output():
                    new.name = presents[presents.index(old.name) + 2 * (j - p)]
                    graph.outputs.append(new)
                mapped[id(old)] = new
            graph.append(clone)
            stamped.append(clone)
        hidden = mapped[id(markers[p].outputs[0])]
    for node, index in head_uses:
        node.replace_input_with(index, hidden)
    for node in [*markers.values(), *(n for n in stamped if n.domain == DOMAIN)]:
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
    graph.opset_imports.pop(DOMAIN, None)
    _reorder(graph.inputs, input_names)
    _reorder(graph.outputs, output_names)
    graph.sort()
    return num_layers - period


def _regions(graph, markers, period: int, inputs, pools: list[str], layer_of) -> dict[int, list]:
    """Each layer's nodes, in graph order: the descendants of the boundary before it, of its KV inputs and of its
    weights, up to its own boundary; a node two layers reach raises Unstampable."""
    owner: dict[int, int] = {}  # id(node) -> layer
    for p in range(period):
        stack = [markers[p - 1].outputs[0], *(inputs[n] for n in pools[2 * p:2 * p + 2])]
        stack += [v for v in graph.initializers.values() if layer_of(v) == p]
        while stack:
            for node in stack.pop().consumers():
                if node is markers[p] or owner.get(id(node)) == p or node.op_type in SHAPES:
                    continue
                if id(node) in owner or node.domain == DOMAIN:
                    raise Unstampable(f"node {node.name} is reached from layer {p} and from beyond it")
                owner[id(node)] = p
                stack.extend(node.outputs)
    return {p: [n for n in graph if owner.get(id(n)) == p] for p in range(period)}


def _reorder(values, names: list[str]) -> None:
    by_name = {v.name: v for v in values}
    if set(by_name) != set(names):
        raise Unstampable(f"the stamped graph's {sorted(set(by_name) ^ set(names))} do not match the whole graph's")
    values.clear()
    values.extend(by_name[n] for n in names)


def _like(value, name: str, const_value=None):
    import onnx_ir as ir

    return ir.Value(name=name, shape=_shape(value), type=value.type, const_value=const_value)


def _shape(value):
    return value.shape.copy() if value.shape is not None else None

