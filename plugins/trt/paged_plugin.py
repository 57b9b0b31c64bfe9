"""The TensorRT plugin behind the `LlmcPagedAttention` node (plugins/op/paged_node.py), as a quickly
deployable plugin (`tensorrt.plugin`) with an ahead-of-time implementation only.

    @trtp.register   output like the query; key_cache' / value_cache' aliased to the cache inputs (the
                     engine's block pools are bound once and updated in place), the split workspace' and
                     counters' to theirs (as the slot plugin's: plugin.py)
    @trtp.autotune   one float type for every float tensor (fp32, fp16 or bf16), int32 lengths and tables,
                     the workspace fp32 and the counters int32
    @trtp.aot_impl   paged_kernels_aot.py's one-launch kernel compiled to PTX for the node's heads, head
                     size, rotary and softmax options (softcap, window, causal, sinks; head_sink an input);
                     its grid (packed tokens x group / BLOCK_M + rows, KV heads, key_splits) and int32 extras
                     (rows, block-table width, pool blocks, block size) as shape expressions, so one engine
                     serves any batch and any split of its tokens; the key splits (the grid's third axis) a
                     shape expression too (split_kv.plugin_splits)

TensorRT checks these functions' signatures (real annotations, not strings: this module has no
`from __future__ import annotations`) and embeds the PTX in the engine; nothing here runs at inference.
"""

from typing import Tuple, Union

from llmc.plugins.gpu import paged_kernels_aot
from llmc.plugins.op.onnx_schema import SPLIT_TRT_TYPES
from llmc.plugins.op.paged_node import PAGED_PLUGIN_OP, PLUGIN_NAMESPACE

PAGED_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PAGED_PLUGIN_OP}"
_FLOATS = "FP32|FP16|BF16"  # alternatives line up position by position: one type for all


def shape_ops(trtp) -> dict:
    """The grid's arithmetic on TensorRT's shape expressions (kernels_aot.PluginKernel.grid): its ceiling division,
    and split_kv.plugin_splits' min, max and constants (an expression's // takes an int on its right only)."""
    return {"cdiv": trtp.cdiv, "minimum": trtp.min, "maximum": trtp.max, "constant": trtp.ShapeExpr}


def register_paged(trtp, capability, float_type) -> None:
    """Register the paged plugin with `trtp` (tensorrt.plugin); `capability()` is the GPU generation
    the PTX is for, `float_type(dtype)` names a TensorRT float type ("fp16", ...)."""
    TensorDesc = trtp.TensorDesc

    @trtp.register(PAGED_PLUGIN_ID)
    def describe(query: TensorDesc, key: TensorDesc, value: TensorDesc, key_cache: TensorDesc,
                 value_cache: TensorDesc, cumulative_sequence_length: TensorDesc, past_seqlens: TensorDesc,
                 block_table: TensorDesc, cos_cache: TensorDesc, sin_cache: TensorDesc, head_sink: TensorDesc,
                 split_partials: TensorDesc, split_counters: TensorDesc, num_heads: int, kv_num_heads: int,
                 head_size: int, rotary_dim: int, rotary_interleaved: int, local_window_size: int, is_causal: int,
                 sinks: int, scale: float, softcap: float, key_splits: int,
                 split_slots: int) -> Tuple[TensorDesc, TensorDesc, TensorDesc, TensorDesc, TensorDesc]:
        return (query.like(), key_cache.aliased(), value_cache.aliased(), split_partials.aliased(),
                split_counters.aliased())

    @trtp.autotune(PAGED_PLUGIN_ID)
    def formats(query: TensorDesc, key: TensorDesc, value: TensorDesc, key_cache: TensorDesc, value_cache: TensorDesc,
                cumulative_sequence_length: TensorDesc, past_seqlens: TensorDesc, block_table: TensorDesc,
                cos_cache: TensorDesc, sin_cache: TensorDesc, head_sink: TensorDesc, split_partials: TensorDesc,
                split_counters: TensorDesc, outputs: Tuple[TensorDesc]):
        return [trtp.AutoTuneCombination(", ".join([_FLOATS] * 5 + ["INT32"] * 3 + [_FLOATS] * 3 + SPLIT_TRT_TYPES
                                                   + [_FLOATS] * 3 + SPLIT_TRT_TYPES))]

    @trtp.aot_impl(PAGED_PLUGIN_ID)
    def compile_kernel(query: TensorDesc, key: TensorDesc, value: TensorDesc, key_cache: TensorDesc,
                       value_cache: TensorDesc, cumulative_sequence_length: TensorDesc, past_seqlens: TensorDesc,
                       block_table: TensorDesc, cos_cache: TensorDesc, sin_cache: TensorDesc, head_sink: TensorDesc,
                       split_partials: TensorDesc, split_counters: TensorDesc,
                       num_heads: int, kv_num_heads: int, head_size: int, rotary_dim: int, rotary_interleaved: int,
                       local_window_size: int, is_causal: int, sinks: int, scale: float, softcap: float,
                       key_splits: int, split_slots: int, outputs: Tuple[TensorDesc], tactic: int,
                       ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        kernel = paged_kernels_aot.paged_plugin_kernel(
            num_heads, kv_num_heads, head_size, scale, float_type(query.dtype), capability(), rotary_dim=rotary_dim,
            interleaved=bool(rotary_interleaved), softcap=softcap, window=local_window_size, causal=bool(is_causal),
            sinks=bool(sinks), splits=key_splits, slots=split_slots)
        rows = past_seqlens.shape_expr[0]
        launch = trtp.KernelLaunchParams()
        keys = block_table.shape_expr[1] * key_cache.shape_expr[1]  # what a row's block table reaches
        launch.grid_x, launch.grid_y, launch.grid_z = kernel.grid(query.shape_expr[0], rows, num_heads, kv_num_heads,
                                                                  keys, **shape_ops(trtp))
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (
            rows, block_table.shape_expr[1], key_cache.shape_expr[0], key_cache.shape_expr[1])])
        return kernel.name, kernel.ptx, launch, extra
