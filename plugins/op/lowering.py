"""ONNX lowerings of `llmc::attention`: one torch op, one ONNX form per consumer.

    fused      com.microsoft.GroupQueryAttention (ONNX Runtime). The cache inputs are full-capacity
               buffers and the op writes the new tokens into them; bound through IO binding as both
               `past_key_values.*` and `present.*`, the update happens in place. Rotary tables,
               when the op gets them, go to GQA too (`do_rotary=1`): it rotates at the positions
               it derives from `seqlens_k`, which are exactly the op's `cache_position + i`.
    reference  standard ONNX (opset 23): `RotaryEmbedding` when there are tables, ScatterElements
               writes the new tokens into a copy of the cache, `Attention` runs over the whole
               capacity under a causal, per-row mask. For tools that need plain ONNX; ONNX Runtime
               runs it too (with a cache copy per step).
    plugin     one `LlmcFusedAttention` node for TensorRT's ONNX parser, which imports a node whose
               op type is a registered plugin's name (`plugin_version`, `plugin_namespace`
               attributes). Its kernel and registration live with the TensorRT target.
    paged      one `llmc.PagedAttention` node (ONNX Runtime's com.microsoft.PagedAttention contract)
               over block pools, for a decoder traced with `llmc::paged_attention` instead
               (plugins/op/paged_op.py): packed tokens, block tables, caches updated in place; llmc's
               CPU kernel runs it.

Every form maps `cache_position` (int64 [B], tokens already cached per row) to what the op wants:
GQA takes `seqlens_k = cache_position + S - 1` (int32, last index written) and
`total_sequence_length = max(cache_position) + S`; the plugin takes int32 positions.

`register_schemas()` must run before export: onnxscript builds nodes from `onnx.defs` schemas,
and `onnx.checker` validates the custom domains against them (with shape inference).
"""

from __future__ import annotations

import enum

import onnx
from onnx import TensorProto
from onnx.defs import OpSchema

from llmc.plugins.op import paged_node, paged_schema
from llmc.plugins.op.onnx_schema import (LLMC_DOMAIN, MICROSOFT_DOMAIN, PLUGIN_NAMESPACE, PLUGIN_OP,  # noqa: F401
                                         PLUGIN_VERSION, Heads, copy_types, make_schema)

class Lowering(str, enum.Enum):
    fused = "fused"
    reference = "reference"
    plugin = "plugin"
    paged = "paged"

    @property
    def runs_on_onnxruntime(self) -> bool:
        return self is not Lowering.plugin


def _infer_gqa(ctx) -> None:
    """Output [B, S, H * D] (query is [B, S, (H + 2 KVH) * D] when K and V come packed in it);
    present has the past's shape (shared buffers)."""
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    packed = not (ctx.has_input(1) and ctx.has_input(2))
    dims = out.tensor_type.shape.dim
    if packed and len(dims) == 3 and dims[2].HasField("dim_value"):
        heads = onnx.helper.get_attribute_value(ctx.get_attribute("num_heads"))
        kv_heads = onnx.helper.get_attribute_value(ctx.get_attribute("kv_num_heads"))
        dims[2].dim_value = dims[2].dim_value // (heads + 2 * kv_heads) * heads
    ctx.set_output_type(0, out)
    ctx.set_output_type(1, ctx.get_input_type(3))
    ctx.set_output_type(2, ctx.get_input_type(4))


def _gqa_schema() -> OpSchema:
    A = OpSchema.AttrType
    return make_schema(
        "GroupQueryAttention", MICROSOFT_DOMAIN,
        [("query", "T"), ("key?", "T"), ("value?", "T"), ("past_key", "T"), ("past_value", "T"),
         ("seqlens_k", "M"), ("total_sequence_length", "M"), ("cos_cache?", "T"), ("sin_cache?", "T"),
         ("position_ids?", "P"), ("attention_bias?", "T"), ("head_sink?", "T")],
        [("output", "T"), ("present_key", "T"), ("present_value", "T")],
        [OpSchema.Attribute("num_heads", A.INT, "query heads"),
         OpSchema.Attribute("kv_num_heads", A.INT, "key/value heads"),
         OpSchema.Attribute("scale", A.FLOAT, "softmax scale", required=False),
         OpSchema.Attribute("do_rotary", A.INT, "apply rotary inside the op", required=False),
         OpSchema.Attribute("softcap", A.FLOAT, "logit softcap (0: none)", required=False),
         OpSchema.Attribute("local_window_size", A.INT, "keys a query sees, itself included (-1: all)",
                            required=False)],
        "ONNX Runtime contrib op, the subset of inputs llmc emits (see onnxruntime ContribOperators.md).",
        _infer_gqa,
    )


