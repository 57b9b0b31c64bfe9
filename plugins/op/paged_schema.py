"""The OpSchema of ONNX Runtime's `com.microsoft.PagedAttention` (1.32), registered with `onnx.defs`
twice: as ONNX Runtime defines it (fp16/bf16, the CUDA kernel's node) and as `llmc.PagedAttention`, the
same inputs, outputs and attributes with float32 admitted too (llmc's CPU kernel, runtime/kernels/paged_attention/paged_attention.c).
A graph switches between the two by the node's domain alone. plugins/op/lowering.py's register_schemas()
registers both, so onnx.checker (with shape inference) passes on graphs that use either.

What llmc's CPU kernel implements of the contract, and what it refuses with an error naming the
input or attribute (at session creation through runtime/kernels/cpu_kernels.py, and again at compute):
- runs: separate or packed QKV, float32 query with a float32, float16 or int8 cache (int8: `k_scale`/
  `v_scale` with `k_quant_type`/`v_quant_type` PER_TENSOR or PER_CHANNEL, `k_cache_dtype` '' or 'int8'), GQA/MQA, rotary
  (`do_rotary`, rotate-half or `rotary_interleaved`, partial tables, `rotary_offset`), `scale`,
  `softcap`, `local_window_size`, `is_causal` 0 or 1, `slot_mapping` (-1 skips a write), unmapped
  block-table entries (masked out), `head_sink` (float32 [num_heads]: attention sinks, on every instruction
  set's path), `attention_metadata` (accepted; a hint the CPU does not need);
- refuses: `head_sink` of another shape or type, `q_norm_weight`/`k_norm_weight`, scales or quant types on float caches, packed
  int4 / fp8 caches, and `kv_cache_layout: LATENT` / `v_head_size` (MLA); and past_seqlens that do not fit the
  block table (the CUDA kernel zeroes such a row; on CPU the lengths are exact, so it is an error).
"""

from __future__ import annotations

import onnx
from onnx.defs import OpSchema

OP = "PagedAttention"
MICROSOFT_DOMAIN = "com.microsoft"
LLMC_DOMAIN = "llmc"

# (name, type parameter, optional): ONNX Runtime's inputs, in order
INPUTS = [
    ("query", "T", False), ("key", "T", True), ("value", "T", True), ("key_cache", "T_CACHE", False),
    ("value_cache", "T_CACHE", True), ("cumulative_sequence_length", "S", False), ("past_seqlens", "S", False),
    ("block_table", "S", False), ("cos_cache", "T", True), ("sin_cache", "T", True), ("slot_mapping", "S", True),
    ("head_sink", "T", True), ("q_norm_weight", "T", True), ("k_norm_weight", "T", True),
    ("k_scale", "T_KV_SCALE", True), ("v_scale", "T_KV_SCALE", True), ("attention_metadata", "S", True),
]
OUTPUTS = [("output", "T", False), ("key_cache_out", "T_CACHE", True), ("value_cache_out", "T_CACHE", True)]
A = OpSchema.AttrType
# (name, type, default or None for "unset"), required ones first
ATTRIBUTES = [
    ("num_heads", A.INT, None), ("kv_num_heads", A.INT, None), ("scale", A.FLOAT, None), ("softcap", A.FLOAT, None),
    ("local_window_size", A.INT, -1), ("do_rotary", A.INT, None), ("rotary_interleaved", A.INT, None),
    ("is_causal", A.INT, 1), ("qk_norm_epsilon", A.FLOAT, None), ("k_quant_type", A.STRING, "NONE"),
    ("v_quant_type", A.STRING, "NONE"), ("k_cache_dtype", A.STRING, ""), ("v_cache_dtype", A.STRING, ""),
    ("kv_cache_layout", A.STRING, "SEPARATE"), ("v_head_size", A.INT, None), ("rotary_offset", A.INT, None),
]
REQUIRED = {"num_heads", "kv_num_heads"}
_HALF = ["tensor(float16)", "tensor(bfloat16)"]
_QUANTIZED = ["tensor(int8)", "tensor(float8e4m3fn)", "tensor(uint8)"]


def _infer(ctx) -> None:
    """output [T, num_heads * head_size] (head_size from query, packed or not); the caches' outputs
    have their inputs' types and shapes (they alias them)."""
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    dims = out.tensor_type.shape.dim
    packed = not ctx.has_input(1)
    if packed and len(dims) == 2 and dims[1].HasField("dim_value"):
        heads = onnx.helper.get_attribute_value(ctx.get_attribute("num_heads"))
        kv_heads = onnx.helper.get_attribute_value(ctx.get_attribute("kv_num_heads"))
        dims[1].dim_value = dims[1].dim_value // (heads + 2 * kv_heads) * heads
    ctx.set_output_type(0, out)
    for o, i in ((1, 3), (2, 4)):
        if o < ctx.get_num_outputs() and ctx.has_input(i):
            ctx.set_output_type(o, ctx.get_input_type(i))


def _attribute(name: str, kind, default) -> OpSchema.Attribute:
    if default is None:
        return OpSchema.Attribute(name, kind, "see ONNX Runtime's PagedAttention", required=name in REQUIRED)
    return OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), "see ONNX Runtime's PagedAttention")


def paged_schema(domain: str) -> OpSchema:
    """The contract in `domain`: com.microsoft admits fp16/bf16 as ONNX Runtime does; llmc adds float32."""
    floats = _HALF if domain == MICROSOFT_DOMAIN else ["tensor(float)", *_HALF]
    optional, single = OpSchema.FormalParameterOption.Optional, OpSchema.FormalParameterOption.Single
    schema = OpSchema(
        OP, domain, 1,
        "ONNX Runtime's com.microsoft.PagedAttention contract (1.32): packed tokens, block caches "
        "[num_blocks, block_size, kv_num_heads, head_size] updated in place, per-row past lengths and block tables."
        + (" llmc's CPU kernel: plugins/op/paged_schema.py lists what it runs and refuses." if domain == LLMC_DOMAIN else ""),
        inputs=[OpSchema.FormalParameter(n, t, param_option=optional if o else single) for n, t, o in INPUTS],
        outputs=[OpSchema.FormalParameter(n, t, param_option=optional if o else single) for n, t, o in OUTPUTS],
        type_constraints=[("T", floats, "activations"), ("T_CACHE", floats + _QUANTIZED, "the KV cache"),
                          ("T_KV_SCALE", ["tensor(float)"], "KV cache scales"), ("S", ["tensor(int32)"], "positions")],
        attributes=[_attribute(*a) for a in ATTRIBUTES],
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register() -> None:
    """Register both domains' schemas with onnx.defs (idempotent)."""
    for domain in (MICROSOFT_DOMAIN, LLMC_DOMAIN):
        if not onnx.defs.has(OP, domain):
            onnx.defs.register_schema(paged_schema(domain))
