"""The session-time expert-LoRA fusion: each mixture layer's branch of a LoRA graph (compiler/lora/experts.py: the
layer recomputed for the adapter tokens, every expert, in standard ops) becomes one `llmc.MoeLora` node
(moe_lora/: the C op, each adapter token's routed experts only), in the in-memory copy `cpu_kernels.prepare` opens,
beside lora_fusion.py's four-node sites and under the same switch (`LLMC_LORA_FUSION`).

A layer's branch is every node named `lora/experts.<i>/...`, ending in `lora/experts.<i>/scatter` (ScatterND over
`lora/experts.<i>/base`, the MoE node's output renamed). It is fused only when those nodes read nothing from outside
but the MoE node's inputs and output, `lora_mask` and the layer's four stacks (`lora.experts.<i>.fc1.a`, ...), and
nothing outside reads any of their values but the scatter's output; else it runs as stored. The routing attributes
are the MoE node's own. The names are experts.py's (the compiler's, which the runtime does not import:
tests/runtime/kernels/test_moe_lora.py fuses a graph the compiler's pass wrote, so a renaming there fails it).
"""

from __future__ import annotations

import re

from llmc.runtime.kernels.graph_edits import readers_of
from llmc.runtime.kernels.lora_fusion import DOMAIN

MOE_LORA_OP = "MoeLora"
_LAYER = re.compile(r"^lora/(experts\.\d+)/")
_ROUTING = ("k", "normalize_routing_weights", "activation_alpha", "activation_beta", "swiglu_limit")


def _layer_inputs(layer: str, moe, inputs: set[str]) -> list[str] | None:
    """llmc.MoeLora's inputs for the branch of `layer` over the MoE node `moe` (None: not the contract's)."""
    stacks = [f"lora.{layer}.{fc}.{w}" for fc in ("fc1", "fc2") for w in "ab"]
    if moe is None or moe.op_type != "MoE" or len(moe.input) < 5 or not set(stacks) | {"lora_mask"} <= inputs:
        return None
    x, logits, fc1, fc1_bias, fc2, fc2_bias = (list(moe.input) + [""] * 6)[:6]
    return [f"lora/{layer}/base", x, logits, fc1, fc1_bias, fc2, fc2_bias, "lora_mask", *stacks]


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
    fused: dict[int, object] = {}  # id() of a branch's scatter -> the node in its place
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
        fused[id(scatter)] = helper.make_node(MOE_LORA_OP, wanted, [scatter.output[0]], name=f"lora/{layer}/{MOE_LORA_OP}",
                                              domain=DOMAIN, threads=max(1, threads), site=layer, **routing)
        gone.update(id(n) for n in nodes if n is not scatter)
        dropped.update(made - {scatter.output[0]})
    if not fused:
        return 0
    kept_nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in gone]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    kept = [v for v in graph.value_info if v.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=DOMAIN, version=1)
    return len(fused)
