"""The ONNX prepared for a TensorRT engine: AutoCast fp16/bf16 over the plugin, reference and Q/DQ
graphs; passes onnx.checker and the TensorRT Q/DQ rules; KV I/O in the low precision."""

import onnx
import pytest
from onnx import TensorProto

from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.compiler.tensorrt.compat import qdq_problems
from llmc.compiler.tensorrt.prep import FP32_OPS, prepare_for_tensorrt
from llmc.compiler.tensorrt.split_kv import COUNTERS, PARTIALS, SplitBuffers, add_split_buffers
from llmc.plugins.op.fused_node import INPUTS
from llmc.runtime.runners.trt_split import SPLIT_BUFFERS
from llmc.plugins.op.lowering import PLUGIN_OP

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def _types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in inferred.graph.initializer})
    return types


@pytest.mark.parametrize(("model_type", "precision"), [("llama", "fp16"), ("llama", "bf16"), ("gpt2", "fp16")])
def test_plugin_graph_is_cast_with_kv_io_in_low_precision_and_norms_in_fp32(tiny_checkpoints, tmp_path, model_type,
                                                                            precision):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints[model_type]), "target": "tensorrt",
                       "precision": precision})
    exported = build(spec, output=tmp_path / "out", until="export").exported
    split = SplitBuffers(4096, exported.model.head_dim)
    path = prepare_for_tensorrt(tmp_path / "out" / "export" / "model.onnx", precision, tmp_path / "trt", split=split)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    io = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert io["past_key_values.0.key"] == io["present.0.key"] == io["logits"] == LOW[precision]
    assert io["input_ids"] == TensorProto.INT64
    types = _types(model)
    plugins = [n for n in model.graph.node if n.op_type == PLUGIN_OP]
    assert plugins and all(types[i] == LOW[precision] for n in plugins for i in (n.input[0], n.input[6], n.input[7]))
    norms = [n for n in model.graph.node if n.op_type in FP32_OPS]
    assert norms and all(types[n.output[0]] == TensorProto.FLOAT for n in norms)
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names))
    # the key-split buffers, fp32 and int32 in any precision, threaded through every plugin node in layer order
    assert io[PARTIALS] == io[SPLIT_BUFFERS[PARTIALS]] == TensorProto.FLOAT
    assert io[COUNTERS] == io[SPLIT_BUFFERS[COUNTERS]] == TensorProto.INT32
    chain = [PARTIALS, COUNTERS]
    for node in plugins:
        assert list(node.input[len(INPUTS):]) == chain and len(node.output) == 5
        chain = list(node.output[3:])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["key_splits"], attrs["split_slots"]) == (split.key_splits(attrs["num_heads"],
                                                                                attrs["num_kv_heads"]), 264)
    assert chain == [SPLIT_BUFFERS[PARTIALS], SPLIT_BUFFERS[COUNTERS]]
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert shapes[PARTIALS] == [264 * 16 * (exported.model.head_dim + 2)] and shapes[COUNTERS] == [264]


def test_split_buffers_size_the_splits_by_the_gpu_and_a_plugin_graph_needs_them(tiny_llama, tmp_path):
    buffers = SplitBuffers(32768, 128)
    assert buffers.key_splits(32, 8) == 32  # one row, 8 KV heads: 8 tiles x 32 splits fill 2 x 132 programs
    assert buffers.key_splits(64, 8) == 32  # GQA 8: still one tile per KV head
    assert SplitBuffers(1024, 128).key_splits(32, 8) == 4  # no slice under 256 keys
    assert SplitBuffers(32768, 64, num_sms=108).key_splits(14, 2) == 64  # an A100, Qwen2.5-0.5B's heads
    assert buffers.shapes() == {PARTIALS: (264 * 16 * 130,), COUNTERS: (264,)}
    spec = parse_spec({"name": "t", "source": str(tiny_llama), "target": "tensorrt", "precision": "fp16"})
    build(spec, output=tmp_path / "out", until="export")
    with pytest.raises(ValueError, match="key-split buffers"):
        prepare_for_tensorrt(tmp_path / "out" / "export" / "model.onnx", "fp16", tmp_path / "trt")
    assert not (tmp_path / "trt").exists()
    with pytest.raises(ValueError, match="head size 16 is wider than the split workspace's 4"):
        prepare_for_tensorrt(tmp_path / "out" / "export" / "model.onnx", "fp32", tmp_path / "trt",
                             split=SplitBuffers(64, 4))
    assert not (tmp_path / "trt").exists()
    exported = tmp_path / "out" / "export" / "model.onnx"
    model = onnx.load(str(exported), load_external_data=False)
    layers = sum(n.op_type == PLUGIN_OP for n in model.graph.node)
    assert layers and add_split_buffers(model, SplitBuffers(64, 16)) == layers
    with pytest.raises(ValueError, match="the graph already has split buffers .*prepared twice"):
        add_split_buffers(model, SplitBuffers(64, 16))
    model = onnx.load(str(exported), load_external_data=False)  # a node given buffers the graph does not name
    next(n for n in model.graph.node if n.op_type == PLUGIN_OP).input.append("elsewhere")
    with pytest.raises(ValueError, match=f"has {len(INPUTS) + 1} inputs: split buffers already given"):
        add_split_buffers(model, SplitBuffers(64, 16))


def test_a_qdq_graph_keeps_the_tensorrt_rules_in_fp16(tiny_llama, tmp_path):
    spec = parse_spec({"name": "t", "source": str(tiny_llama), "limits": {"max_seq_len": 320},
                       "quantization": {"mode": "fp8", "max_perplexity_increase": 10.0,
                                        "calibration": {"seq_len": 32, "num_samples": 4}}})
    result = build(spec, output=tmp_path / "out", until="quantize")
    path = prepare_for_tensorrt(tmp_path / "out" / "quantize" / result.quantized.onnx, "fp16", tmp_path / "trt")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert qdq_problems(model) == []
    scales = {t.name: t.data_type for t in model.graph.initializer}
    dequantizers = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert dequantizers and all(scales[n.input[1]] == TensorProto.FLOAT16 for n in dequantizers)  # fp16 network


def test_preparing_for_tensorrt_imports_no_triton():
    """The preparation (its split buffers' sizes from plugins/gpu/configs.py) leaves triton unimported: a process
    that imports triton before the CPU kernel tests set TRITON_INTERPRET gets compiled kernels where interpreted
    ones are wanted, and pytest imports this file before tests/gpu/'s."""
    import subprocess
    import sys

    code = ("import sys\nimport llmc.compiler.tensorrt.prep, llmc.compiler.tensorrt.split_kv\n"
            "assert 'triton' not in sys.modules, 'triton imported'\nprint('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "ok", run.stderr[-2000:]
