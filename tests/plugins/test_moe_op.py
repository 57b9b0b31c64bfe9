"""`llmc::moe` (plugins/op/moe.py): its reference against a per-token formula written out here, the routing
variants against the families' own routers, its ONNX lowering (com.microsoft.MoE) and the QMoE node the
weight-only quantizer makes (compiler/quantize/experts.py) run by ONNX Runtime's CPU kernels, with random
routing, top-k 1 to 4, more experts than rows, rows that pick the same experts and an expert nobody picks."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from llmc.compiler.quantize.experts import ExpertStatistics, expert_block, quantize_experts, routers
from llmc.plugins.op import moe

E, H, I = 6, 32, 48


def _weights(seed: int, biases: bool):
    g = torch.Generator().manual_seed(seed)
    fc1, fc2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    b1 = torch.randn(E, 2 * I, generator=g) * 0.2 if biases else None
    b2 = torch.randn(E, H, generator=g) * 0.2 if biases else None
    return fc1, b1, fc2, b2


def _per_token(x, logits, fc1, b1, fc2, b2, k, normalize, alpha, beta, limit):
    """The op's definition, one token and one expert at a time."""
    out = torch.zeros_like(x)
    for t in range(len(x)):
        probs = torch.softmax(logits[t], -1)
        top = sorted(range(E), key=lambda e: -float(probs[e]))[:k]
        total = sum(float(probs[e]) for e in top) if normalize else 1.0
        for e in top:
            a = fc1[e] @ x[t] + (b1[e] if b1 is not None else 0)
            g, u = a[0::2], a[1::2]
            if limit > 0:
                g, u = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
            y = fc2[e] @ (g * torch.sigmoid(alpha * g) * (u + beta)) + (b2[e] if b2 is not None else 0)
            out[t] += float(probs[e]) / total * y
    return out


VARIANTS = {  # k, normalize, alpha, beta, limit, biases
    "top1": (1, False, 1.0, 0.0, 0.0, False),
    "mixtral": (2, True, 1.0, 0.0, 0.0, False),
    "qwen3-moe": (3, False, 1.0, 0.0, 0.0, False),
    "gpt-oss": (4, True, 1.702, 1.0, 0.5, True),
}


def _case(rows: int, variant: str, seed: int = 0):
    k, normalize, alpha, beta, limit, biases = VARIANTS[variant]
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(rows, H, generator=g)
    logits = torch.randn(rows, E, generator=g) * 2
    logits[:, E - 1] = -30.0  # an expert no row picks
    if rows > 2:
        logits[1] = logits[0]  # two rows that pick the same experts
    return x, logits, (*_weights(seed, biases), k, normalize, alpha, beta, limit)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_reference_is_the_per_token_definition(variant, rows):
    x, logits, (fc1, b1, fc2, b2, *rest) = _case(rows, variant)
    got = moe.reference_moe(x, logits, fc1, b1, fc2, b2, *rest)
    torch.testing.assert_close(got, _per_token(x, logits, fc1, b1, fc2, b2, *rest), rtol=1e-5, atol=1e-5)
    if VARIANTS[variant][4] > 0:  # the clamp is reached, so dropping it would show
        loose = moe.reference_moe(x, logits, fc1, b1, fc2, b2, *rest[:-1], 0.0)
        assert not torch.allclose(got, loose, atol=1e-3)


def test_top_k_then_softmax_is_renormalized_softmax_top_k():
    """gpt-oss routes by a softmax over its top-k logits; the op's normalize=True is the same weights."""
    logits = torch.randn(20, 8)
    values, experts = torch.topk(logits, 3, dim=-1)
    weights, picked = moe.route(logits, 3, normalize=True)
    assert torch.equal(picked, experts)
    torch.testing.assert_close(weights, torch.softmax(values, dim=-1))


