"""Graph cleanups run on the exported model (onnx_ir) before it is saved.

The exporter translates each layer separately, so every layer recomputes the same sequence-length
arithmetic and wraps attention in view/flatten reshapes; these passes leave one copy of the former
and none of the latter, which matters on CPU where a decode step is hundreds of tiny kernels.
"""

from __future__ import annotations

from llmc.plugins.lowering import pack_qkv


def drop_reshape_round_trips(graph) -> None:
    """Reshape(Reshape(x)) back to x's own shape (attention output viewed as heads, then flattened
    again) is x: point the outer Reshape's users at x."""
    for node in list(graph):
        inner = node.inputs[0].producer() if node.op_type == "Reshape" and node.inputs[0] is not None else None
        if inner is None or inner.op_type != "Reshape":
            continue
        x, y = inner.inputs[0], node.outputs[0]
        if x.shape is None or y.shape is None or list(x.shape) != list(y.shape) or y.is_graph_output():
            continue
        if any(not isinstance(d, int) and getattr(d, "value", None) is None for d in x.shape):
            continue  # an anonymous dim: equality of shapes says nothing
        y.replace_all_uses_with(x)


def sequence_length_from_input_ids(graph) -> None:
    """Each layer's lowering reads S off its own query (`Shape(q, start=1, end=2)`); read it off
    `input_ids` instead, so the length arithmetic is one expression in every layer and CSE keeps
    one copy."""
    input_ids = graph.inputs[0]
    assert input_ids.name == "input_ids", input_ids.name
    for node in graph:
        source = node.inputs[0] if node.op_type == "Shape" and node.inputs else None
        if source is None or source is input_ids or source.shape is None or len(source.shape) < 2:
            continue
        if source.shape[1] == input_ids.shape[1] and node.attributes.get_int("start", 0) == 1 \
                and node.attributes.get_int("end", -1) == 2:
            node.replace_input_with(0, input_ids)


def simplify(model) -> None:
    """Clean an exported onnx_ir model in place: one copy of what every layer's attention
    recomputes (sequence lengths, shapes), no reshape round trips, GQA fed packed QKV."""
    from onnx_ir.passes.common import (CommonSubexpressionEliminationPass, DeduplicateInitializersPass,
                                       RemoveUnusedNodesPass)

    sequence_length_from_input_ids(model.graph)
    drop_reshape_round_trips(model.graph)
    pack_qkv(model.graph)
    DeduplicateInitializersPass()(model)
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
