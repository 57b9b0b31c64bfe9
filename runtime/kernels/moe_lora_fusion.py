"""The session-time expert-LoRA fusion: each mixture layer's branch of a LoRA graph (compiler/lora/experts.py: the
layer recomputed for the adapter tokens, every expert, in standard ops) becomes one `llmc.MoeLora` node
(moe_lora/: the C op, each adapter token's routed experts only), in the in-memory copy `cpu_kernels.prepare` opens,
beside lora_fusion.py's four-node sites and under the same switch (`LLMC_LORA_FUSION`).

The MoE node itself then runs on the tokens without a slot only (its inputs gathered to them, its output scattered
back into zeros: `lora/experts.<i>/base_rows/...`, the rows found once from `lora_mask`), so an adapter token's
experts run once, in the op; a step without an adapter token gathers every row, a copy of the node's input and output.

A layer's branch is every node named `lora/experts.<i>/...`, ending in `lora/experts.<i>/scatter` (ScatterND over
`lora/experts.<i>/base`, the MoE node's output renamed). It is fused only when those nodes read nothing from outside
but the MoE node's inputs and output, `lora_mask` and the layer's four stacks (`lora.experts.<i>.fc1.a`, ...), and
nothing outside reads any of their values but the scatter's output; else it runs as stored. The routing attributes
are the MoE node's own. The names are experts.py's (the compiler's, which the runtime does not import:
tests/runtime/kernels/test_moe_lora.py fuses a graph the compiler's pass wrote, so a renaming there fails it).

Over a QMoE node (quantized experts) there is no stored branch to fuse: the standard ops cannot read its codes, so
the compiler writes `llmc.MoeLoraQ` into the stored graph itself, with the same row gating (`quantized_branch`, over
these helpers), and `configure_experts` gives it the session's threads.
"""

from __future__ import annotations

import re

from llmc.runtime.kernels.graph_edits import DOMAIN, readers_of, replace_nodes

MOE_LORA_OP = "MoeLora"
MOE_LORA_Q_OP = "MoeLoraQ"  # over QMoE's quantized experts: written into the stored graph (quantized_branch)
_LAYER = re.compile(r"^lora/(experts\.\d+)/")
_ROUTING = ("k", "normalize_routing_weights", "activation_alpha", "activation_beta", "swiglu_limit")


def _layer_inputs(layer: str, moe, inputs: set[str]) -> list[str] | None:
    """llmc.MoeLora's inputs for the branch of `layer` over the MoE node `moe` (None: not the contract's)."""
    stacks = [f"lora.{layer}.{fc}.{w}" for fc in ("fc1", "fc2") for w in "ab"]
    if moe is None or moe.op_type != "MoE" or len(moe.input) < 5 or not set(stacks) | {"lora_mask"} <= inputs:
        return None
    x, logits, fc1, fc1_bias, fc2, fc2_bias = (list(moe.input) + [""] * 6)[:6]
    return [f"lora/{layer}/base", x, logits, fc1, fc1_bias, fc2, fc2_bias, "lora_mask", *stacks]


_ROWS = "lora/experts/base_rows"  # [Nb, 1] int64: the tokens without a slot (ScatterND's indices)
_ROWS_FLAT = "lora/experts/base_rows_flat"  # [Nb] (Gather's)


def base_rows_nodes() -> list:
    """The rows no slot column of `lora_mask` is set in, once for every layer."""
    from onnx import TensorProto, helper

    p = "lora/experts"
    return [
        helper.make_node("Constant", [], [f"{p}/columns"], name=f"{p}/columns",
                         value=helper.make_tensor("columns", TensorProto.INT64, [1], [1])),
        helper.make_node("Constant", [], [f"{p}/zero"], name=f"{p}/zero",
                         value=helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Constant", [], [f"{p}/flat"], name=f"{p}/flat",
                         value=helper.make_tensor("flat", TensorProto.INT64, [1], [-1])),
        helper.make_node("ReduceMax", ["lora_mask", f"{p}/columns"], [f"{p}/any"], name=f"{p}/any", keepdims=0),
        # not (any > 0), the stored branch's own test negated: a zero-width mask's ReduceMax is -inf, not 0
        helper.make_node("Greater", [f"{p}/any", f"{p}/zero"], [f"{p}/slot"], name=f"{p}/slot"),
        helper.make_node("Not", [f"{p}/slot"], [f"{p}/no_slot"], name=f"{p}/no_slot"),
        helper.make_node("NonZero", [f"{p}/no_slot"], [f"{p}/nonzero"], name=f"{p}/nonzero"),
        helper.make_node("Transpose", [f"{p}/nonzero"], [_ROWS], name=_ROWS, perm=[1, 0]),
        helper.make_node("Reshape", [_ROWS, f"{p}/flat"], [_ROWS_FLAT], name=_ROWS_FLAT),
    ]


