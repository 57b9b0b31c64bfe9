"""The build plan (`llmc build --dry-run`): profiles, precision, memory estimate, and the refusal of
a real TensorRT build on a machine without TensorRT or a GPU."""

import onnx
import pytest
from onnx import numpy_helper

from llmc.compiler import build
from llmc.compiler.pipeline.plan import plan_build
from llmc.compiler.models.config import read_dims
from llmc.compiler.source import inspect_source
from llmc.compiler.tensorrt.stage import tensorrt_missing
from llmc.compiler.spec import parse_spec
from llmc.errors import UnsupportedError

LIMITS = {"max_batch_size": 4, "max_seq_len": 96, "max_num_tokens": 64}


def _spec(ckpt, **extra):
    return parse_spec({"name": "p", "source": str(ckpt), "limits": LIMITS, "serving": {"default_max_tokens": 8},
                       **extra})


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "phi3", "gemma2"])  # phi3: fused projections
def test_weight_estimate_matches_the_exported_initializers(tiny_checkpoints, tmp_path, model_type):
    spec = _spec(tiny_checkpoints[model_type])
    planned = plan_build(spec)
    build(spec, output=tmp_path / "out", until="export")
    model = onnx.load(str(tmp_path / "out" / "export" / "model.onnx"))
    stored = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer if len(t.dims) >= 2)
    dims = read_dims(inspect_source(spec.source))
    # RoPE tables [positions, <= head_dim / 2] are not weights
    rotary = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer
                 if len(t.dims) == 2 and t.dims[0] == dims.max_position_embeddings and t.dims[1] <= dims.head_dim // 2)
    assert planned.weights_bytes == pytest.approx(stored - rotary, rel=0.05)
    assert planned.attention_nodes == dims.num_layers


def test_kv_cache_and_activation_estimates_follow_the_limits(tiny_llama):
    dims = read_dims(inspect_source(_spec(tiny_llama).source))
    planned = plan_build(_spec(tiny_llama))
    per_token = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * 4
    assert planned.kv_cache_bytes == per_token * LIMITS["max_seq_len"] * LIMITS["max_batch_size"]
    assert planned.activation_bytes >= LIMITS["max_num_tokens"] * dims.vocab_size * 4  # the prefill chunk's logits
    assert planned.profiles == [] and planned.stages == ["source", "export", "verify", "package"]


def test_the_build_peak_is_the_largest_stage_of_the_build(tiny_llama):
    """--dry-run's build memory: the weights at fp32 times the largest factor among the stages the build
    runs (BUILD_PEAK) over the fixed cost, the untied LM head counted when a quantized build makes one."""
    from llmc.compiler.pipeline.plan import BASE, BUILD_PEAK

    dims = read_dims(inspect_source(_spec(tiny_llama).source))
    fp32 = 4 * (dims.linear_params + dims.other_params)
    plain = plan_build(_spec(tiny_llama))
    assert plain.load == "whole"
    assert plain.build_peak_bytes == int(BASE + max(BUILD_PEAK["export"][0], BUILD_PEAK["verify"][0]) * fp32)
    int4 = plan_build(_spec(tiny_llama, quantization={"mode": "int4-weight-only"}))
    w, u, _ = BUILD_PEAK["quantize"]  # (the experts' factor: no experts here)
    untied = 4 * dims.vocab_size * dims.hidden_size if dims.tied_embeddings else 0
    assert int4.build_peak_bytes == int(BASE + w * fp32 + u * untied) > plain.build_peak_bytes
    assert ("build: peak memory (estimate)", f"{int4.build_peak_bytes / 2**30:.2f} GiB") in int4.rows()


def test_tensorrt_plan_has_prefill_and_decode_profiles_and_halves_for_fp16(tiny_llama):
    fp32 = plan_build(_spec(tiny_llama))
    planned = plan_build(_spec(tiny_llama, target="tensorrt", precision="fp16"))
    prefill, decode = planned.profiles
    dims = read_dims(inspect_source(_spec(tiny_llama).source))
    kv = (dims.num_kv_heads, LIMITS["max_seq_len"], dims.head_dim)
    assert prefill.shapes["input_ids"] == ((1, 2), (1, LIMITS["max_num_tokens"]), (1, LIMITS["max_num_tokens"]))
    assert decode.shapes["input_ids"] == ((1, 1), (4, 1), (4, 1))
    assert prefill.shapes["past_key_values.*"] == ((1, *kv),) * 3  # one sequence prefilled per step
    assert decode.shapes["past_key_values.*"] == ((1, *kv), (4, *kv), (4, *kv))
    assert planned.kv_cache_bytes * 2 == fp32.kv_cache_bytes and planned.weights_bytes * 2 == fp32.weights_bytes
    assert "AutoCast" in planned.precision and planned.attention.startswith("LlmcFusedAttention")
    assert planned.stages == ["source", "export", "tensorrt", "package"]  # the plugin graph is not verified on CPU
    rows = dict(planned.rows())
    assert "opt [4, 1]" in rows["profile decode"] and "GiB" in rows["memory: total (estimate)"]


def test_quantized_tensorrt_plan_counts_one_byte_linear_weights(tiny_llama):
    fp16 = plan_build(_spec(tiny_llama, target="tensorrt", precision="fp16"))
    fp8 = plan_build(_spec(tiny_llama, target="tensorrt", precision="fp16", quantization={"mode": "fp8"}))
    assert fp8.weights_bytes < fp16.weights_bytes and fp8.attention.startswith("opset-23")  # Q/DQ: reference lowering
    assert "quantize" in fp8.stages and "verify" in fp8.stages and fp8.quantization.startswith("fp8 (Q/DQ")


@pytest.mark.skipif(tensorrt_missing() is None, reason="this machine has TensorRT and a GPU")
def test_a_real_tensorrt_build_stops_at_once_naming_what_is_missing_and_the_target_that_works(tiny_llama, tmp_path):
    with pytest.raises(UnsupportedError, match="target: tensorrt needs .*(TensorRT|GPU).* target: onnxruntime"):
        build(_spec(tiny_llama, target="tensorrt"), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_mixture_reports_total_and_active_parameters_and_its_experts_memory(tiny_checkpoints, model_type):
    """Active: the checkpoint's parameters less the share of each sparse layer's experts a token does not
    route to (counted here from the PyTorch model itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[model_type], dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    unrouted = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name) \
        * (1 - config.num_experts_per_tok / experts)
    from llmc.compiler.pipeline.plan import BASE, BUILD_PEAK

    planned = plan_build(_spec(tiny_checkpoints[model_type]))
    assert planned.total_params == total and planned.active_params == round(total - unrouted)
    assert 0 < planned.expert_bytes < planned.weights_bytes
    fp32 = 4 * total
    assert planned.build_peak_bytes == max(int(BASE + w * fp32 + x * 4 * (total - sum(
        p.numel() for name, p in model.named_parameters() if ".experts." not in name))) for w, _, x in
        (BUILD_PEAK["export"], BUILD_PEAK["verify"]))  # the experts' own factor on top of the weights'
    rows = dict(planned.rows())
    assert rows["parameters"] == f"{total:,} total, {planned.active_params:,} active per token"
    assert rows["memory: weights"].startswith(f"{planned.weights_bytes / 2**30:.2f} GiB (experts ")
