"""A tensor-parallel rank's collectives as TensorRT's own ONNX op, `DistCollective`, and the rewrite that puts it
in place of the export's `llmc.AllReduce` / `llmc.AllGather` nodes (plugins/op/collective.py).

    llmc.AllReduce(x)                  -> DistCollective(x; collective_operation "all_reduce", reduce_op "sum")
    llmc.AllGather(x [..., w])         -> Transpose(last axis first) -> DistCollective("all_gather", "none")
                                          -> Transpose(first axis last): [..., world_size * w], ranks in order

Why this op: TensorRT's ONNX parser imports a node of op type `DistCollective` as an `IDistCollectiveLayer`
(onnx-tensorrt 10.16 release notes: "Added DistCollective operator support for multi-device execution"; GA with
TensorRT 11's multi-device runtime). Its attributes are those of TensorRT's DistCollective operator reference:
`collective_operation`, `reduce_op`, `root` (-1: no root), `nb_rank` (ranks in the collective; it sets the output
shape of a gather), `groups` and `group_size` (the participating rank ids and their count). NVIDIA's
`polygraphy multi-device shard` writes the same node (default domain, lower-case operation names), which is what
this module follows. The parser is left no choice to make: an unknown `AllReduce` op type would go to its plugin
fallback, which finds TensorRT-LLM's NCCL plugin of that very name wherever that library is loaded.

TensorRT's ALL_GATHER concatenates along the first dimension ("[nb_rank * input.shape[0], ...]"), llmc's along the
last (the LM head's vocabulary slices), hence the two transposes around it: TensorRT-LLM's `allgather(tensor,
group, gather_dim)` does the same on top of dimension 0. `groups` lists every rank explicitly: Torch-TensorRT,
which emits the same layer through `INetworkDefinition.add_dist_collective`, found an empty group list treated as
no collective at all.

`register_schema()` gives onnx.checker and ONNX shape inference the op's shape rule (TensorRT carries its own
importer; this schema is only for checking the rewritten graph here). Nothing here imports TensorRT.
"""

from __future__ import annotations

from typing import NamedTuple

import onnx
from onnx import helper
from onnx.defs import OpSchema

DIST_COLLECTIVE = "DistCollective"  # TensorRT's ONNX op type; the default ONNX domain, as polygraphy writes it
LLMC_DOMAIN = "llmc"
REDUCE_OP, GATHER_OP = "AllReduce", "AllGather"  # plugins/op/collective.py's node types
_TYPES = ["tensor(float16)", "tensor(bfloat16)", "tensor(float)", "tensor(int8)", "tensor(int32)", "tensor(int64)"]


class Collectives(NamedTuple):
    """What a rank's graph asks of its group: its rank, the group's size, and how many of each collective."""

    rank: int
    world_size: int
    all_reduce: int
    all_gather: int


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _is_llmc_collective(node: onnx.NodeProto) -> bool:
    return node.domain == LLMC_DOMAIN and node.op_type in (REDUCE_OP, GATHER_OP)


def collectives(model: onnx.ModelProto) -> Collectives | None:
    """The llmc collectives of a rank's graph (None: it has none); every node must name the same rank and group."""
    nodes = [n for n in model.graph.node if _is_llmc_collective(n)]
    if not nodes:
        return None
    groups = {(_attributes(n)["rank"], _attributes(n)["world_size"]) for n in nodes}
    if len(groups) != 1:
        raise ValueError(f"the graph's collectives disagree on their rank and group: {sorted(groups)} "
                         "(one graph is one rank)")
    (rank, world_size), = groups
    if not 0 <= rank < world_size:
        raise ValueError(f"collective of rank {rank} in a group of {world_size}")
    reduces = sum(n.op_type == REDUCE_OP for n in nodes)
    return Collectives(rank, world_size, reduces, len(nodes) - reduces)


def dist_collective_attributes(operation: str, world_size: int) -> dict:
    """A DistCollective node's attributes for `operation` ("all_reduce" or "all_gather") over `world_size` ranks."""
    reduce_op = {"all_reduce": "sum", "all_gather": "none"}[operation]
    return {"collective_operation": operation, "reduce_op": reduce_op, "root": -1, "nb_rank": world_size,
            "groups": list(range(world_size)), "group_size": world_size}


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """Each value's number of dimensions, where the graph records its shape."""
    values = list(graph.value_info) + list(graph.input) + list(graph.output)
    return {v.name: len(v.type.tensor_type.shape.dim) for v in values
            if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}


