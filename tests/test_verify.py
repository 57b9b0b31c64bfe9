"""Verify: parity at batch 1 and for a padded batch, and a broken export is caught."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmc.compiler import build
from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.spec import parse_spec
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.verify import left_pad, positions, verify
from llmc.errors import VerifyError


def test_parity_batch1_and_padded_batch(tiny_llama, tmp_path):
    report = build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out").verify
    assert report and report.passed
    by_name = {c.name: c for c in report.cases}
    assert by_name["batch-1"].batch == 1
    padded = by_name["padded-batch-3"]
    assert padded.batch == 3 and len(set(padded.prompt_lengths)) == 3
    assert padded.decode_steps == 32 and padded.token_agreement == 1.0
    assert padded.first_divergence == [None, None, None]
    assert 0 <= report.max_abs_logit_diff < 1e-4


def test_left_padding_positions():
    ids, mask = left_pad([[5, 6, 7], [9]])
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def _perturb(onnx_path, scale):
    """Add noise to the largest weight (the embedding / LM head) of an exported graph."""
    proto = onnx.load(str(onnx_path))
    init = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))
    w = numpy_helper.to_array(init)
    noisy = w + np.random.default_rng(0).normal(0, scale, w.shape).astype(w.dtype)
    init.CopyFrom(numpy_helper.from_array(noisy, init.name))
    onnx.save(proto, str(onnx_path))


def test_small_logit_drift_fails_the_tolerance(tiny_llama, tmp_path):
    build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out", until="export")
    export_dir = tmp_path / "out" / "export"
    _perturb(export_dir / "model.onnx", 1e-3)
    model, tok = load_model(inspect_source(parse_spec({"name": "t", "source": str(tiny_llama)}).source))
    exported = ExportedModel.load(export_dir)
    strict = verify(exported, export_dir, model, tok, tmp_path / "v1", inputs_hash="x", steps=4, tolerance=1e-6)
    loose = verify(exported, export_dir, model, tok, tmp_path / "v2", inputs_hash="x", steps=4, tolerance=10.0)
    assert not strict and strict.max_abs_logit_diff > 1e-6
    assert loose.max_abs_logit_diff == strict.max_abs_logit_diff


def test_broken_export_fails_the_build_and_keeps_previous_output(tiny_llama, tmp_path, monkeypatch):
    spec = parse_spec({"name": "t", "source": str(tiny_llama)})
    out = tmp_path / "out"
    build(spec, output=out)
    before = (out / "build.json").read_text()

    from llmc.compiler import export as export_stage

    real = export_stage.export_onnx

    def broken(model, info, out_dir, threshold):
        external = real(model, info, out_dir, threshold)
        _perturb(out_dir / "model.onnx", 1.0)
        return external

    monkeypatch.setattr(export_stage, "export_onnx", broken)
    with pytest.raises(VerifyError, match="verification failed") as err:
        build(spec, output=out, force={"export", "verify"})
    assert "first divergence" in str(err.value)
    assert (out / "build.json").read_text() == before
    assert not list(tmp_path.glob(".out.staging-*"))
