"""Tensor parallelism: one rank's share of a decoder (base.py), Megatron style.

    q, k, v           column-parallel: a rank computes its heads (its query heads and their KV heads)
    o_proj            row-parallel: a rank's heads' columns, then `llmc::all_reduce` (the bias on rank 0)
    gate/up, fc       column-parallel: a rank's slice of the intermediate channels
    down_proj, fc2    row-parallel, then `llmc::all_reduce` (the bias on rank 0)
    experts           each expert's intermediate channels split the same way; the router replicated
    LM head           column-parallel over the vocabulary (padded to a multiple of N with zero rows), then
                      `llmc::all_gather` and the padding cut: every rank ends with the whole logits
    embeddings, norms replicated (a split embedding would cost an all-reduce of the hidden state per step)

Which heads a rank keeps (the KV heads split, or replicated where there are fewer than ranks): heads.py.

The shard is a rebuilt decoder whose hooks read sliced copies of the HF modules (the HF model is left as it
is: it is the reference, and the other ranks are cut from it too). Two all-reduces per layer and one gather
per step; the collectives are plugins/op/collective.py. A layer whose weights are on the meta device (a streamed
build's, compiler/stream/model.py) is cut on the meta device, shapes only; `shard(..., layers=...)` cuts only
those layers from real weights (the rest, and the LM head, on the meta device): the streamed export's view of
one layer at a time (compiler/graph/streamed_export.py).
"""

from __future__ import annotations

from typing import Collection

import torch
from torch import Tensor, nn

import llmc.plugins.op.collective  # noqa: F401  (registers torch.ops.llmc.all_reduce / all_gather)
from llmc.compiler.models.base import sink_list
from llmc.compiler.models.parallel.heads import UNSPLITTABLE, tensor_split
from llmc.errors import UnsupportedError


def refusal(decoder) -> str | None:
    """Why this decoder cannot be split (None when it can)."""
    return UNSPLITTABLE.get(decoder.config.model_type)


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                    device=weight.device)  # meta: a streamed layer not loaded, shapes only
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.requires_grad_(False)


def _meta(t: Tensor | None, meta: bool) -> Tensor | None:
    """`t`, or with `meta` a tensor of its shape on the meta device (no data read or copied)."""
    return t.to("meta") if meta and t is not None else t


def _weight_bias(module: nn.Module, meta: bool = False) -> tuple[Tensor, Tensor | None]:
    """(weight [out, in], bias) of an nn.Linear or of transformers' Conv1D (GPT-2: weight [in, out]); `meta`: as
    meta tensors."""
    if isinstance(module, nn.Linear):
        return _meta(module.weight, meta), _meta(module.bias, meta)
    if type(module).__name__ == "Conv1D":
        return _meta(module.weight, meta).T, _meta(module.bias, meta)
    raise UnsupportedError(f"tensor parallelism splits Linear projections; this one is {type(module).__name__}")


def rows(module: nn.Module, *ranges: range, meta: bool = False) -> nn.Linear:
    """The output channels `ranges` of a projection (column parallel), one Linear (`meta`: shapes only)."""
    weight, bias = _weight_bias(module, meta)
    pick = torch.cat([torch.arange(r.start, r.stop) for r in ranges]).to(weight.device)
    return _linear(weight[pick], None if bias is None else bias[pick])


def columns(module: nn.Module, span: range, rank: int, meta: bool = False) -> nn.Linear:
    """The input channels `span` of a projection (row parallel), its bias kept on rank 0 only (`meta`: shapes
    only)."""
    weight, bias = _weight_bias(module, meta)
    return _linear(weight[:, span.start:span.stop], bias if rank == 0 else None)


def _share(size: int, rank: int, ranks: int, what: str) -> range:
    if size % ranks:
        raise UnsupportedError(f"parallel.tensor ({ranks}) must divide the model's {what} ({size})")
    width = size // ranks
    return range(rank * width, (rank + 1) * width)


class Reduced(nn.Module):
    """A row-parallel projection (or feed-forward) followed by the all-reduce of its partial sums."""

    def __init__(self, inner: nn.Module, rank: int, ranks: int):
        super().__init__()
        self.inner, self.rank, self.ranks = inner, rank, ranks

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.llmc.all_reduce(self.inner(x), self.rank, self.ranks)


