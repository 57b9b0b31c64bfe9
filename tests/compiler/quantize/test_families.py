"""Weight-only quantization on every model family (compiler/models/): AWQ's scaling keeps each family's
function (sandwich norms, q/k norms, post-norms, multipliers, (1 + w) norms and GPT-2's Gemm layers
included), every linear layer ends up quantized, and int4/int8 builds pass the quality gate."""

import numpy as np
import onnx
import pytest

from checkpoints import TINY
from llmc.compiler.quantize import HANDLERS, check_quality_gate, quantize
from llmc.compiler.quantize.calibrate import run_tensors
from llmc.compiler.quantize.handler import gemms_as_matmuls, untie_lm_head
from llmc.compiler.quantize.smoothquant import apply_scales, smoothable
from llmc.compiler.source import inspect_source, load_tokenizer
from llmc.compiler.spec import QuantizationSpec, SourceSpec

# what AWQ may scale, per family: per layer the attention input norm, the MLP input norm and the gated
# MLP's up -> down (Phi-3's up: its half of gate_up_proj), then the final norm. Not the norms whose output
# feeds a residual Add (Gemma 2/3's sandwich norms, OLMo 2's post-norms: OLMo 2 keeps only the MLP's
# site) or attention (q/k norms); GPT-2's and Nemotron's MLPs are not gated. A mixture's sparse layer keeps only
# the attention input norm: its MLP input norm also feeds the router and the expert op, and its experts' up ->
# down lives inside the op (Qwen3-MoE's tiny middle layer is dense: 1 + 3 + 1 sites)
SITES_PER_LAYER = {"olmo2": 1, "gpt2": 2, "nemotron": 2, "mixtral": 1, "gpt_oss": 1, "qwen3_moe": 5 / 3}
GATED_FAMILIES = ["qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "olmo2", "smollm3", "gpt2"]


def _layers(model_type: str) -> int:
    config = TINY[model_type]
    return config.get("num_hidden_layers") or config["n_layer"]


def _logits(model, layout, ids: np.ndarray) -> np.ndarray:
    return next(run_tensors(model, layout, [ids], ["logits"], 1, None))["logits"]


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_awq_scaling_leaves_each_family_function_unchanged(paged_export, model_type):
    """The graph weight-only quantization scales (LM head untied, Gemm as MatMul) with a random
    positive scale at every AWQ site gives the exported graph's logits (before any rounding): a
    site whose producer is not linear in the scale (a norm feeding a residual or attention) would not."""
    folder, exported = paged_export(model_type)
    original = onnx.load(str(folder / exported.onnx))
    model = onnx.ModelProto()
    model.CopyFrom(original)
    untie_lm_head(model.graph)
    gemms_as_matmuls(model.graph)
    sites = smoothable(model.graph)
    assert len(sites) == round(SITES_PER_LAYER.get(model_type, 3) * _layers(model_type)) + 1
    rng = np.random.default_rng(0)
    weights = {t.name: t for t in model.graph.initializer}
    scales = [np.exp(rng.uniform(-1.5, 1.5, weights[s.readers[0].input[1]].dims[0])).astype(np.float32) for s in sites]
    apply_scales(model, sites, scales)
    ids = rng.integers(0, exported.model.vocab_size, 40)
    before, after = _logits(original, exported.kv_layout, ids), _logits(model, exported.kv_layout, ids)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())


