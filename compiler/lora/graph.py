"""The stacked-slot LoRA branch: a graph pass over an exported llmc graph adding, beside each site's projection
(sites.py), the deltas of the adapters a step's tokens use. The projection itself (fp32 MatMul, Gemm, or int8/int4
MatMulNBits after weight-only quantization) is not touched: only its output gains an Add.

New graph inputs (names: `SLOTS`, `a_name(site)`, `b_name(site)`, from runtime/lora/sites.py: the runtime binds them):

    lora_slots      int64 [N]              each token's slot, -1 for none (N: the tokens of x flattened, so
                                           `num_tokens` in the paged graph)
    lora.<site>.a   fp32 [S, in, M*R]      slot s's A for the site; M = the site's PEFT modules (3 for a
                                           Llama q/k/v projection, 1 elsewhere), module m in columns m*R ..
    lora.<site>.b   fp32 [S, M*R, out]     slot s's B with PEFT's scaling folded in, module m's rows m*R ..
                                           written only into m's output columns: block-diagonal

For each site, with one-hot(slot) as a mask [S, N, 1] shared by all sites:

    h  = MatMul(x [N, in], A [S, in, M*R])                    [S, N, M*R]   shrink: every slot at once
    h  = h * mask                                             a token keeps its own slot's row only
    d  = MatMul(Transpose(h) -> [N, S*M*R], B -> [S*M*R, out]) [N, out]     expand: the sum over slots is
    y' = y + Reshape(d, Shape(y))                                           the token's slot's term alone

which is y = x W + (x A[slot]) B[slot] per token, and for a fused site each module's own x A_m B_m in its own
columns (the block-diagonal B keeps q's delta out of k's and v's columns). A token with slot -1 gets exactly
+0. S and R are dynamic: a step binds only the adapters its tokens use (S >= 1, the distinct ones) padded to
the highest rank among them (R >= 1, zeros beyond a module's rank), not lora.max_slots x lora.max_rank.

A step with no adapter costs what the base costs: the runtime keeps the graph without this pass beside the one
with it (the same weights: the branch adds inputs, not initializers, so a second session can map the same data
file) and runs the base graph whenever no token of the step has a slot. An `If` over "any slot >= 0" would keep
one session, at the price of a subgraph per site (or the whole decoder inside one) and whatever ONNX Runtime
charges for them; which is cheaper is the next slice's measurement (docs/lora.md).

Written here by hand: onnx and onnx_ir have graph editing, not a LoRA rewrite, and ONNX Runtime's own
adapters (onnxruntime-genai's og.Adapters) swap one adapter's weights per generator, not per token.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from llmc.runtime.lora.sites import SLOTS, Site, a_name, b_name

_PREFIX = "lora"  # every value and node this pass adds is named lora/...


def rank_dim(site: Site) -> str:
    """The symbolic rank dim of a site's stacks: `lora_rank`, times its modules when it has several."""
    return "lora_rank" if len(site.members) == 1 else f"lora_rank_x{len(site.members)}"


def add_lora_branches(model: ModelProto, sites: list[Site]) -> None:
    """Add the branch for every site to `model` in place (sites found on this graph, or on the fp32 export it was
    quantized from: the pass looks tensors up by name)."""
    graph = model.graph
    if not sites:
        raise ValueError("no sites: find_sites gives every layer projection of an exported graph")
    if any(i.name == SLOTS for i in graph.input):
        raise ValueError(f"the graph already has a {SLOTS} input: the LoRA pass ran on it before")
    producers = {out: k for k, node in enumerate(graph.node) for out in node.output}  # tensor -> node index
    inputs = {i.name for i in graph.input}
    for site in sites:
        if site.x not in producers and site.x not in inputs or site.y not in producers:
            missing = site.x if site.y in producers else site.y
            raise ValueError(f"site {site.name}: no tensor {missing} in the graph")
    tokens = _token_dim(graph)
    graph.input.append(helper.make_tensor_value_info(SLOTS, TensorProto.INT64, [tokens]))
    for site in sites:
        rank = rank_dim(site)
        graph.input.append(helper.make_tensor_value_info(a_name(site), TensorProto.FLOAT,
                                                         ["lora_num_slots", site.in_features, rank]))
        graph.input.append(helper.make_tensor_value_info(b_name(site), TensorProto.FLOAT,
                                                         ["lora_num_slots", rank, site.out_features]))
    mask = f"{_PREFIX}/mask"
    head = _mask_nodes(graph, a_name(sites[0]), mask)
    after: dict[int, list] = {}  # node index -> the branch nodes that follow it (one per output it is a site's y of)
    for site in sites:
        k = producers[site.y]
        producer = graph.node[k]
        base = f"{_PREFIX}/{site.name}/base"
        producer.output[list(producer.output).index(site.y)] = base
        after.setdefault(k, []).extend(_branch_nodes(graph, site, base, mask))
    nodes = list(head)
    for k, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(after.get(k, []))
    del graph.node[:]
    graph.node.extend(nodes)


