"""`llmc::attention`: the one attention op the compiler owns, as a torch custom op with a reference.

    attention(query [B, S, H, D], key [B, S, KVH, D], value [B, S, KVH, D],
              k_cache [B, KVH, C, D], v_cache [B, KVH, C, D], cache_position int64 [B], scale,
              cos_cache [P, D/2] = None, sin_cache [P, D/2] = None)
      -> (output [B, S, H, D], k_cache', v_cache')

Row b's S new tokens are written into the preallocated cache (capacity C) at positions
`cache_position[b] .. cache_position[b] + S - 1`; query i of row b attends causally to cache
positions `0 .. cache_position[b] + i`. Rows may sit at different positions (what in-flight
batching needs); H must be a multiple of KVH (MHA, GQA, MQA). Cache entries beyond a row's
position are never read, so a right-padded row's pad tokens and stale data from an earlier
occupant of the slot are harmless.

The op is functional (returns new caches, `mutates_args=()`): torch.export and the ONNX translator
handle it as one node, which each target lowers to its own fused form (ONNX Runtime
GroupQueryAttention with a shared past/present buffer updates the cache in place).

With `cos_cache`/`sin_cache` (one row per position, half the head dim: the rotate-half RoPE
convention of Llama-family models) the op applies rotary embeddings to the new queries and keys at
their positions itself, so a fused kernel can do it on the fly; without them, query and key
arrive already rotated (or the model has no rotary at all, like GPT-2).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, cache_position: Tensor) -> None:
    b, s, h, d = query.shape
    kvh = key.shape[2]
    assert key.shape == value.shape == (b, s, kvh, d), (key.shape, value.shape, query.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[:2] == (b, kvh) and k_cache.shape[3] == d, k_cache.shape
    assert h % kvh == 0, f"num_heads {h} is not a multiple of num_kv_heads {kvh}"
    assert cache_position.shape == (b,), cache_position.shape


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim: the rotate-half RoPE convention of Llama-family models."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: Tensor, cos_cache: Tensor, sin_cache: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding, rotate-half convention: x [B, S, heads, D] at `positions` [B, S]."""
    cos = torch.cat([cos_cache[positions]] * 2, dim=-1)[:, :, None].to(torch.float32)  # [B, S, 1, D]
    sin = torch.cat([sin_cache[positions]] * 2, dim=-1)[:, :, None].to(torch.float32)
    x32 = x.to(torch.float32)
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def reference_attention(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                        cache_position: Tensor, scale: float, cos_cache: Tensor | None = None,
                        sin_cache: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Plain PyTorch semantics of the op: the definition every lowering and kernel is tested against."""
    _check(query, key, value, k_cache, v_cache, cache_position)
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    positions = cache_position.to(torch.int64)[:, None] + torch.arange(s, device=query.device)  # [B, S]
    if not torch.compiler.is_compiling() and int(positions.max()) >= capacity:
        raise ValueError(f"KV cache overflow: position {int(positions.max())} does not fit capacity {capacity}")
    assert (cos_cache is None) == (sin_cache is None), "cos_cache and sin_cache come together"
    if cos_cache is not None:
        assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] * 2 == d, (cos_cache.shape, d)
        query, key = rotate(query, cos_cache, sin_cache, positions), rotate(key, cos_cache, sin_cache, positions)
    index = positions[:, None, :, None].expand(b, kvh, s, d)
    k_out = k_cache.scatter(2, index, key.transpose(1, 2).to(k_cache.dtype))
    v_out = v_cache.scatter(2, index, value.transpose(1, 2).to(v_cache.dtype))

    group = h // kvh
    q = query.transpose(1, 2).float()  # [B, H, S, D]
    k = k_out.float().repeat_interleave(group, dim=1)  # [B, H, C, D]
    v = v_out.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, S, C]
    visible = torch.arange(capacity, device=query.device)[None, None, :] <= positions[:, :, None]  # [B, S, C]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, H, S, D]
    return out.transpose(1, 2).to(query.dtype).contiguous(), k_out, v_out


@torch.library.custom_op("llmc::attention", mutates_args=())
def attention(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
              cache_position: Tensor, scale: float, cos_cache: Tensor | None = None,
              sin_cache: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return reference_attention(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache, sin_cache)


@attention.register_fake
def _attention_fake(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None):
    _check(query, key, value, k_cache, v_cache, cache_position)
    return torch.empty_like(query), torch.empty_like(k_cache), torch.empty_like(v_cache)
