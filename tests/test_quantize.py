"""Weight-only quantization (ONNX Runtime MatMulNBits): the stage, its quality report and gate,
calibration/evaluation text, and a quantized build serving through Triton."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import assert_serves_like_its_graph, write_spec
from llmc.compiler import build
from llmc.compiler.quantize.handler import untie_lm_head
from llmc.compiler.spec import parse_spec
from llmc.compiler.quantize.textdata import builtin_documents, load_documents, token_windows
from llmc.errors import QuantizationError, SpecError, UnsupportedError
from llmc.runtime.manifest import RepositoryManifest


def _spec(tiny_llama, mode, **quant):
    return parse_spec({"name": "q", "source": str(tiny_llama), "limits": {"max_batch_size": 2, "max_seq_len": 320},
                       "serving": {"default_max_tokens": 8},
                       "quantization": {"mode": mode, "max_perplexity_increase": 1.0, **quant}})


@pytest.fixture(scope="module")
def int4_build(tiny_checkpoints, tmp_path_factory):
    return build(_spec(tiny_checkpoints["llama"], "int4-weight-only"), output=tmp_path_factory.mktemp("q") / "int4")


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_weight_only_builds_quantize_every_matmul_including_the_tied_lm_head(int4_build):
    out = int4_build.output
    q = int4_build.quantized
    assert q.bits == 4 and q.mode.value == "int4-weight-only"
    ops = _ops(out / "quantize" / q.onnx)
    exported = _ops(out / "export" / "model.onnx")
    assert exported.count("MatMul") == 2 * 5 + 1  # per layer QKV, out, gate, up, down; the LM head
    assert ops.count("MatMulNBits") == 2 * 4 + 1 and ops.count("Split") == 2  # gate and up merged
    assert "MatMul" not in ops and "Transpose" not in ops  # the LM head's Transpose(embedding) folded too
    graph = onnx.load(str(out / "quantize" / q.onnx), load_external_data=False).graph
    assert all(len(n.input) == 4 for n in graph.node if n.op_type == "MatMulNBits")  # awq: zero points (asymmetric)
    assert "asymmetric" in q.method and "activation-weighted" in q.method


def test_quality_report_is_measured_and_recorded(int4_build):
    r = int4_build.quantized.report
    assert r.perplexity_reference > 1 and r.perplexity_quantized > 1
    assert r.perplexity_increase == pytest.approx(r.perplexity_quantized / r.perplexity_reference - 1)
    assert 0 <= r.token_agreement <= 1 and r.agreement_tokens == 3 * 32
    assert r.size_quantized_mib < r.size_reference_mib and r.eval_tokens >= 256
    assert r.decode_tok_s_reference > 0 and r.decode_tok_s_quantized > 0
    saved = json.loads((int4_build.output / "quantize" / "quantized.json").read_text())
    assert saved["report"]["perplexity_quantized"] == r.perplexity_quantized
    from llmc.compiler import inspect_path

    section = next(s for s in inspect_path(int4_build.output) if s.title == "quantization")
    rows = dict(section.rows)
    assert rows["mode"] == "int4-weight-only" and f"{r.perplexity_increase:+.2%}" in rows["perplexity"]


def test_the_repository_serves_the_quantized_graph(int4_build):
    manifest = RepositoryManifest.load(int4_build.repository / "q" / "1")
    served = int4_build.repository / "q" / "1" / manifest.engine
    assert served.read_bytes() == (int4_build.output / "quantize" / "model.onnx").read_bytes()


def test_quality_gate_fails_the_build_and_keeps_the_previous_output(tiny_llama, tmp_path):
    rtn = {"algorithm": "rtn"}  # plain rounding: the random tiny model reliably loses a little at 4 bits
    first = build(_spec(tiny_llama, "int4-weight-only", **rtn), output=tmp_path / "out")
    assert first.quantized.report.perplexity_increase > 0.0  # so the gate below must trip on it
    with pytest.raises(QuantizationError, match=r"quantization.max_perplexity_increase \(0.0%\)"):
        build(_spec(tiny_llama, "int4-weight-only", max_perplexity_increase=0.0, **rtn), output=tmp_path / "out")
    assert json.loads((tmp_path / "out" / "build.json").read_text())["spec"]["quantization"]["max_perplexity_increase"] == 1.0
    again = build(_spec(tiny_llama, "int4-weight-only", max_perplexity_increase=0.5, **rtn), output=tmp_path / "out")
    statuses = {s.name: s.status for s in again.stages}
    assert statuses["quantize"] == "cached" and again.quantized == first.quantized  # the limit is not in the key


def test_int8_weight_only_is_closer_than_int4(tiny_llama, tmp_path):
    q4, q8 = (build(_spec(tiny_llama, f"{bits}-weight-only", algorithm="rtn"), output=tmp_path / bits).quantized
              for bits in ("int4", "int8"))
    assert (q4.bits, q8.bits) == (4, 8) and q4.calibration.startswith("none")  # rtn reads no calibration text
    assert "symmetric weights" in q4.method and "asymmetric" not in q4.method  # rtn: ORT's own rounding
    assert q8.report.perplexity_increase < q4.report.perplexity_increase
    assert q8.report.size_quantized_mib > q4.report.size_quantized_mib


def test_int8_weight_only_is_symmetric_in_wide_blocks_by_default(tiny_llama, tmp_path):
    """8-bit codes: no zero points (MatMulNBits runs them faster) and blocks of 128 unless the spec says."""
    q8 = build(_spec(tiny_llama, "int8-weight-only"), output=tmp_path / "int8").quantized
    graph = onnx.load(str(tmp_path / "int8" / "quantize" / q8.onnx), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 3 for n in nodes)
    assert {onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "block_size"} == {128}
    assert "8-bit symmetric weights, blocks of 128" in q8.method and "activation-weighted" in q8.method
    assert q8.report.perplexity_increase < 0.01


def test_static_modes_without_modelopt_are_refused_before_any_work(tiny_llama, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "modelopt.onnx.quantization", None)  # import raises ImportError
    for mode in ("int8", "fp8"):
        with pytest.raises(UnsupportedError, match=f"quantization.mode: {mode} needs NVIDIA ModelOpt.*`quantize` extra"):
            build(_spec(tiny_llama, mode), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_untie_lm_head_folds_a_transposed_initializer():
    from onnx import helper, numpy_helper

    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]), helper.make_node("MatMul", ["x", "emb_t"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [numpy_helper.from_array(table, "emb")])
    assert untie_lm_head(graph) == 1
    assert [n.op_type for n in graph.node] == ["MatMul"]
    folded = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    np.testing.assert_array_equal(folded["emb_t"], table.T)
    np.testing.assert_array_equal(folded["emb"], table)  # the Gather side keeps the original table


def test_builtin_corpus_splits_are_disjoint_and_nonempty():
    calibration, heldout = builtin_documents("calibration"), builtin_documents("heldout")
    assert len(calibration) >= 8 and len(heldout) >= 8 and not set(calibration) & set(heldout)


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "not found"),
    ("empty.txt", "\n\n  \n", "has no text"),
    ("data.csv", "a,b", "must be a .txt or .jsonl"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', "line 2 is not JSON"),
    ("nofield.jsonl", '{"body": "x"}\n', "line 1 has no string field `text`"),
])
def test_calibration_file_problems_name_the_field_and_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError, match=message) as err:
        load_documents(str(path), "quantization.calibration.data")
    assert "quantization.calibration.data" in str(err.value) and name in str(err.value)


def test_text_and_jsonl_files_are_read_and_windows_need_enough_tokens(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from conftest import byte_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())
    (tmp_path / "a.txt").write_text("first document\n\nsecond one")
    (tmp_path / "b.jsonl").write_text('{"text": "first document"}\n\n{"text": "second one"}\n')
    assert load_documents(str(tmp_path / "a.txt"), "f") == load_documents(str(tmp_path / "b.jsonl"), "f")
    windows = token_windows(tok, ["abcdefgh" * 4], 8, 3, "f", "it")
    assert [w.tolist() for w in windows] == [tok("abcdefgh")["input_ids"]] * 3
    with pytest.raises(SpecError, match="too short: 8 tokens.*seq_len = 16"):
        token_windows(tok, ["abcdefgh"], 16, 1, "quantization.calibration.data", "a.txt")


def test_a_missing_calibration_file_fails_the_build_early(tiny_llama, tmp_path):
    spec_path = write_spec(tmp_path, {"name": "q", "source": str(tiny_llama),
                                      "quantization": {"mode": "int8-weight-only", "calibration": {"data": "calib.txt"}}})
    from llmc.compiler import load_spec

    spec = load_spec(spec_path)
    assert spec.quantization.calibration.data == str(tmp_path / "calib.txt")  # resolved against the spec's folder
    with pytest.raises(SpecError, match="quantization.calibration.data: .*calib.txt not found"):
        build(spec, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_check_asks_each_mode_for_what_it_needs(tiny_llama, tmp_path):
    from conftest import make_checkpoint
    from llmc.compiler.quantize import check
    from llmc.compiler.source import inspect_source

    info = inspect_source(_spec(tiny_llama, "none").source)
    short = {"calibration": {"data": str(tmp_path / "short.txt")}}
    (tmp_path / "short.txt").write_text("a few words")
    check(_spec(tiny_llama, "int4-weight-only", algorithm="rtn", **short).quantization, info)  # rtn reads no samples
    with pytest.raises(SpecError, match="quantization.calibration: .*short.txt is too short"):
        check(_spec(tiny_llama, "int4-weight-only", **short).quantization, info)
    bare = inspect_source(_spec(make_checkpoint("llama", tmp_path / "bare", tokenizer=False), "none").source)
    with pytest.raises(SpecError, match="quantization.mode: int8-weight-only needs the checkpoint's tokenizer"):
        check(_spec(tiny_llama, "int8-weight-only").quantization, bare)


@pytest.mark.triton
def test_a_quantized_build_serves_through_triton(int4_build, tmp_path):
    assert_serves_like_its_graph(int4_build, tmp_path)


@pytest.mark.parametrize("bits,k,symmetric", [(4, 64, False), (4, 96, False), (4, 80, False), (8, 64, False),
                                               (8, 80, False), (8, 80, True), (4, 96, True)])
def test_packed_codes_are_what_matmulnbits_computes_with(bits, k, symmetric):
    """blockwise.pack's layout read by ONNX Runtime's kernel (odd block counts and a K that is not a
    multiple of the block included) gives exactly x @ the codes' dequantized weight; symmetric codes
    go without zero points (the kernel's default, 2^(bits-1))."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.compiler.quantize.blockwise import minmax, pack, search

    rng = np.random.default_rng(bits + k)
    w = rng.standard_normal((k, 6)).astype(np.float32)
    w[3, 0] = 9.0
    importance = rng.random(k) + 0.1
    q = search(w, importance, bits, 32, symmetric)
    names = ("B", "scales", "zero_points")[:2 if symmetric else 3]
    inits = [numpy_helper.from_array(a, name) for a, name in zip(pack(q), names)]
    node = helper.make_node("MatMulNBits", ["x", *names], ["y"], domain="com.microsoft",
                            K=k, N=6, bits=bits, block_size=32, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ q.dequantize(), rtol=1e-5, atol=1e-5)
    weighted = [float((importance[:, None] * np.square(c.dequantize() - w)).sum())
                for c in (q, minmax(w, bits, 32, symmetric))]
    assert weighted[0] <= weighted[1]  # never worse than round to nearest over the block's range
    if symmetric:
        assert q.symmetric and (q.zero_points == 2 ** (bits - 1)).all()
    else:
        assert np.abs(q.dequantize() - w).max() < 1.3 * np.ptp(w) / (2**bits - 1)  # within a (searched) code step


def test_sibling_matmul_nbits_are_merged_into_one_with_the_same_outputs():
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.compiler.quantize.blockwise import minmax, pack
    from llmc.compiler.graph_passes import merge_sibling_matmul_nbits

    rng = np.random.default_rng(4)
    nodes, inits = [], []
    for name, k, n, source in (("gate", 64, 24, "x"), ("up", 64, 40, "x"), ("down", 64, 8, "x2"), ("other", 64, 8, "x2")):
        arrays = pack(minmax(rng.standard_normal((k, n)).astype(np.float32), 4, 32))
        inits += [numpy_helper.from_array(a, f"{name}.{r}") for a, r in zip(arrays, ("B", "s", "z"))]
        level = 4 if name != "other" else 0  # a different accuracy level: not merged with "down"
        nodes.append(helper.make_node("MatMulNBits", [source, f"{name}.B", f"{name}.s", f"{name}.z"], [name],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=level))
    nodes.insert(0, helper.make_node("Neg", ["x"], ["x2"]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("gate", "up", "down", "other")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((2, 64)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    before = run(model)
    assert merge_sibling_matmul_nbits(model.graph) == 1
    assert [n.op_type for n in model.graph.node] == ["Neg", "MatMulNBits", "Split", "MatMulNBits", "MatMulNBits"]
    assert not any(t.name.startswith(("gate.", "up.")) for t in model.graph.initializer)
    for a, b in zip(before, run(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_weighted_search_puts_the_accuracy_where_the_activations_are():
    from llmc.compiler.quantize.blockwise import minmax, search

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    importance = np.ones(64)
    importance[[5, 37]] = 1e4  # two outlier input channels, as in real activations

    def weighted_error(q):
        return float((importance[:, None] * np.square(q.dequantize() - w)).sum())

    searched, plain = search(w, importance, 4, 32), minmax(w, 4, 32)
    assert weighted_error(searched) < 0.5 * weighted_error(plain)
    assert np.abs(searched.dequantize()[[5, 37]] - w[[5, 37]]).max() < np.abs(plain.dequantize()[[5, 37]] - w[[5, 37]]).max()
    assert searched.codes.max() <= 15 and searched.zero_points.max() <= 15
    symmetric = search(w, importance, 4, 32, symmetric=True)  # the scale alone: zero points stay at 8
    assert (symmetric.zero_points == 8).all()
    assert weighted_error(symmetric) < 0.5 * weighted_error(minmax(w, 4, 32, symmetric=True))


def test_awq_search_never_does_worse_than_round_to_nearest():
    from llmc.compiler.quantize.awq import search_scale
    from llmc.compiler.quantize.blockwise import fake_quantize

    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    x[:, [3, 17]] *= 40  # two outlier channels, as in real activations
    w = rng.standard_normal((64, 48)).astype(np.float32)
    s, alpha = search_scale(x, [w], bits=4, block=32)
    rtn = np.square(x @ w - x @ fake_quantize(w, 4, 32)).sum()
    scaled = np.square(x @ w - (x / s) @ fake_quantize(w * s[:, None], 4, 32)).sum()
    assert alpha > 0 and scaled < 0.9 * rtn


def test_awq_keeps_the_fp32_function(int4_build):
    import onnxruntime as ort

    from llmc.compiler.quantize.awq import awq
    from llmc.compiler.quantize.calibrate import feeds

    layout = int4_build.exported.kv_layout
    model = onnx.load(str(int4_build.output / "export" / "model.onnx"))
    untie_lm_head(model.graph)
    original = model.SerializeToString()
    windows = [np.random.default_rng(2).integers(0, 250, 24) for _ in range(3)]
    alphas = awq(model, layout, windows, bits=4, block=32)
    assert len(alphas) == 2 * 3 + 1  # fused lowering: skip-norms, the MLP up -> down, the final norm
    logits = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(["logits"], feeds(layout, windows[0]))[0]
              for m in (original, model.SerializeToString())]  # fresh KV buffers per run: the graph updates them
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert "AWQ scaling on 7 layer inputs" in int4_build.quantized.method


def test_a_4bit_repository_carries_the_cpu_kernel_for_hosts_without_a_compiler(int4_build, tmp_path):
    """The packaged runtime finds the library built here next to its own copy of the source: the
    serving Python (no compiler on PATH, an empty cache) swaps the kernel into the served graph."""
    import subprocess

    from conftest import serving_env
    from llmc.runtime import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("llmc's CPU kernel is unavailable on this host")
    version = int4_build.repository / "q" / "1"
    assert (version / "llmc" / "runtime" / cpu_kernels.library().name).is_file()
    code = f"""
import sys
sys.path.insert(0, {str(version)!r})
import onnxruntime as ort
from llmc.runtime import cpu_kernels
library = cpu_kernels.library()
assert library is not None and str(library).startswith({str(version)!r}), library
source = cpu_kernels.prepare({str(version / "model.onnx")!r}, ort.SessionOptions())
assert isinstance(source, bytes) and b"MatMulNBits4" in source
"""
    env = {"PATH": "/nonexistent", "CC": "no-such-cc", "LLMC_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    python = serving_env() / "bin" / "python3"
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "measured on llmc's MatMulNBits4 kernel" in int4_build.quantized.method  # the report says what it ran