def _token_dim(graph) -> str:
    """The paged graph's token dim (input_ids is [num_tokens]); a slot graph's x is [batch, sequence] flattened."""
    ids = next((i for i in graph.input if i.name == "input_ids"), None)
    dims = list(ids.type.tensor_type.shape.dim) if ids is not None else []
    return dims[0].dim_param if len(dims) == 1 and dims[0].dim_param else "lora_tokens"


def _const(graph, name: str, values) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def _mask_nodes(graph, first_a: str, mask: str) -> list:
    """mask [S, N, 1] fp32: 1 where token n's slot is s. S is read off the first site's A stack."""
    p = f"{_PREFIX}/mask"
    zero, one = _const(graph, f"{p}/zero", 0), _const(graph, f"{p}/one", 1)
    axis0, axis1, axis2 = (_const(graph, f"{p}/axis{k}", [k]) for k in range(3))
    return [
        helper.make_node("Shape", [first_a], [f"{p}/shape"], name=f"{p}/Shape", start=0, end=1),
        helper.make_node("Squeeze", [f"{p}/shape", axis0], [f"{p}/num_slots"], name=f"{p}/Squeeze"),
        helper.make_node("Range", [zero, f"{p}/num_slots", one], [f"{p}/slot_ids"], name=f"{p}/Range"),
        helper.make_node("Unsqueeze", [f"{p}/slot_ids", axis1], [f"{p}/slot_col"], name=f"{p}/Unsqueeze_col"),
        helper.make_node("Unsqueeze", [SLOTS, axis0], [f"{p}/token_row"], name=f"{p}/Unsqueeze_row"),
        helper.make_node("Equal", [f"{p}/slot_col", f"{p}/token_row"], [f"{p}/hit"], name=f"{p}/Equal"),
        helper.make_node("Cast", [f"{p}/hit"], [f"{p}/hit_f"], name=f"{p}/Cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [f"{p}/hit_f", axis2], [mask], name=f"{p}/Unsqueeze_mask"),
    ]


def _branch_nodes(graph, site: Site, base: str, mask: str) -> list:
    p = f"{_PREFIX}/{site.name}"
    x_shape = _const(graph, f"{p}/x_shape", [-1, site.in_features])
    h_shape = _const(graph, f"{p}/h_shape", [0, -1])
    b_shape = _const(graph, f"{p}/b_shape", [-1, site.out_features])
    return [
        helper.make_node("Reshape", [site.x, x_shape], [f"{p}/x"], name=f"{p}/Reshape_x"),
        helper.make_node("MatMul", [f"{p}/x", a_name(site)], [f"{p}/h"], name=f"{p}/shrink"),
        helper.make_node("Mul", [f"{p}/h", mask], [f"{p}/h_own"], name=f"{p}/Mul_mask"),
        helper.make_node("Transpose", [f"{p}/h_own"], [f"{p}/h_t"], name=f"{p}/Transpose", perm=[1, 0, 2]),
        helper.make_node("Reshape", [f"{p}/h_t", h_shape], [f"{p}/h_flat"], name=f"{p}/Reshape_h"),
        helper.make_node("Reshape", [b_name(site), b_shape], [f"{p}/b_flat"], name=f"{p}/Reshape_b"),
        helper.make_node("MatMul", [f"{p}/h_flat", f"{p}/b_flat"], [f"{p}/delta"], name=f"{p}/expand"),
        helper.make_node("Shape", [base], [f"{p}/y_shape"], name=f"{p}/Shape_y"),
        helper.make_node("Reshape", [f"{p}/delta", f"{p}/y_shape"], [f"{p}/delta_y"], name=f"{p}/Reshape_delta"),
        helper.make_node("Add", [base, f"{p}/delta_y"], [site.y], name=f"{p}/Add"),
    ]
