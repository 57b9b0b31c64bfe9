"""The flat-slot LoRA branch: a graph pass over an exported llmc graph adding, beside each site's projection
(sites.py), the deltas of the adapters a step's tokens use. The projection itself (fp32 MatMul, Gemm, or int8/int4
MatMulNBits after weight-only quantization) is not touched: only its output gains an Add.

New graph inputs (names and layout: runtime/lora/sites.py; the runtime binds them, runtime/lora/stacks.py):

    lora.<site>.a   fp32 [in, S*M*R]            the step's S slots' A side by side; M = the site's PEFT modules (3
                                                for a Llama q/k/v projection, 1 elsewhere), slot s in columns
                                                s*M*R .., module m of it at m*R ..
    lora.<site>.b   fp32 [S*M*R, out]           the slots' B stacked the same way, PEFT's scaling folded in, module
                                                m's rows written only into m's output columns: block-diagonal
    lora_mask(_xM)  fp32 [num_tokens, S*M*R]    1 in the token's own slot's columns, else 0 (none: all 0); a slot
                                                graph's [batch, seq, S*M*R]

Each site is four nodes, no reshape, transpose or batched MatMul:

    h  = MatMul(x, A)          [.., N, S*M*R]   shrink: every slot's columns at once, one GEMM
    h' = Mul(h, mask)                           a token keeps its own slot's columns only
    d  = MatMul(h', B)         [.., N, out]     expand: the sum over the columns is the token's slot's term alone
    y' = Add(y, d)

which is y = x W + (x A_slot) B_slot per token, and for a fused site each module's own x A_m B_m in its own
columns (the block-diagonal B keeps q's delta out of k's and v's columns). A token with no slot gets exactly +0.
A site that sees only some tokens' rows (the LM head: `rows` = logits_indices) reads the token mask gathered by
that input, one node before its branch: `lora/<site>/mask` = Gather(mask, logits_indices), [L, S*M*R].
x and y keep the projection's own shapes (the paged graph's tokens: [1, N, in] or [N, in]); the mask [N, S*M*R]
broadcasts over the leading 1. A slot graph's (the TensorRT target's, and the fused and reference lowerings on ONNX
Runtime) are [batch, seq, in], and its masks [batch, seq, S*M*R]: a row per token as well. S and R are dynamic: a
step binds only the adapters its tokens use (S >= 1, the distinct ones; 0 for a step with none, where one graph serves
both) padded to the highest rank among them (R >= 1, zeros beyond a module's rank), not lora.max_slots x
lora.max_rank. (The stacked-slot layout before it, [S, in, M*R] stacks and an int64 slot per token, was ten nodes a
site: reshapes, a batched shrink, a transpose copy; docs/lora.md has what the change measured.)

The branch adds inputs, not initializers: the LoRA graph names the base graph's data file. Where the session fuses
each site into llmc.LoraDelta, a step with no adapter runs this graph too (every mask row 0: no slot read); where the
four nodes run as they are, the runtime keeps a session over the graph without this pass beside this one and runs
that for a step no token of which has a slot (runtime/runners/paged.py). An `If` over "any slot" would keep one
session there, at the price of a subgraph per site (or the whole decoder inside one).

A mixture layer's expert sites (runtime/lora/sites.py: `experts`) get one branch over its MoE node instead, which
recomputes the layer for the step's adapter tokens (experts.py). Over a QMoE node (quantized experts) that branch is
llmc's own op, `llmc.MoeLoraQ`, written here (runtime/kernels/moe_lora_fusion.py: quantized_branch), with the node
rewired to the tokens without a slot: the standard ops cannot read QMoE's codes, and the paged graph needs llmc's
kernel library anyway (its PagedAttention).

Where llmc's CPU kernels run, the session fuses each site's four nodes into one `llmc.LoraDelta` that reads only each
token's own slot (runtime/kernels/lora_fusion.py matches the node names and op types written here: `lora/<site>/
shrink`, `Mul_mask`, `expand`, `Add`; renaming them leaves the branch unfused, and its tests fail).

`lora_graph` writes such a graph of an export for a check (the verify-adapters stage, the TensorRT engine's), beside
a hard link of the export's weights.

Written here by hand: onnx and onnx_ir have graph editing, not a LoRA rewrite, and ONNX Runtime's own
adapters (onnxruntime-genai's og.Adapters) swap one adapter's weights per generator, not per token.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from onnx import ModelProto, TensorProto, helper

from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, ONNX_NAME

from llmc.compiler.lora import experts
from llmc.runtime.kernels.moe_lora_fusion import base_rows_nodes, quantized_branch
from llmc.runtime.lora.sites import OLD_SLOTS, Site, a_name, b_name, mask_name, mask_names, stack_shapes

_PREFIX = "lora"  # every value and node this pass adds is named lora/...
BRANCH_OPS = ("MatMul", "Mul", "MatMul", "Add")  # a site's nodes, in order


def cols_dim(members: int) -> str:
    """The symbolic width of the flat stacks of a site with `members` PEFT modules: `lora_cols` (S*R), or
    `lora_cols_x<M>` (S*M*R)."""
    return "lora_cols" if members == 1 else f"lora_cols_x{members}"


def add_lora_branches(model: ModelProto, sites: list[Site]) -> None:
    """Add the branch for every site to `model` in place (sites found on this graph, or on the fp32 export it was
    quantized from: the pass looks tensors up by name)."""
    graph = model.graph
    if not sites:
        raise ValueError("no sites: find_sites gives every layer projection of an exported graph")
    if any(i.name in (OLD_SLOTS, *mask_names(sites)) for i in graph.input):
        raise ValueError("the graph already has LoRA inputs: the LoRA pass ran on it before")
    producers = {out: k for k, node in enumerate(graph.node) for out in node.output}  # tensor -> node index
    inputs = {i.name for i in graph.input}
    for site in sites:
        if site.x not in producers and site.x not in inputs or site.y not in producers:
            missing = site.x if site.y in producers else site.y
            raise ValueError(f"site {site.name}: no tensor {missing} in the graph")
        if site.rows is not None and site.rows not in inputs:
            raise ValueError(f"site {site.name}: no graph input {site.rows} picking its rows")
    fp32_weights = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    tokens = _token_dims(graph)
    for members in sorted({len(site.members) for site in sites}):
        graph.input.append(helper.make_tensor_value_info(mask_name(members), TensorProto.FLOAT,
                                                         [*tokens, cols_dim(members)]))
    for site in sites:
        cols = cols_dim(len(site.members))
        a_shape, b_shape = stack_shapes(site, cols)
        graph.input.append(helper.make_tensor_value_info(a_name(site), TensorProto.FLOAT, list(a_shape)))
        graph.input.append(helper.make_tensor_value_info(b_name(site), TensorProto.FLOAT, list(b_shape)))
    after: dict[int, list] = {}  # node index -> the branch nodes that follow it (one per output it is a site's y of)
    for site in (s for s in sites if not s.experts):
        k = producers[site.y]
        producer = graph.node[k]
        base = f"{_PREFIX}/{site.name}/base"
        producer.output[list(producer.output).index(site.y)] = base
        after.setdefault(k, []).extend(_branch_nodes(site, base))
    before: dict[int, list] = {}  # node index -> the nodes that go before it (a QMoE node's gathered inputs)
    for fc1, fc2 in _expert_pairs(sites):  # a mixture layer's fc1 and fc2 sites: one branch over its MoE node
        k = producers[fc1.y]
        moe, layer = graph.node[k], fc1.name.rpartition(".")[0]
        if (moe.op_type, moe.domain) == ("QMoE", experts.MICROSOFT):  # codes the standard ops cannot read: llmc's op
            before[k], after[k] = quantized_branch(moe, layer, [n(s) for s in (fc1, fc2) for n in (a_name, b_name)])
            continue
        if (moe.op_type, moe.domain) != ("MoE", experts.MICROSOFT) or moe.input[2] not in fp32_weights:
            raise ValueError(f"site {fc1.name}: {fc1.y} is not made by a com.microsoft.MoE or QMoE node")
        base = f"{_PREFIX}/{layer}/base"
        moe.output[0] = base
        after.setdefault(k, []).extend(experts.branch_nodes(moe, fc1, fc2, base))
    nodes = [helper.make_node("Gather", [mask_name(len(site.members)), site.rows], [site_mask(site)], axis=0,
                              name=f"{_PREFIX}/{site.name}/Gather_mask") for site in sites if site.rows is not None]
    nodes += base_rows_nodes() if before else []  # the tokens without a slot, found once for every QMoE node
    for k, node in enumerate(graph.node):
        nodes.extend(before.get(k, []))
        nodes.append(node)
        nodes.extend(after.get(k, []))
    del graph.node[:]
    graph.node.extend(nodes)


def _expert_pairs(sites: list[Site]) -> list[tuple[Site, Site]]:
    """The expert sites as (fc1, fc2) of each MoE node (both come from it: experts.find_expert_sites)."""
    by_y: dict[str, dict[str, Site]] = {}
    for site in (s for s in sites if s.experts):
        by_y.setdefault(site.y, {})[site.name.rpartition(".")[2]] = site
    for y, pair in by_y.items():
        if set(pair) != {"fc1", "fc2"}:
            raise ValueError(f"the expert sites of {y} are {sorted(pair)}, not its fc1 and fc2")
    return [(pair["fc1"], pair["fc2"]) for pair in by_y.values()]


def _token_dims(graph) -> list[str]:
    """The dims a token mask has: input_ids' ([num_tokens] in a paged graph, [batch, seq] in a slot graph)."""
    ids = next((i for i in graph.input if i.name == "input_ids"), None)
    dims = list(ids.type.tensor_type.shape.dim) if ids is not None else []
    if len(dims) == 2:
        return [d.dim_param or f"lora_tokens_{k}" for k, d in enumerate(dims)]
    return [dims[0].dim_param if len(dims) == 1 and dims[0].dim_param else "lora_tokens"]


