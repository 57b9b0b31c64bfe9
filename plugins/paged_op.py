"""`llmc::paged_attention`: the paged attention op as the export traces it, and its ONNX lowering.

    paged_attention(query [T, H*D], key [T, KVH*D], value [T, KVH*D],
                    key_cache [num_blocks, block_size, KVH, D], value_cache (same),
                    cumulative_sequence_length int32 [B + 1], past_seqlens int32 [B],
                    block_table int32 [B, max_blocks], num_heads, kv_num_heads, scale,
                    cos_cache [P, D/2] = None, sin_cache [P, D/2] = None)
      -> (output [T, H*D], key_cache', value_cache')

Exactly ONNX Runtime's `com.microsoft.PagedAttention` contract (its inputs, in order, and its
attributes): T packed tokens of B rows, row b's `cumulative_sequence_length[b+1] - [b]` new tokens
at positions `past_seqlens[b] ..`, their keys and values written into the blocks `block_table[b]`
names (position p in block `block_table[b, p // block_size]`, offset `p % block_size`), each query
attending causally to its row's cached and new tokens; with cos/sin tables the op rotates the new
queries and keys at those positions (`do_rotary`). Its semantics (the reference and the kernels)
are plugins/attention.py's and runtime/paged_attention's; this module only gives the exporter a node
to trace (a functional custom op, as `llmc::attention` is) and lowers it to one
`llmc.PagedAttention` node, whose schema plugins/lowering.py registers. A graph whose node is moved
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
                    sin_cache: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    from llmc.plugins.attention import reference_paged_attention

    return reference_paged_attention(query, key, value, key_cache.clone(), value_cache.clone(),
                                     cumulative_sequence_length, past_seqlens, block_table, num_heads, kv_num_heads,
                                     scale, cos_cache, sin_cache)


@paged_attention.register_fake
def _paged_attention_fake(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
                          block_table, num_heads, kv_num_heads, scale, cos_cache=None, sin_cache=None):
    assert query.dim() == key.dim() == 2 and key_cache.dim() == 4, (query.shape, key.shape, key_cache.shape)
    assert key_cache.shape == value_cache.shape and key_cache.shape[2] == kv_num_heads, key_cache.shape
    return torch.empty_like(query), torch.empty_like(key_cache), torch.empty_like(value_cache)


def lowering():
    """The onnxscript function for `custom_translation_table`: one llmc.PagedAttention node."""
    from onnxscript.values import Opset

    llmc = Opset(LLMC_DOMAIN, 1)

    def attention(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                  num_heads: int, kv_num_heads: int, scale: float, cos_cache=None, sin_cache=None):
        rotary = [] if cos_cache is None else [cos_cache, sin_cache]
        return llmc.PagedAttention(query, key, value, key_cache, value_cache, cumulative_sequence_length,
                                   past_seqlens, block_table, *rotary, num_heads=num_heads, kv_num_heads=kv_num_heads,
                                   scale=scale, do_rotary=int(bool(rotary)))

    return attention
