"""LoRA on a mixture's experts (PEFT's `target_parameters` over the fused 3-D expert weights): the expert sites of an
exported graph, and the branch that serves them.

PEFT wraps a 3-D parameter `experts.gate_up_proj` or `experts.down_proj` (transformers 5's fused experts) with one
LoRA pair for all E experts: lora_A [E*r, in] (expert e's A in rows e*r ..), lora_B [out, r*E] (its B in columns
e, E + e, ...), so expert e's projection gains scaling * B_e A_e (peft/tuners/lora/layer.py: ParamWrapper). `in` and
`out` are the projection's: the parameter is [E, out, in], or [E, in, out] where the experts module says
`is_transposed` (gpt-oss). The delta sits inside the expert MLP, before the SwiGLU for gate_up_proj, so it cannot be
added to the MoE op's output as a dense site's is (graph.py): ONNX Runtime's MoE node has fixed weights and no LoRA.

The branch (`branch_nodes`) recomputes the layer's MoE for the step's adapter tokens only and writes their rows over
the MoE node's output; the node itself stays as it is and still computes every token, so a step without an adapter
token costs the base's MoE (the branch runs on zero rows). For each adapter token it runs every expert, its slot's
deltas added, and weighs them by the token's routing (a softmax, the top k kept, renormalized as the node does:
plugins/op/moe.py), which is E/k times the routed experts' work for those tokens. Written in standard ONNX ops, so any
ONNX Runtime runs it; an op that runs only the routed experts of each adapter token is the next step (docs/lora.md).

    rows  = NonZero(ReduceMax(lora_mask, 1) > 0)                the adapter tokens (any slot column set)
    x, logits, mask = their rows (Gather)
    w     = top-k routing weights, 0 elsewhere                  [Na, E]
    g     = fc1 x + b1 + (x A1 * mask) B1                       [E, Na, 2I], every expert
    h     = SwiGLU(g) (interleaved, alpha, beta, limit)         [E, Na, I]
    o     = fc2 h + b2 + (h A2 * mask) B2                       [E, Na, H]
    y     = ScatterND(y_base, rows, sum_e w[:, e] o[e])

The stacks (runtime/lora/sites.py): lora.experts.<i>.fc1.a [E, H, S*R], .b [E, S*R, 2I] with B's rows in the op's
interleaved gate/up order, and the same for fc2; the token mask is `lora_mask` (one PEFT parameter a site).

Written here by hand: neither PEFT nor ONNX Runtime has per-token LoRA on MoE experts for ONNX graphs.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto, helper

from llmc.runtime.lora.sites import Member, Site, a_name, b_name, mask_name

MICROSOFT = "com.microsoft"
_EXPERTS = re.compile(r"^(?:.+\.)?layers\.(\d+)\.mlp\.experts$")  # the HF experts module of layer i
_SCOPE = re.compile(r"^decoder\.experts\.(\d+)$")  # the llmc ExpertLayer the MoE node was traced in
_STAMPED = re.compile(r"\.layer(\d+)$")
FC = {"gate_up_proj": "fc1", "down_proj": "fc2"}  # transformers 5's fused experts -> the MoE op's weights


@dataclass(frozen=True)
class ExpertParam:
    """One 3-D expert parameter PEFT can target, as the MoE op sees it."""

    key: str  # the parameter's name in the checkpoint's model (model.layers.0.mlp.experts.gate_up_proj)
    layer: int
    fc: str  # "fc1" (gate_up_proj) or "fc2" (down_proj)
    experts: int
    in_features: int
    out_features: int
    interleave: bool  # PEFT's output rows are [gate | up] and the op's fc1 rows interleaved
    order: int  # its place among its module's parameters (PEFT nests wrappers in this order: adapter.py)

    @property
    def site(self) -> str:
        return f"experts.{self.layer}.{self.fc}"


def expert_params(hf_model) -> dict[str, list[ExpertParam]]:
    """Experts module name -> the parameters of it that expert LoRA serves, in the module's order; {} for a dense
    model."""
    from llmc.compiler.models import family_of

    family = family_of(hf_model.config.model_type)
    if not family.experts:
        return {}
    interleaved = bool(getattr(family.decoder, "GATE_UP_INTERLEAVED", False))
    found: dict[str, list[ExpertParam]] = {}
    for name, module in hf_model.named_modules():
        match = _EXPERTS.match(name)
        params = dict(module.named_parameters(recurse=False))
        if match is None or not set(FC) <= set(params):
            continue
        transposed = bool(getattr(module, "is_transposed", False))  # PEFT reads [E, in, out] then (ParamWrapper)
        listed = []
        for order, (param_name, param) in enumerate(params.items()):
            if param_name not in FC:
                continue
            experts, d1, d2 = param.shape
            fin, fout = (d1, d2) if transposed else (d2, d1)
            fc = FC[param_name]
            listed.append(ExpertParam(f"{name}.{param_name}", int(match[1]), fc, int(experts), int(fin), int(fout),
                                      fc == "fc1" and not interleaved, order))
        found[name] = listed
    return found


def params_of_sites(sites) -> dict[str, list[ExpertParam]]:
    """expert_params rebuilt from a site table (the manifest's): what a served model knows of its experts."""
    found: dict[str, list[ExpertParam]] = {}
    for site in sorted((s for s in sites if s.experts), key=lambda s: s.order):
        key = site.members[0].module
        layer, fc = site.name.split(".")[1:]
        found.setdefault(key.rpartition(".")[0], []).append(ExpertParam(
            key, int(layer), fc, site.experts, site.in_features, site.out_features, site.interleave, site.order))
    return found


def find_expert_sites(model, hf_model) -> list[Site]:
    """The expert sites of `model` (an exported graph): fc1 and fc2 of each full-precision com.microsoft.MoE node.
    A quantized node (QMoE) has none: the branch reads the experts' fp32 weights."""
    by_site = {p.site: p for listed in expert_params(hf_model).values() for p in listed}
    layers = {p.layer for p in by_site.values()}
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    sites = []
    for node in model.graph.node:
        if node.op_type != "MoE" or node.domain != MICROSOFT:
            continue
        layer = _layer(node)
        if layer is None or layer not in layers:
            raise ValueError(f"MoE node {node.name}: no experts module of the checkpoint for its layer ({layer})")
        for fc, weight in (("fc1", node.input[2]), ("fc2", node.input[4])):
            param = by_site[f"experts.{layer}.{fc}"]
            want = [param.experts, param.out_features, param.in_features]
            if dims.get(weight) != want:
                raise ValueError(f"MoE node {node.name}: its {fc} is {dims.get(weight)}, not {param.key}'s {want}")
            sites.append(Site(param.site, node.input[0], node.output[0], param.in_features, param.out_features,
                              (Member(param.key, 0, param.out_features),), experts=param.experts,
                              interleave=param.interleave, order=param.order))
    return sites


def _layer(node) -> int | None:
    scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
    stamped = _STAMPED.search(node.output[0])
    for scope in ast.literal_eval(scopes) if scopes else ():
        match = _SCOPE.match(scope)
        if match:
            return int(stamped[1]) if stamped else int(match[1])
    return None


def op_rows(b: np.ndarray, interleave: bool) -> np.ndarray:
    """PEFT's output rows of an expert's B (last axis) in the op's order: [gate | up] -> gate 0, up 0, gate 1, ..."""
    if not interleave:
        return b
    gate, up = np.split(b, 2, axis=-1)
    return np.stack((gate, up), axis=-1).reshape(b.shape)


def branch_nodes(moe: NodeProto, fc1: Site, fc2: Site, base: str) -> list[NodeProto]:
    """The nodes recomputing `moe`'s output for the adapter tokens (module docstring): they read the node's inputs
    and `base` (its output, renamed) and write `fc1.y`."""
    attrs = {a.name: helper.get_attribute_value(a) for a in moe.attribute}
    k, normalize = int(attrs["k"]), bool(attrs.get("normalize_routing_weights", 0))
    alpha, beta, limit = (float(attrs.get(a, d)) for a, d in
                          (("activation_alpha", 1.0), ("activation_beta", 0.0), ("swiglu_limit", 0.0)))
    x, logits, w1, b1, w2, b2 = (list(moe.input) + [""] * 6)[:6]
    p = f"lora/{fc1.name.rpartition('.')[0]}"
    nodes: list[NodeProto] = []

    def node(op: str, inputs: list[str], name: str, **attributes) -> str:
        nodes.append(helper.make_node(op, inputs, [f"{p}/{name}"], name=f"{p}/{name}", **attributes))
        return f"{p}/{name}"

    def const(name: str, value, dtype=TensorProto.INT64) -> str:
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if isinstance(value, list) else []
        nodes.append(helper.make_node("Constant", [], [f"{p}/{name}"], name=f"{p}/{name}",
                                      value=helper.make_tensor(name, dtype, dims, values)))
        return f"{p}/{name}"

    def scalar(name: str, value: float) -> str:
        return const(name, float(value), TensorProto.FLOAT)

    def projection(fc: str, inputs: str, weight: str, bias: str, site: Site, own: str) -> str:
        """[E, Na, out]: every expert's projection of `inputs` ([Na, in], or [E, Na, in] per expert), its bias and
        the token's slot's delta."""
        per_expert = node("Transpose", [inputs], f"{fc}_in_t", perm=[0, 2, 1] if fc == "fc2" else [1, 0])
        out = node("Transpose", [node("MatMul", [weight, per_expert], f"{fc}_base_t")], f"{fc}_base", perm=[0, 2, 1])
        if bias:
            out = node("Add", [out, node("Unsqueeze", [bias, const(f"{fc}_bias_axis", [1])], f"{fc}_bias")],
                       f"{fc}_biased")
        h = node("Mul", [node("MatMul", [inputs, a_name(site)], f"{fc}_shrink"), own], f"{fc}_own")
        return node("Add", [out, node("MatMul", [h, b_name(site)], f"{fc}_expand")], f"{fc}_out")

    mask = mask_name(1)
    rows2 = node("Transpose", [node("NonZero", [node("Greater", [
        node("ReduceMax", [mask, const("columns", [1])], "any", keepdims=0), scalar("zero", 0.0)], "flag")],
        "nonzero")], "rows2", perm=[1, 0])  # [Na, 1]
    rows = node("Squeeze", [rows2, const("row_axis", [1])], "rows")
    xa, la = node("Gather", [x, rows], "x", axis=0), node("Gather", [logits, rows], "logits", axis=0)
    own = node("Unsqueeze", [node("Gather", [mask, rows], "mask", axis=0), const("expert_axis", [0])], "own")

    probs = node("Softmax", [la], "probs", axis=-1)
    top_w, top_e = f"{p}/top_weights", f"{p}/top_experts"
    nodes.append(helper.make_node("TopK", [probs, const("k", [k])], [top_w, top_e], name=f"{p}/top_k", axis=-1))
    if normalize:
        top_w = node("Div", [top_w, node("ReduceSum", [top_w, const("k_axis", [1])], "top_sum", keepdims=1)],
                     "top_normalized")
    zeros = node("ConstantOfShape", [node("Shape", [probs], "routing_shape")], "routing_zeros",
                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    weights = node("ScatterElements", [zeros, top_e, top_w], "routing", axis=1)  # [Na, E]
    weights = node("Unsqueeze", [node("Transpose", [weights], "routing_t", perm=[1, 0]), const("out_axis", [2])],
                   "routing_e")  # [E, Na, 1]

    g = projection("fc1", xa, w1, b1, fc1, own)
    start, stop, step, axis = (const(n, [v]) for n, v in (("even", 0), ("end", 1 << 62), ("two", 2), ("last", 2)))
    gate = node("Slice", [g, start, stop, axis, step], "gate")
    up = node("Slice", [g, const("odd", [1]), stop, axis, step], "up")
    if limit > 0:
        gate = node("Clip", [gate, "", scalar("limit", limit)], "gate_clipped")
        up = node("Clip", [up, scalar("neg_limit", -limit), scalar("limit_up", limit)], "up_clipped")
    sig_in = gate if alpha == 1.0 else node("Mul", [gate, scalar("alpha", alpha)], "gate_alpha")
    silu = node("Mul", [gate, node("Sigmoid", [sig_in], "sigmoid")], "silu")
    up = up if beta == 0.0 else node("Add", [up, scalar("beta", beta)], "up_beta")
    h = node("Mul", [silu, up], "swiglu")  # [E, Na, I]

    o = projection("fc2", h, w2, b2, fc2, own)
    ya = node("ReduceSum", [node("Mul", [o, weights], "weighted"), const("sum_axis", [0])], "y", keepdims=0)
    nodes.append(helper.make_node("ScatterND", [base, rows2, ya], [fc1.y], name=f"{p}/scatter"))
    return nodes
