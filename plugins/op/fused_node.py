"""`llmc::attention` as the TensorRT plugin node `LlmcFusedAttention`: its ONNX schema and the `plugin`
lowering that emits it (plugins/op/lowering.py's `_plugin_schema` and `_plugin` are these).

    LlmcFusedAttention(query [B,S,H,D], key [B,S,KVH,D], value [B,S,KVH,D], k_cache [B,KVH,C,D],
                       v_cache [B,KVH,C,D], cache_position int32 [B], cos_cache [P,R/2], sin_cache [P,R/2],
                       head_sink [H][, split_partials fp32 [N], split_counters int32 [slots]])
      -> (output [B,S,H,D], k_cache_out, v_cache_out[, split_partials_out, split_counters_out])
                                                          the caches and split buffers aliased: updated in place

    attributes  plugin_version, plugin_namespace (the parser's registry key), num_heads, num_kv_heads,
                head_dim, scale, rotary (1: rotate the new queries and keys with the tables), rotary_dim
                (R <= head_dim: partial rotary rotates the first R channels), softcap (> 0: logits capped),
                local_window_size (> 0: a query sees that many positions, itself included), sinks (1: head_sink
                joins each head's softmax denominator); key_splits and split_slots with the split buffers

The split buffers (the key splits' workspace and counters, split_kv.py) are not in an export: the TensorRT
preparation threads one pair through every plugin node of the engine (compiler/tensorrt/split_kv.py).

A TensorRT plugin has a fixed number of inputs, so the tables and the sinks are always there: a [1, D/2]
zero table without rotary, a [H] zero vector without sinks (never read: `rotary` / `sinks` say so). The
lowering always writes every attribute, so the plugin's fields are all set whatever the layer uses. The
plugin itself (plugins/trt/plugin.py) compiles kernels_aot.py's one-launch kernel for these fields.
"""

from __future__ import annotations

from onnx import TensorProto
from onnx.defs import OpSchema

from llmc.plugins.op.onnx_schema import (LLMC_DOMAIN, PLUGIN_NAMESPACE, PLUGIN_OP, PLUGIN_VERSION, SPLIT_INPUTS,
                                         SPLIT_OUTPUTS, Heads, copy_types, make_schema, split_attributes)

INPUTS = [("query", "T"), ("key", "T"), ("value", "T"), ("k_cache", "T"), ("v_cache", "T"), ("cache_position", "M"),
          ("cos_cache", "T"), ("sin_cache", "T"), ("head_sink", "T")]
OUTPUTS = [("output", "T"), ("k_cache_out", "T"), ("v_cache_out", "T")]
# the attention features' fields: (name, type, default: what a layer without the feature gets)
FEATURES = [("rotary_dim", OpSchema.AttrType.INT, 0), ("softcap", OpSchema.AttrType.FLOAT, 0.0),
            ("local_window_size", OpSchema.AttrType.INT, -1), ("sinks", OpSchema.AttrType.INT, 0)]


def plugin_schema() -> OpSchema:
    from onnx import helper

    A = OpSchema.AttrType
    return make_schema(
        PLUGIN_OP, LLMC_DOMAIN, INPUTS + SPLIT_INPUTS, OUTPUTS + SPLIT_OUTPUTS,
        [OpSchema.Attribute(n, A.STRING, "TensorRT plugin registry key")
         for n in ("plugin_version", "plugin_namespace")]
        + [OpSchema.Attribute(n, A.INT, "") for n in ("num_heads", "num_kv_heads", "head_dim")]
        + [OpSchema.Attribute("scale", A.FLOAT, "softmax scale"),
           OpSchema.Attribute("rotary", A.INT, "1: rotate the new queries and keys with the tables")]
        + [OpSchema.Attribute(n, helper.make_attribute(n, default), "an attention feature (plugins/op/fused_node.py)")
           for n, _, default in FEATURES] + split_attributes(),
        "llmc::attention as a TensorRT plugin node: query [B,S,H,D], key/value [B,S,KVH,D], caches [B,KVH,C,D] "
        "written at cache_position (int32 [B]); with rotary=1 the plugin rotates the new queries and keys "
        "(rotate-half over the first rotary_dim channels) with the cos/sin tables [P,rotary_dim/2]; softcap, "
        "local_window_size and the head_sink [H] sinks (read when sinks=1) as plugins/op/attention.py defines them. "
        "The tables and the sinks are always inputs (placeholders when unused: a TensorRT plugin has a fixed "
        "number of inputs). In a TensorRT engine, the split-KV workspace and counters follow, aliased to two more "
        "outputs.",
        copy_types([(0, 0), (1, 3), (2, 4), (3, 9), (4, 10)]),
    )


def lowering(heads: Heads):
    """The onnxscript function for `custom_translation_table`: one LlmcFusedAttention node per call."""
    import numpy
    import onnx.numpy_helper
    from onnxscript import opset23 as op
    from onnxscript.values import Opset

    llmc = Opset(LLMC_DOMAIN, 1)

    def placeholder(shape, like):
        return op.CastLike(op.Constant(value=onnx.numpy_helper.from_array(numpy.zeros(shape, numpy.float32))), like)

    def attention(query, key, value, k_cache, v_cache, cache_position, scale: float, cos_cache=None, sin_cache=None,
                  head_sink=None, softcap: float = 0.0, local_window_size: int = -1):
        rotary, sinks = cos_cache is not None, head_sink is not None
        rotary_dim = 2 * cos_cache.shape[1] if rotary else 0
        if rotary and not isinstance(rotary_dim, int):
            raise ValueError(f"{PLUGIN_OP}: the rotary tables' width must be static (cos_cache is {cos_cache.shape})")
        if not rotary:  # the plugin's fixed arity: placeholders it never reads
            cos_cache = sin_cache = placeholder((1, heads.head_dim // 2), query)
        head_sink = op.CastLike(head_sink, query) if sinks else placeholder((heads.num_heads,), query)
        return llmc.LlmcFusedAttention(
            query, key, value, k_cache, v_cache, op.Cast(cache_position, to=TensorProto.INT32), cos_cache, sin_cache,
            head_sink, plugin_version=PLUGIN_VERSION, plugin_namespace=PLUGIN_NAMESPACE,
            num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, head_dim=heads.head_dim, scale=scale,
            rotary=int(rotary), rotary_dim=rotary_dim, softcap=float(max(softcap, 0.0)),
            local_window_size=int(local_window_size) if local_window_size > 0 else -1, sinks=int(sinks))

    return attention
