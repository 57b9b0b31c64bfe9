"""The paged attention op as a TensorRT plugin node, `LlmcPagedAttention`, and the rewrite that puts it
in place of a paged export's `llmc.PagedAttention` nodes (ONNX Runtime's contract, plugins/op/paged_op.py).

    LlmcPagedAttention(query [T, H*D], key [T, KVH*D], value [T, KVH*D],
                       key_cache [num_blocks, block_size, KVH, D], value_cache (same),
                       cumulative_sequence_length int32 [B + 1], past_seqlens int32 [B],
                       block_table int32 [B, max_blocks], cos_cache [P, R/2], sin_cache [P, R/2], head_sink [H]
                       [, split_partials fp32 [N], split_counters int32 [slots]])
      -> (output [T, H*D], key_cache_out, value_cache_out[, split_partials_out, split_counters_out])
                                                          the caches and split buffers aliased: updated in place

    attributes  plugin_version, plugin_namespace (the parser's registry key), num_heads, kv_num_heads,
                head_size, scale, rotary_dim (R; 0: no rotary, the tables a [1, D/2] zero placeholder, since
                a TensorRT plugin has a fixed number of inputs), rotary_interleaved, softcap,
                local_window_size, is_causal, sinks (1: head_sink, the contract's input 11, joins each head's
                softmax denominator; 0: head_sink is a [H] zero placeholder the kernel never reads); key_splits
                and split_slots with the split buffers (threaded through by compiler/tensorrt/split_kv.py, as
                LlmcFusedAttention's: plugins/op/fused_node.py)

TensorRT's ONNX parser imports a node whose op type is a registered plugin's name (the domain is
ignored); plugins/trt/plugin.py registers the plugin, whose kernel is paged_kernels_aot.py's one launch.
Packed QKV is split back into three inputs (one Split a layer). What the plugin does not carry
(`slot_mapping`, q/k norms, quantized caches, MLA) is refused with the node and input named.
"""

from __future__ import annotations

import numpy
import onnx
from onnx import helper, numpy_helper
from onnx.defs import OpSchema

from llmc.plugins.op import paged_schema
from llmc.plugins.op.onnx_schema import SPLIT_INPUTS, SPLIT_OUTPUTS, copy_types, split_attributes

PAGED_PLUGIN_OP = "LlmcPagedAttention"
PLUGIN_NAMESPACE = "llmc"
PLUGIN_VERSION = "1"
LLMC_DOMAIN = "llmc"
INPUTS = [("query", "T"), ("key", "T"), ("value", "T"), ("key_cache", "T"), ("value_cache", "T"),
           ("cumulative_sequence_length", "S"), ("past_seqlens", "S"), ("block_table", "S"), ("cos_cache", "T"),
           ("sin_cache", "T"), ("head_sink", "T")]
_OUTPUTS = [("output", "T"), ("key_cache_out", "T"), ("value_cache_out", "T")]
INT_ATTRIBUTES = ("num_heads", "kv_num_heads", "head_size", "rotary_dim", "rotary_interleaved", "local_window_size",
                  "is_causal", "sinks")
FLOAT_ATTRIBUTES = ("scale", "softcap")
# the contract's defaults for what the plugin cannot do: a node must leave these as they are
_UNSUPPORTED_ATTRIBUTES = {"k_quant_type": b"NONE", "v_quant_type": b"NONE", "k_cache_dtype": b"",
                           "v_cache_dtype": b"", "kv_cache_layout": b"SEPARATE"}
