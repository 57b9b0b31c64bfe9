"""What the ONNX forms of llmc's ops share: their domains, the TensorRT plugin's name, the heads an attention node
carries, and how a custom op's schema is made (onnx.defs.OpSchema with its shape inference). The lowerings
(lowering.py, moe.py, collective.py, fused_node.py) and the TensorRT plugins (plugins/trt/) read them here, so
none imports another to get them."""

from __future__ import annotations

from dataclasses import dataclass

from onnx.defs import OpSchema

MICROSOFT_DOMAIN = "com.microsoft"
LLMC_DOMAIN = "llmc"
PLUGIN_OP = "LlmcFusedAttention"
PLUGIN_NAMESPACE = "llmc"
PLUGIN_VERSION = "1"
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
# the type letters a schema's inputs and outputs may use (a schema constrains those it uses)
_TYPES = [("T", _FLOATS, "activations, caches, float weights"), ("M", ["tensor(int32)"], "lengths, counters"),
          ("P", ["tensor(int64)"], "positions"), ("T1", ["tensor(uint8)"], "packed weights"),
          ("W", ["tensor(float)"], "fp32 workspaces")]
# the split-KV buffers a TensorRT engine's attention plugin nodes take last and return aliased (set by
# compiler/tensorrt/split_kv.py; absent from an export): the partials' workspace (fp32) and the tiles' counters
SPLIT_INPUTS = [("split_partials?", "W"), ("split_counters?", "M")]
SPLIT_OUTPUTS = [("split_partials_out?", "W"), ("split_counters_out?", "M")]
SPLIT_TRT_TYPES = ["FP32", "INT32"]  # their types in the plugins' format combinations, whatever the float type
SPLIT_ATTRIBUTES = (("key_splits", 1, "the most key splits a launch takes (its grid's third axis)"),
                    ("split_slots", 0, "partials the split_partials workspace holds (0: no key splits)"))


def split_attributes() -> list[OpSchema.Attribute]:
    """The plugin nodes' split-KV attributes, optional (an export's node has none: no splits)."""
    from onnx import helper

    return [OpSchema.Attribute(n, helper.make_attribute(n, default), doc) for n, default, doc in SPLIT_ATTRIBUTES]


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def copy_types(pairs: list[tuple[int, int]]):
    """Shape inference that gives output `o` the type and shape of input `i` for each (o, i) the node has."""
    def infer(ctx) -> None:
        for o, i in pairs:
            if o < ctx.get_num_outputs() and ctx.has_input(i):
                ctx.set_output_type(o, ctx.get_input_type(i))
    return infer


def make_schema(name: str, domain: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
            attributes: list[OpSchema.Attribute], doc: str, infer) -> OpSchema:
    """Inputs and outputs named with a trailing '?' are optional; the types are _TYPES' letters."""
    optional = OpSchema.FormalParameterOption.Optional
    used = {t for _, t in inputs + outputs}
    schema = OpSchema(
        name, domain, 1, doc,
        inputs=[OpSchema.FormalParameter(n.rstrip("?"), t, **({"param_option": optional} if n.endswith("?") else {}))
                for n, t in inputs],
        outputs=[OpSchema.FormalParameter(n.rstrip("?"), t, **({"param_option": optional} if n.endswith("?") else {}))
                 for n, t in outputs],
        type_constraints=[c for c in _TYPES if c[0] in used],
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(infer)
    return schema
