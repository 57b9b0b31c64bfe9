"""OpenAI Triton kernels for `llmc::attention` (plugins/op/attention.py) on a GPU, called from PyTorch.

    fused_attention(query [B,S,H,D], key [B,S,KVH,D], value [B,S,KVH,D],
                    k_cache [B,KVH,C,D], v_cache [B,KVH,C,D], cache_position int [B], scale,
                    cos_cache [P,R/2] = None, sin_cache [P,R/2] = None, head_sink [H] = None,
                    softcap = 0.0, local_window_size = -1) -> output [B,S,H,D]

The caches are updated in place (the plugin's contract, like ONNX Runtime's shared past/present
buffer): row b's new keys and values land at `cache_position[b] ..`, in the KV layout the artifact
records ([batch, kv_heads, capacity, head_dim]). Three steps, each one kernel launch:

1. `_rope_write`: optional rotary (rotate-half over the tables' R <= D channels, the rest passing
   through) on the new queries and keys at their positions, and the new keys/values written into the caches.
2. prefill (S > 1), `_prefill`: flash attention over the cache — one program per (query block,
   batch x head), online softmax in fp32, causal by absolute position, a block of keys at a time.
3. decode (S == 1), flash-decoding: `_decode_split` gives each (batch x head, split) program a slice
   of the row's keys and writes a partial (max, sum, weighted values); `_decode_reduce` merges the
   splits. Splitting the keys keeps a GPU busy when batch x heads alone is too few programs.

The attention features (plugins/op/attention.py) are compile-time constants: SOFTCAP > 0 caps the scaled
logits, WINDOW > 0 starts each query's keys at position - WINDOW + 1 (the loops begin there too), and SINKS
reads one sink logit per head from `sink_ptr` into the denominator when a softmax is finished (`with_sink`).

The same op in one launch, for the TensorRT plugin, is in one_launch.py (compiled ahead of time by kernels_aot.py).

GQA: query head h reads KV head h // (H / KVH). fp16, bf16 and fp32 inputs; accumulation in fp32.
Runs on CPU under `TRITON_INTERPRET=1` (how the tests check it against the reference) and compiles
for sm_80 / sm_90 without a GPU (kernels_aot.compile_ptx).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# block sizes, warps and pipeline stages by head size: configs.py (shared with the ahead-of-time compiles)
from llmc.plugins.gpu.configs import BLOCK_M, BLOCK_N, DECODE_BLOCK, attention_config, decode_splits, default_config


@triton.jit
def rotated(x_ptr, offsets, d, mask, positions, cos_ptr, sin_ptr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x[offsets + d] in fp32, rotated at `positions` ([rows]) over its first 2 * HALF channels:
    pairs (i, i + HALF) (rotate-half) or (2i, 2i + 1) (interleaved); the channels after pass through."""
    x = tl.load(x_ptr + offsets + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if INTERLEAVED:
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
        freq = d // 2
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        freq = d % HALF
    rot = mask & (d < 2 * HALF)[None, :]
    table = positions.to(tl.int64)[:, None] * HALF + freq[None, :]
    cos = tl.load(cos_ptr + table, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=rot, other=0.0).to(tl.float32)
    other = tl.load(x_ptr + offsets + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    return x * cos + sign[None, :] * other * sin


@triton.jit
def _rope_write(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr,
                S, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, C,
                HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr):
    """One program per (b, s): rotate q (into qo) and k over their first 2 * HALF channels, write k and v
    into the caches at pos + s."""
    row = tl.program_id(0)
    b = row // S
    s = row % S
    pos = tl.load(pos_ptr + b).to(tl.int64) + s
    at = tl.zeros([1], tl.int64) + pos  # one row of positions, for `rotated`
    d = tl.arange(0, BLOCK_D)
    in_d = (d < D)[None, :]
    for h in range(H):
        base = (row * H + h) * D
        if ROTARY:
            x = rotated(q_ptr, base, d, in_d, at, cos_ptr, sin_ptr, HALF, False)
        else:
            x = tl.load(q_ptr + base + d[None, :], mask=in_d, other=0.0).to(tl.float32)
        tl.store(qo_ptr + base + d[None, :], x.to(qo_ptr.dtype.element_ty), mask=in_d)
    for g in range(KVH):
        base = (row * KVH + g) * D
        if ROTARY:
            x = rotated(k_ptr, base, d, in_d, at, cos_ptr, sin_ptr, HALF, False)
        else:
            x = tl.load(k_ptr + base + d[None, :], mask=in_d, other=0.0).to(tl.float32)
        slot = ((b * KVH + g) * C + pos) * D
        tl.store(kc_ptr + slot + d[None, :], x.to(kc_ptr.dtype.element_ty), mask=in_d)
        tl.store(vc_ptr + slot + d[None, :],
                 tl.load(v_ptr + base + d[None, :], mask=in_d, other=0.0).to(vc_ptr.dtype.element_ty), mask=in_d)


@triton.jit
def softmax_block(scores, m_i, l_i):
    """One block of keys in an online softmax over rows: the block's unnormalized probabilities, the
    factor that rescales what came before, and the new running max and sum (fully masked rows stay 0)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def capped(scores, SOFTCAP: tl.constexpr):
    """softcap * tanh(scores / softcap) when SOFTCAP > 0 (through exp: saturates cleanly at +-softcap)."""
    if SOFTCAP > 0:
        scores = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * scores / SOFTCAP) + 1.0))
    return scores


@triton.jit
def with_sink(acc, m_i, l_i, sink):
    """A finished online softmax (acc [rows, D], running max and sum [rows]) with each row's sink logit
    joining the denominator: the max taken over both, the values rescaled to it. A row that saw nothing
    keeps acc 0 (its output stays 0); a sink of -inf changes nothing."""
    top = tl.maximum(m_i, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    factor = tl.exp(m_i - top)
    return acc * factor[:, None], l_i * factor + tl.exp(sink - top)


@triton.jit
def _prefill(q_ptr, kc_ptr, vc_ptr, o_ptr, pos_ptr, sink_ptr, scale, S, C,
             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
             UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr):
    """One program per (query block, b * H + h): flash attention over cache positions 0 .. pos + i (from
    pos + i - WINDOW + 1 with a window). UPCAST: tiles go to the dots as fp32 (set only under the
    interpreter for bf16, whose dot there reads bfloat16 bit patterns as integers: NumPy has no bfloat16)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    kv = (bh % H) // (H // KVH)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    m_idx = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_rows = (b * S + m_idx) * H + bh % H
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=(m_idx[:, None] < S) & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = pos + tl.minimum(start_m + BLOCK_M, S)  # keys this block can see: 0 .. last - 1
    first = 0
    if WINDOW > 0:  # ... from the block's first query's window on
        first = tl.maximum(pos + start_m - WINDOW + 1, 0)
    cache = (b * KVH + kv) * C * D
    for start_n in range(first, last, BLOCK_N):
        n_idx = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (n_idx[:, None] < last) & (d[None, :] < D)
        k = tl.load(kc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        scores = capped(tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PRECISION) * scale, SOFTCAP)
        visible = n_idx[None, :] <= pos + m_idx[:, None]
        if WINDOW > 0:
            visible = visible & (n_idx[None, :] > pos + m_idx[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i)
        v = tl.load(vc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    if SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + bh % H + 0 * m_idx).to(tl.float32))
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(m_idx[:, None] < S) & (d[None, :] < D))


@triton.jit
def _decode_split(q_ptr, kc_ptr, vc_ptr, part_acc, part_m, part_l, pos_ptr, scale, C, keys_per_split,
                  H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    """One program per (b * H + h, split): partial softmax over the split's slice of keys 0 .. pos (its
    window's part of them: a split before the window leaves an empty partial)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    kv = (bh % H) // (H // KVH)
    length = tl.load(pos_ptr + b).to(tl.int64) + 1
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + bh * D + d, mask=d < D, other=0.0).to(tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, length)
    if WINDOW > 0:
        lo = tl.maximum(lo, length - WINDOW)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    cache = (b * KVH + kv) * C * D
    for start_n in range(lo, hi, BLOCK_N):
        n_idx = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (n_idx[:, None] < hi) & (d[None, :] < D)
        k = tl.load(kc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(n_idx < hi, capped(tl.sum(k * q[None, :], 1) * scale, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(vc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    slot = bh * SPLITS + split
    tl.store(part_acc + slot * D + d, acc, mask=d < D)
    tl.store(part_m + slot, m_i)
    tl.store(part_l + slot, l_i)


@triton.jit
def _decode_reduce(part_acc, part_m, part_l, sink_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """One program per b * H + h: merge the splits' partial softmaxes (and the head's sink)."""
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_m + bh * SPLITS + s)
    l = tl.load(part_l + bh * SPLITS + s)
    top = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sink_ptr + bh % H).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(part_acc + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0)
    total = tl.sum(l * w, 0)
    if SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, cache_position: torch.Tensor, scale: float,
                    cos_cache: torch.Tensor | None = None, sin_cache: torch.Tensor | None = None,
                    head_sink: torch.Tensor | None = None, softcap: float = 0.0, local_window_size: int = -1,
                    splits: int | None = None) -> torch.Tensor:
    """`llmc::attention` with the caches updated in place; returns the output [B, S, H, D]."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    assert all(t.is_contiguous() for t in (query, key, value, k_cache, v_cache)), "contiguous tensors expected"
    assert head_sink is None or head_sink.shape == (h,), f"head_sink is not [num_heads {h}]"
    block_d = triton.next_power_of_2(d)
    rotary = cos_cache is not None
    rotated_q = torch.empty_like(query)
    dummy = query  # stands in for absent rotary tables and sinks (never read when ROTARY / SINKS is off)
    half = cos_cache.shape[1] if rotary else 1
    _rope_write[(b * s,)](query, key, value, k_cache, v_cache, rotated_q, cache_position,
                          cos_cache if rotary else dummy, sin_cache if rotary else dummy,
                          s, h, kvh, d, capacity, half, block_d, rotary)
    out = torch.empty_like(query)
    sink = head_sink.contiguous() if head_sink is not None else dummy
    features = {"SOFTCAP": float(softcap), "WINDOW": int(local_window_size)}
    if s > 1:
        precision = "ieee" if query.dtype == torch.float32 else "tf32"  # fp32 stays fp32 on tensor cores
        upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        config = attention_config(d, query.element_size(), fresh=False)
        _prefill[(triton.cdiv(s, config.block_m), b * h)](
            rotated_q, k_cache, v_cache, out, cache_position, sink, scale, s, capacity, h, kvh, d, config.block_m,
            config.block_n, block_d, precision, upcast, SINKS=head_sink is not None, **features, **config.launch())
        return out
    longest = int(cache_position.max()) + 1
    splits = splits or decode_splits(b, h, longest, min_keys=DECODE_BLOCK)  # one program per query head
    keys_per_split = max(DECODE_BLOCK, math.ceil(longest / splits / DECODE_BLOCK) * DECODE_BLOCK)
    part_acc = torch.empty((b * h, splits, d), dtype=torch.float32, device=query.device)
    part_m = torch.empty((b * h, splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty((b * h, splits), dtype=torch.float32, device=query.device)
    _decode_split[(b * h, splits)](rotated_q, k_cache, v_cache, part_acc, part_m, part_l, cache_position, scale,
                                   capacity, keys_per_split, h, kvh, d, splits, DECODE_BLOCK, block_d, **features,
                                   **default_config().launch())
    _decode_reduce[(b * h,)](part_acc, part_m, part_l, sink, out, h, d, splits, block_d, head_sink is not None)
    return out
