"""Export: graph I/O names and dynamic dims, every family and lowering, reproducible bytes, external data."""

import logging
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmc.compiler import build
from llmc.compiler.artifacts import ExportedModel
from llmc.compiler.graph.files import load_graph
from llmc.compiler.hashing import sha256_file
from llmc.compiler.spec import parse_spec


def _spec(ckpt, name="tiny", **extra):
    return parse_spec({"name": name, "source": str(ckpt), **extra})


ATTENTION_OPS = {"fused": ("com.microsoft", "GroupQueryAttention"), "reference": ("", "Attention")}


@pytest.mark.parametrize("attention", ["fused", "reference"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gpt2"])
def test_each_family_and_lowering_exports_and_verifies(tiny_checkpoints, tmp_path, model_type, attention):
    result = build(_spec(tiny_checkpoints[model_type], export={"attention": attention}), output=tmp_path / "out")
    exported = result.exported
    layout = exported.kv_layout
    path = tmp_path / "out" / "export" / "model.onnx"
    graph = onnx.load(str(path)).graph
    onnx.checker.check_model(str(path), full_check=True)
    names_in = [i.name for i in graph.input]
    names_out = [o.name for o in graph.output]
    assert names_in == ["input_ids", "cache_position", *layout.past_names()]
    assert names_out == ["logits", *layout.present_names()]
    assert names_in[2:4] == ["past_key_values.0.key", "past_key_values.0.value"]
    dims = {t.name: t.shape for t in exported.inputs + exported.outputs}
    assert dims["input_ids"] == ["batch", "sequence_length"]
    assert dims["cache_position"] == ["batch"]
    kv_shape = ["batch", layout.num_kv_heads, "kv_capacity", layout.head_dim]
    assert dims["past_key_values.1.value"] == dims["present.1.value"] == kv_shape
    assert dims["logits"] == ["batch", "sequence_length", exported.model.vocab_size]
    assert exported.opset == 23 and exported.model.model_type == model_type
    attention_nodes = [n for n in graph.node if (n.domain, n.op_type) == ATTENTION_OPS[attention]]
    assert len(attention_nodes) == exported.model.num_layers
    assert not any(n.op_type in ("Softmax", "Attention", "GroupQueryAttention") for n in graph.node
                   if n not in attention_nodes)  # nothing of transformers' attention is left over
    assert exported.lowering.value == attention and layout.in_place == (attention == "fused")
    if attention == "fused":  # the fused QKV projection feeds GQA packed: no Split, no reshapes between
        assert all(list(n.input[1:3]) == ["", ""] for n in attention_nodes)
    assert result.verify.passed
    assert all(c.token_agreement == 1.0 for c in result.verify.cases)


def test_gqa_layout_is_recorded(tiny_checkpoints, tmp_path):
    exported = build(_spec(tiny_checkpoints["llama"]), output=tmp_path / "out", until="export").exported
    assert (exported.model.num_heads, exported.model.num_kv_heads, exported.model.head_dim) == (4, 2, 16)
    assert exported.kv_layout.num_kv_heads == 2


def test_reexport_gives_the_same_bytes(tiny_llama, tmp_path):
    a = build(_spec(tiny_llama), output=tmp_path / "a", until="export", force={"export"})
    b = build(_spec(tiny_llama), output=tmp_path / "b", until="export", force={"export"})
    assert a.exported.files == b.exported.files
    assert sha256_file(tmp_path / "a/export/model.onnx") == sha256_file(tmp_path / "b/export/model.onnx")


def test_external_data_above_threshold(tiny_llama, tmp_path):
    result = build(_spec(tiny_llama), output=tmp_path / "out", external_threshold=1024)
    export_dir = tmp_path / "out" / "export"
    assert result.exported.external_data
    assert set(result.exported.files) == {"model.onnx", "model.onnx.data"}
    assert (export_dir / "model.onnx").stat().st_size < (export_dir / "model.onnx.data").stat().st_size
    assert result.verify.passed  # ONNX Runtime finds the data file next to the graph
    assert ExportedModel.load(export_dir).external_data
    # as readable as the graph (onnx writes it owner-only): a server running as another user reads both
    graph, data = ((export_dir / name).stat().st_mode & 0o777 for name in ("model.onnx", "model.onnx.data"))
    assert data == graph
    # a rebuild that quantizes the cached export: the stage cache hard-links it, which onnx's loader refuses
    # (its guard against linked files); llmc reads its own data file
    quantized = build(_spec(tiny_llama, quantization={"mode": "int8-weight-only", "algorithm": "rtn"}),
                      output=tmp_path / "out", external_threshold=1024)
    assert {s.name: s.status for s in quantized.stages}["export"] == "cached"
    assert quantized.quantized.report.perplexity_quantized > 0
    os.link(export_dir / "model.onnx.data", tmp_path / "another-link")
    with pytest.raises(onnx.checker.ValidationError, match="hard link"):
        onnx.load(str(export_dir / "model.onnx"))
    shutil.copytree(export_dir, tmp_path / "copied")  # a copy has one link: what onnx reads, load_graph reads
    want = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "copied" / "model.onnx")).graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in load_graph(export_dir / "model.onnx").graph.initializer}
    assert want.keys() == got.keys() and all(np.array_equal(want[n], got[n]) for n in want)


def test_export_logs_nothing_when_the_root_logger_is_at_info(tiny_llama, tmp_path, caplog):
    """Importing ORT's MatMulNBits quantizer sets the root logger to INFO; the exporter's passes
    (torch.onnx, onnxscript, onnx_ir) must still not print a line per pass into a build's output."""
    with caplog.at_level(logging.INFO):
        build(_spec(tiny_llama), output=tmp_path / "out", until="export", force={"export"})
    exporter = [r.name for r in caplog.records if r.name.split(".")[0] in ("torch", "onnxscript", "onnx_ir")]
    assert exporter == []
