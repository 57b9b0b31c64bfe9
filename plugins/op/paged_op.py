"""`llmc::paged_attention`: the paged attention op as the export traces it, and its ONNX lowering.

    paged_attention(query [T, H*D], key [T, KVH*D], value [T, KVH*D],
                    key_cache [num_blocks, block_size, KVH, D], value_cache (same),
                    cumulative_sequence_length int32 [B + 1], past_seqlens int32 [B],
                    block_table int32 [B, max_blocks], num_heads, kv_num_heads, scale,
                    cos_cache [P, R/2] = None, sin_cache [P, R/2] = None, head_sink [H] = None,
                    softcap = 0.0, local_window_size = -1)
      -> (output [T, H*D], key_cache', value_cache')

Exactly ONNX Runtime's `com.microsoft.PagedAttention` contract (its inputs, in order, and its
attributes): T packed tokens of B rows, row b's `cumulative_sequence_length[b+1] - [b]` new tokens
at positions `past_seqlens[b] ..`, their keys and values written into the blocks `block_table[b]`
names (position p in block `block_table[b, p // block_size]`, offset `p % block_size`), each query
attending causally to its row's cached and new tokens; with cos/sin tables the op rotates the new
queries and keys at those positions (`do_rotary`; R < D rotates the first R channels); `softcap`,
`local_window_size` and `head_sink` are the contract's, as plugins/op/attention.py defines them (each
reaches the node only when set, so a graph without them is what it was). Its semantics (the reference and the kernels)
are plugins/op/attention.py's and runtime/paged_attention's; this module only gives the exporter a node
to trace (a functional custom op, as `llmc::attention` is) and lowers it to one
`llmc.PagedAttention` node, whose schema plugins/op/lowering.py registers. A graph whose node is moved
to domain `com.microsoft` runs on ONNX Runtime's CUDA kernel (fp16/bf16) unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

LLMC_DOMAIN = "llmc"
OP_TYPE = "PagedAttention"


@torch.library.custom_op("llmc::paged_attention", mutates_args=())
def paged_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                    cumulative_sequence_length: Tensor, past_seqlens: Tensor, block_table: Tensor, num_heads: int,
                    kv_num_heads: int, scale: float, cos_cache: Tensor | None = None,
                    sin_cache: Tensor | None = None, head_sink: Tensor | None = None, softcap: float = 0.0,
                    local_window_size: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    from llmc.plugins.op.attention import reference_paged_attention

    return reference_paged_attention(query, key, value, key_cache.clone(), value_cache.clone(),
                                     cumulative_sequence_length, past_seqlens, block_table, num_heads, kv_num_heads,
                                     scale, cos_cache, sin_cache, softcap=softcap, local_window_size=local_window_size,
                                     head_sink=head_sink)


@paged_attention.register_fake
def _paged_attention_fake(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
                          block_table, num_heads, kv_num_heads, scale, cos_cache=None, sin_cache=None,
                          head_sink=None, softcap=0.0, local_window_size=-1):
    assert query.dim() == key.dim() == 2 and key_cache.dim() == 4, (query.shape, key.shape, key_cache.shape)
    assert key_cache.shape == value_cache.shape and key_cache.shape[2] == kv_num_heads, key_cache.shape
    return torch.empty_like(query), torch.empty_like(key_cache), torch.empty_like(value_cache)


def lowering():
    """The onnxscript function for `custom_translation_table`: one llmc.PagedAttention node."""
    from onnxscript.values import Opset

    llmc = Opset(LLMC_DOMAIN, 1)

    def attention(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                  num_heads: int, kv_num_heads: int, scale: float, cos_cache=None, sin_cache=None, head_sink=None,
                  softcap: float = 0.0, local_window_size: int = -1):
        inputs = [cos_cache, sin_cache]
        if head_sink is not None:  # input 11, after slot_mapping (10), which llmc leaves absent
            inputs += [None, head_sink]
        while inputs and inputs[-1] is None:
            inputs.pop()
        features = {}  # only what is set, so a graph without these features is unchanged
        if softcap > 0:
            features["softcap"] = softcap
        if local_window_size > 0:
            features["local_window_size"] = local_window_size
        return llmc.PagedAttention(query, key, value, key_cache, value_cache, cumulative_sequence_length,
                                   past_seqlens, block_table, *inputs, num_heads=num_heads, kv_num_heads=kv_num_heads,
                                   scale=scale, do_rotary=int(cos_cache is not None), **features)

    return attention


def pack_qkv(graph) -> int:
    """PagedAttention nodes whose query, key and value are the three outputs of one last-axis Split
    (the fused QKV projection), each flattened to [T, width] by a Reshape, take the Split's input
    flattened once instead: the contract's packed-QKV form (key and value absent), one Reshape per
    layer instead of a Split and three. Works on an onnx_ir graph after export; the orphaned nodes
    are left for dead-code removal. Returns how many nodes were packed."""
    import numpy
    import onnx_ir as ir

    packed = 0
    for node in list(graph):
        if node.op_type != OP_TYPE or len(node.inputs) < 3 or any(v is None for v in node.inputs[:3]):
            continue
        reshapes = [v.producer() for v in node.inputs[:3]]
        if any(r is None or r.op_type != "Reshape" for r in reshapes):
            continue
        split = reshapes[0].inputs[0].producer()
        source = split.inputs[0] if split is not None and split.op_type == "Split" else None
        if source is None or source.shape is None or len(split.outputs) != 3 \
                or split.attributes.get_int("axis", 0) not in (-1, len(source.shape) - 1) \
                or any(r.inputs[0] is not out for r, out in zip(reshapes, split.outputs)) \
                or not isinstance(source.shape[-1], int):
            continue
        shape = ir.Value(name=f"{node.name}_packed_shape",
                         const_value=ir.tensor(numpy.array([-1, source.shape[-1]], dtype=numpy.int64)))
        graph.register_initializer(shape)
        flat = ir.node("Reshape", [source, shape], name=f"{node.name}_packed_qkv")
        graph.insert_before(node, flat)
        node.replace_input_with(0, flat.outputs[0])
        node.replace_input_with(1, None)
        node.replace_input_with(2, None)
        packed += 1
    return packed
