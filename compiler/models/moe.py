"""Mixture-of-experts blocks: a decoder mixin that runs each sparse layer's feed-forward as one
`llmc::moe` call (plugins/op/moe.py), and the adapters that read each family's expert weights into
that op's layout.

transformers 5 keeps a layer's experts as fused 3-D parameters, in two layouts:
- Mixtral and Qwen3-MoE: `gate_up_proj` [E, 2I, H] with gate and up concatenated ([gate | up]),
  `down_proj` [E, H, I], a bias-free router;
- gpt-oss: `gate_up_proj` [E, H, 2I], transposed, gate and up already interleaved, with biases, and
  `down_proj` [E, I, H]; a router with a bias; SwiGLU with alpha 1.702, up + 1 and a clamp.

The op wants fc1 [E, 2I, H] interleaved (row 2j gate j, row 2j + 1 up j) and fc2 [E, H, I]: ONNX Runtime's
MoE layout, whose CPU kernel takes gate and up only interleaved. The adapters copy the experts once
into it at export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import llmc.plugins.op.moe  # noqa: F401  (registers torch.ops.llmc.moe)
from llmc.compiler.models.base import Decoder
from llmc.errors import UnsupportedError


@dataclass(frozen=True)
class Routing:
    """How a layer picks and weighs its experts, and its SwiGLU's constants (plugins/op/moe.py)."""

    k: int
    normalize: bool
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = 0.0


class ExpertLayer(nn.Module):
    """One sparse feed-forward: router logits, then `llmc::moe` over the experts in the op's layout."""

    def __init__(self, router_weight: Tensor, router_bias: Tensor | None, fc1: Tensor, fc1_bias: Tensor | None,
                 fc2: Tensor, fc2_bias: Tensor | None, routing: Routing):
        super().__init__()
        self.router = nn.Linear(router_weight.shape[1], router_weight.shape[0], bias=router_bias is not None,
                                dtype=router_weight.dtype, device=router_weight.device)  # meta: a streamed layer
        with torch.no_grad():
            self.router.weight.copy_(router_weight)
            if router_bias is not None:
                self.router.bias.copy_(router_bias)
        self.fc1 = nn.Parameter(fc1.detach().contiguous(), requires_grad=False)
        self.fc2 = nn.Parameter(fc2.detach().contiguous(), requires_grad=False)
        self.fc1_bias = None if fc1_bias is None else nn.Parameter(fc1_bias.detach().clone(), requires_grad=False)
        self.fc2_bias = None if fc2_bias is None else nn.Parameter(fc2_bias.detach().clone(), requires_grad=False)
        self.routing = routing
        self.requires_grad_(False)

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.routing
        out = torch.ops.llmc.moe(flat, self.router(flat), self.fc1, self.fc1_bias, self.fc2, self.fc2_bias, r.k,
                                 r.normalize, r.alpha, r.beta, r.limit)
        return out.view(x.shape)


def interleave(gate_up: Tensor) -> Tensor:
    """[E, 2I, ...] as [gate | up] -> rows interleaved (gate 0, up 0, gate 1, up 1, ...)."""
    gate, up = gate_up.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def concatenated_experts(mlp: nn.Module, normalize: bool) -> ExpertLayer:
    """Mixtral's and Qwen3-MoE's sparse block (`gate`: the router, `experts`: the fused 3-D weights)."""
    experts = mlp.experts
    act = getattr(experts, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise UnsupportedError(f"hidden_act: the experts' activation is {type(act).__name__}; llmc's expert op "
                               f"runs SwiGLU (silu) experts")
    return ExpertLayer(mlp.gate.weight, getattr(mlp.gate, "bias", None), interleave(experts.gate_up_proj), None,
                       experts.down_proj, None, Routing(k=int(mlp.gate.top_k), normalize=normalize))


def refusal(lowering: str) -> str | None:
    """Why an attention lowering cannot carry a mixture's expert layers (None when it can)."""
    if lowering in ("paged", "fused"):
        return None
    return ("its expert layers export as ONNX Runtime's com.microsoft.MoE, which neither opset 23 nor a TensorRT "
            "engine has (docs/tensorrt.md says what an engine would need); build it with target: onnxruntime and "
            "export.attention: paged (the default) or fused")


class MoEDecoder:
    """A decoder mixin: layers whose MLP is sparse (`sparse_layer` says which, `expert_layer` reads it)
    run it through `llmc::moe` (the base's `feed_forward` hook); dense layers keep their own MLP."""

    LAYERWISE = (*Decoder.LAYERWISE, "experts")
    # whether the checkpoint's gate_up_proj has gate and up interleaved already (gpt-oss), or as [gate | up]: where
    # a LoRA delta on it (PEFT's output rows) goes in the op's fc1 (compiler/lora/experts.py)
    GATE_UP_INTERLEAVED = False

    def __init__(self, hf_model):
        super().__init__(hf_model)
        sparse = {i: self.expert_layer(layer) for i, layer in enumerate(self.layers) if self.sparse_layer(layer)}
        self.experts = nn.ModuleDict({str(i): m for i, m in sparse.items()})
        self._sparse_of = {id(self.layers[i]): m for i, m in sparse.items()}

    def sparse_layer(self, layer) -> bool:
        return hasattr(layer.mlp, "experts")

    def expert_layer(self, layer) -> ExpertLayer:
        raise NotImplementedError  # each MoE family reads its own layout

    def feed_forward(self, layer, x: Tensor) -> Tensor:
        sparse = self._sparse_of.get(id(layer))
        return super().feed_forward(layer, x) if sparse is None else sparse(x)
