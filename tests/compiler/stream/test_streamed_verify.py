"""Verify with the streamed reference (graph/streamed_reference.py): the checkpoint's model run layer by layer,
teacher-forced on the candidate's tokens, judges an export as the whole model's greedy decode does: the same logits compared, the
same tokens, the same verdict, a mixture's routing ties and a LongRoPE model's switch included."""

import numpy as np
import pytest

from llmc.compiler.graph.verify import verify
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec
from llmc.compiler.stream.model import StreamedModel


@pytest.mark.parametrize("family", ["llama", "phi3", "mixtral", "gemma3_text"])
def test_streamed_reference_gives_the_whole_models_verdict(paged_export, tiny_checkpoints, tmp_path, family):
    folder, exported = paged_export(family)
    info = inspect_source(SourceSpec(path=tiny_checkpoints[family]))
    model, tokenizer = load_model(info)
    whole = verify(exported, folder, model, tokenizer, tmp_path / "whole", inputs_hash="h", steps=12)
    ticks = []
    streamed = verify(exported, folder, StreamedModel(info), tokenizer, tmp_path / "streamed", inputs_hash="h",
                      steps=12, progress=lambda done, total, *what: ticks.append((done, total)))
    assert whole.passed and streamed.passed
    assert "streamed layer by layer" in streamed.reference and "streamed" not in whole.reference
    assert ticks[-1][0] == ticks[-1][1]  # the progress total is what ran
    for a, b in zip(whole.cases, streamed.cases):
        assert a.token_agreement == b.token_agreement == 1.0
        assert a.routing_ties == b.routing_ties
        assert np.isclose(a.max_abs_logit_diff, b.max_abs_logit_diff, atol=2e-5), (a, b)


def test_phi3_rows_cross_the_longrope_switch(tiny_checkpoints):
    """The case above exercises the switch only if a verify row crosses it."""
    from llmc.compiler.graph.verify import prompt_ids
    from llmc.compiler.models.config import longrope_switch

    info = inspect_source(SourceSpec(path=tiny_checkpoints["phi3"]))
    model, tokenizer = load_model(info)
    switch = longrope_switch(model.config)
    lengths = [len(p) for p in prompt_ids(tokenizer, model.config.vocab_size)]
    assert any(n <= switch < n + 11 for n in lengths)


def test_a_broken_export_fails_the_streamed_verify(paged_export, tiny_checkpoints, tmp_path):
    import shutil

    import onnx
    from onnx import numpy_helper

    folder, exported = paged_export("llama")
    broken = tmp_path / "export"
    shutil.copytree(folder, broken)
    proto = onnx.load(str(broken / exported.onnx))
    norm = next(t for t in proto.graph.initializer if "layernorm" in t.name)
    w = numpy_helper.to_array(norm)
    norm.CopyFrom(numpy_helper.from_array((w * 1.01).astype(w.dtype), norm.name))  # a 1% wrong norm in a layer
    onnx.save(proto, str(broken / exported.onnx))
    info = inspect_source(SourceSpec(path=tiny_checkpoints["llama"]))
    report = verify(exported, broken, StreamedModel(info), load_model(info)[1], tmp_path / "v", inputs_hash="h",
                    steps=12)
    assert not report.passed and report.max_abs_logit_diff > 1e-3


@pytest.mark.parametrize("family", ["llama", "phi3", "mixtral", "gpt2"])
def test_the_segmented_candidate_passes_where_the_whole_one_does(paged_export, tiny_checkpoints, tmp_path, monkeypatch,
                                                                  family):
    """A streamed build's candidate (graph/segmented_candidate.py): the graph cut inside its layers, every step of
    both cases run a segment at a time with the KV cache carried, both models fed a fixed continuation."""
    from llmc.compiler.graph import segments

    folder, exported = paged_export(family)
    info = inspect_source(SourceSpec(path=tiny_checkpoints[family]))
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 32 << 10)
    cuts = []
    real_cut = segments.cut
    monkeypatch.setattr(segments, "cut", lambda graph, budget: cuts.append(real_cut(graph, budget)) or cuts[-1])
    ticks = []
    report = verify(exported, folder, StreamedModel(info), load_model(info)[1], tmp_path / "v", inputs_hash="h",
                    steps=12, segmented=True, progress=lambda done, total, what="": ticks.append((done, total, what)))
    assert len(cuts) == 1 and len(cuts[0]) > exported.kv_layout.num_layers
    assert report.passed, report
    assert "segment at a time" in report.candidate and "continuation" in report.reference
    assert all(c.token_agreement == 1.0 and c.max_abs_logit_diff > 0 for c in report.cases)
    assert {what for *_, what in ticks} == {"the graph's steps, a segment at a time (segments x steps)",
                                            "the reference's layers"}
    assert all(done == total for done, total, _ in [t for t in ticks if t[0] == t[1]][-1:])


def test_a_broken_export_fails_the_segmented_verify(paged_export, tiny_checkpoints, tmp_path):
    import shutil

    import onnx
    from onnx import numpy_helper

    folder, exported = paged_export("llama")
    broken = tmp_path / "export"
    shutil.copytree(folder, broken)
    proto = onnx.load(str(broken / exported.onnx))
    norm = [t for t in proto.graph.initializer if "layernorm" in t.name][-1]  # the last layer's
    w = numpy_helper.to_array(norm)
    norm.CopyFrom(numpy_helper.from_array((w * 1.01).astype(w.dtype), norm.name))
    onnx.save(proto, str(broken / exported.onnx))
    info = inspect_source(SourceSpec(path=tiny_checkpoints["llama"]))
    report = verify(exported, broken, StreamedModel(info), load_model(info)[1], tmp_path / "v", inputs_hash="h",
                    steps=12, segmented=True)
    assert not report.passed and report.max_abs_logit_diff > 1e-3