class GatedMLP(nn.Module):
    """act(gate(x)) * up(x) -> down, or act(up(x)) -> down without a gate (GPT-2, Nemotron): a rank's slice."""

    def __init__(self, gate: nn.Linear | None, up: nn.Linear, down: nn.Linear, act):
        super().__init__()
        self.gate, self.up, self.down, self.act = gate, up, down, act

    def forward(self, x: Tensor) -> Tensor:
        up = self.up(x)
        return self.down(self.act(up) if self.gate is None else self.act(self.gate(x)) * up)


def shard_mlp(mlp: nn.Module, rank: int, ranks: int, meta: bool = False) -> nn.Module:
    """A rank's slice of a dense MLP (Llama's gate/up/down, Phi-3's fused gate_up, GPT-2's c_fc/c_proj,
    Nemotron's up/down), with the all-reduce after it (`meta`: shapes only)."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None) or getattr(mlp, "act", None)
    if hasattr(mlp, "gate_proj"):
        span = _share(mlp.gate_proj.out_features, rank, ranks, "intermediate size")
        inner = GatedMLP(rows(mlp.gate_proj, span, meta=meta), rows(mlp.up_proj, span, meta=meta),
                         columns(mlp.down_proj, span, rank, meta), act)
    elif hasattr(mlp, "gate_up_proj"):
        half = _weight_bias(mlp.gate_up_proj, meta)[0].shape[0] // 2
        span = _share(half, rank, ranks, "intermediate size")
        gate_up = rows(mlp.gate_up_proj, span, range(half + span.start, half + span.stop), meta=meta)
        gate, up = (_linear(w, b) for w, b in zip(gate_up.weight.chunk(2), (gate_up.bias.chunk(2) if gate_up.bias
                                                                          is not None else (None, None))))
        inner = GatedMLP(gate, up, columns(mlp.down_proj, span, rank, meta), act)
    elif hasattr(mlp, "up_proj"):
        span = _share(mlp.up_proj.out_features, rank, ranks, "intermediate size")
        inner = GatedMLP(None, rows(mlp.up_proj, span, meta=meta), columns(mlp.down_proj, span, rank, meta), act)
    elif hasattr(mlp, "c_fc"):
        span = _share(_weight_bias(mlp.c_fc, meta)[0].shape[0], rank, ranks, "intermediate size")
        inner = GatedMLP(None, rows(mlp.c_fc, span, meta=meta), columns(mlp.c_proj, span, rank, meta), act)
    else:
        raise UnsupportedError(f"tensor parallelism does not know this MLP ({type(mlp).__name__})")
    if act is None:
        raise UnsupportedError(f"tensor parallelism found no activation on {type(mlp).__name__}")
    return Reduced(inner, rank, ranks)


def shard_experts(layer: nn.Module, rank: int, ranks: int, meta: bool = False) -> nn.Module:
    """A rank's slice of an ExpertLayer (compiler/models/moe.py): every expert's intermediate channels
    [I/N] (fc1's interleaved rows 2j, 2j + 1 and fc2's columns j), the router whole, fc2's bias on rank 0
    (`meta`: shapes only)."""
    from llmc.compiler.models.moe import ExpertLayer

    fc1, fc1_bias, fc2 = (_meta(t, meta) for t in (layer.fc1, layer.fc1_bias, layer.fc2))
    span = _share(fc2.shape[2], rank, ranks, "expert intermediate size")
    fused = slice(2 * span.start, 2 * span.stop)
    sliced = ExpertLayer(_meta(layer.router.weight, meta), _meta(layer.router.bias, meta), fc1[:, fused],
                         None if fc1_bias is None else fc1_bias[:, fused], fc2[:, :, span.start:span.stop],
                         _meta(layer.fc2_bias, meta) if rank == 0 else None, layer.routing)
    return Reduced(sliced, rank, ranks)


class GatheredHead(nn.Module):
    """The LM head's rows for a rank's share of the vocabulary (padded with zero rows to a multiple of N),
    then the gather and the padding cut: [..., vocab] on every rank."""

    def __init__(self, lm_head: nn.Module, rank: int, ranks: int, meta: bool = False):
        super().__init__()
        weight, bias = _weight_bias(lm_head, meta)
        self.vocab = weight.shape[0]
        width = -(-self.vocab // ranks)
        span = range(rank * width, min((rank + 1) * width, self.vocab))
        padded = torch.zeros(width, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[:len(span)] = weight[span.start:span.stop]
        padded_bias = None
        if bias is not None:
            padded_bias = torch.zeros(width, dtype=bias.dtype, device=bias.device)
            padded_bias[:len(span)] = bias[span.start:span.stop]
        self.part, self.rank, self.ranks = _linear(padded, padded_bias), rank, ranks

    def forward(self, x: Tensor) -> Tensor:
        logits = torch.ops.llmc.all_gather(self.part(x), self.rank, self.ranks)
        return logits if logits.shape[-1] == self.vocab else logits[..., :self.vocab]


class TensorParallel:
    """A decoder mixin: the hooks read the rank's sliced modules (set up by `shard`)."""

    def out_proj(self, layer):
        return self.tp_out[self._tp_index[id(layer)]]

    def feed_forward(self, layer, x: Tensor) -> Tensor:
        return self.tp_mlp[self._tp_index[id(layer)]](x)


