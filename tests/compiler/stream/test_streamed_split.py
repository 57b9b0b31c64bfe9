"""A tensor-parallel build read a layer at a time (`source.load: layers` with `parallel.tensor`): each rank's graph is
the whole-model split's, tensor for tensor, written from the stream with one decoder layer loaded beside the traced
period; the ranks verify together against the streamed reference; an int8 KV pool still refuses to stream."""

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from checkpoints import make_checkpoint
from llmc.compiler import build
from llmc.compiler.graph import streamed_export
from llmc.compiler.graph.export import export
from llmc.compiler.graph.files import load_graph
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec, parse_spec
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import UnsupportedError
from llmc.plugins.op.lowering import Lowering

# 4 layers (a period of 1: three stamped from the stream), 4 query and 2 KV heads: one KV head per rank
LAYERS = {"num_hidden_layers": 4}


def _initializers(graph: Path) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in load_graph(graph).graph.initializer}


@pytest.mark.parametrize("family", ["llama", "phi3"])  # phi3: fused qkv and gate_up projections cut by rows
def test_each_ranks_streamed_graph_is_the_whole_models_split_one_layer_loaded(tmp_path, family, monkeypatch):
    path = make_checkpoint(family, tmp_path / "ckpt", **LAYERS)
    info = inspect_source(SourceSpec(path=path))
    model, tokenizer = load_model(info)
    whole = export(model, tokenizer, tmp_path / "whole", lowering=Lowering.paged, source_hash="s", inputs_hash="i",
                   ranks=2)
    del model
    made, most = [], [0]
    monkeypatch.setattr(streamed_export, "LayerTensors",
                        lambda *a, _cls=streamed_export.LayerTensors: made.append(_cls(*a)) or made[-1])
    load = StreamedModel.load_layer

    def counted(self, i):
        load(self, i)
        most[0] = max(most[0], len(self.loaded))

    monkeypatch.setattr(StreamedModel, "load_layer", counted)
    streamed = export(StreamedModel(info), tokenizer, tmp_path / "streamed", lowering=Lowering.paged,
                      source_hash="s", inputs_hash="i", ranks=2)
    assert streamed.tensor_parallel == 2 and streamed.kv_layout == whole.kv_layout
    assert sorted(streamed.files) == ["rank0/model.onnx", "rank0/model.onnx.data",
                                      "rank1/model.onnx", "rank1/model.onnx.data"]
    for graph, reference in zip(streamed.graphs(tmp_path / "streamed"), whole.graphs(tmp_path / "whole")):
        a, b = _initializers(reference), _initializers(graph)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), graph
    # per rank, each stamped layer read twice (the exporter's optimizer reads its norms, then it is written), in
    # order; never more than the period and one layer loaded
    assert [m.loads for m in made] == [2 * streamed.stamped_layers] * 2 and streamed.stamped_layers == 3
    assert most[0] == 2


def test_a_streamed_split_build_verifies_quantizes_and_packages(tmp_path):
    path = make_checkpoint("llama", tmp_path / "ckpt", **LAYERS)
    spec = parse_spec({"name": "t", "source": {"path": str(path), "load": "layers"}, "parallel": {"tensor": 2},
                       "quantization": {"mode": "int4-weight-only", "algorithm": "rtn", "block_size": 32}})
    result = build(spec, output=tmp_path / "out")
    report = result.verify
    assert report.passed and "streamed layer by layer" in report.reference and "split over 2 ranks" in report.candidate
    assert all(c.token_agreement == 1.0 for c in report.cases)
    assert sorted(result.quantized.files) == ["rank0/model.onnx", "rank1/model.onnx"]
    assert result.repository.is_dir()


def test_int8_kv_pools_still_refuse_to_stream_a_split(tmp_path):
    """Their scales run the whole model: refused by the export, before the split's scales would be measured."""
    path = make_checkpoint("llama", tmp_path / "ckpt")
    spec = parse_spec({"name": "t", "source": {"path": str(path), "load": "layers"}, "parallel": {"tensor": 2},
                       "export": {"kv_cache_dtype": "int8"}})
    with pytest.raises(UnsupportedError, match="kv_cache_dtype: int8.*source.load: whole"):
        build(spec, output=tmp_path / "out", until="export")
    assert not (tmp_path / "out").exists()


def test_the_plan_of_a_streamed_split_counts_every_ranks_session(tmp_path):
    """Llama-3.1-8B's shape over 2 ranks: the export stays a layer's size, verify and quantize hold every rank's
    session at once (the whole fp32 graph and more), and the plan says so."""
    from llmc.compiler.models.config import Dims
    from llmc.compiler.pipeline import plan as plan_module

    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
    dims = Dims(model_type="llama", num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                num_kv_heads=8, head_dim=128, vocab_size=128256, tied_embeddings=False, max_position_embeddings=131072,
                linear_params=32 * per_layer + 128256 * 4096, other_params=128256 * 4096 + 32 * 2 * 4096 + 4096)
    stages = ["export", "verify", "quantize"]
    one = plan_module.stage_peaks(dims, stages, 0, "layers")
    two = plan_module.stage_peaks(dims, stages, 0, "layers", ranks=2)
    fp32 = 4 * dims.total_params
    assert one["export"] < two["export"] < 1.25 * one["export"]  # the rank's LM head slice and a layer's slice
    assert two["verify"] > 1.5 * fp32 and two["quantize"] > 1.5 * fp32 > max(one.values())
    path = make_checkpoint("llama", tmp_path / "ckpt")
    plan = plan_module.plan_build(parse_spec({"name": "t", "source": {"path": str(path), "load": "layers"},
                                              "parallel": {"tensor": 2}}))
    assert plan.load == "layers" and any("every rank's session at once" in n for n in plan.notes)