def _gather_nodes(node: onnx.NodeProto, world_size: int, dims: int) -> list[onnx.NodeProto]:
    """llmc's gather along the last axis as TensorRT's gather along the first, between two transposes."""
    name = node.name or f"{node.output[0]}_gather"
    collective = dist_collective_attributes("all_gather", world_size)
    if dims == 1:
        return [helper.make_node(DIST_COLLECTIVE, list(node.input), list(node.output), name=name, **collective)]
    front, gathered = f"{name}/last_axis_first", f"{name}/gathered"
    return [
        helper.make_node("Transpose", [node.input[0]], [front], name=f"{name}/to_front",
                         perm=[dims - 1, *range(dims - 1)]),
        helper.make_node(DIST_COLLECTIVE, [front], [gathered], name=name, **collective),
        helper.make_node("Transpose", [gathered], list(node.output), name=f"{name}/to_back",
                         perm=[*range(1, dims), 0]),
    ]


def to_dist_collectives(model: onnx.ModelProto) -> Collectives | None:
    """Rewrite `model`'s llmc collectives to DistCollective nodes, in place; returns what it rewrote (None: the
    graph had none). An all-gather's input must have a recorded shape (its number of dimensions sets the
    transposes); the export records every value's."""
    found = collectives(model)
    if found is None:
        return None
    graph, ranks = model.graph, _ranks(model.graph)
    rewritten = []
    for node in graph.node:
        if not _is_llmc_collective(node):
            rewritten.append(node)
        elif node.op_type == REDUCE_OP:
            rewritten.append(helper.make_node(DIST_COLLECTIVE, list(node.input), list(node.output),
                                              name=node.name or f"{node.output[0]}_reduce",
                                              **dist_collective_attributes("all_reduce", found.world_size)))
        else:
            if node.input[0] not in ranks:
                raise ValueError(f"llmc.AllGather node {node.name!r}: the graph records no shape for its input "
                                 f"{node.input[0]!r}, so its last axis is unknown")
            rewritten.extend(_gather_nodes(node, found.world_size, ranks[node.input[0]]))
    del graph.node[:]
    graph.node.extend(rewritten)
    if not any(o.domain == "" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", 17))
    return found


def dist_collectives(model: onnx.ModelProto) -> list[dict]:
    """The attributes of each DistCollective node of `model`, in graph order (what TensorRT's parser will import)."""
    return [_attributes(n) for n in model.graph.node if n.op_type == DIST_COLLECTIVE and n.domain == ""]


def _infer(ctx) -> None:
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    operation = helper.get_attribute_value(ctx.get_attribute("collective_operation"))
    dims = out.tensor_type.shape.dim
    if operation in (b"all_gather", "all_gather") and dims:
        ranks = helper.get_attribute_value(ctx.get_attribute("nb_rank"))
        if dims[0].HasField("dim_value"):
            dims[0].dim_value *= ranks
        else:
            dims[0].Clear()  # symbolic: unknown after the gather
    ctx.set_output_type(0, out)


def register_schema() -> None:
    """DistCollective's all-reduce and all-gather rule for onnx.checker and shape inference here. Idempotent."""
    if onnx.defs.has(DIST_COLLECTIVE, ""):
        return
    A = OpSchema.AttrType
    schema = OpSchema(
        DIST_COLLECTIVE, "", 1,
        "TensorRT's multi-device collective over NCCL (IDistCollectiveLayer); gathers concatenate along axis 0.",
        inputs=[OpSchema.FormalParameter("input", "T")], outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", _TYPES, "the collective's element types")],
        attributes=[OpSchema.Attribute("collective_operation", A.STRING, "all_reduce, all_gather, ..."),
                    OpSchema.Attribute("reduce_op", A.STRING, "sum, prod, max, min, avg or none"),
                    OpSchema.Attribute("root", A.INT, "the root rank; -1 for collectives without one"),
                    OpSchema.Attribute("nb_rank", A.INT, "ranks taking part"),
                    OpSchema.Attribute("groups", A.INTS, "the participating rank ids", required=False),
                    OpSchema.Attribute("group_size", A.INT, "len(groups)", required=False)])
    schema.set_type_and_shape_inference_function(_infer)
    onnx.defs.register_schema(schema)
