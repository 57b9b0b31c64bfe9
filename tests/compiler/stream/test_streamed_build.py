"""Builds that read the checkpoint a layer at a time (`source.load: layers`): the streamed export writes the graph
the whole model's export writes, each layer read once; the build verifies against the streamed reference, from
safetensors and from GGUF; the plan picks the load and says why; what cannot stream is refused naming the field."""

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from llmc.compiler import build
from llmc.compiler.graph.export import export
from llmc.compiler.graph.files import load_graph
from llmc.compiler.pipeline import plan as plan_module
from llmc.compiler.pipeline.plan import plan_build
from llmc.compiler.source import inspect_source, load_model
from llmc.compiler.spec import SourceSpec, parse_spec
from llmc.compiler.graph import streamed_export as stream_export
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import ResourceError, UnsupportedError
from llmc.plugins.op.lowering import Lowering


def _initializers(folder: Path) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in load_graph(folder / "model.onnx").graph.initializer}


@pytest.mark.parametrize("family", ["llama", "mixtral", "phi3", "gpt2"])
def test_the_streamed_export_is_the_whole_models_graph_each_layer_read_once(tiny_checkpoints, tmp_path, family,
                                                                            monkeypatch):
    info = inspect_source(SourceSpec(path=tiny_checkpoints[family]))
    model, tokenizer = load_model(info)
    whole = export(model, tokenizer, tmp_path / "whole", lowering=Lowering.paged, source_hash="s", inputs_hash="i")
    made = []
    monkeypatch.setattr(stream_export, "LayerTensors",
                        lambda *a, _cls=stream_export.LayerTensors: made.append(_cls(*a)) or made[-1])
    ticks = []
    streamed = export(StreamedModel(info), tokenizer, tmp_path / "streamed", lowering=Lowering.paged,
                      source_hash="s", inputs_hash="i", progress=lambda done, total, *what: ticks.append((done, total)))
    a, b = _initializers(tmp_path / "whole"), _initializers(tmp_path / "streamed")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert streamed.external_data and streamed.stamped_layers == whole.stamped_layers > 0
    assert made[0].loads == streamed.stamped_layers  # every stamped layer read once, in order
    assert ticks and ticks[-1][0] == ticks[-1][1]


def test_a_build_reads_layers_and_verifies_against_the_streamed_reference(tiny_checkpoints, tmp_path):
    spec = parse_spec({"name": "t", "source": {"path": str(tiny_checkpoints["qwen2"]), "load": "layers"}})
    result = build(spec, output=tmp_path / "out")
    assert result.verify.passed and "streamed layer by layer" in result.verify.reference
    assert result.exported.external_data and result.repository.is_dir()


