"""HF models rebuilt around `llmc::attention`, so export depends on no transformers attention code.

A decoder reuses the HF model's own submodules (embeddings, norms, projections, MLPs, rotary
frequencies, LM head) and runs its own forward:

    forward(input_ids [B, S], cache_position int64 [B], k_caches, v_caches)
        -> logits [B, S, V], new k_caches, new v_caches       (caches [B, KVH, C, D] per layer)

Row b's tokens sit at positions `cache_position[b] ..`; rows may be at different positions, so no
attention mask and no left padding are needed (a shorter prompt in a batch is right-padded and its
pad tokens' outputs are ignored).

The forward is made of `body(input_ids, positions, attend, k_caches, v_caches)` (embeddings and
blocks, attention through `attend`) and `head(hidden)` (final norm and LM head), so another cache
form reuses the same blocks with its own attention call: the slot form's `attend` is
`llmc::attention` at `cache_position`; the paged form (paged_decoder.py) packs the tokens and calls
`llmc::paged_attention` over block tables.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from llmc.plugins.op.attention import rotate_half  # importing it registers torch.ops.llmc.attention


# attend(query [B,S,H,D], key [B,S,KVH,D], value, k_cache, v_cache, scale, rotary tables ((cos, sin) or ()))
#   -> (output [B,S,H,D], k_cache', v_cache')
Attend = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _positions(input_ids: Tensor, cache_position: Tensor) -> Tensor:
    return cache_position[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)  # [B, S]


def slot_attend(cache_position: Tensor) -> Attend:
    """Attention into per-row cache slots at `cache_position`: `llmc::attention`."""
    def attend(q, k, v, k_cache, v_cache, scale, tables):
        return torch.ops.llmc.attention(q, k, v, k_cache, v_cache, cache_position, scale, *tables)
    return attend


def _concat_linears(*linears: nn.Linear) -> nn.Linear:
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


# RoPE variants whose frequencies change with the sequence length: no fixed cos/sin table exists
POSITION_DEPENDENT_ROPE = {"dynamic", "longrope"}


class LlamaFamilyDecoder(nn.Module):
    """Llama, Mistral, Qwen2 (and SmolLM, which is Llama): pre-norm blocks, rotary, GQA.

    Rotary embeddings go to the op as cos/sin tables (one row per position up to
    max_position_embeddings, built with the model's own rotary module), so fused lowerings apply
    them inside attention; RoPE variants without a fixed table are applied here instead.
    """

    def __init__(self, hf_model):
        super().__init__()
        config = hf_model.config
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", window is not None) and window is not None \
                and window < config.max_position_embeddings:
            raise NotImplementedError(f"sliding-window attention ({window} tokens) is not supported by llmc::attention yet")
        inner = hf_model.model
        self.embed_tokens, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary_emb, self.lm_head = inner.rotary_emb, hf_model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.fuse_rotary = getattr(self.rotary_emb, "rope_type", "default") not in POSITION_DEPENDENT_ROPE
        if self.fuse_rotary:
            table = torch.arange(config.max_position_embeddings)[None]
            with torch.no_grad():
                cos, sin = self.rotary_emb(torch.zeros(1), table)  # [1, P, D], the two halves equal
            half = self.head_dim // 2
            self.register_buffer("cos_cache", cos[0, :, :half].contiguous(), persistent=False)
            self.register_buffer("sin_cache", sin[0, :, :half].contiguous(), persistent=False)
        self.qkv = nn.ModuleList(_concat_linears(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
                                 for l in self.layers)
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2

    def forward(self, input_ids: Tensor, cache_position: Tensor, k_caches: list[Tensor], v_caches: list[Tensor]):
        hidden, new_k, new_v = self.body(input_ids, _positions(input_ids, cache_position), slot_attend(cache_position),
                                         k_caches, v_caches)
        return self.head(hidden), new_k, new_v

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def body(self, input_ids: Tensor, positions: Tensor, attend: Attend, k_caches: list[Tensor],
             v_caches: list[Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        b, s = input_ids.shape
        hidden = self.embed_tokens(input_ids)
        if self.fuse_rotary:
            tables = (self.cos_cache, self.sin_cache)
        else:
            cos, sin = self.rotary_emb(hidden, positions)  # [B, S, D]
            cos, sin, tables = cos[:, :, None], sin[:, :, None], ()  # broadcast over heads
        new_k, new_v = [], []
        for layer, qkv, k_cache, v_cache in zip(self.layers, self.qkv, k_caches, v_caches):
            attn = layer.self_attn
            q, k, v = qkv(layer.input_layernorm(hidden)).split(self.qkv_sizes, dim=-1)
            q = q.view(b, s, self.num_heads, self.head_dim)
            k = k.view(b, s, self.num_kv_heads, self.head_dim)
            v = v.view(b, s, self.num_kv_heads, self.head_dim)
            if not self.fuse_rotary:
                q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            out, k_cache, v_cache = attend(q, k, v, k_cache, v_cache, attn.scaling, tables)
            hidden = hidden + attn.o_proj(out.reshape(b, s, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            new_k.append(k_cache)
            new_v.append(v_cache)
        return hidden, new_k, new_v


class GPT2Decoder(nn.Module):
    """GPT-2: learned positions, fused QKV projection (Conv1D), multi-head attention."""

    def __init__(self, hf_model):
        super().__init__()
        config = hf_model.config
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with cross-attention is an encoder-decoder; llmc exports decoder-only models")
        inner = hf_model.transformer
        self.wte, self.wpe, self.blocks, self.ln_f = inner.wte, inner.wpe, inner.h, inner.ln_f
        self.lm_head = hf_model.lm_head
        self.num_heads = self.num_kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        base = 1 / math.sqrt(self.head_dim) if config.scale_attn_weights else 1.0
        inverse = config.scale_attn_by_inverse_layer_idx
        self.scales = [base / (i + 1) if inverse else base for i in range(config.n_layer)]

    def forward(self, input_ids: Tensor, cache_position: Tensor, k_caches: list[Tensor], v_caches: list[Tensor]):
        hidden, new_k, new_v = self.body(input_ids, _positions(input_ids, cache_position), slot_attend(cache_position),
                                         k_caches, v_caches)
        return self.head(hidden), new_k, new_v

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden))

    def body(self, input_ids: Tensor, positions: Tensor, attend: Attend, k_caches: list[Tensor],
             v_caches: list[Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        b, s = input_ids.shape
        hidden = self.wte(input_ids) + self.wpe(positions)
        new_k, new_v = [], []
        for block, scale, k_cache, v_cache in zip(self.blocks, self.scales, k_caches, v_caches):
            q, k, v = block.attn.c_attn(block.ln_1(hidden)).split(self.num_heads * self.head_dim, dim=2)
            shape = (b, s, self.num_heads, self.head_dim)
            out, k_cache, v_cache = attend(q.view(shape), k.view(shape), v.view(shape), k_cache, v_cache, scale, ())
            hidden = hidden + block.attn.c_proj(out.reshape(b, s, -1))
            hidden = hidden + block.mlp(block.ln_2(hidden))
            new_k.append(k_cache)
            new_v.append(v_cache)
        return hidden, new_k, new_v


DECODERS = {"llama": LlamaFamilyDecoder, "gpt2": GPT2Decoder}


def decoder_for(hf_model, family: str) -> nn.Module:
    """The llmc decoder for an HF model of a supported family (see source.SUPPORTED_MODEL_TYPES)."""
    return DECODERS[family](hf_model).eval()