def test_a_norm_read_by_a_residual_or_by_attention_is_no_site():
    """Sandwich norms and q/k norms (their output reaches an Add or attention, not only linear layers)
    and a norm whose scale is a broadcast scalar keep their scale; a flattening Reshape before the
    linear layer (GPT-2's Conv1D) does not hide a site."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value, dtype=np.int64 if "shape" in name else np.float32), name)

    nodes = [
        helper.make_node("RMSNormalization", ["x", "g_post"], ["post"]),  # sandwich: read by the residual Add
        helper.make_node("Add", ["x", "post"], ["h"]),
        helper.make_node("RMSNormalization", ["h", "g_in"], ["normed"]),  # read by a linear layer: a site
        helper.make_node("MatMul", ["normed", "w1"], ["y1"]),
        helper.make_node("RMSNormalization", ["y1", "g_qk"], ["q"]),  # a q norm: read by attention (here Mul)
        helper.make_node("Mul", ["q", "q"], ["att"]),
        helper.make_node("RMSNormalization", ["h", "g_scalar"], ["s"]),  # a scalar scale cannot absorb 1/s per channel
        helper.make_node("MatMul", ["s", "w2"], ["y2"]),
        helper.make_node("LayerNormalization", ["h", "g_ln", "b_ln"], ["ln"]),  # GPT-2: through a flatten
        helper.make_node("Reshape", ["ln", "shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w3"], ["y3"]),
    ]
    inits = [const("g_post", np.ones(4)), const("g_in", np.ones(4)), const("w1", np.ones((4, 4))),
             const("g_qk", np.ones(4)), const("g_scalar", np.ones(1)), const("w2", np.ones((4, 4))),
             const("g_ln", np.ones(4)), const("b_ln", np.zeros(4)), const("shape", [-1, 4]), const("w3", np.ones((4, 4)))]
    out = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("att", "y2", "y3")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])], out, inits)
    sites = {s.tensor: [(n.op_type, n.input[i]) for n, i, *_ in s.divide] for s in smoothable(graph)}
    assert sites == {"normed": [("RMSNormalization", "g_in")],
                     "flat": [("LayerNormalization", "g_ln"), ("LayerNormalization", "b_ln")]}


@pytest.mark.parametrize("mode", ["int4-weight-only", "int8-weight-only"])
@pytest.mark.parametrize("model_type", GATED_FAMILIES)
def test_weight_only_quantizes_every_linear_layer_through_the_quality_gate(paged_export, tiny_checkpoints,
                                                                            tmp_path, model_type, mode):
    folder, exported = paged_export(model_type)
    spec = QuantizationSpec(mode=mode)  # the defaults: AWQ on the built-in calibration text, the 5% gate
    tokenizer = load_tokenizer(inspect_source(SourceSpec(path=tiny_checkpoints[model_type])))
    art = quantize(exported, folder, tmp_path / "quantize", spec, tokenizer, inputs_hash="test", num_threads=1)
    graph = onnx.load(str(tmp_path / "quantize" / art.onnx), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    unquantized = [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert not unquantized  # every linear layer (GPT-2's Gemm too) is a MatMulNBits
    assert art.bits == HANDLERS[spec.mode].bits and "AWQ scaling" in art.method
    check_quality_gate(art.report, spec.max_perplexity_increase)  # perplexity +5% at most
    # a floor, not a measure: a random tiny model's next tokens are near ties (perplexity ~300 of 256 ids)
    assert art.report.token_agreement >= (0.8 if art.bits == 8 else 0.4)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_int4_experts_pass_the_quality_gate_as_qmoe_with_the_router_in_fp32(paged_export, tiny_checkpoints,
                                                                           tmp_path, model_type):
    """A mixture's sparse layers become QMoE nodes (experts' codes searched on the tokens routed to each), every
    other linear layer a MatMulNBits, the routers stay fp32 MatMuls, and the build passes the gate."""
    folder, exported = paged_export(model_type)
    spec = QuantizationSpec(mode="int4-weight-only")
    tokenizer = load_tokenizer(inspect_source(SourceSpec(path=tiny_checkpoints[model_type])))
    art = quantize(exported, folder, tmp_path / "quantize", spec, tokenizer, inputs_hash="test", num_threads=1)
    graph = onnx.load(str(tmp_path / "quantize" / art.onnx), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    sparse = _layers(model_type) - (1 if model_type == "qwen3_moe" else 0)  # its middle layer is dense
    assert ops.count("QMoE") == sparse and "MoE" not in ops
    weights = {t.name for t in graph.initializer}
    unquantized = [n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert len(unquantized) == sparse and all("router" in w for w in unquantized)
    assert "expert(s) reached by no token rounded to nearest" in art.method
    check_quality_gate(art.report, spec.max_perplexity_increase)
    assert art.report.token_agreement >= 0.4


def test_greedy_agreement_judges_both_graphs_on_the_same_inputs(paged_export, tiny_checkpoints):
    """Phi-3's tiny LongRoPE switches its table past 88 positions, which the longest verify prompt
    (80 tokens) crosses while decoding 32: there the graph's step-by-step decode and its one-step
    prefill of the same tokens pick differently. The report feeds both graphs the same tokens, so a
    graph measured against itself agrees fully (judged against its own step-by-step decode: 76/96)."""
    from llmc.compiler.graph.verify import PROMPTS
    from llmc.compiler.quantize import AGREEMENT_STEPS
    from llmc.compiler.quantize.quality import compare

    folder, exported = paged_export("phi3")
    tokenizer = load_tokenizer(inspect_source(SourceSpec(path=tiny_checkpoints["phi3"])))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert max(map(len, prompts)) + AGREEMENT_STEPS > TINY["phi3"]["original_max_position_embeddings"]
    graph = folder / exported.onnx
    report = compare(graph, graph, exported.kv_layout, windows=[np.arange(64) % 256], eval_text="ids",
                     prompts=prompts, steps=AGREEMENT_STEPS, vocab_size=exported.model.vocab_size, sizes=(1, 1),
                     num_threads=1)
    assert report.token_agreement == 1.0 and report.perplexity_increase == 0.0
