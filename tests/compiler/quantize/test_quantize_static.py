"""Static Q/DQ quantization (int8, fp8) for TensorRT: ModelOpt placement, llmc calibration and its
cache, the TensorRT-compatibility rules, the quality report, and serving an int8 build."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from serving_rig import assert_serves_like_its_graph
from llmc.compiler import build
from llmc.compiler.quantize.calibrate import Calibration, calibrate, calibration_key, weight_matmul_inputs
from llmc.compiler.spec import parse_spec
from llmc.compiler.tensorrt.compat import qdq_problems
from llmc.errors import SpecError

CALIBRATION = {"seq_len": 32, "num_samples": 6}


def _spec(ckpt, mode, method="max", extra_quant=None, **extra):
    return parse_spec({"name": "s", "source": str(ckpt), "limits": {"max_batch_size": 2, "max_seq_len": 320},
                       "serving": {"default_max_tokens": 8},
                       "quantization": {"mode": mode, "max_perplexity_increase": 1.0, **(extra_quant or {}),
                                        "calibration": {**CALIBRATION, "method": method}}, **extra})


@pytest.fixture(scope="module")
def static_out(tmp_path_factory):
    return tmp_path_factory.mktemp("static")


@pytest.fixture(scope="module")
def int8_build(tiny_checkpoints, static_out):
    return build(_spec(tiny_checkpoints["llama"], "int8"), output=static_out / "int8")


@pytest.fixture(scope="module")
def fp8_build(tiny_checkpoints, static_out):
    return build(_spec(tiny_checkpoints["llama"], "fp8", "entropy"), output=static_out / "fp8")


def _graph(result):
    return onnx.load(str(result.output / "quantize" / result.quantized.onnx)).graph


def _matmul_inputs(graph):
    producers = {o: n for n in graph.node for o in n.output}
    return [[producers.get(i) for i in n.input] for n in graph.node if n.op_type == "MatMul"]


@pytest.mark.parametrize("mode, weight_type", [("int8", TensorProto.INT8), ("fp8", TensorProto.FLOAT8E4M3FN)])
def test_every_linear_layer_gets_qdq_on_both_inputs_and_passes_the_tensorrt_rules(
        request, mode, weight_type):
    result = request.getfixturevalue(f"{mode}_build")
    assert result.exported.lowering.value == "reference"  # auto picks plain ONNX for Q/DQ modes
    graph = _graph(result)
    model = onnx.load(str(result.output / "quantize" / result.quantized.onnx))
    assert qdq_problems(model) == []
    matmuls = _matmul_inputs(graph)
    assert len(matmuls) == 2 * 5 + 1  # QKV, out, gate, up, down per layer + the LM head
    initializers = {t.name: t for t in graph.initializer}
    for act, weight in matmuls:
        assert act.op_type == weight.op_type == "DequantizeLinear"
        assert initializers[weight.input[0]].data_type == weight_type  # stored quantized
    onnx.checker.check_model(model)


def test_activation_scales_are_the_calibrated_ranges(int8_build):
    cal = Calibration.model_validate_json((int8_build.output / "quantize" / "calibration.json").read_text())
    assert cal.method == "max" and cal.samples == CALIBRATION["num_samples"]
    graph = _graph(int8_build)
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    quantizers = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    assert {q.input[0] for q in quantizers} == set(cal.amax)
    for q in quantizers:
        assert float(initializers[q.input[1]]) == pytest.approx(cal.amax[q.input[0]] / 127, rel=1e-6)


def test_reports_are_measured_and_fp8_says_it_is_the_reference_path(int8_build, fp8_build):
    for result in (int8_build, fp8_build):
        r = result.quantized.report
        assert np.isfinite(r.perplexity_quantized) and r.perplexity_quantized > 1
        assert 0 <= r.token_agreement <= 1
    assert "graph optimizations off" in fp8_build.quantized.report.runtime
    assert "graph optimizations off" not in int8_build.quantized.report.runtime
    assert "entropy over 6 sample(s) of 32 tokens" in fp8_build.quantized.calibration


def test_calibration_is_reused_across_modes_and_redone_when_the_method_changes(tiny_llama, tmp_path, monkeypatch):
    import llmc.compiler.quantize.qdq_static as quantize_module

    plain = {"smoothquant": False}  # SmoothQuant changes the int8 graph, so its ranges would differ from fp8's
    first = build(_spec(tiny_llama, "int8", extra_quant=plain), output=tmp_path / "out")
    calls = []
    real = quantize_module.calibrate
    monkeypatch.setattr(quantize_module, "calibrate", lambda *a, **k: calls.append(k["key"]) or real(*a, **k))
    fp8 = build(_spec(tiny_llama, "fp8"), output=tmp_path / "out")
    assert calls == [] and fp8.quantized.mode.value == "fp8"  # same graph, samples and method: cached ranges
    first_cal = Calibration.model_validate_json((first.output / "quantize" / "calibration.json").read_text())
    again = Calibration.model_validate_json((fp8.output / "quantize" / "calibration.json").read_text())
    assert again == first_cal
    build(_spec(tiny_llama, "fp8", "percentile"), output=tmp_path / "out")
    assert len(calls) == 1 and calls[0] != first_cal.key


def test_methods_clip_no_more_than_max(int8_build, tokenizer_windows):
    model = onnx.load(str(int8_build.output / "export" / "model.onnx"))
    layout = int8_build.exported.kv_layout
    ranges = {m: calibrate(model, layout, tokenizer_windows, m, key=m).amax for m in ("max", "entropy", "percentile")}
    assert set(ranges["max"]) == set(weight_matmul_inputs(model.graph))
    for name, top in ranges["max"].items():
        assert 0 < ranges["percentile"][name] <= top * (1 + 1e-6)
        assert 0 < ranges["entropy"][name] <= top * 1.01  # histogram edges may sit a bin above the max
    assert any(ranges["percentile"][n] < ranges["max"][n] for n in ranges["max"])
    assert calibration_key("g", tokenizer_windows, "max") != calibration_key("g", tokenizer_windows[:-1], "max")


@pytest.fixture
def tokenizer_windows():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 250, 24) for _ in range(4)]


@pytest.mark.parametrize("attention", ["fused"])
def test_static_modes_refuse_lowerings_onnx_runtime_cannot_calibrate_as_plain_onnx(tiny_llama, attention):
    with pytest.raises(SpecError, match=f"quantization.mode: int8 quantizes the reference .*export.attention: {attention}"):
        _spec(tiny_llama, "int8", export={"attention": attention})


def _qdq_model(zero_point=0, zp_type=TensorProto.INT8, weight_q_at_runtime=False):
    f = TensorProto.FLOAT
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "xs"),
             helper.make_tensor("xz", zp_type, [], [zero_point]),
             numpy_helper.from_array(np.full(3, 0.01, np.float32), "ws"),
             helper.make_tensor("wz", TensorProto.INT8, [3], [0, 0, 0])]
    if weight_q_at_runtime:
        inits.append(numpy_helper.from_array(w, "w"))
        nodes = [helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], axis=1)]
    else:
        inits.append(numpy_helper.from_array(np.round(w / 0.01).astype(np.int8), "wq"))
        nodes = []
    nodes += [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
              helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
              helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
              helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 4])],
                              [helper.make_tensor_value_info("y", f, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("model_args, problem", [
    ({}, None),
    ({"zero_point": 3}, "zero point is not 0"),
    ({"zp_type": TensorProto.UINT8}, "quantized type UINT8"),
    ({"weight_q_at_runtime": True}, "quantizes a constant at run time"),
])
def test_tensorrt_rules_catch_asymmetric_unsigned_and_runtime_weight_quantization(model_args, problem):
    problems = qdq_problems(_qdq_model(**model_args))
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_tensorrt_rules_refuse_onnx_runtime_weight_only_graphs(tiny_llama, tmp_path):
    weight_only = build(_spec(tiny_llama, "int8-weight-only"), output=tmp_path / "wo")
    problems = qdq_problems(onnx.load(str(weight_only.output / "quantize" / "model.onnx")))
    assert problems and all("MatMulNBits" in p for p in problems)


@pytest.mark.triton
def test_an_int8_build_serves_through_triton(int8_build, tmp_path):
    assert_serves_like_its_graph(int8_build, tmp_path)


def test_smoothquant_keeps_the_fp32_function_and_moves_range_out_of_activations(int8_build, tokenizer_windows):
    import onnxruntime as ort

    from llmc.compiler.quantize.calibrate import feeds
    from llmc.compiler.quantize.handler import untie_lm_head
    from llmc.compiler.quantize.smoothquant import channel_amax, smooth, smoothable

    layout = int8_build.exported.kv_layout
    model = onnx.load(str(int8_build.output / "export" / "model.onnx"))
    untie_lm_head(model.graph)
    sites = [site.tensor for site in smoothable(model.graph)]
    # per layer: the two norms and the MLP's up -> down projection; then the final norm
    assert len(sites) == 2 * 3 + 1
    before_amax = channel_amax(model, layout, tokenizer_windows, sites, 0, None)
    original = model.SerializeToString()
    assert smooth(model, layout, tokenizer_windows, alpha=0.5) == len(sites)
    after_amax = channel_amax(model, layout, tokenizer_windows, sites, 0, None)
    sample = feeds(layout, tokenizer_windows[0])
    logits = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(["logits"], sample)[0]
              for m in (original, model.SerializeToString())]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    spread = [max(a.max() / a.min() for a in amax.values()) for amax in (before_amax, after_amax)]
    assert spread[1] < spread[0]  # channels evened out: the outlier ratio per tensor shrank


def test_smoothquant_is_only_for_int8(tiny_llama, int8_build):
    with pytest.raises(SpecError, match="smoothquant applies to mode int8"):
        _spec(tiny_llama, "fp8", extra_quant={"smoothquant": True})
    assert not _spec(tiny_llama, "fp8").quantization.smoothed  # on by default, for int8 only
    assert not _spec(tiny_llama, "int8", extra_quant={"smoothquant": False}).quantization.smoothed
    for mode in ("int8", "fp8", "none"):  # a recorded spec (build.json) parses back to the same spec
        spec = _spec(tiny_llama, mode)
        assert parse_spec(spec.model_dump(mode="json")) == spec
    assert "SmoothQuant alpha 0.8" in int8_build.quantized.method


def test_a_too_short_calibration_file_fails_before_export(tiny_llama, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("only a few words here")
    started = []

    class Recorder:
        def stage_started(self, name, description):
            started.append(name)

        def stage_progress(self, done, total, what=""): ...

        def stage_finished(self, result): ...

    spec = parse_spec({"name": "s", "source": str(tiny_llama),
                       "quantization": {"mode": "int8", "calibration": {"data": str(text), "seq_len": 64}}})
    with pytest.raises(SpecError, match=r"quantization.calibration: .*calib.txt is too short: \d+ tokens.*seq_len = 64"):
        build(spec, output=tmp_path / "out", reporter=Recorder())
    assert started == ["source"] and not (tmp_path / "out").exists()
