"""The in-memory edits `cpu_kernels.prepare` makes to a graph before ONNX Runtime opens it, for llmc's ops:
- the 4-bit swap: every `MatMulNBits` llmc's kernel computes as ONNX Runtime does (`eligible`) becomes
  `llmc.MatMulNBits4` for the session's thread count and instruction set (`accelerate`), and an Add of a
  bias after a swapped node is folded into it (`fold_bias`);
- `llmc.PagedAttention` nodes get the session's thread count (`configure_paged`);
- `llmc.AllReduce` / `llmc.AllGather` nodes get their rank group's name (`configure_collective`);
- each LoRA site's four-node branch becomes `llmc.LoraDelta` (lora_fusion.py, a module of its own), each mixture
  layer's expert branch `llmc.MoeLora` (moe_lora_fusion.py); both end in `replace_nodes`.
Stored graphs keep the standard ops; only the session's copy is edited."""

from __future__ import annotations

DOMAIN, OP, PAGED_OP = "llmc", "MatMulNBits4", "PagedAttention"
COLLECTIVE_OPS = ("AllReduce", "AllGather")


def _attributes(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def eligible(node, uint8_initializers: set[str], float_initializers: set[str]) -> bool:
    """Whether a node is a MatMulNBits the llmc kernel computes as ONNX Runtime's does: 4 bits in blocks
    of 32, 64 or 128, int8 activations, K a multiple of 64 and of the block, no g_idx,
    zero points (if any) packed uint8, a bias or none;
    B, its scales and zero points initializers (the kernel repacks them when the session opens)."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) > 6:
        return False
    if len(node.input) < 3 or node.input[1] not in uint8_initializers or node.input[2] not in float_initializers:
        return False
    if len(node.input) >= 4 and node.input[3] and node.input[3] not in uint8_initializers:
        return False
    if len(node.input) >= 5 and node.input[4]:  # g_idx
        return False
    a = _attributes(node)
    block = a.get("block_size")
    return (a.get("bits", 4) == 4 and block in (32, 64, 128) and a.get("accuracy_level", 0) == 4
            and a.get("K", 0) % max(64, block) == 0)


def swappable(model) -> list:
    """The nodes of an ONNX ModelProto llmc's kernel takes."""
    from onnx import TensorProto

    uint8 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.UINT8}
    floats = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    return [n for n in model.graph.node if eligible(n, uint8, floats)]


def accelerate(model, threads: int, isa: str) -> int:
    """Swap eligible MatMulNBits nodes of an ONNX ModelProto for llmc's, in place, for a session of
    `threads` intra-op threads (decode splits the columns into one run per thread), computed by the
    kernel for instruction set `isa`; returns how many."""
    from onnx import helper

    nodes = swappable(model)
    for node in nodes:
        node.op_type, node.domain = OP, DOMAIN
        node.attribute.extend([helper.make_attribute("threads", max(1, threads)), helper.make_attribute("isa", isa)])
    if nodes:
        declare_domain(model)
    fold_bias(model, nodes)
    return len(nodes)


def declare_domain(model) -> None:
    """The ModelProto imports llmc's op domain (version 1), once."""
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=DOMAIN, version=1)


def drop_value_info(graph, names: set[str]) -> None:
    """`graph`'s value_info without the entries of `names` (values an edit removed)."""
    kept = [v for v in graph.value_info if v.name not in names]
    if len(kept) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)


def replace_nodes(model, nodes: list, dropped: set[str]) -> None:
    """A fusion's last step: `nodes` become the graph's, the values in `dropped` lose their value_info, and the
    model imports llmc's domain (the fused ops are in it)."""
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    drop_value_info(model.graph, dropped)
    declare_domain(model)


def readers_of(graph) -> dict[str, list]:
    """Each value of `graph` (a GraphProto) -> the nodes that read it, in the graph's order."""
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def fold_bias(model, nodes: list) -> int:
    """Each of `nodes` (MatMulNBits4, swapped in) whose output only an Add of a float [N] initializer reads
    takes that initializer as its bias (input 5) and the Add's output, and the Add goes: the kernel adds the
    bias to the columns it has just written, where the Add was a node of its own (ONNX Runtime's graph
    optimizer does not fold it into a custom op). Qwen's q/k/v bias: 24 Add nodes of a 0.5B decode step.
    Returns how many it folded."""
    from onnx import TensorProto

    floats = {t.name: list(t.dims) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    readers = readers_of(model.graph)
    graph_outputs = {o.name for o in model.graph.output}
    gone: set[str] = set()  # the swapped nodes' own outputs, which no node reads once their Adds go
    for node in nodes:
        out = node.output[0]
        if len(node.input) > 5 or out in graph_outputs or len(readers.get(out, [])) != 1:
            continue
        add = readers[out][0]
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or list(add.input).count(out) != 1:
            continue
        bias = add.input[1] if add.input[0] == out else add.input[0]
        if floats.get(bias) != [_attributes(node).get("N")]:
            continue
        node.input.extend([""] * (5 - len(node.input)) + [bias])  # zero points (or none), no g_idx, the bias
        node.output[0] = add.output[0]
        model.graph.node.remove(add)
        gone.add(out)
    drop_value_info(model.graph, gone)
    return len(gone)


REFUSED_INPUTS = {12: "q_norm_weight", 13: "k_norm_weight"}  # k_scale/v_scale: int8 caches take them


def configure_paged(model, threads: int) -> int:
    """Give the llmc.PagedAttention nodes of an ONNX ModelProto the session's intra-op thread count (how
    finely the kernel splits its work), in place; an input the CPU kernel does not implement is refused here
    (the kernel refuses attributes it does not when the session creates it). Returns how many nodes."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type == PAGED_OP and n.domain == DOMAIN]
    for node in nodes:
        refused = [name for i, name in REFUSED_INPUTS.items() if i < len(node.input) and node.input[i]]
        if refused:
            raise ValueError(f"llmc.PagedAttention node {node.name!r}: input {refused[0]} is not implemented on CPU")
        if not any(a.name == "threads" for a in node.attribute):
            node.attribute.append(helper.make_attribute("threads", max(1, threads)))
    return len(nodes)


def configure_collective(model, group: str | None) -> int:
    """Give the llmc.AllReduce / llmc.AllGather nodes of an ONNX ModelProto the shared-memory group's name
    (collective.py's `Group.name`), in place; returns how many nodes. Such a graph without a group is a
    ValueError naming the node: its ranks run only together."""
    from onnx import helper

    nodes = [n for n in model.graph.node if n.op_type in COLLECTIVE_OPS and n.domain == DOMAIN]
    if nodes and not group:
        raise ValueError(f"llmc.{nodes[0].op_type} node {nodes[0].name!r}: a tensor-parallel graph runs only inside a "
                         "rank group: pass group= (the name of a runtime.kernels.collective.Group)")
    for node in nodes:
        kept = [a for a in node.attribute if a.name != "group"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("group", group)])
    return len(nodes)
