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

With `cos_cache`/`sin_cache` (one row per position, R/2 columns: the rotate-half RoPE convention of
Llama-family models over the first R <= D channels, the rest passing through: partial rotary) the op
applies rotary embeddings to the new queries and keys at their positions itself, so a fused kernel
can do it on the fly; without them, query and key arrive already rotated (or the model has no
rotary at all, like GPT-2, or this layer has none, like SmolLM3's no-RoPE layers).

The per-layer attention features (every lowering and kernel carries them; 0 / -1 / None is off):
- `softcap`: a scaled logit x becomes softcap * tanh(x / softcap) (Gemma 2);
- `local_window_size` W: a query sees at most W positions, itself included (`kv > q - W`:
  transformers' sliding window; Mistral, Gemma 2/3, Qwen's sliding layers);
- `head_sink` [H]: one more logit per head joins each softmax's denominator and is then dropped
  (attention sinks: gpt-oss); it is neither scaled nor capped.
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


def rotate(x: Tensor, cos_cache: Tensor, sin_cache: Tensor, positions: Tensor | None,
           interleaved: bool = False) -> Tensor:
    """Rotary embedding of x [..., heads, D] at `positions` [...] (x's leading dims; None: the tables are
    already one row per token, [..., R/2]) over its first R = 2 * cos_cache.shape[-1] channels, the rest
    passing through: rotate-half pairs (i, i + R/2), or interleaved pairs (2i, 2i + 1). Computed in
    float32, returned in x's dtype."""
    half = cos_cache.shape[-1]
    if positions is not None:
        cos_cache, sin_cache = cos_cache[positions], sin_cache[positions]
    cos = cos_cache.float().unsqueeze(-2)  # [..., 1, R/2]
    sin = sin_cache.float().unsqueeze(-2)
    x32 = x.float()
    if interleaved:
        x1, x2 = x32[..., 0:2 * half:2], x32[..., 1:2 * half:2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x32[..., :half], x32[..., half:2 * half]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, x32[..., 2 * half:]), dim=-1).to(x.dtype)


def softmax_with_sink(logits: Tensor, head_sink: Tensor | None, head_dim: int) -> Tensor:
    """softmax over the last dim; with sinks [H], each head's sink logit joins the denominator (the
    head is `logits`' dim `head_dim`). Fully masked rows (all -inf, no sink) give zeros."""
    if head_sink is None:
        return torch.softmax(logits, dim=-1).nan_to_num(0.0)
    shape = [1] * logits.dim()
    shape[head_dim] = -1
    sink = head_sink.float().reshape(shape).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]


