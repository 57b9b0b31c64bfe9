"""`llmc::moe`: a mixture-of-experts feed-forward as one torch custom op with a reference, and its ONNX
lowering.

    moe(hidden [T, H], router_logits [T, E], fc1 [E, 2I, H], fc1_bias [E, 2I] = None,
        fc2 [E, H, I], fc2_bias [E, H] = None, k, normalize, alpha = 1.0, beta = 0.0, limit = 0.0)
      -> [T, H]

Routing: each token's E logits go through a softmax, its `k` largest probabilities pick its experts,
and (`normalize`) those k weights are rescaled to sum to one. That covers the families' variants:
softmax-then-top-k (Qwen3-MoE with `norm_topk_prob` off: `normalize=False`), softmax-top-k-renormalize
(Mixtral, Qwen3-MoE with it on) and top-k-then-softmax (gpt-oss: a softmax over the k largest logits is
the renormalized softmax over all of them, since softmax is monotonic). A router bias is the router
projection's, before the op.

Each expert is a SwiGLU with gate and up interleaved in fc1 (row 2j is gate j, row 2j + 1 is up j):

    g, u = (x fc1[e]^T + b1)[0::2], [1::2]
    g, u = min(g, limit), clamp(u, -limit, limit)          (limit > 0 only)
    y = (g * sigmoid(alpha * g) * (u + beta)) fc2[e]^T + b2

Mixtral and Qwen3-MoE are alpha 1, beta 0, no limit (SiLU(g) * u); gpt-oss is alpha 1.702, beta 1 and
its `swiglu_limit`. The token's output is the routing-weighted sum of its k experts' outputs.

This is exactly ONNX Runtime's `com.microsoft.MoE` contract (`activation_type=swiglu`,
`swiglu_fusion=1`, weights [E, N, K] as from 1.23), which its CPU kernel runs from 1.23; the lowering
emits that node. The reference groups tokens by expert, as a step should: each routed expert's weights
are read once for all the tokens that picked it, and an expert no token picked is not touched.
"""

from __future__ import annotations

import onnx
import torch
from onnx.defs import OpSchema
from torch import Tensor

from llmc.plugins.op.onnx_schema import MICROSOFT_DOMAIN, copy_types
from llmc.plugins.op.onnx_schema import make_schema as op_schema

OP_TYPE = "MoE"
QUANTIZED_OP_TYPE = "QMoE"