def _exported(tmp_path, variant: str):
    """One llmc::moe call exported through the lowering, its weights as initializers."""
    _, _, (fc1, b1, fc2, b2, k, normalize, alpha, beta, limit) = _case(1, variant)

    class Mixture(torch.nn.Module):
        def forward(self, x, logits):
            return torch.ops.llmc.moe(x, logits, fc1, b1, fc2, b2, k, normalize, alpha, beta, limit)

    import onnxscript  # noqa: F401  (before the schemas: it imports onnx.reference, which a name in two domains breaks)

    from llmc.plugins.op.lowering import register_schemas

    register_schemas()
    x, logits = torch.randn(3, H), torch.randn(3, E)
    program = torch.onnx.export(Mixture(), (x, logits), dynamo=True, input_names=["x", "logits"],
                                dynamic_shapes={"x": {0: "tokens"}, "logits": {0: "tokens"}},
                                custom_translation_table={torch.ops.llmc.moe.default: moe.lowering()},
                                opset_version=23, optimize=True, verbose=False, report=False)
    path = tmp_path / "moe.onnx"
    program.save(str(path))
    return path


def _run(model, x, logits):
    session = ort.InferenceSession(model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_onnx_runtime_runs_the_lowered_op_as_the_reference(tmp_path, variant):
    path = _exported(tmp_path, variant)
    assert [n.op_type for n in onnx.load(str(path)).graph.node if n.domain == "com.microsoft"] == ["MoE"]
    for rows in (1, 3, 16):
        x, logits, args = _case(rows, variant, seed=rows)
        _, _, (fc1, b1, fc2, b2, *rest) = _case(1, variant)  # the exported weights
        want = moe.reference_moe(x, logits, fc1, b1, fc2, b2, *rest)
        np.testing.assert_allclose(_run(path, x, logits), want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_qmoe_runs_the_dequantized_experts(tmp_path, bits):
    """QMoE over llmc's block codes computes the reference over the weights those codes give back (up to its
    int8 activations); an expert with statistics gets searched codes, one without is rounded to nearest."""
    from llmc.compiler.quantize.experts import expert_codes

    variant = "gpt-oss"
    model = onnx.load(str(_exported(tmp_path, variant)))
    fc1_name = next(n for n in model.graph.node if n.op_type == "MoE").input[2]
    stats = ExpertStatistics(fc1={fc1_name: [np.ones(H)] * (E - 1) + [None]},
                             fc2={fc1_name: [np.ones(I)] * (E - 1) + [None]}, tokens={fc1_name: [1] * (E - 1) + [0]})
    block = expert_block(model.graph, 32)
    assert block == 16  # 48 is no multiple of 32: the largest power of two dividing both widths
    assert quantize_experts(model, bits, block, bits == 8, stats) == 1 and stats.unreached == 1
    node = next(n for n in model.graph.node if n.domain == "com.microsoft")
    assert node.op_type == "QMoE" and len(node.input) == (8 if bits == 8 else 13)
    _, _, (fc1, b1, fc2, b2, *rest) = _case(1, variant)
    dequantized = [torch.stack([torch.from_numpy(c.dequantize().T)
                                for c in expert_codes(w.numpy(), h[fc1_name], bits, block, bits == 8)])
                   for w, h in ((fc1, stats.fc1), (fc2, stats.fc2))]
    x, logits, _ = _case(16, variant, seed=3)
    want = moe.reference_moe(x, logits, dequantized[0], b1, dequantized[1], b2, *rest).numpy()
    got = _run(model, x, logits)
    assert np.abs(got - want).max() / np.abs(want).max() < 0.03  # int8 activations in the kernel
    exact = moe.reference_moe(x, logits, fc1, b1, fc2, b2, *rest).numpy()
    assert np.abs(got - exact).max() / np.abs(exact).max() < (0.2 if bits == 4 else 0.03)


def test_the_router_is_kept_out_of_the_linear_quantizer(tiny_checkpoints, tmp_path):
    """The MatMul computing a mixture's router logits is found (so it stays fp32) through the export's shapes."""
    from llmc.compiler import build
    from llmc.compiler.quantize.handler import gemms_as_matmuls
    from llmc.compiler.spec import parse_spec

    result = build(parse_spec({"name": "t", "source": str(tiny_checkpoints["mixtral"])}), output=tmp_path / "o",
                   until="export")
    model = onnx.load(str(tmp_path / "o" / "export" / "model.onnx"))
    gemms_as_matmuls(model.graph)
    names = routers(model.graph)
    nodes = {n.name: n for n in model.graph.node}
    assert len(names) == result.exported.model.num_layers
    assert all(nodes[n].op_type == "MatMul" and "router" in nodes[n].input[1] for n in names)
