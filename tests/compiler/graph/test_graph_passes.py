"""Graph passes on the exported ONNX: the skip + RMS-norm fusion."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.graph.passes import fuse_skip_rms_norm
from llmc.plugins.op.lowering import MICROSOFT_DOMAIN


def _residual_block(gamma_is_input: bool = False):
    """x + y -> RMSNorm -> out, with the sum also a graph output (the residual stream)."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    gamma = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "gamma")
    nodes = [helper.make_node("Add", ["x", "y"], ["sum"], name="add"),
             helper.make_node("RMSNormalization", ["sum", "gamma"], ["normed"], name="norm", epsilon=1e-6, axis=-1),
             helper.make_node("Relu", ["normed"], ["out"], name="after")]
    inputs = [helper.make_tensor_value_info(n, f, [2, 3, 8]) for n in ("x", "y")]
    if gamma_is_input:
        inputs.append(helper.make_tensor_value_info("gamma", f, [8]))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info(n, f, [2, 3, 8]) for n in ("out", "sum")],
                              initializer=[] if gamma_is_input else [gamma])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(MICROSOFT_DOMAIN, 1)])
    model.ir_version = 10
    return model, gamma


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["out", "sum"], feeds)


def test_add_then_rms_norm_becomes_one_skip_norm_with_the_same_outputs():
    model, _ = _residual_block()
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 3, 8)).astype(np.float32) for n in ("x", "y")}
    before = _run(model, feeds)
    assert fuse_skip_rms_norm(model.graph) == 1
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops == [(MICROSOFT_DOMAIN, "SkipSimplifiedLayerNormalization"), ("", "Relu")]
    onnx.checker.check_model(model)
    after = _run(model, feeds)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_norm_whose_weight_is_not_a_constant_is_left_alone():
    model, _ = _residual_block(gamma_is_input=True)
    assert fuse_skip_rms_norm(model.graph) == 0
    assert [n.op_type for n in model.graph.node] == ["Add", "RMSNormalization", "Relu"]


def test_the_fused_export_has_one_skip_norm_per_residual_join(tiny_slot_build):
    exported = tiny_slot_build.exported
    graph = onnx.load(str(tiny_slot_build.output / "export" / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    # Each layer's two norms after the first take a residual sum, plus the final norm: 2 * layers - 1 + 1.
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * exported.model.num_layers
    assert ops.count("RMSNormalization") == 1  # the first layer's input norm has no residual sum before it