def shard(decoder, rank: int, ranks: int, layers: Collection[int] | None = None):
    """Turn `decoder` (a fresh decoder_for(hf_model), not shared) into rank `rank` of `ranks`, in place; returns it.
    The HF modules it reads are not modified: every sliced weight is a copy. `layers`: cut only these layers'
    slices from their weights, every other layer's and the LM head's on the meta device (shapes, no copy)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks}")
    reason = refusal(decoder)
    if reason is not None:
        raise UnsupportedError(f"parallel.tensor: {ranks} cannot split {decoder.config.model_type}: {reason}")
    split = tensor_split(decoder.num_heads, decoder.num_kv_heads, ranks)
    d = decoder.head_dim
    q_heads = range(rank * split.heads, (rank + 1) * split.heads)
    kv_heads = split.kv_range(rank)
    q_end, k_end = decoder.num_heads * d, (decoder.num_heads + decoder.num_kv_heads) * d
    q_rows = range(q_heads.start * d, q_heads.stop * d)
    k_rows = range(q_end + kv_heads.start * d, q_end + kv_heads.stop * d)
    v_rows = range(k_end + kv_heads.start * d, k_end + kv_heads.stop * d)
    sparse = getattr(decoder, "_sparse_of", {})
    meta = [layers is not None and i not in layers for i in range(len(decoder.layers))]
    tp_mlp = []
    for i, layer in enumerate(decoder.layers):
        experts = sparse.get(id(layer))
        tp_mlp.append(shard_experts(experts, rank, ranks, meta[i]) if experts is not None
                      else shard_mlp(layer.mlp, rank, ranks, meta[i]))
    decoder.tp_out = nn.ModuleList(Reduced(columns(decoder.out_proj(layer), q_rows, rank, meta[i]), rank, ranks)
                                   for i, layer in enumerate(decoder.layers))
    decoder.tp_mlp = nn.ModuleList(tp_mlp)
    decoder._tp_index = {id(layer): i for i, layer in enumerate(decoder.layers)}
    decoder.qkv = nn.ModuleList(rows(qkv, q_rows, k_rows, v_rows, meta=meta[i]) for i, qkv in enumerate(decoder.qkv))
    decoder.num_heads, decoder.num_kv_heads = split.heads, split.kv_heads
    decoder.qkv_sizes = [split.heads * d, split.kv_heads * d, split.kv_heads * d]
    if decoder.sinks is not None:
        decoder.sinks = sink_list([None if s is None else _meta(s.detach(), meta[i])[q_heads.start:q_heads.stop].clone()
                                   for i, s in enumerate(decoder.sinks)])
    decoder.lm_head = GatheredHead(decoder.lm_head, rank, ranks, layers is not None)
    cls = type(decoder)
    decoder.__class__ = type(f"TensorParallel{cls.__name__}", (TensorParallel, cls), {})
    decoder.tp_rank, decoder.tp_ranks = rank, ranks
    decoder.LAYERWISE = (*cls.LAYERWISE, "tp_out", "tp_mlp")
    return decoder.eval()
