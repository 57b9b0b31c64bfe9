"""Verify: parity at batch 1 and for a batch decoding at different positions; a broken export is caught."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmc.compiler import build
from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.spec import parse_spec
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.graph.verify import verify
from llmc.errors import VerifyError


@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_parity_batch1_and_batch3_at_different_positions(tiny_llama, tmp_path, attention):
    spec = parse_spec({"name": "t", "source": str(tiny_llama), "export": {"attention": attention}})
    report = build(spec, output=tmp_path / "out").verify
    assert report and report.passed
    assert attention in report.candidate
    by_name = {c.name: c for c in report.cases}
    assert by_name["batch-1"].batch == 1
    batch = by_name["batch-3"]
    assert batch.batch == 3 and len(set(batch.prompt_lengths)) == 3
    assert batch.decode_steps == 32 and batch.token_agreement == 1.0
    assert batch.first_divergence == [None, None, None]
    assert 0 <= report.max_abs_logit_diff < 1e-4


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

    from llmc.compiler.graph import export as export_stage

    real = export_stage.export_onnx

    def broken(model, info, lowering, out_dir, threshold, *cache):
        external = real(model, info, lowering, out_dir, threshold, *cache)
        _perturb(out_dir / "model.onnx", 1.0)
        return external

    monkeypatch.setattr(export_stage, "export_onnx", broken)
    with pytest.raises(VerifyError, match="verification failed") as err:
        build(spec, output=out, force={"export", "verify"})
    assert "first divergence" in str(err.value)
    assert (out / "build.json").read_text() == before
    assert not list(tmp_path.glob(".out.staging-*"))
