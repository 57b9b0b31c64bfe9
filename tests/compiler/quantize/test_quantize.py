"""Weight-only quantization (ONNX Runtime MatMulNBits): the stage, its quality report and gate,
calibration/evaluation text, and a quantized build serving through Triton."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from checkpoints import write_spec
from serving_rig import assert_serves_like_its_graph
from llmc.compiler import build
from llmc.compiler.quantize.handler import untie_lm_head
from llmc.compiler.spec import parse_spec
from llmc.compiler.textdata import builtin_documents, load_documents, token_windows
from llmc.errors import QuantizationError, SpecError, UnsupportedError
from llmc.runtime.manifest import RepositoryManifest


def _spec(tiny_llama, mode, **quant):
    # weight-only on the slot graph: these tests read its structure (the paged graph's: test_paged_graph.py);
    # the static modes quantize the reference lowering, which auto picks for them
    export = {} if mode in ("int8", "fp8") else {"attention": "fused"}
    return parse_spec({"name": "q", "source": str(tiny_llama), "export": export,
                       "limits": {"max_batch_size": 2, "max_seq_len": 320},
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
    served = int4_build.repository / "q" / "1" / manifest.model_file
    assert served.read_bytes() == (int4_build.output / "quantize" / "model.onnx").read_bytes()


def test_quality_gate_fails_the_build_and_keeps_the_previous_output(tiny_checkpoints, tmp_path):
    # plain rounding of the tiny Mistral at 4 bits loses ~9% (a random model may as well gain: the tiny
    # Llama, its norms perturbed, gains 0.7%), so a gate of 0% must trip
    source, rtn = tiny_checkpoints["mistral"], {"algorithm": "rtn"}
    first = build(_spec(source, "int4-weight-only", **rtn), output=tmp_path / "out")
    assert first.quantized.report.perplexity_increase > 0.0  # so the gate below must trip on it
    with pytest.raises(QuantizationError, match=r"quantization.max_perplexity_increase \(0.0%\)"):
        build(_spec(source, "int4-weight-only", max_perplexity_increase=0.0, **rtn), output=tmp_path / "out")
    assert json.loads((tmp_path / "out" / "build.json").read_text())["spec"]["quantization"]["max_perplexity_increase"] == 1.0
    again = build(_spec(source, "int4-weight-only", max_perplexity_increase=0.5, **rtn), output=tmp_path / "out")
    statuses = {s.name: s.status for s in again.stages}
    assert statuses["quantize"] == "cached" and again.quantized == first.quantized  # the limit is not in the key


def test_int8_weight_only_is_closer_than_int4(tiny_checkpoints, tmp_path):
    mistral = tiny_checkpoints["mistral"]  # rounded at 4 bits it loses clearly (see the quality gate's test)
    q4, q8 = (build(_spec(mistral, f"{bits}-weight-only", algorithm="rtn"), output=tmp_path / bits).quantized
              for bits in ("int4", "int8"))
    assert (q4.bits, q8.bits) == (4, 8) and q4.calibration.startswith("none")  # rtn reads no calibration text
    assert "symmetric weights" in q4.method and "asymmetric" not in q4.method  # rtn: ORT's own rounding
    assert abs(q8.report.perplexity_increase) < abs(q4.report.perplexity_increase)
    assert q8.report.token_agreement > q4.report.token_agreement
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

    from checkpoints import byte_tokenizer

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
    from checkpoints import make_checkpoint
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


def test_awq_keeps_the_fp32_function(int4_build):
    import onnxruntime as ort

    from llmc.compiler.quantize.awq import awq
    from llmc.compiler.quantize.calibrate import activation_statistics, feeds

    layout = int4_build.exported.kv_layout
    model = onnx.load(str(int4_build.output / "export" / "model.onnx"))
    untie_lm_head(model.graph)
    original = model.SerializeToString()
    windows = [np.random.default_rng(2).integers(0, 250, 24) for _ in range(3)]
    scaled = awq(model, layout, windows, bits=4, block=32)
    assert len(scaled.alphas) == 2 * 3 + 1  # fused lowering: skip-norms, the MLP up -> down, the final norm
    # the importance it derived for the scaled graph (E[x^2] / s^2 at the sites) is what the scaled graph measures
    _, measured = activation_statistics(model, layout, windows, [], 0)
    assert set(measured) == set(scaled.importance)
    for name, value in measured.items():
        np.testing.assert_allclose(scaled.importance[name], value, rtol=1e-3, atol=1e-9)
    assert any(not np.allclose(scaled.importance[n], v) for n, v in
               activation_statistics(onnx.load_from_string(original), layout, windows, [], 0)[1].items())
    logits = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(["logits"], feeds(layout, windows[0]))[0]
              for m in (original, model.SerializeToString())]  # fresh KV buffers per run: the graph updates them
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert "AWQ scaling on 7 layer inputs" in int4_build.quantized.method


def _external_export(build, tmp_path):
    """The build's export saved with its weights in an external data file (the layout a large export has), and the
    graph loaded whole."""
    source = build.output / "export" / "model.onnx"
    external = tmp_path / "external"
    external.mkdir()
    onnx.save_model(onnx.load(str(source)), str(external / "model.onnx"), save_as_external_data=True,
                    location="model.onnx.data", size_threshold=0)
    return external, onnx.load(str(source))


def test_calibration_over_the_linked_export_measures_what_the_untied_copy_does(int4_build, tmp_path):
    """A graph with external weights is calibrated through its own file (graph rewritten, weights linked,
    no prepacked copy), not by serializing the untied model: the same rows and mean squares."""
    from llmc.compiler.quantize.calibrate import activation_statistics
    from llmc.compiler.quantize.smoothquant import smoothable

    layout = int4_build.exported.kv_layout
    external, model = _external_export(int4_build, tmp_path)
    untie_lm_head(model.graph)
    windows = [np.random.default_rng(3).integers(0, 250, 20) for _ in range(2)]
    sites = [s.tensor for s in smoothable(model.graph)]
    copied = activation_statistics(model, layout, windows, sites, 16)
    linked = activation_statistics(model, layout, windows, sites, 16, graph_file=external / "model.onnx")
    for a, b in zip(copied, linked):
        assert set(a) == set(b) and a
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert (external / "model.onnx.data").stat().st_nlink == 1  # the link went with the calibration's folder


def test_across_file_systems_calibration_links_the_weights_beside_the_graph_never_copies_them(int4_build, tmp_path,
                                                                                             monkeypatch):
    """Where the system temp folder is another file system (a tmpfs /tmp), the calibration's folder goes beside the
    graph: a link, where a copy would put the fp32 weights (30 GB at 8B) on the temp file system, or in memory."""
    from llmc.compiler.quantize import calibrate
    from llmc.compiler.quantize.smoothquant import smoothable

    external, model = _external_export(int4_build, tmp_path)
    links = []
    real_link = calibrate.os.link
    monkeypatch.setattr(calibrate, "_same_file_system", lambda a, b: False)
    monkeypatch.setattr(calibrate.os, "link", lambda src, dst: (links.append(Path(dst)), real_link(src, dst))[1])
    windows = [np.random.default_rng(3).integers(0, 250, 20)]
    sites = [s.tensor for s in smoothable(model.graph)]
    found = calibrate.activation_statistics(model, int4_build.exported.kv_layout, windows, sites, 16,
                                            graph_file=external / "model.onnx")
    assert found[0] and len(links) == 1
    assert links[0].parent.parent == external and links[0].parent.name.startswith(".llmc-calibrate-")
    assert not list(external.glob(".llmc-calibrate-*")) and (external / "model.onnx.data").stat().st_nlink == 1


def test_a_4bit_repository_carries_the_cpu_kernel_for_hosts_without_a_compiler(int4_build, tmp_path):
    """The packaged runtime finds the library built here next to its own copy of the source: the
    serving Python (no compiler on PATH, an empty cache) swaps the kernel into the served graph."""
    import subprocess

    from serving_rig import serving_env
    from llmc.runtime.kernels import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("llmc's CPU kernel is unavailable on this host")
    version = int4_build.repository / "q" / "1"
    assert (version / "llmc" / "runtime" / "kernels" / cpu_kernels.library().name).is_file()  # where cpu_kernels looks
    code = f"""
import sys
sys.path.insert(0, {str(version)!r})
import onnxruntime as ort
from llmc.runtime.kernels import cpu_kernels
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