def reference_attention(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                        cache_position: Tensor, scale: float, cos_cache: Tensor | None = None,
                        sin_cache: Tensor | None = None, head_sink: Tensor | None = None, softcap: float = 0.0,
                        local_window_size: int = -1, *, k_scale: Tensor | None = None,
                        v_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Plain PyTorch semantics of the op: the definition every lowering and kernel is tested against. An fp8
    cache (float8_e4m3fn; the GPU kernels' fp8 KV) takes `k_scale` / `v_scale` ([KVH] or [1]): entries are
    stored as fp8(x / scale) (saturated at +-448) and read back as float(stored) * scale."""
    _check(query, key, value, k_cache, v_cache, cache_position)
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    positions = cache_position.to(torch.int64)[:, None] + torch.arange(s, device=query.device)  # [B, S]
    if not torch.compiler.is_compiling() and int(positions.max()) >= capacity:
        raise ValueError(f"KV cache overflow: position {int(positions.max())} does not fit capacity {capacity}")
    assert (cos_cache is None) == (sin_cache is None), "cos_cache and sin_cache come together"
    if cos_cache is not None:
        assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] * 2 <= d, (cos_cache.shape, d)
        query, key = rotate(query, cos_cache, sin_cache, positions), rotate(key, cos_cache, sin_cache, positions)
    index = positions[:, None, :, None].expand(b, kvh, s, d)
    k_out = _scatter(k_cache, index, key, k_scale)
    v_out = _scatter(v_cache, index, value, v_scale)

    group = h // kvh
    q = query.transpose(1, 2).float()  # [B, H, S, D]
    k = _read(k_out, k_scale).repeat_interleave(group, dim=1)  # [B, H, C, D]
    v = _read(v_out, v_scale).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, S, C]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    slots = torch.arange(capacity, device=query.device)[None, None, :]
    visible = slots <= positions[:, :, None]  # [B, S, C]
    if local_window_size > 0:
        visible = visible & (slots > positions[:, :, None] - local_window_size)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.matmul(softmax_with_sink(scores, head_sink, 1), v)  # [B, H, S, D]
    return out.transpose(1, 2).to(query.dtype).contiguous(), k_out, v_out


def _scatter(cache: Tensor, index: Tensor, new: Tensor, scale: Tensor | None) -> Tensor:
    """The slot cache [B, KVH, C, D] with `new` [B, S, KVH, D] stored at `index` (as _encode stores it; an fp8
    cache scattered as bytes: PyTorch's CPU scatter has no float8)."""
    b, s, kvh, d = new.shape
    codes = _encode(new.reshape(b * s, kvh, d), cache.dtype, scale).reshape(b, s, kvh, d).transpose(1, 2)
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).scatter(2, index, codes.view(torch.uint8)).view(cache.dtype)
    return cache.scatter(2, index, codes)


def _read(cache: Tensor, scale: Tensor | None) -> Tensor:
    """The slot cache [B, KVH, C, D] as float32 values (_decode's)."""
    b, kvh, c, d = cache.shape
    return _decode(cache.transpose(1, 2).reshape(b * c, kvh, d), scale).reshape(b, c, kvh, d).transpose(1, 2)


@torch.library.custom_op("llmc::attention", mutates_args=())
def attention(query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
              cache_position: Tensor, scale: float, cos_cache: Tensor | None = None,
              sin_cache: Tensor | None = None, head_sink: Tensor | None = None, softcap: float = 0.0,
              local_window_size: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    return reference_attention(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache, sin_cache,
                               head_sink, softcap, local_window_size)


@attention.register_fake
def _attention_fake(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None,
                    head_sink=None, softcap=0.0, local_window_size=-1):
    _check(query, key, value, k_cache, v_cache, cache_position)
    return torch.empty_like(query), torch.empty_like(k_cache), torch.empty_like(v_cache)


FP8_MAX = 448.0  # e4m3fn's largest finite value: fp8 cache entries saturate there


def _channel_scales(scale: Tensor, kv_heads: int, head_size: int) -> Tensor:
    """A cache scale ([1], [KVH]: one per KV head, or [KVH, 1, D]) as [KVH, D]."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(kv_heads, head_size)
    if scale.numel() == kv_heads:
        return scale.float().reshape(kv_heads, 1).expand(kv_heads, head_size)
    return scale.float().reshape(-1, head_size).expand(kv_heads, head_size)


def _encode(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """[N, KVH, D] float values as a cache stores them: cast, int8 codes under `scale`, or fp8 (e4m3fn) of
    x / scale, saturated at +-448 and rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        scaled = x.float() / _channel_scales(scale, x.shape[1], x.shape[2]) if scale is not None else x.float()
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    if dtype != torch.int8:
        return x.to(dtype)
    codes = torch.round(x / _channel_scales(scale, x.shape[1], x.shape[2]))
    return codes.clamp(-128, 127).to(torch.int8)


def _decode(x: Tensor, scale: Tensor | None) -> Tensor:
    """[N, KVH, D] cache entries as float32: int8 codes or fp8 values times their scales."""
    if x.dtype not in (torch.int8, torch.float8_e4m3fn) or scale is None:
        return x.float()
    return x.float() * _channel_scales(scale, x.shape[1], x.shape[2])


def reference_paged_attention(query: Tensor, key: Tensor | None, value: Tensor | None, key_cache: Tensor,
                              value_cache: Tensor, cumulative_sequence_length: Tensor, past_seqlens: Tensor,
                              block_table: Tensor, num_heads: int, kv_num_heads: int, scale: float = 0.0,
                              cos_cache: Tensor | None = None, sin_cache: Tensor | None = None, *,
                              slot_mapping: Tensor | None = None, rotary_interleaved: bool = False,
                              softcap: float = 0.0, local_window_size: int = -1, is_causal: bool = True,
                              head_sink: Tensor | None = None, k_scale: Tensor | None = None,
                              v_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """ONNX Runtime's com.microsoft.PagedAttention in plain PyTorch, the definition llmc's CPU kernel
    (runtime/kernels/paged_attention/paged_attention.c) is tested against. Writes the new keys and values INTO `key_cache` and
    `value_cache` (the contract updates them in place) and returns (output [T, H*D], key_cache, value_cache).

    query [T, H*D] (or packed [T, (H + 2 KVH) * D] with key and value None), key/value [T, KVH*D];
    caches [num_blocks, block_size, KVH, D]; row b owns tokens cumulative_sequence_length[b] .. [b+1],
    at positions past_seqlens[b] + i. With cos/sin tables [P, R/2] (do_rotary) the new queries and keys
    are rotated at those positions. Token t's key/value go to slot `slot_mapping[t]` (block * block_size
    + offset; -1 writes nothing) or, without it, to its position's slot through `block_table`. Each query
    then attends to its row's positions 0 .. its own (all of the row's with is_causal=False), at most
    `local_window_size` of them counting itself (when > 0), read from the cache through `block_table`;
    block-table entries outside [0, num_blocks) are unmapped and masked out. softcap > 0 turns a logit
    x into softcap * tanh(x / softcap); scale 0 means 1 / sqrt(D); `head_sink` [H] adds one logit per
    head to each softmax's denominator. A query with nothing to attend to (and no sink) gets zeros. int8 caches take `k_scale`/`v_scale`, the contract's dequantization scales ([1]:
    PER_TENSOR, [KVH, 1, D]: PER_CHANNEL): x is stored as round(x / scale) (to nearest even) saturated to
    [-128, 127] and read back as code * scale. fp8 caches (float8_e4m3fn, the GPU kernels' fp8 KV: scales
    [KVH], one per KV head, or [1]) store fp8(x / scale), saturated at +-448, read back as float(stored) * scale."""
    tokens = query.shape[0]
    if key is None:
        head_size = query.shape[1] // (num_heads + 2 * kv_num_heads)
        query, key, value = query.split([num_heads * head_size, kv_num_heads * head_size,
                                         kv_num_heads * head_size], dim=1)
    head_size = query.shape[1] // num_heads
    num_blocks, block_size = key_cache.shape[:2]
    scale = scale or head_size ** -0.5
    cu, past = cumulative_sequence_length.tolist(), past_seqlens.tolist()
    rows = torch.repeat_interleave(torch.arange(len(past)), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    positions = torch.tensor(past, dtype=torch.int64)[rows] + torch.arange(tokens) - torch.tensor(cu[:-1])[rows]
    q = query.reshape(tokens, num_heads, head_size).float()
    k = key.reshape(tokens, kv_num_heads, head_size).float()
    if cos_cache is not None:
        q = rotate(q, cos_cache, sin_cache, positions, rotary_interleaved)
        k = rotate(k, cos_cache, sin_cache, positions, rotary_interleaved)
    table = block_table.to(torch.int64)
    table = torch.where((table >= 0) & (table < num_blocks), table, -1)
    if slot_mapping is None:
        block = table[rows, positions // block_size]
        slots = torch.where(block >= 0, block * block_size + positions % block_size, -1)
    else:
        slots = slot_mapping.to(torch.int64)
    k_flat = key_cache.view(num_blocks * block_size, kv_num_heads, head_size)
    v_flat = value_cache.view(num_blocks * block_size, kv_num_heads, head_size)
    written = slots >= 0
    k_flat[slots[written]] = _encode(k[written], key_cache.dtype, k_scale)
    v_flat[slots[written]] = _encode(value.reshape(tokens, kv_num_heads, head_size)[written].float(), value_cache.dtype,
                                     v_scale)

    out = torch.zeros(tokens, num_heads, head_size)
    group = num_heads // kv_num_heads
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        total = past[b] + end - start
        if end == start:
            continue
        seen = torch.arange(total)
        block = table[b, seen // block_size]
        slot = block.clamp(min=0) * block_size + seen % block_size
        keys = _decode(k_flat[slot], k_scale).repeat_interleave(group, dim=1)  # [total, H, D]
        values = _decode(v_flat[slot], v_scale).repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        at = positions[start:end, None]  # [n, 1]
        visible = (block >= 0)[None, :].expand(end - start, total)
        if is_causal:
            visible = visible & (seen[None, :] <= at)
        if local_window_size > 0:
            visible = visible & (seen[None, :] > at - local_window_size)
        weights = softmax_with_sink(logits.masked_fill(~visible, float("-inf")), head_sink, 0)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out.reshape(tokens, num_heads * head_size).to(query.dtype), key_cache, value_cache
