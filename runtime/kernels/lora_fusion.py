"""The session-time LoRA fusion: each site's four-node branch of a LoRA graph (compiler/lora/graph.py) becomes one
`llmc.LoraDelta` node (lora_delta/: the C op), in the in-memory copy `cpu_kernels.prepare` opens, as the 4-bit swap
does for MatMulNBits (graph_edits.py). Stored graphs keep the portable branch and its input contract (the runtime
binds A, B and the masks as before); only the session's copy is edited.

The branch graph.py writes, for a site named <site> (x, y_base, A, B and the mask being the branch's inputs):

    lora/<site>/shrink    MatMul(x, lora.<site>.a)                  -> lora/<site>/h
    lora/<site>/Mul_mask  Mul(lora/<site>/h, lora_mask[_x<M>])      -> lora/<site>/h_own
    lora/<site>/expand    MatMul(lora/<site>/h_own, lora.<site>.b)  -> lora/<site>/delta
    lora/<site>/Add       Add(lora/<site>/base, lora/<site>/delta)  -> y

(the LM head's mask is `lora/<site>/mask`, the token mask gathered by the rows it sees: `lora/<site>/Gather_mask`)
becomes `lora/<site>/LoraDelta` = llmc.LoraDelta(lora/<site>/base, x, A, mask, B) -> y, where the Add was (every
input it reads is computed before the Add, x before the shrink). The op finds each token's slot from its mask row,
so it needs neither S nor R (both dynamic), only the session's thread count (`threads`) and the site's name (`site`,
for its error messages). A site is fused only when the four nodes are exactly that: these names, op types and
inputs, A and B and the mask graph inputs, and the three intermediate values read by the next node alone (not
graph outputs). Anything else (a branch an edit changed) keeps its nodes, and runs as stored.

The names are graph.py's (the compiler's, which the runtime does not import: tests/runtime/kernels/
test_lora_delta.py fuses a graph the compiler's pass wrote, so a renaming there fails it).
"""

from __future__ import annotations

import os
import re

from llmc.runtime.kernels.graph_edits import DOMAIN, readers_of, replace_nodes

LORA_OP = "LoraDelta"
SWITCH = "LLMC_LORA_FUSION"  # "0" keeps the four-node branch (llmc's other kernels stay on)
_MASK = re.compile(r"lora_mask(_x[0-9]+)?")


def enabled() -> bool:
    """Whether sessions fuse the LoRA branch (`LLMC_LORA_FUSION` other than "0"; llmc's kernels available at all is
    cpu_kernels.prepare's to check)."""
    return os.environ.get(SWITCH, "1") != "0"


def _branch(add, producers: dict, readers: dict, inputs: set[str], outputs: set[str]):
    """The site and the branch's nodes (shrink, mul, expand, add) whose last node is `add`, or None where they are
    not exactly the nodes graph.py writes."""
    match = re.fullmatch(r"lora/(.+)/Add", add.name)
    if not match or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    site = match.group(1)
    p = f"lora/{site}"
    if list(add.input) != [f"{p}/base", f"{p}/delta"]:
        return None
    nodes = []
    for value, name, op, second in ((f"{p}/delta", "expand", "MatMul", f"lora.{site}.b"),
                                    (f"{p}/h_own", "Mul_mask", "Mul", None),
                                    (f"{p}/h", "shrink", "MatMul", f"lora.{site}.a")):
        node = producers.get(value)
        if (node is None or node.name != f"{p}/{name}" or node.op_type != op or node.domain not in ("", "ai.onnx")
                or list(node.output) != [value] or value in outputs or len(readers.get(value, ())) != 1):
            return None
        if second is not None and node.input[1:] != [second] or len(node.input) != 2:
            return None
        gathered = name == "Mul_mask" and _gathered_mask(node.input[1], p, producers, inputs)
        if node.input[1] not in inputs and not gathered:
            return None
        nodes.append(node)
    expand, mul, shrink = nodes
    if list(expand.input)[0] != f"{p}/h_own" or list(mul.input)[0] != f"{p}/h" or \
            not (_MASK.fullmatch(mul.input[1]) or mul.input[1] == f"{p}/mask"):
        return None
    return site, (shrink, mul, expand, add)


def _gathered_mask(value: str, p: str, producers: dict, inputs: set[str]) -> bool:
    """Whether `value` is a site's token mask gathered by the rows it sees (graph.py: the LM head's
    `lora/<site>/mask` = Gather(lora_mask, logits_indices)): the op reads it as it reads a mask input."""
    node = producers.get(value)
    return (value == f"{p}/mask" and node is not None and node.op_type == "Gather" and
            node.name == f"{p}/Gather_mask" and node.input[0] in inputs and bool(_MASK.fullmatch(node.input[0])))


def fuse_lora(model, threads: int) -> int:
    """Replace every LoRA site's four-node branch of an ONNX ModelProto by one llmc.LoraDelta node, in place, for a
    session of `threads` intra-op threads; returns how many sites were fused."""
    from onnx import helper

    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = readers_of(graph)
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    gone: set[int] = set()  # id() of the nodes fused away
    fused: dict[int, object] = {}  # id() of a branch's Add -> the node in its place
    dropped: set[str] = set()  # the intermediate values, whose value_info goes
    for node in graph.node:
        found = _branch(node, producers, readers, inputs, outputs) if node.name.startswith("lora/") else None
        if found is None:
            continue
        site, (shrink, mul, expand, add) = found
        fused[id(add)] = helper.make_node(
            LORA_OP, [add.input[0], shrink.input[0], shrink.input[1], mul.input[1], expand.input[1]], [add.output[0]],
            name=f"lora/{site}/{LORA_OP}", domain=DOMAIN, threads=max(1, threads), site=site)
        gone.update(id(n) for n in (shrink, mul, expand))
        dropped.update(o for n in (shrink, mul, expand) for o in n.output)
    if not fused:
        return 0
    replace_nodes(model, [fused.get(id(n), n) for n in graph.node if id(n) not in gone], dropped)
    return len(fused)
