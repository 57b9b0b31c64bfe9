"""The ONNX lowerings of llmc::attention: TensorRT plugin node + schema, reference graph hygiene, spec rules."""

import onnx
import pytest
from onnx import TensorProto, helper

from llmc import compiler  # its build, looked up when called: the pipeline imports the export extra
from llmc.compiler.spec import parse_spec
from llmc.errors import SpecError, UnsupportedError
from llmc.plugins.op.lowering import LLMC_DOMAIN, PLUGIN_OP, register_schemas


def _spec(ckpt, **extra):
    return parse_spec({"name": "t", "source": str(ckpt), **extra})


def _nodes(path, op_type):
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == op_type]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_tensorrt_target_exports_plugin_nodes_that_the_checker_accepts(tiny_checkpoints, tmp_path, model_type):
    result = compiler.build(_spec(tiny_checkpoints[model_type], target="tensorrt"), output=tmp_path / "out",
                            until="export")
    path = tmp_path / "out" / "export" / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    info = result.exported.model
    nodes = _nodes(path, PLUGIN_OP)
    assert len(nodes) == info.num_layers and all(n.domain == LLMC_DOMAIN for n in nodes)
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b"llmc"
    assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]) == (info.num_heads, info.num_kv_heads, info.head_dim)
    assert attrs["scale"] == pytest.approx(info.head_dim ** -0.5)
    assert attrs["rotary"] == (model_type == "llama") and all(len(n.input) == 9 for n in nodes)  # fixed arity
    assert (attrs["softcap"], attrs["local_window_size"], attrs["sinks"]) == (0.0, -1, 0)  # the features off
    assert result.exported.lowering.value == "plugin"
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True)
    shapes = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    out = shapes[nodes[0].output[0]]
    assert out.elem_type == TensorProto.FLOAT and len(out.shape.dim) == 4  # [B, S, H, D] from the schema


def test_tensorrt_target_stops_after_export(tiny_llama, tmp_path):
    with pytest.raises(UnsupportedError, match=r"target: tensorrt .*`llmc export`.*target: onnxruntime|"
                                                r"target: tensorrt needs .*target: onnxruntime.*`llmc export`"):
        compiler.build(_spec(tiny_llama, target="tensorrt"), output=tmp_path / "out")


def _plugin_model(position_type):
    register_schemas()
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, s) for n, s in
              (("q", [1, 2, 4, 8]), ("k", [1, 2, 2, 8]), ("v", [1, 2, 2, 8]), ("kc", [1, 2, 16, 8]), ("vc", [1, 2, 16, 8]),
               ("cos", [16, 4]), ("sin", [16, 4]), ("sink", [4]))]
    inputs.append(helper.make_tensor_value_info("pos", position_type, [1]))
    node = helper.make_node(PLUGIN_OP, ["q", "k", "v", "kc", "vc", "pos", "cos", "sin", "sink"], ["o", "kc2", "vc2"],
                            domain=LLMC_DOMAIN, plugin_version="1", plugin_namespace="llmc", num_heads=4, num_kv_heads=2,
                            head_dim=8, scale=0.35, rotary=1)
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("o", "kc2", "vc2")]
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(LLMC_DOMAIN, 1)])


def test_plugin_schema_checks_types_and_infers_shapes():
    good = onnx.shape_inference.infer_shapes(_plugin_model(TensorProto.INT32), strict_mode=True)
    onnx.checker.check_model(good, full_check=True)
    dims = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in good.graph.output}
    assert dims == {"o": [1, 2, 4, 8], "kc2": [1, 2, 16, 8], "vc2": [1, 2, 16, 8]}
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(_plugin_model(TensorProto.INT64), full_check=True)  # positions must be int32


def test_register_schemas_is_idempotent():
    register_schemas()
    register_schemas()
    assert onnx.defs.has(PLUGIN_OP, LLMC_DOMAIN) and onnx.defs.has("GroupQueryAttention", "com.microsoft")


def test_reference_lowering_keeps_only_attentions_main_output(tiny_llama, tmp_path):
    compiler.build(_spec(tiny_llama, export={"attention": "reference"}), output=tmp_path / "out", until="export")
    nodes = _nodes(tmp_path / "out" / "export" / "model.onnx", "Attention")
    assert nodes and all(list(n.output)[1:] == [] for n in nodes)  # present/qk outputs not computed


@pytest.mark.parametrize(("target", "attention", "message"), [
    ("tensorrt", "fused", "runs only with target: onnxruntime"),
    ("onnxruntime", "plugin", "runs only with target: tensorrt"),
    ("tensorrt", "paged", "runs only with target: onnxruntime"),
])
def test_lowering_must_suit_the_target(tiny_llama, target, attention, message):
    with pytest.raises(SpecError, match=message):
        _spec(tiny_llama, target=target, export={"attention": attention})


@pytest.mark.parametrize(("target", "expected"), [("onnxruntime", "paged"), ("tensorrt", "plugin")])
def test_auto_picks_the_targets_default_form(tiny_llama, target, expected):
    assert _spec(tiny_llama, target=target).attention_lowering == expected
    assert _spec(tiny_llama, target=target, export={"attention": "reference"}).attention_lowering == "reference"
