"""A real TensorRT build of the tiny Llama, where TensorRT and a GPU exist (skipped here with the
reason): the engine with the plugin is built, compared with ONNX Runtime by the tensorrt stage, packaged
with KIND_GPU instances, and its runner decodes greedily like the ONNX Runtime graph."""

import numpy as np
import pytest

from llmc.compiler.tensorrt.stage import tensorrt_missing

pytestmark = [pytest.mark.tensorrt, pytest.mark.cuda,
              pytest.mark.skipif(tensorrt_missing() is not None,
                                 reason=f"needs TensorRT and a GPU: this machine lacks {tensorrt_missing()}")]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_tiny_engine_builds_verifies_packages_and_decodes_like_onnxruntime(tiny_llama, tmp_path, precision):
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec
    from llmc.compiler.repository.triton_config import parse
    from llmc.compiler.graph.greedy import runner_greedy
    from llmc.runtime.runners.ort import OrtRunner
    from llmc.runtime.runners.trt import TrtRunner

    spec = parse_spec({"name": "tiny", "source": str(tiny_llama), "target": "tensorrt", "precision": precision,
                       "limits": {"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64}})
    result = build(spec, output=tmp_path / "out")
    assert [s.name for s in result.stages] == ["source", "export", "verify", "quantize", "tensorrt", "package"]
    assert "passed" in result.tensorrt.verified and (tmp_path / "out" / "tensorrt" / "timing.cache").is_file()
    config = parse((result.repository / "tiny" / "config.pbtxt").read_text())
    assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU
    version = result.repository / "tiny" / "1"
    m = result.manifest
    trt = TrtRunner(version / m.model_file, m.kv_layout, max_batch=4, capacity=128, max_num_tokens=64, info=m.tensorrt)
    ort_spec = parse_spec({"name": "tiny", "source": str(tiny_llama)})
    exported = build(ort_spec, output=tmp_path / "ort", until="export").exported
    ort = OrtRunner(tmp_path / "ort" / "export" / exported.onnx, exported.kv_layout, max_batch=4, capacity=128)
    prompts = [[5, 9, 200, 17], list(range(1, 30)), [42]]
    ours, theirs = runner_greedy(trt, prompts, 8, lambda: None), runner_greedy(ort, prompts, 8, lambda: None)
    for (_, a), (_, b) in zip(ours, theirs):
        assert [int(x.argmax()) for x in a] == [int(x.argmax()) for x in b]
    rebuilt = build(spec, output=tmp_path / "out")  # unchanged: the engine is reused
    assert {s.name: s.status for s in rebuilt.stages}["tensorrt"] == "cached"
    np.testing.assert_equal(rebuilt.tensorrt.tensorrt.profiles, result.tensorrt.tensorrt.profiles)


def test_an_engine_with_lora_adapters_verifies_each_and_serves_them_mixed(tiny_llama, tmp_path):
    """The tiny Llama's engine built with two PEFT adapters (docs/tensorrt.md: the LoRA inputs in its profiles): the
    tensorrt stage compares each adapter with ONNX Runtime's LoRA graph, the manifest names the engine as the LoRA
    graph, and the slot engine serves base and adapter rows in one batch as ONNX Runtime's slot engine does."""
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).parents[1] / "e2e" / "lora"))
    from lora_build import SPEC, engine_greedy, two_adapters

    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec
    from llmc.runtime.serving.loader import load

    adapters = two_adapters(tiny_llama, tmp_path)
    runs = [([5, 9, 200, 17], None), ([5, 9, 200, 17], "a"), (list(range(1, 20)), "b")]
    got = {}
    for target in ("tensorrt", "onnxruntime"):
        fields = {"target": "tensorrt", "precision": "fp16"} if target == "tensorrt" else \
            {"export": {"attention": "fused"}}
        result = build(parse_spec({"name": "tiny", "source": str(tiny_llama), **SPEC, **fields, "adapters": adapters}),
                       output=tmp_path / target)
        if target == "tensorrt":
            assert "adapter a: " in result.tensorrt.verified and "adapter b: " in result.tensorrt.verified
            assert result.manifest.lora.lora_file == result.manifest.model_file
        engine = load(result.repository / "tiny" / "1")[0]
        try:
            got[target] = engine_greedy(engine, runs, 8)
        finally:
            engine.close()
    assert got["tensorrt"] == got["onnxruntime"]