def site_mask(site: Site) -> str:
    """The mask `site`'s branch reads: the token mask, or its rows gathered (`lora/<site>/mask`, a `rows` site)."""
    return mask_name(len(site.members)) if site.rows is None else f"{_PREFIX}/{site.name}/mask"


def _branch_nodes(site: Site, base: str) -> list:
    p = f"{_PREFIX}/{site.name}"
    return [
        helper.make_node("MatMul", [site.x, a_name(site)], [f"{p}/h"], name=f"{p}/shrink"),
        helper.make_node("Mul", [f"{p}/h", site_mask(site)], [f"{p}/h_own"], name=f"{p}/Mul_mask"),
        helper.make_node("MatMul", [f"{p}/h_own", b_name(site)], [f"{p}/delta"], name=f"{p}/expand"),
        helper.make_node("Add", [base, f"{p}/delta"], [site.y], name=f"{p}/Add"),
    ]


@contextlib.contextmanager
def lora_graph(export_graph: Path, sites: Sequence[Site], folder: Path) -> Iterator[Path]:
    """The export's graph with a branch beside each site, saved in a temporary folder under `folder` beside a hard link
    of the export's weights file (ONNX Runtime refuses a symbolic link out of the model's folder; across file systems
    the folder goes beside the export instead, never a copy), removed after."""
    import onnx

    graph = onnx.load(str(export_graph), load_external_data=False)  # its weights stay in the export's data file
    add_lora_branches(graph, list(sites))
    data = export_graph.parent / EXTERNAL_DATA_NAME
    tmp = Path(tempfile.mkdtemp(prefix=".llmc-lora-", dir=folder))
    try:
        if data.is_file():
            try:
                os.link(data, tmp / EXTERNAL_DATA_NAME)
            except OSError:
                shutil.rmtree(tmp)
                tmp = Path(tempfile.mkdtemp(prefix=".llmc-lora-", dir=export_graph.parent))
                os.link(data, tmp / EXTERNAL_DATA_NAME)
        onnx.save(graph, str(tmp / ONNX_NAME))
        yield tmp / ONNX_NAME
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
