"""An exported graph run a segment at a time (graph/segments.py) computes what its whole session computes: every
value asked for, at every cut, for three families' paged graphs, with segments of a layer or less."""

from pathlib import Path

import numpy as np
import onnx
import pytest

from llmc.compiler.graph.segments import SegmentedGraph, cut
from llmc.compiler.quantize.calibrate import feeds, weight_matmul_inputs
from llmc.compiler.graph.files import load_graph, save_model
from llmc.runtime.runners.ort import make_session


def _external(folder, exported, out):
    out.mkdir()
    assert save_model(load_graph(folder / exported.onnx), out, external_threshold=0)
    return out / "model.onnx"


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_segments_compute_what_the_whole_graph_computes(paged_export, tmp_path, family):
    folder, exported = paged_export(family)
    graph_file = _external(folder, exported, tmp_path / "g")
    proto = onnx.load(str(graph_file), load_external_data=False)
    layer_bytes = sum(int({e.key: e.value for e in t.external_data}.get("length", 0))
                      for t in proto.graph.initializer) // (2 * exported.kv_layout.num_layers)
    wanted = ["logits", *weight_matmul_inputs(proto.graph)]
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, exported.model.vocab_size, n) for n in (9, 17)]
    layout = exported.kv_layout
    augmented = onnx.load(str(graph_file), load_external_data=False)  # every wanted value a graph output
    del augmented.graph.output[:]
    augmented.graph.output.extend(onnx.helper.make_value_info(n, onnx.TypeProto()) for n in wanted)
    onnx.save(augmented, str(graph_file.with_name("whole.onnx")))
    whole = make_session(graph_file.with_name("whole.onnx"), 1, prepack=False)
    expected = [dict(zip(wanted, whole.run(wanted, feeds(layout, ids)))) for ids in windows]
    with SegmentedGraph(graph_file, budget=layer_bytes, num_threads=1) as segmented:
        assert len(segmented.segments) > exported.kv_layout.num_layers  # cut inside the layers
        ticks = []
        got = [{} for _ in windows]
        for k, values in segmented.run(len(windows), lambda k: feeds(layout, windows[k]), wanted,
                                       lambda done, total: ticks.append((done, total))):
            assert not got[k].keys() & values.keys()  # each value once
            got[k].update(values)
    assert ticks[-1] == (2 * len(segmented.segments),) * 2
    for exp, have in zip(expected, got):
        assert exp.keys() == have.keys()
        for name in wanted:
            np.testing.assert_allclose(have[name], exp[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert not expected[0]["logits"].std() == 0


def test_a_node_whose_weights_pass_the_budget_is_a_segment_of_its_own():
    from onnx import helper, numpy_helper

    big = numpy_helper.from_array(np.zeros((64, 64), np.float32), "big")
    small = numpy_helper.from_array(np.zeros((4, 64), np.float32), "small")
    nodes = [helper.make_node("MatMul", ["x", "small"], ["a"]), helper.make_node("MatMul", ["a", "big"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("MatMul", ["c", "big"], ["d"])]
    graph = helper.make_graph(nodes, "g", [], [], [big, small])
    assert cut(graph, 2048) == [[0], [1, 2, 3]]  # the big weight read twice, counted once
    assert cut(graph, 1 << 20) == [[0, 1, 2, 3]]


def test_an_unknown_value_is_named(paged_export, tmp_path):
    folder, exported = paged_export("llama")
    with SegmentedGraph(_external(folder, exported, tmp_path / "g")) as segmented:
        with pytest.raises(KeyError, match="no value nope"):
            next(segmented.run(1, lambda k: {}, ["nope"]))


def test_across_file_systems_the_weights_are_linked_beside_the_graph_never_copied(paged_export, tmp_path, monkeypatch):
    from llmc.compiler.graph import segments

    folder, exported = paged_export("llama")
    graph_file = _external(folder, exported, tmp_path / "g")
    real_link, calls = segments.os.link, []

    def link(src, dst):  # the first link (into the temporary folder) crosses file systems
        calls.append(Path(dst))
        if len(calls) == 1:
            raise OSError(18, "Invalid cross-device link")
        real_link(src, dst)

    monkeypatch.setattr(segments.os, "link", link)
    monkeypatch.setattr(segments.shutil, "copyfile", lambda *a: pytest.fail("the weights were copied"))
    layout = exported.kv_layout
    with SegmentedGraph(graph_file, num_threads=1) as segmented:
        assert calls[-1].parent.parent == graph_file.parent and calls[-1].parent.name.startswith(".llmc-segments-")
        (k, values), = list(segmented.run(1, lambda k: feeds(layout, np.arange(5)), ["logits"]))
    assert values["logits"].shape[-1] == exported.model.vocab_size
    assert not list(graph_file.parent.glob(".llmc-segments-*"))