def route(router_logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [T, k] float32, experts [T, k] int64) for each token."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def swiglu(gate_up: Tensor, alpha: float, beta: float, limit: float) -> Tensor:
    """The interleaved SwiGLU of fc1's output [.., 2I] -> [.., I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def reference_moe(hidden: Tensor, router_logits: Tensor, fc1: Tensor, fc1_bias: Tensor | None, fc2: Tensor,
                  fc2_bias: Tensor | None, k: int, normalize: bool, alpha: float = 1.0, beta: float = 0.0,
                  limit: float = 0.0) -> Tensor:
    weights, experts = route(router_logits, k, normalize)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == expert)
        gate_up = hidden[rows] @ fc1[expert].T
        if fc1_bias is not None:
            gate_up = gate_up + fc1_bias[expert]
        y = swiglu(gate_up, alpha, beta, limit) @ fc2[expert].T
        if fc2_bias is not None:
            y = y + fc2_bias[expert]
        out.index_add_(0, rows, y.float() * weights[rows, slot, None])
    return out.to(hidden.dtype)


@torch.library.custom_op("llmc::moe", mutates_args=())
def moe(hidden: Tensor, router_logits: Tensor, fc1: Tensor, fc1_bias: Tensor | None, fc2: Tensor,
        fc2_bias: Tensor | None, k: int, normalize: bool, alpha: float = 1.0, beta: float = 0.0,
        limit: float = 0.0) -> Tensor:
    return reference_moe(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, k, normalize, alpha, beta, limit)


@moe.register_fake
def _moe_fake(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, k, normalize, alpha=1.0, beta=0.0, limit=0.0):
    num_experts, fused, width = fc1.shape
    assert hidden.dim() == 2 and hidden.shape[1] == width, (hidden.shape, fc1.shape)
    assert router_logits.shape[-1] == num_experts and 0 < k <= num_experts, (router_logits.shape, k)
    assert fc2.shape == (num_experts, width, fused // 2), (fc2.shape, fc1.shape)
    return torch.empty_like(hidden)


def attributes(k: int, normalize: bool, alpha: float, beta: float, limit: float) -> dict:
    return dict(k=k, normalize_routing_weights=int(normalize), activation_type="swiglu", swiglu_fusion=1,
                activation_alpha=alpha, activation_beta=beta, **({"swiglu_limit": limit} if limit > 0 else {}))


def lowering():
    """The onnxscript function for `custom_translation_table`: one com.microsoft.MoE node."""
    from onnxscript.values import Opset

    msft = Opset(MICROSOFT_DOMAIN, 1)

    def mixture(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias, k: int, normalize: bool, alpha: float = 1.0,
                beta: float = 0.0, limit: float = 0.0):
        return msft.MoE(hidden, router_logits, fc1, fc1_bias, fc2, fc2_bias,
                        **attributes(k, normalize, alpha, beta, limit))

    return mixture


_A = OpSchema.AttrType
_ROUTING = [("k", _A.INT), ("normalize_routing_weights", _A.INT), ("activation_type", _A.STRING),
            ("swiglu_fusion", _A.INT), ("activation_alpha", _A.FLOAT), ("activation_beta", _A.FLOAT),
            ("swiglu_limit", _A.FLOAT)]
_QUANTIZED = [("expert_weight_bits", _A.INT), ("block_size", _A.INT), ("accuracy_level", _A.INT)]


def _schema(name: str, inputs: list[tuple[str, str]], attributes: list[tuple[str, int]], doc: str) -> OpSchema:
    """The subset of ONNX Runtime's contrib schema that llmc emits (its output: the input's type and shape)."""
    return op_schema(name, MICROSOFT_DOMAIN, inputs, [("output", "T")],
                     [OpSchema.Attribute(a, kind, a, required=False) for a, kind in attributes], doc,
                     copy_types([(0, 0)]))


def register_schemas() -> None:
    """com.microsoft.MoE and QMoE, as far as llmc emits them, for onnxscript and onnx.checker. Idempotent."""
    if not onnx.defs.has(OP_TYPE, MICROSOFT_DOMAIN):
        onnx.defs.register_schema(_schema(
            OP_TYPE, [("input", "T"), ("router_probs", "T"), ("fc1_experts_weights", "T"), ("fc1_experts_bias?", "T"),
                      ("fc2_experts_weights", "T"), ("fc2_experts_bias?", "T")],
            _ROUTING, "ONNX Runtime's mixture of experts (contrib op), the inputs llmc emits."))
    if not onnx.defs.has(QUANTIZED_OP_TYPE, MICROSOFT_DOMAIN):
        onnx.defs.register_schema(_schema(
            QUANTIZED_OP_TYPE,
            [("input", "T"), ("router_probs", "T"), ("fc1_experts_weights", "T1"), ("fc1_scales?", "T"),
             ("fc1_experts_bias?", "T"), ("fc2_experts_weights", "T1"), ("fc2_scales?", "T"),
             ("fc2_experts_bias?", "T"), ("fc3_experts_weights?", "T1"), ("fc3_scales?", "T"),
             ("fc3_experts_bias?", "T"), ("fc1_zero_points?", "T1"), ("fc2_zero_points?", "T1")],
            _ROUTING + _QUANTIZED,
            "ONNX Runtime's quantized mixture of experts (contrib op), the inputs llmc emits."))