def _plugin_schema() -> OpSchema:
    """LlmcFusedAttention's schema: fused_node.py (with the node's attention-feature fields)."""
    from llmc.plugins.op import fused_node

    return fused_node.plugin_schema()


def register_schemas() -> None:
    """Make the custom ops known to onnx (and so to onnxscript and onnx.checker). Idempotent."""
    for make, name, domain in ((_gqa_schema, "GroupQueryAttention", MICROSOFT_DOMAIN),
                               (_plugin_schema, PLUGIN_OP, LLMC_DOMAIN)):
        if not onnx.defs.has(name, domain):
            onnx.defs.register_schema(make())
    paged_schema.register()  # llmc.PagedAttention and com.microsoft.PagedAttention
    from llmc.plugins.op import moe  # (imports torch: the op registers with it)

    moe.register_schemas()  # com.microsoft.MoE and QMoE
    from llmc.plugins.op import collective

    collective.register_schemas()  # llmc.AllReduce and AllGather (tensor-parallel ranks)
    paged_node.register_schema()  # LlmcPagedAttention, the TensorRT plugin node


def _features(softcap: float, local_window_size: int) -> dict:
    """The attention features' attributes, only where set (so a graph without them is unchanged)."""
    return {**({"softcap": softcap} if softcap > 0 else {}),
            **({"local_window_size": local_window_size} if local_window_size > 0 else {})}


def _fused(heads: Heads):
    from onnxscript import opset23 as op
    from onnxscript.values import Opset

    msft = Opset(MICROSOFT_DOMAIN, 1)

    def attention(query, key, value, k_cache, v_cache, cache_position, scale: float, cos_cache=None, sin_cache=None,
                  head_sink=None, softcap: float = 0.0, local_window_size: int = -1):
        seq = op.Shape(query, start=1, end=2)  # [1]
        last = op.Sub(op.Add(cache_position, seq), op.Constant(value_int=1))
        seqlens_k = op.Cast(last, to=TensorProto.INT32)
        total = op.Cast(op.Add(op.ReduceMax(cache_position, keepdims=0), op.Squeeze(seq)), to=TensorProto.INT32)
        # GQA rotates at seqlens-derived positions; partial tables (R < D) rotate the first R channels.
        # head_sink is input 11, after position_ids and attention_bias, which llmc leaves absent.
        extra = [cos_cache, sin_cache] + ([None, None, head_sink] if head_sink is not None else [])
        while extra and extra[-1] is None:
            extra.pop()
        flat = op.Constant(value_ints=[0, 0, -1])  # [B, S, heads, D] -> [B, S, heads * D]
        out, k_out, v_out = msft.GroupQueryAttention(
            op.Reshape(query, flat), op.Reshape(key, flat), op.Reshape(value, flat), k_cache, v_cache,
            seqlens_k, total, *extra, num_heads=heads.num_heads, kv_num_heads=heads.num_kv_heads, scale=scale,
            do_rotary=int(cos_cache is not None), **_features(softcap, local_window_size))
        return op.Reshape(out, op.Constant(value_ints=[0, 0, heads.num_heads, heads.head_dim])), k_out, v_out

    return attention