def base_rows_only(moe, layer: str) -> tuple[list, list]:
    """(nodes before, nodes after) the MoE node `moe`, rewired in place to run on the tokens without a slot only: its
    x and logits gathered to them, its output scattered back into zeros of x's shape (llmc.MoeLora writes the
    adapter tokens' rows), so an adapter token's experts run once, in the op, not also in the node."""
    from onnx import helper

    p = f"lora/{layer}/base_rows"
    x, logits = moe.input[0], moe.input[1]
    base = moe.output[0]
    gathered = [helper.make_node("Gather", [name, _ROWS_FLAT], [f"{p}/{what}"], name=f"{p}/{what}", axis=0)
                for name, what in ((x, "x"), (logits, "logits"))]
    moe.input[0], moe.input[1], moe.output[0] = f"{p}/x", f"{p}/logits", f"{p}/moe"
    after = [helper.make_node("Shape", [x], [f"{p}/shape"], name=f"{p}/shape"),
             helper.make_node("ConstantOfShape", [f"{p}/shape"], [f"{p}/zeros"], name=f"{p}/zeros"),
             helper.make_node("ScatterND", [f"{p}/zeros", _ROWS, f"{p}/moe"], [base], name=f"{p}/scatter")]
    return gathered, after


def quantized_branch(qmoe, layer: str, stacks: list[str]) -> tuple[list, list]:
    """(nodes before, nodes after) the QMoE node `qmoe` (compiler/quantize/experts.py's) serving `layer`'s expert
    LoRA, for the stored graph: the node rewired to run on the tokens without a slot (base_rows_only: the shared
    row nodes, base_rows_nodes, go first in the graph), then one llmc.MoeLoraQ over its codes for the adapter
    tokens. `stacks`: the layer's fc1.a, fc1.b, fc2.a, fc2.b inputs."""
    from onnx import helper

    if qmoe.op_type != "QMoE" or len(qmoe.input) < 7:
        raise ValueError(f"{qmoe.name}: not a com.microsoft.QMoE node")
    inputs = list(qmoe.input) + [""] * (13 - len(qmoe.input))
    y = qmoe.output[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in qmoe.attribute}
    before, after = base_rows_only(qmoe, layer)
    base = after[-1].output[0] = f"lora/{layer}/base"  # the scatter writes the node's rows, which the op reads
    op = helper.make_node(
        MOE_LORA_Q_OP, [base, inputs[0], inputs[1], inputs[2], inputs[3], inputs[11], inputs[4], inputs[5],
                        inputs[6], inputs[12], inputs[7], "lora_mask", *stacks], [y],
        name=f"lora/{layer}/{MOE_LORA_Q_OP}", domain=DOMAIN, site=layer,
        expert_weight_bits=int(attrs.get("expert_weight_bits", 4)), block_size=int(attrs.get("block_size", 0)),
        **{a: v for a, v in attrs.items() if a in _ROUTING})
    return before, [*after, op]


def configure_experts(model, threads: int) -> int:
    """Give the stored llmc.MoeLoraQ nodes of an ONNX ModelProto the session's intra-op thread count, in place;
    returns how many (they need llmc's library, as PagedAttention does)."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type == MOE_LORA_Q_OP and n.domain == DOMAIN]
    for node in nodes:
        if not any(a.name == "threads" for a in node.attribute):
            node.attribute.append(helper.make_attribute("threads", max(1, threads)))
    return len(nodes)


def fuse_experts(model, threads: int) -> int:
    """Replace every mixture layer's expert-LoRA branch of an ONNX ModelProto by one llmc.MoeLora node, in place, for
    a session of `threads` intra-op threads; returns how many layers were fused."""
    from onnx import helper

    graph = model.graph
    branches: dict[str, list] = {}
    for node in graph.node:
        match = _LAYER.match(node.name)
        if match:
            branches.setdefault(match[1], []).append(node)
    if not branches:
        return 0
    producers = {out: node for node in graph.node for out in node.output}
    readers = readers_of(graph)
    inputs, outputs = {i.name for i in graph.input}, {o.name for o in graph.output}
    fused: dict[int, list] = {}  # id() of a branch's scatter -> the op in its place; of its MoE node -> it and after
    before: dict[int, list] = {}  # id() of a MoE node -> the nodes gathering its inputs' base rows
    gone: set[int] = set()
    dropped: set[str] = set()
    for layer, nodes in branches.items():
        scatter = next((n for n in nodes if n.name == f"lora/{layer}/scatter" and n.op_type == "ScatterND"), None)
        wanted = _layer_inputs(layer, producers.get(f"lora/{layer}/base"), inputs)
        if scatter is None or wanted is None or scatter.input[0] != wanted[0]:
            continue
        made = {out for n in nodes for out in n.output}
        read = {i for n in nodes for i in n.input if i and i not in made}
        leaked = {v for v in made - {scatter.output[0]} if v in outputs or
                  any(id(r) not in {id(n) for n in nodes} for r in readers.get(v, ()))}
        if leaked or not read <= set(wanted) - {""}:
            continue
        moe = producers[wanted[0]]
        routing = {a.name: helper.get_attribute_value(a) for a in moe.attribute if a.name in _ROUTING}
        fused[id(scatter)] = [helper.make_node(
            MOE_LORA_OP, wanted, [scatter.output[0]], name=f"lora/{layer}/{MOE_LORA_OP}", domain=DOMAIN,
            threads=max(1, threads), site=layer, **routing)]
        gone.update(id(n) for n in nodes if n is not scatter)
        dropped.update(made - {scatter.output[0]})
        before[id(moe)], after = base_rows_only(moe, layer)
        fused[id(moe)] = [moe, *after]
    if not fused:
        return 0
    nodes = [*base_rows_nodes()]
    for n in graph.node:
        if id(n) not in gone:
            nodes.extend([*before.get(id(n), []), *fused.get(id(n), [n])])
    replace_nodes(model, nodes, dropped)
    return len(before)
