"""compiler/graph/files.py: a graph saved with its weights beside it, wherever the build runs from."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, ONNX_NAME, load_graph, save_model


def _graph(value: float):
    weight = numpy_helper.from_array(np.full((64, 64), value, dtype=np.float32), "w")
    small = numpy_helper.from_array(np.ones(4, dtype=np.float32), "b")  # under 1 KiB: stays in the graph
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight, small])
    return helper.make_model(graph)


def test_external_weights_are_saved_beside_the_graph_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / EXTERNAL_DATA_NAME).write_bytes(b"another graph's weights")
    monkeypatch.chdir(elsewhere)  # onnx's own check would look here, not in the model's folder
    out = tmp_path / "out"
    out.mkdir()
    assert save_model(_graph(1.0), out, external_threshold=0)
    assert save_model(_graph(2.0), out, external_threshold=0)  # saved again over it: replaced, not appended to
    assert (out / EXTERNAL_DATA_NAME).stat().st_size == 64 * 64 * 4
    loaded = load_graph(out / ONNX_NAME)
    weights = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert np.all(weights["w"] == 2.0) and np.all(weights["b"] == 1.0)
    stored = onnx.load(str(out / ONNX_NAME), load_external_data=False).graph.initializer
    assert [t.data_location for t in stored] == [TensorProto.EXTERNAL, TensorProto.DEFAULT]
    assert (elsewhere / EXTERNAL_DATA_NAME).read_bytes() == b"another graph's weights"