def _reference(heads: Heads):
    from onnxscript import opset23 as op

    def attention(query, key, value, k_cache, v_cache, cache_position, scale: float, cos_cache=None, sin_cache=None,
                  head_sink=None, softcap: float = 0.0, local_window_size: int = -1):
        if head_sink is not None:
            raise NotImplementedError("attention sinks (`head_sink`): opset 23's Attention has no sink input; "
                                      "export with `export.attention: paged` or `fused`")
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        steps = op.Range(zero, op.Squeeze(op.Shape(query, start=1, end=2)), one)  # [S]
        positions = op.Add(op.Unsqueeze(cache_position, op.Constant(value_ints=[1])), steps)  # [B, S]
        q = op.Transpose(query, perm=[0, 2, 1, 3])  # [B, H, S, D]
        k_new = op.Transpose(key, perm=[0, 2, 1, 3])  # [B, KVH, S, D]
        v_new = op.Transpose(value, perm=[0, 2, 1, 3])
        if cos_cache is not None:
            rotary = 2 * cos_cache.shape[1]
            partial = {"rotary_embedding_dim": rotary} if rotary != heads.head_dim else {}
            q = op.RotaryEmbedding(q, cos_cache, sin_cache, positions, interleaved=0, **partial)
            k_new = op.RotaryEmbedding(k_new, cos_cache, sin_cache, positions, interleaved=0, **partial)
        index = op.Expand(op.Unsqueeze(positions, op.Constant(value_ints=[1, 3])), op.Shape(k_new))
        k_out = op.ScatterElements(k_cache, index, k_new, axis=2)
        v_out = op.ScatterElements(v_cache, index, v_new, axis=2)
        slots = op.Range(zero, op.Squeeze(op.Shape(k_cache, start=2, end=3)), one)  # [C]
        at = op.Unsqueeze(positions, op.Constant(value_ints=[2]))  # [B, S, 1]
        visible = op.LessOrEqual(slots, at)  # [B, S, C]
        if local_window_size > 0:
            visible = op.And(visible, op.Greater(slots, op.Sub(at, op.Constant(value_int=local_window_size))))
        mask = op.Unsqueeze(visible, op.Constant(value_ints=[1]))  # [B, 1, S, C]
        # the exporter emits all four outputs of Attention; the unused optional ones are dropped after
        # export (trim_unused_outputs) so ONNX Runtime does not compute them
        out = op.Attention(q, k_out, v_out, mask, scale=scale, **({"softcap": softcap} if softcap > 0 else {}))[0]
        return op.Transpose(out, perm=[0, 2, 1, 3]), k_out, v_out

    return attention


def _plugin(heads: Heads):
    """One LlmcFusedAttention node per call, every attention feature a plugin field: fused_node.py."""
    from llmc.plugins.op import fused_node

    return fused_node.lowering(heads)


def pack_qkv(graph) -> None:
    """GroupQueryAttention nodes fed by the three outputs of one last-axis Split (a fused QKV
    projection) take the Split's input instead: GQA's packed-QKV form, one node less per layer.
    Works on an onnx_ir graph after export; the orphaned Split is left for dead-code removal."""
    for node in graph:
        if node.op_type != "GroupQueryAttention" or node.domain != MICROSOFT_DOMAIN:
            continue
        q, k, v = node.inputs[:3]
        split = q.producer() if q is not None else None
        if split is None or split.op_type != "Split" or len(split.outputs) != 3 \
                or any(a is not b for a, b in zip(split.outputs, (q, k, v))):
            continue
        source = split.inputs[0]
        if source.shape is None or split.attributes.get_int("axis", 0) not in (-1, len(source.shape) - 1):
            continue
        node.replace_input_with(0, source)
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)


def trim_unused_outputs(graph: onnx.GraphProto) -> None:
    """Blank the trailing optional outputs of `Attention` nodes that nothing reads."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            outputs = list(node.output)
            while len(outputs) > 1 and outputs[-1] not in used:
                outputs.pop()
            outputs = [o if o in used or i == 0 else "" for i, o in enumerate(outputs)]
            del node.output[:]
            node.output.extend(outputs)


def translation_table(lowering: Lowering, heads: Heads) -> dict:
    """`custom_translation_table` for torch.onnx.export: llmc::attention -> the lowering's ONNX,
    llmc::moe -> com.microsoft.MoE (which lowerings may carry a mixture is compiler/models/moe.py's
    `refusal`, checked before export), and the collectives -> llmc.AllReduce / AllGather."""
    import onnxscript  # noqa: F401  (first: it imports onnx.reference, which fails on one op name in two domains)
    import torch

    import llmc.plugins.op.attention  # noqa: F401  (registers torch.ops.llmc.attention)

    from llmc.plugins.op import collective, moe

    register_schemas()
    others = {torch.ops.llmc.moe.default: moe.lowering(), **collective.lowerings()}
    if lowering is Lowering.paged:
        from llmc.plugins.op import paged_op

        return {torch.ops.llmc.paged_attention.default: paged_op.lowering(), **others}
    make = {Lowering.fused: _fused, Lowering.reference: _reference, Lowering.plugin: _plugin}[lowering]
    return {torch.ops.llmc.attention.default: make(heads), **others}
