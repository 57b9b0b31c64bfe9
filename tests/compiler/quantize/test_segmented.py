"""A streamed build's quantize stage (`segmented`): its calibration pass and its quality report's reference run the
export a segment of weights at a time (graph/segments.py). The graph it makes is the whole pass's, and the
reference's perplexity is the whole reference's."""

import numpy as np
import pytest
from onnx import numpy_helper

from llmc.compiler.graph import segments
from llmc.compiler.graph.files import load_graph, save_model
from llmc.compiler.quantize import quantize, summary
from llmc.compiler.source import inspect_source, load_tokenizer
from llmc.compiler.spec import SourceSpec, parse_spec


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_segmented_quantize_makes_the_whole_ones_graph(paged_export, tiny_checkpoints, tmp_path, monkeypatch,
                                                        family):
    folder, exported = paged_export(family)
    external = tmp_path / "external"
    external.mkdir()
    assert save_model(load_graph(folder / exported.onnx), external, external_threshold=0)
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints[family]),
                       "quantization": {"mode": "int4-weight-only",
                                        "calibration": {"num_samples": 4, "seq_len": 32}}}).quantization
    tokenizer = load_tokenizer(inspect_source(SourceSpec(path=tiny_checkpoints[family])))
    whole = quantize(exported, external, tmp_path / "whole", spec, tokenizer, inputs_hash="h", num_threads=1)
    cuts = []
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 64 << 10)  # a tiny layer's weights are ~100 KiB
    real_cut = segments.cut
    monkeypatch.setattr(segments, "cut", lambda graph, budget: cuts.append(real_cut(graph, budget)) or cuts[-1])
    ticks = []
    streamed = quantize(exported, external, tmp_path / "segmented", spec, tokenizer, inputs_hash="h", num_threads=1,
                        segmented=True, progress=lambda done, total, what="": ticks.append(what))
    assert len(cuts) == 2 and all(len(c) > exported.kv_layout.num_layers for c in cuts)  # calibration, reference
    assert any("graph segments" in what for what in ticks)
    a, b = load_graph(tmp_path / "whole" / "model.onnx"), load_graph(tmp_path / "segmented" / "model.onnx")
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    for x, y in zip(a.graph.initializer, b.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(x).astype(np.float64),
                                   numpy_helper.to_array(y).astype(np.float64), rtol=1e-3, atol=1e-3, err_msg=x.name)
    r, s = whole.report, streamed.report
    assert s.perplexity_reference == pytest.approx(r.perplexity_reference, rel=1e-4)
    assert s.perplexity_quantized == pytest.approx(r.perplexity_quantized, rel=1e-3)
    assert 0 < s.token_agreement <= 1 and s.decode_tok_s_reference is None and s.decode_tok_s_quantized > 0
    assert "reference not run as served" in summary(streamed) and "segment" in s.runtime
