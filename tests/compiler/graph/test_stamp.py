"""Stamped layers (compiler/graph/stamp.py): a decoder's repeating layers are traced once a period and copied in
the graph, and the result verifies against the checkpoint's own PyTorch model; what is not a chain of
self-contained layers is traced whole."""

import numpy as np
import onnx_ir as ir
import pytest

from llmc.compiler import build
from llmc.compiler.graph import stamp
from llmc.compiler.spec import parse_spec

# tiny configs whose layers differ (sliding and full, sparse and dense, RoPE and none): doubled, each must find
# its pattern's period and stamp the second half; llama repeats from its first layer. Qwen3's full layers are the
# first `max_window_layers`, which repeat in no period: its doubled config alternates them instead; Qwen3-MoE's has
# no windows (transformers' own masks fail on its layer_types) and its dense layer, listed by index, comes again.
PATTERNED = ("llama", "qwen3", "gemma2", "gemma3_text", "smollm3", "qwen3_moe", "gpt_oss")
PATTERNS = {"qwen3": {"layer_types": ["full_attention", "sliding_attention"]},
            "qwen3_moe": {"use_sliding_window": False}}
SECOND_HALF = {"qwen3_moe": {"mlp_only_layers": [1, 4]}}


def doubled(model_type: str) -> dict:
    """The tiny config with twice the layers, every per-layer list repeated."""
    from checkpoints import TINY

    config = {**TINY[model_type], **PATTERNS.get(model_type, {})}
    n = config["num_hidden_layers"]
    return {**{k: v * 2 for k, v in config.items() if isinstance(v, list) and len(v) == n},
            "num_hidden_layers": 2 * n, **SECOND_HALF.get(model_type, {})}


@pytest.mark.parametrize("model_type", PATTERNED)
def test_a_doubled_decoder_stamps_its_second_half_and_verifies(tmp_path, model_type):
    from checkpoints import make_checkpoint

    config = doubled(model_type)
    checkpoint = make_checkpoint(model_type, tmp_path / "ckpt", **config)
    result = build(parse_spec({"name": "t", "source": str(checkpoint)}), output=tmp_path / "out", until="verify")
    n = config["num_hidden_layers"]
    assert n // 2 <= result.exported.stamped_layers < n  # at most the tiny config's own layers traced
    assert result.verify.passed and all(c.token_agreement == 1.0 for c in result.verify.cases), result.verify


def test_the_period_is_the_shortest_repeat_and_none_without_one(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    from llmc.compiler.models import decoder_for

    def period(model_type):
        return stamp.layer_period(decoder_for(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[model_type])))

    assert period("llama") == 1  # 2 layers alike
    assert period("smollm3") == 2  # RoPE on every other layer
    assert period("gemma2") is None  # sliding, full: a period of 2 in 2 layers saves nothing
    assert period("gemma3_text") is None  # its 6 layers are one pattern


def _chain(cross: bool) -> ir.Model:
    """A period graph of two layers (markers -1, 0, 1), each x -> Relu -> Add(its weight), its KV inputs k, v
    giving k + relu and v * relu; with `cross`, layer 1 adds layer 0's Relu instead of its own."""
    f32 = ir.TensorType(ir.DataType.FLOAT)

    def value(name):
        return ir.Value(name=name, shape=ir.Shape([4]), type=f32)

    x, nodes, weights, pools, presents = value("x"), [], [], [], []

    def node(op, *inputs, **attributes):
        made = ir.Node(stamp.DOMAIN if op == stamp.MARKER else "", op, inputs,
                       [ir.AttrInt64(k, v) for k, v in attributes.items()])
        nodes.append(made)
        return made.outputs[0]

    hidden, relus = node(stamp.MARKER, x, layer=-1), []
    for layer in range(2):
        weight = ir.Value(name=f"decoder.sinks.{layer}", shape=ir.Shape([4]), type=f32,
                          const_value=ir.tensor(np.full(4, layer, np.float32)))
        weights.append(weight)
        relus.append(node("Relu", hidden))
        k, v = value(f"k{layer}"), value(f"v{layer}")
        pools += [k, v]
        for made, name in ((node("Add", k, relus[-1]), f"k{layer}'"), (node("Mul", v, relus[-1]), f"v{layer}'")):
            made.name = name
            presents.append(made)
        hidden = node(stamp.MARKER, node("Add", relus[0 if cross else layer], weight), layer=layer)
    y = node("Identity", hidden)
    y.name = "y"
    graph = ir.Graph([x, *pools], [y, *presents], nodes=nodes, initializers=weights,
                     opset_imports={"": 23, stamp.DOMAIN: 1})
    return ir.Model(graph, ir_version=10)


def _stamp(model, layers: int) -> int:
    import torch

    tensors = {f"decoder.sinks.{i}": torch.full((4,), float(i)) for i in range(layers)}
    kv = [f"{kind}{i}" for i in range(layers) for kind in "kv"]
    return stamp.stamp(model, layers, 2, tensors, ["decoder.layers", "decoder.sinks"], ["x", *kv], ["y", *(f"{n}'" for n in kv)],
                       kv, [f"{n}'" for n in kv])


def test_a_chain_of_layers_is_stamped_and_a_layer_reading_another_is_refused():
    model = _chain(cross=False)
    assert _stamp(model, 5) == 3
    graph = model.graph
    assert [v.name for v in graph.inputs] == ["x", *(f"{kind}{i}" for i in range(5) for kind in "kv")]
    weights = [n.inputs[1].name for n in graph if n.op_type == "Add" and n.inputs[1].is_initializer()]
    assert weights == [f"decoder.sinks.{i}" for i in range(5)]  # a list entry: no path after the index
    assert not any(n.domain == stamp.DOMAIN for n in graph)  # no marker left
    k4 = graph.outputs[9].producer()  # layer 4's key: its own KV input plus its own Relu, of layer 3's output
    assert graph.outputs[9].name == "k4'" and k4.inputs[0].name == "k4"
    assert k4.inputs[1].producer().inputs[0].producer().inputs[1].name == "decoder.sinks.3"
    with pytest.raises(stamp.Unstampable, match="is reached from layer 0 and from beyond it"):
        _stamp(_chain(cross=True), 5)
