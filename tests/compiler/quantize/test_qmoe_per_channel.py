"""Experts whose input widths share no power-of-two block of 16 or more (QMoE's smallest; one `block_size`
serves fc1 and fc2), such as hidden 120 beside intermediate 200, are quantized per channel: one scale (and zero
point) per expert row, QMoE without `block_size` (compiler/quantize/experts.py). ONNX Runtime's CPU kernel runs
them as the reference over the dequantized codes, and a tiny Mixtral with such widths builds int4."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from helpers import moe_model
from llmc.compiler.quantize.experts import (PER_CHANNEL, ExpertStatistics, expert_block, expert_codes,
                                            quantize_experts)
from llmc.plugins.op import moe

E, K_TOP = 6, 2


def _moe_graph(hidden: int, inter: int, seed: int = 0):
    """One com.microsoft.MoE node (Mixtral's routing) over random fp32 experts, and those experts."""
    g = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(E, 2 * inter, hidden, generator=g) * 0.25
    fc2 = torch.randn(E, hidden, inter, generator=g) * 0.25
    model = moe_model(fc1.numpy(), fc2.numpy(), K_TOP)
    return model, fc1, fc2


@pytest.mark.parametrize("widths, block, want", [((120, 200), 32, PER_CHANNEL), ((128, 200), 128, PER_CHANNEL),
                                                 ((64, 96), 128, 32), ((128, 256), 32, 32)])
def test_the_experts_block_is_per_channel_only_where_no_power_of_two_fits(widths, block, want):
    model, _, _ = _moe_graph(*widths)
    assert expert_block(model.graph, block) == want


@pytest.mark.parametrize("bits, symmetric, widths", [(4, False, (120, 200)), (4, True, (128, 200)),
                                                     (8, True, (120, 200)), (8, False, (96, 40))])
def test_per_channel_qmoe_runs_the_dequantized_experts(bits, symmetric, widths):
    """Searched codes for the experts with statistics, round to nearest for the one without; QMoE's output is
    the reference over what those codes give back, and near the fp32 experts'."""
    hidden, inter = widths
    model, fc1, fc2 = _moe_graph(hidden, inter, seed=bits)
    rng = np.random.default_rng(1)
    stats = ExpertStatistics(fc1={"fc1": [rng.uniform(0.5, 2, hidden) for _ in range(E - 1)] + [None]},
                             fc2={"fc1": [rng.uniform(0.5, 2, inter) for _ in range(E - 1)] + [None]},
                             tokens={"fc1": [4] * (E - 1) + [0]})
    block = expert_block(model.graph, 32)
    assert quantize_experts(model, bits, block, symmetric, stats) == 1
    node = model.graph.node[0]
    assert node.op_type == moe.QUANTIZED_OP_TYPE and "block_size" not in [a.name for a in node.attribute]
    onnx.checker.check_model(model)
    dequantized = [torch.stack([torch.from_numpy(c.dequantize().T) for c in
                                expert_codes(w.numpy(), stats_of["fc1"], bits, block, symmetric)])
                   for w, stats_of in ((fc1, stats.fc1), (fc2, stats.fc2))]
    g = torch.Generator().manual_seed(7)
    x, logits = torch.randn(9, hidden, generator=g), torch.randn(9, E, generator=g) * 2
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
    want = moe.reference_moe(x.double(), logits.double(), dequantized[0].double(), None, dequantized[1].double(),
                             None, K_TOP, True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    exact = moe.reference_moe(x, logits, fc1, None, fc2, None, K_TOP, True).numpy()
    assert np.abs(got - exact).max() / np.abs(exact).max() < (0.25 if bits == 4 else 0.03)


def test_an_odd_width_that_fills_no_whole_byte_at_4_bits_names_the_mode_that_builds_it():
    from llmc.errors import QuantizationError

    model, _, _ = _moe_graph(64, 41)
    with pytest.raises(QuantizationError, match=r"width of 41 at 4 bits .* int8-weight-only"):
        quantize_experts(model, 4, expert_block(model.graph, 32), False, None)


def test_a_mixtral_whose_widths_share_no_block_builds_int4(tmp_path):
    """Hidden 64 beside intermediate 200: the dense layers take blocks of 32, the experts per channel."""
    from checkpoints import make_checkpoint
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    checkpoint = make_checkpoint("mixtral", tmp_path / "ckpt", intermediate_size=200)
    result = build(parse_spec({"name": "t", "source": str(checkpoint),
                               "quantization": {"mode": "int4-weight-only"}}), output=tmp_path / "out",
                   until="quantize")
    art, folder = result.artifacts["quantize"].artifact, result.artifacts["quantize"].folder
    assert "per-channel scales" in art.method
    graph = onnx.load(str(folder / art.onnx), load_external_data=False).graph
    assert [n.op_type for n in graph.node].count("QMoE") == 2