def test_a_q8_0_gguf_source_builds_a_layer_at_a_time(tmp_path, monkeypatch):
    """Its matrices in Q8_0 (as a quantized llama.cpp file stores them), dequantized a tensor at a time by the
    export and by the streamed reference alike."""
    import gguf

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_gguf import GGUF_TINY, _hf, write_gguf

    model_type, config = GGUF_TINY["qwen3"]
    _, model = _hf(model_type, tmp_path / "hf", **config)
    add = gguf.GGUFWriter.add_tensor

    def quantized(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2:
            return add(self, name, gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0),
                       raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return add(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
    path = write_gguf(model, tmp_path / "qwen3.gguf", "qwen3")
    monkeypatch.undo()
    assert gguf.GGMLQuantizationType.Q8_0 in {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    result = build(parse_spec({"name": "g", "source": {"path": str(path), "load": "layers"}}),
                   output=tmp_path / "g", until="verify")
    assert result.verify.passed and "streamed" in result.verify.reference


def test_what_cannot_stream_is_refused_naming_the_field(tiny_checkpoints, tmp_path):
    info = inspect_source(SourceSpec(path=tiny_checkpoints["gemma3_text"]))  # 4 layers, a period of 6: no repeat
    with pytest.raises(UnsupportedError, match="do not repeat.*source.load: whole"):
        export(StreamedModel(info), None, tmp_path / "g", lowering=Lowering.paged, source_hash="s", inputs_hash="i")
    spec = parse_spec({"name": "t", "source": {"path": str(tiny_checkpoints["llama"]), "load": "layers"},
                       "export": {"kv_cache_dtype": "int8"}})
    with pytest.raises(UnsupportedError, match="kv_cache_dtype: int8.*source.load: whole"):
        build(spec, output=tmp_path / "i", until="export")
    assert not (tmp_path / "i").exists()


def test_the_plan_reads_layers_only_where_the_whole_model_would_not_fit(tiny_checkpoints, monkeypatch):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"])})
    fits = plan_build(spec)
    assert fits.load == "whole" and "fits" in fits.load_reason
    assert ("build: checkpoint read", "whole (auto: the model fits in memory)") in fits.rows()
    whole_peak = max(fits.stage_peak_bytes[s] for s in ("export", "verify"))
    monkeypatch.setattr(plan_module.memory, "available_bytes", lambda: whole_peak - 1)
    tight = plan_build(spec)
    assert tight.load == "layers" and "would not fit" in tight.load_reason
    forced = plan_build(parse_spec({"name": "t", "source": {"path": str(tiny_checkpoints["llama"]), "load": "whole"}}))
    assert forced.load == "whole" and forced.load_reason == ""


def test_a_tight_machine_is_told_that_layers_would_fit(tiny_checkpoints, monkeypatch):
    """A deep model (the tiny one's config grown to 32 layers of a real model's weights): reading it a layer at a time
    needs less than whole."""
    import dataclasses

    from llmc.compiler.models.config import read_dims

    spec = parse_spec({"name": "t", "source": {"path": str(tiny_checkpoints["llama"]), "load": "whole"}})
    dims = read_dims(inspect_source(spec.source))
    deep = dataclasses.replace(dims, num_layers=32, linear_params=dims.linear_params * 4000)
    plan = plan_module.build_plan(spec, deep)
    between = (plan.layers_peak_bytes + plan.build_peak_bytes) // 2
    assert plan.layers_peak_bytes < between < plan.build_peak_bytes
    monkeypatch.setattr(plan_module.memory, "available_bytes", lambda: between)
    with pytest.raises(ResourceError, match="source.load: layers"):
        plan_module.check_plan_memory(plan_module.build_plan(spec, deep))


def test_an_8b_int4_plan_reading_layers_fits_a_24_gb_runner_and_is_flat_in_depth():
    """Llama-3.1-8B's shape (no weights: the plan reads the config alone): whole it needs a large host, a layer at
    a time every stage fits in 12 GiB, and 4 layers of the same shape need within 1.3x of what 32 do."""
    from llmc.compiler.models.config import Dims

    def dims(layers: int) -> Dims:
        per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
        return Dims(model_type="llama", num_layers=layers, hidden_size=4096, intermediate_size=14336, num_heads=32,
                    num_kv_heads=8, head_dim=128, vocab_size=128256, tied_embeddings=False,
                    max_position_embeddings=131072, linear_params=layers * per_layer + 128256 * 4096,
                    other_params=128256 * 4096 + layers * 2 * 4096 + 4096)

    stages = ["export", "verify", "quantize"]
    whole = plan_module.stage_peaks(dims(32), stages, 0, "whole")
    layers = plan_module.stage_peaks(dims(32), stages, 0, "layers")
    shallow = plan_module.stage_peaks(dims(4), stages, 0, "layers")
    assert dims(32).total_params == pytest.approx(8_030_261_248, rel=1e-3)
    assert max(whole.values()) > 40 * 2**30 and max(layers.values()) <= 12 * 2**30
    assert max(layers.values()) / max(shallow.values()) <= 1.3
