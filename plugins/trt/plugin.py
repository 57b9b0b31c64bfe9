"""The TensorRT plugins behind the `LlmcFusedAttention` node (below) and the `LlmcPagedAttention` node
(plugins/trt/paged_plugin.py), as quickly deployable plugins (`tensorrt.plugin`) with ahead-of-time
implementations only; `register()` registers both.

    @trtp.register   output like the query; k_cache' / v_cache' aliased to the cache inputs, so
                     the cache is updated in place (the engine's KV buffers are bound once), and the split
                     workspace' / counters' aliased to theirs (engine inputs bound once, threaded through
                     every attention node: compiler/tensorrt/split_kv.py)
    @trtp.autotune   one float type for every float tensor (fp32, fp16 or bf16), int32 positions, the
                     workspace fp32 and the counters int32; two tactics, TensorRT keeping the faster for each
                     optimization profile: the one-launch kernel (decode: a KV group's heads share a tile) and
                     the prefill kernel (slot_prefill.py: 64 tokens of one head a tile, FlashAttention-2's loop)
    @trtp.aot_impl   the tactic's kernel compiled to PTX by kernels_aot.py for the node's shapes,
                     scale and attention features (rotary width, softcap, window, sinks: plugin fields,
                     plugins/op/fused_node.py; the sinks an input), its grid and integer arguments
                     as shape expressions; up to key_splits key splits over a workspace of split_slots
                     partials, the grid's third axis a shape expression too (split_kv.plugin_splits)

TensorRT embeds the PTX in the engine, so the engine runs without Python or Triton: in Triton's
TensorRT backend, in `trtexec`, and in llmc's TensorRT runner. The ONNX parser finds the plugin by
the node's op type, `plugin_namespace` and `plugin_version` attributes once `register()` ran.
TensorRT validates the decorated functions' annotations as classes, so this module must not use
`from __future__ import annotations` (which turns them into strings), and `aot_impl` declares its return.
"""

from llmc.plugins.op.onnx_schema import PLUGIN_NAMESPACE, PLUGIN_OP, SPLIT_TRT_TYPES

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_OP}"
ONE_LAUNCH, PREFILL = 1, 2  # the plugin's tactics (positive: TensorRT's custom tactics)
_state = {"registered": False, "capability": None}


def set_target_capability(capability: int | None) -> None:
    """Compile the plugin's PTX for sm_<capability> (80 for an engine that must also run on later
    GPUs: PTX is JIT-compiled forward); None: the GPU the engine is built on."""
    _state["capability"] = capability


def _capability() -> int:
    if _state["capability"] is not None:
        return _state["capability"]
    import torch

    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def _float_type(dtype) -> str:
    import tensorrt as trt

    types = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
    if dtype not in types:
        raise TypeError(f"{PLUGIN_OP} runs on fp32, fp16 or bf16 tensors, not {dtype}")
    return types[dtype]


def register() -> None:
    """Make both plugins known to TensorRT's registry (idempotent). Needs `tensorrt` (10.14+) and
    `triton` (the `kernels` extra)."""
    if _state["registered"]:
        return
    from typing import Tuple, Union

    import tensorrt.plugin as trtp

    from llmc.plugins.gpu.kernels_aot import plugin_kernel, plugin_prefill_kernel
    from llmc.plugins.trt.paged_plugin import register_paged, shape_ops

    @trtp.register(PLUGIN_ID)
    def describe(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                 v_cache: trtp.TensorDesc, cache_position: trtp.TensorDesc, cos_cache: trtp.TensorDesc,
                 sin_cache: trtp.TensorDesc, head_sink: trtp.TensorDesc, split_partials: trtp.TensorDesc,
                 split_counters: trtp.TensorDesc, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: int, rotary_dim: int, softcap: float, local_window_size: int, sinks: int, key_splits: int,
                 split_slots: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                                            trtp.TensorDesc]:
        return (query.like(), k_cache.aliased(), v_cache.aliased(), split_partials.aliased(),
                split_counters.aliased())

    @trtp.autotune(PLUGIN_ID)
    def formats(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                v_cache: trtp.TensorDesc, cache_position: trtp.TensorDesc, cos_cache: trtp.TensorDesc,
                sin_cache: trtp.TensorDesc, head_sink: trtp.TensorDesc, split_partials: trtp.TensorDesc,
                split_counters: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]):
        floats = "FP32|FP16|BF16"  # alternatives line up position by position: one type for all
        return [trtp.AutoTuneCombination(", ".join([floats] * 5 + ["INT32"] + [floats] * 3 + SPLIT_TRT_TYPES
                                                   + [floats] * 3 + SPLIT_TRT_TYPES), tactics=[ONE_LAUNCH, PREFILL])]

    @trtp.aot_impl(PLUGIN_ID)
    def compile_kernel(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                       k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc, cache_position: trtp.TensorDesc,
                       cos_cache: trtp.TensorDesc, sin_cache: trtp.TensorDesc, head_sink: trtp.TensorDesc,
                       split_partials: trtp.TensorDesc, split_counters: trtp.TensorDesc,
                       num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary: int, rotary_dim: int,
                       softcap: float, local_window_size: int, sinks: int, key_splits: int, split_slots: int,
                       outputs: Tuple[trtp.TensorDesc], tactic: int,
                       ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        features = {"rotary": bool(rotary), "rotary_dim": rotary_dim or head_dim, "softcap": softcap,
                    "window": local_window_size, "sinks": bool(sinks)}
        shapes = (num_heads, num_kv_heads, head_dim, scale, _float_type(query.dtype), _capability())
        if tactic == PREFILL:
            kernel = plugin_prefill_kernel(*shapes, **features)
        else:
            kernel = plugin_kernel(*shapes, **features, splits=key_splits, slots=split_slots)
        batch, tokens = query.shape_expr[0], query.shape_expr[1]
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = kernel.grid(tokens, batch, num_heads, num_kv_heads,
                                                                  k_cache.shape_expr[2], **shape_ops(trtp))
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(tokens), trtp.SymInt32(k_cache.shape_expr[2])])
        return kernel.name, kernel.ptx, launch, extra

    register_paged(trtp, _capability, _float_type)
    _state["registered"] = True