_UNSUPPORTED_INPUTS = ("slot_mapping", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale")


def plugin_schema() -> OpSchema:
    A = OpSchema.AttrType
    attributes = [OpSchema.Attribute(n, A.STRING, "TensorRT plugin registry key") for n in ("plugin_version",
                                                                                            "plugin_namespace")]
    attributes += [OpSchema.Attribute(n, A.INT, "") for n in INT_ATTRIBUTES]
    attributes += [OpSchema.Attribute(n, A.FLOAT, "") for n in FLOAT_ATTRIBUTES] + split_attributes()
    optional = {"param_option": OpSchema.FormalParameterOption.Optional}
    schema = OpSchema(
        PAGED_PLUGIN_OP, LLMC_DOMAIN, 1,
        "ONNX Runtime's PagedAttention contract as a TensorRT plugin node (plugins/op/paged_node.py): separate "
        "query/key/value, the caches updated in place, cos/sin tables and head_sink always present (placeholders "
        "without rotary or sinks).",
        inputs=[OpSchema.FormalParameter(n, t) for n, t in INPUTS]
        + [OpSchema.FormalParameter(n.rstrip("?"), {"M": "S"}.get(t, t), **optional) for n, t in SPLIT_INPUTS],
        outputs=[OpSchema.FormalParameter(n, t) for n, t in _OUTPUTS]
        + [OpSchema.FormalParameter(n.rstrip("?"), {"M": "S"}.get(t, t), **optional) for n, t in SPLIT_OUTPUTS],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and caches"),
                          ("S", ["tensor(int32)"], "lengths, block tables and split counters"),
                          ("W", ["tensor(float)"], "the split workspace")],
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(copy_types([(0, 0), (1, 3), (2, 4), (3, 11), (4, 12)]))
    return schema


def register_schema() -> None:
    """Make the node known to onnx.defs (so onnx.checker validates it). Idempotent."""
    if not onnx.defs.has(PAGED_PLUGIN_OP, LLMC_DOMAIN):
        onnx.defs.register_schema(plugin_schema())


def _static_dim(model: onnx.ModelProto, name: str, axis: int, what: str) -> int:
    graph = model.graph
    for init in graph.initializer:
        if init.name == name:
            return int(init.dims[axis])
    for info in (*graph.input, *graph.value_info, *graph.output):
        if info.name == name:
            dim = info.type.tensor_type.shape.dim[axis]
            if dim.HasField("dim_value"):
                return dim.dim_value
    raise ValueError(f"{what}: {name} needs a static dimension {axis} for the plugin node")


def _check_supported(node: onnx.NodeProto, attrs: dict) -> None:
    for index, (name, _, _) in enumerate(paged_schema.INPUTS):
        if name in _UNSUPPORTED_INPUTS and index < len(node.input) and node.input[index]:
            raise ValueError(f"PagedAttention node {node.name!r}: input {name} has no TensorRT plugin form")
    for name, default in _UNSUPPORTED_ATTRIBUTES.items():
        if attrs.get(name, default) != default:
            raise ValueError(f"PagedAttention node {node.name!r}: attribute {name}={attrs[name]!r} has no TensorRT "
                             "plugin form")
    for name in ("v_head_size", "rotary_offset"):
        if attrs.get(name, 0):
            raise ValueError(f"PagedAttention node {node.name!r}: attribute {name} has no TensorRT plugin form")


def _plugin_node(model: onnx.ModelProto, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes that replace one PagedAttention node: a Split for packed QKV, placeholder tables
    without rotary and sinks without head_sink, then the plugin node with the original outputs."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    _check_supported(node, attrs)
    inputs = list(node.input) + [""] * (12 - len(node.input))  # up to head_sink (11)
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    head_size = _static_dim(model, inputs[3], 3, f"PagedAttention node {node.name!r}")
    added, name = [], node.name or node.output[0]
    if not inputs[1]:
        sizes = numpy_helper.from_array(numpy.array([heads, kv_heads, kv_heads], numpy.int64) * head_size,
                                        f"{name}_qkv_sizes")
        model.graph.initializer.append(sizes)
        inputs[:3] = [f"{name}_{part}" for part in ("query", "key", "value")]
        added.append(helper.make_node("Split", [node.input[0], sizes.name], inputs[:3], axis=1))
    rotary = bool(attrs.get("do_rotary", 0))
    rotary_dim = 2 * _static_dim(model, inputs[8], 1, f"PagedAttention node {node.name!r}") if rotary else 0
    if not rotary:
        zeros = numpy_helper.from_array(numpy.zeros((1, head_size // 2), numpy.float32), f"{name}_no_rotary")
        model.graph.initializer.append(zeros)
        inputs[8] = inputs[9] = f"{name}_no_rotary_like"
        added.append(helper.make_node("CastLike", [zeros.name, inputs[0]], [inputs[8]]))
    sinks = bool(inputs[11])
    if not sinks:
        zeros = numpy_helper.from_array(numpy.zeros(heads, numpy.float32), f"{name}_no_sinks")
        model.graph.initializer.append(zeros)
        inputs[11] = f"{name}_no_sinks_like"
        added.append(helper.make_node("CastLike", [zeros.name, inputs[0]], [inputs[11]]))
    outputs = [o or f"{name}_unused_{i}" for i, o in enumerate(list(node.output) + [""] * (3 - len(node.output)))]
    added.append(helper.make_node(
        PAGED_PLUGIN_OP, inputs[:10] + inputs[11:12], outputs, name=node.name, domain=LLMC_DOMAIN,
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE, num_heads=heads, kv_num_heads=kv_heads, head_size=head_size,
        scale=float(attrs.get("scale", 0.0)) or head_size ** -0.5, rotary_dim=rotary_dim,
        rotary_interleaved=int(attrs.get("rotary_interleaved", 0)), softcap=float(attrs.get("softcap", 0.0)),
        local_window_size=int(attrs.get("local_window_size", -1)), is_causal=int(attrs.get("is_causal", 1)),
        sinks=int(sinks)))
    return added


def to_plugin_nodes(model: onnx.ModelProto) -> int:
    """Replace every PagedAttention node (domain llmc or com.microsoft) by its plugin form, in place;
    shapes the rewrite needs are inferred first. Returns how many nodes were replaced."""
    paged_schema.register()
    register_schema()
    inferred = onnx.shape_inference.infer_shapes(model)
    model.graph.ClearField("value_info")
    model.graph.value_info.extend(inferred.graph.value_info)
    nodes, replaced = [], 0
    for node in model.graph.node:
        if node.op_type == "PagedAttention" and node.domain in (LLMC_DOMAIN, "com.microsoft"):
            nodes.extend(_plugin_node(model, node))
            replaced += 1
        else:
            nodes.append(node)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    if replaced and not any(o.domain == LLMC_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(LLMC_DOMAIN, 1))
    return replaced
