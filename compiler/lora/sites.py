"""Where a LoRA branch goes in an exported llmc graph: one `Site` per weight projection of a decoder layer, with
the PEFT module names (the HF model's own) whose deltas land in its output columns.

torch.onnx names a projection's MatMul/Gemm node anonymously (`node_linear_2`, its weight `val_61`), but its
metadata keeps the module it was traced in (`pkg.torch.onnx.name_scopes`: `decoder.layers.0.mlp.gate_proj`).
Layers stamped from a traced one (compiler/graph/stamp.py) carry layer p's scopes with every output renamed
`<name>.layer{j}`, so the layer index comes from that suffix when present. The decoder (compiler/models)
reuses the HF model's modules, so a decoder path maps to an HF module name by identity; the one module it
makes itself is the fused q/k/v projection (`decoder.qkv.{i}`, base.py's `concat_linears`), whose output
columns are q_proj's, k_proj's and v_proj's side by side (checked against their weights here, not assumed; by
shape on a model built on the meta device, as the package stage builds it: compiler/lora/package.py).
Phi-3's `qkv_proj` and GPT-2's `c_attn` are the checkpoint's own fused modules: one PEFT module, one site.
A mixture's experts are sites of another kind (experts.py): PEFT targets their 3-D parameters, not modules.

An untied LM head is a site too (`lm_head`): it sees only the rows `logits_indices` picks, so its `rows` names that
input and the branch gathers the token mask by it (graph.py). A tied head is the input embeddings as well: not served.

A site's `y` is the projection's whole output (its bias Add included, so a later fold of MatMulNBits + bias
still matches) and `x` its input activation. Quantization keeps both names (MatMulNBits reads the same input
and writes the same output; merged siblings split back into their outputs), so sites found on the fp32 export
apply to its weight-only graph too (docs/lora.md says what AWQ's scales need first).
Written here: neither torch.onnx nor onnx_ir maps exported nodes back to modules.
"""

from __future__ import annotations

import ast
import re

from llmc.compiler.lora.base import tied_head
from llmc.compiler.lora.experts import find_expert_sites
from llmc.runtime.lora.sites import Member, Site

_LAYERWISE = re.compile(r"^decoder\.(layers|qkv)\.(\d+)(\..+)?$")
HEAD = "lm_head"  # the LM head's decoder path (base.py: decoder.lm_head), and its site's name
HEAD_ROWS = "logits_indices"  # the paged graph's input picking the rows the head sees (compiler/paged_decoder.py)
_STAMPED = re.compile(r"\.layer(\d+)$")


def module_members(hf_model) -> dict[str, tuple[Member, ...]]:
    """Decoder module path -> the PEFT modules computing its output columns, for every linear projection of the
    decoder's layers (experts excluded) and an untied LM head (`lm_head`; a tied one is the embeddings too)."""
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from llmc.compiler.models import decoder_for

    decoder = decoder_for(hf_model)
    hf_names = {id(m): name for name, m in hf_model.named_modules()}
    members: dict[str, tuple[Member, ...]] = {}
    fused: set[int] = set()  # q/k/v modules the decoder runs through its own concatenation, never alone
    for path, module in decoder.named_modules(remove_duplicate=False):  # Phi-3's qkv_proj is layers.i.…, qkv.i
        if not isinstance(module, (nn.Linear, Conv1D)) or not _LAYERWISE.match(f"decoder.{path}"):
            continue
        width = module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]
        if id(module) in hf_names:
            members[path] = (Member(hf_names[id(module)], 0, width),)
            continue
        layer = int(path.split(".")[1])
        attn = decoder.attention_module(decoder.layers[layer])
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        if not _side_by_side(module.weight, [p.weight for p in parts]):
            raise ValueError(f"decoder.{path} is no module of the checkpoint nor its q/k/v projections side by side")
        offsets = [0, *torch.cumsum(torch.tensor([p.out_features for p in parts]), 0).tolist()]
        members[path] = tuple(Member(hf_names[id(p)], offsets[k], p.out_features) for k, p in enumerate(parts))
        fused.update(id(p) for p in parts)
    head = hf_model.get_output_embeddings()
    if head is not None and not tied_head(hf_model) and id(head) in hf_names and decoder.lm_head is head:
        members[HEAD] = (Member(hf_names[id(head)], 0, head.out_features),)
    fused_names = {hf_names[i] for i in fused}
    return {path: m for path, m in members.items() if not (len(m) == 1 and m[0].module in fused_names)}


def _side_by_side(weight, parts) -> bool:
    """Whether `weight` is `parts` concatenated over rows: by value, or by shape for a model built on the meta device
    (the package stage's, from the config alone: the decoder's own concat_linears put them in this order)."""
    import torch

    if weight.is_meta or any(p.is_meta for p in parts):
        return weight.shape[0] == sum(p.shape[0] for p in parts) and all(p.shape[1:] == weight.shape[1:] for p in parts)
    return torch.equal(weight, torch.cat(parts))


def find_sites(model, hf_model) -> list[Site]:
    """The sites of `model` (an exported llmc graph, onnx.ModelProto) for `hf_model`, its checkpoint's model;
    every layer projection must be found exactly once. A mixture's full-precision experts add their expert sites
    (experts.py) after the projections'."""
    members = module_members(hf_model)
    initializers = {t.name: t for t in model.graph.initializer}
    graph_inputs = {i.name for i in model.graph.input}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    sites: dict[str, Site] = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        path = _module_path(node, members)
        if path is None:
            continue
        weight = list(initializers[node.input[1]].dims)
        transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        k, n = weight[::-1] if transposed else weight
        y = node.output[0]
        users = consumers.get(y, [])
        if node.op_type == "MatMul" and len(users) == 1 and users[0].op_type == "Add" and \
                any(i in initializers for i in users[0].input if i != y):
            y = users[0].output[0]  # the bias Add: the delta joins the whole output
        if any(site.members == members[path] for site in sites.values()):
            raise ValueError(f"decoder.{path}: a second projection in the graph for the same modules ({y})")
        width = sum(m.width for m in members[path])
        if n != width:
            raise ValueError(f"decoder.{path}: the graph's weight is {weight} but its modules give {width} outputs")
        rows = HEAD_ROWS if path == HEAD and HEAD_ROWS in graph_inputs else None  # a slot graph's head sees all
        sites[path] = Site(path, node.input[0], y, int(k), int(n), members[path], rows)
    missing = sorted({m.module for ms in members.values() for m in ms} -
                     {m.module for site in sites.values() for m in site.members})
    if missing:
        raise ValueError(f"no projection in the graph for {', '.join(missing)}")
    return [sites[path] for path in sorted(sites, key=_natural)] + find_expert_sites(model, hf_model)


def _module_path(node, members) -> str | None:
    """The decoder path (in `members`) of the module `node` was traced in, at the layer it computes."""
    scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
    if scopes is None:
        return None
    stamped = _STAMPED.search(node.output[0])
    for scope in reversed(ast.literal_eval(scopes)):
        if scope == f"decoder.{HEAD}" and HEAD in members:
            return HEAD
        match = _LAYERWISE.match(scope)
        if match is None:
            continue
        layer = int(stamped[1]) if stamped else int(match[2])
        path = f"{match[1]}.{layer}{match[3] or ''}"
        if path in members:
            return path
    return None


def _natural(path: str):
    return [int(p) if p.isdigit() else p for p in path.split(".")]
