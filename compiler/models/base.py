"""The base decoder: an HF causal LM rebuilt around `llmc::attention`, so export depends on no
transformers attention code.

A decoder reuses the HF model's own submodules (embeddings, norms, projections, MLPs, rotary
modules, LM head) and runs its own forward:

    forward(input_ids [B, S], cache_position int64 [B], k_caches, v_caches[, sequence_lengths int64 [B]])
        -> logits [B, S, V], new k_caches, new v_caches       (caches [B, KVH, C, D] per layer)

(`sequence_lengths`: LongRoPE's, compiler/models/rope.py.)

Row b's tokens sit at positions `cache_position[b] ..`; rows may be at different positions, so no
attention mask and no left padding are needed (a shorter prompt in a batch is right-padded and its
pad tokens' outputs are ignored).

The forward is `body(input_ids, positions, attend, k_caches, v_caches)` (embeddings and blocks,
attention through `attend`) then `head(hidden)` (final norm and LM head), so another cache form
reuses the same blocks with its own attention call: the slot form's `attend` is `llmc::attention`
at `cache_position`; the paged form (compiler/paged_decoder.py) packs the tokens and calls
`llmc::paged_attention` over block tables.

`Decoder` is the Llama shape (pre-norm blocks, rotary, GQA). A family (compiler/models/families/<family>.py)
overrides only what differs, through these hooks:

    modules_of(hf_model)         embeddings, blocks, final norm, LM head
    rotary_modules(hf_model)     the model's rotary module(s), by layer kind
    fused_qkv(layer)             the one projection computing q, k and v side by side (and out_proj)
    project(layer, x)            q, k, v [B, S, heads, D] (q/k norms go here: HeadQKNorm per head)
    layer_attention(i, layer)    the layer's LayerAttention: scale, softcap, window, which RoPE
    embed(input_ids, positions)  the input embeddings
    block(layer, hidden, attn)   one block around its attention call (norm placement, multipliers)
    feed_forward(layer, x)       the block's MLP (a mixture's sparse layers: compiler/models/moe.py)
    head(hidden)                 final norm, LM head (and softcap or scaling of the logits)

RoPE comes from the model's own rotary modules (compiler/models/rope.py): tables the op applies
(`cos_cache`/`sin_cache`, partial when the model rotates part of the head), or, for LongRoPE, a
rotation here whose table follows each row's sequence length as transformers' switches with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from llmc.compiler.models import rope as rope_tables
from llmc.compiler.models.config import attention_shape
from llmc.plugins.op.attention import rotate  # importing it registers torch.ops.llmc.attention


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention call carries besides q, k and v (plugins/op/attention.py)."""

    scale: float
    softcap: float = 0.0  # > 0: logits become softcap * tanh(logits / softcap)
    window: int = -1  # > 0: a query sees at most this many positions, itself included
    rope: str | None = "default"  # which of the decoder's RoPE tables; None: no RoPE in this layer


# attend(query [B,S,H,D], key [B,S,KVH,D], value, k_cache, v_cache, LayerAttention, rotary tables
#        ((cos, sin) or ()), head_sink [H] or None) -> (output [B,S,H,D], k_cache', v_cache')
Attend = Callable[..., tuple[Tensor, Tensor, Tensor]]


def positions_of(input_ids: Tensor, cache_position: Tensor) -> Tensor:
    return cache_position[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)  # [B, S]


def slot_attend(cache_position: Tensor) -> Attend:
    """Attention into per-row cache slots at `cache_position`: `llmc::attention`."""
    def attend(q, k, v, k_cache, v_cache, spec: LayerAttention, tables, sink=None):
        cos, sin = tables or (None, None)
        return torch.ops.llmc.attention(q, k, v, k_cache, v_cache, cache_position, spec.scale, cos, sin, sink,
                                        spec.softcap, spec.window)
    return attend


def concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear computing several over the same input (outputs side by side): one GEMM instead of
    several small ones, which is what decode steps are made of."""
    weight = torch.cat([l.weight for l in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                      dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([l.bias for l in linears]))
    return fused.requires_grad_(False)


def sliding_window(attn: nn.Module, config) -> int:
    """The layer's window (transformers' convention: W keys, the query's own included), or -1: the
    attention module's `sliding_window` where it keeps one per layer, else the config's."""
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    if not window or window >= config.max_position_embeddings:
        return -1
    return int(window)


def sink_list(sinks: list[Tensor | None]):
    """Each layer's head sinks (None: no layer has any). A ParameterList when every layer has them: torch.export
    reads a tensor by its module path only through modules, and lifts one met in a plain list as a nameless
    constant (compiler/graph/stamp.py finds each layer's weights by path)."""
    if all(s is None for s in sinks):
        return None
    if any(s is None for s in sinks):
        return list(sinks)
    return nn.ParameterList(s if isinstance(s, nn.Parameter) else nn.Parameter(s, requires_grad=False) for s in sinks)


class Decoder(nn.Module):
    """Llama, Mistral, Qwen2, SmolLM2 and Gemma as they are; other families override hooks."""

    # the attributes holding one entry per layer, layer i's at index i (a mixture adds its experts, a split its
    # slices): compiler/graph/stamp.py traces the first layers and stamps the rest from them
    LAYERWISE: tuple[str, ...] = ("layers", "specs", "qkv", "sinks")
    # f(hidden, i) after the embeddings (i = -1) and after each layer: stamp.py's markers when set
    boundary: Callable[[Tensor, int], Tensor] | None = None

    def __init__(self, hf_model):
        super().__init__()
        config = self.config = hf_model.config
        self.embed_tokens, self.layers, self.norm, self.lm_head = self.modules_of(hf_model)
        self.num_heads, self.num_kv_heads, self.head_dim = attention_shape(config)
        self.specs = [self.layer_attention(i, layer) for i, layer in enumerate(self.layers)]
        self.rope = rope_tables.RotaryTables(self.rotary_modules(hf_model), {s.rope for s in self.specs} - {None},
                                             config)
        self.qkv = nn.ModuleList(self.fused_qkv(layer) for layer in self.layers)
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.sinks = sink_list([getattr(self.attention_module(layer), "sinks", None) for layer in self.layers])

    # hooks ------------------------------------------------------------------------------------
    def modules_of(self, hf_model):
        inner = hf_model.model
        return inner.embed_tokens, inner.layers, inner.norm, hf_model.lm_head

    def rotary_modules(self, hf_model) -> dict[str, Callable]:
        """RoPE kind -> f(x, positions) -> (cos, sin) [B, S, R] from the model's own rotary module."""
        return {"default": hf_model.model.rotary_emb}

    def attention_module(self, layer) -> nn.Module:
        return layer.self_attn

    def out_proj(self, layer) -> nn.Module:
        return self.attention_module(layer).o_proj

    def layer_attention(self, i: int, layer) -> LayerAttention:
        attn = self.attention_module(layer)
        softcap = float(getattr(attn, "attn_logit_softcapping", None) or 0.0)
        return LayerAttention(scale=float(attn.scaling), softcap=softcap, window=sliding_window(attn, self.config))

    def fused_qkv(self, layer) -> nn.Module:
        attn = self.attention_module(layer)
        return concat_linears(attn.q_proj, attn.k_proj, attn.v_proj)

    def project(self, i: int, layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x.shape
        q, k, v = self.qkv[i](x).split(self.qkv_sizes, dim=-1)
        return (q.view(b, s, self.num_heads, self.head_dim), k.view(b, s, self.num_kv_heads, self.head_dim),
                v.view(b, s, self.num_kv_heads, self.head_dim))

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def block(self, layer, hidden: Tensor, attention: Callable[[Tensor], Tensor]) -> Tensor:
        hidden = hidden + attention(layer.input_layernorm(hidden))
        return hidden + self.feed_forward(layer, layer.post_attention_layernorm(hidden))

    def feed_forward(self, layer, x: Tensor) -> Tensor:
        return layer.mlp(x)

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    # the forward ------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, cache_position: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
                sequence_lengths: Tensor | None = None):
        """`sequence_lengths` [B] (LongRoPE only, rope.py): each row's whole sequence length, which picks
        its table; None takes each row's last position here + 1, as transformers' forward on these
        tokens alone does."""
        positions = positions_of(input_ids, cache_position)
        seq_lens = None
        if self.rope.switch is not None:
            ends = positions[:, -1] + 1 if sequence_lengths is None else sequence_lengths.to(torch.int64)
            seq_lens = ends[:, None].expand_as(positions)
        hidden, new_k, new_v = self.body(input_ids, positions, slot_attend(cache_position), k_caches, v_caches,
                                         seq_lens)
        return self.head(hidden), new_k, new_v

    def body(self, input_ids: Tensor, positions: Tensor, attend: Attend, k_caches: list[Tensor],
             v_caches: list[Tensor], seq_lens: Tensor | None = None) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """`seq_lens` [B, S]: the length of each token's sequence, which LongRoPE's table switch reads
        (needed when `rope.switch` is set)."""
        hidden = self.embed(input_ids, positions)
        if self.boundary is not None:
            hidden = self.boundary(hidden, -1)
        in_model = self.rope.in_model_rotation(positions, seq_lens)
        new_k, new_v = [], []
        for i, (layer, spec, k_cache, v_cache) in enumerate(zip(self.layers, self.specs, k_caches, v_caches)):
            def attention(x: Tensor) -> Tensor:
                nonlocal k_cache, v_cache
                q, k, v = self.project(i, layer, x)
                tables = ()
                if spec.rope is not None:
                    if spec.rope in in_model:
                        cos, sin = in_model[spec.rope]
                        q, k = rotate(q, cos, sin, None), rotate(k, cos, sin, None)
                    else:
                        tables = self.rope.tables(spec.rope)
                sink = None if self.sinks is None else self.sinks[i]
                out, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, spec, tables, sink)
                return self.out_proj(layer)(out.flatten(-2))

            hidden = self.block(layer, hidden, attention)
            if self.boundary is not None:
                hidden = self.boundary(hidden, i)
            new_k.append(k_cache)
            new_v.append(v_cache)
        return hidden, new_k, new_v


class HeadQKNorm:
    """A decoder mixin: an RMSNorm over each query and key head before RoPE, the attention module's own
    `q_norm`/`k_norm` (Qwen3, Gemma 3; OLMo 2 norms the whole projection instead)."""

    def project(self, i: int, layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(i, layer, x)
        attn = self.attention_module(layer)
        return attn.q_norm(q), attn.k_norm(k), v

