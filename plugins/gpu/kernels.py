"""OpenAI Triton kernels for `llmc::attention` (plugins/op/attention.py) on a GPU, called from PyTorch.

    fused_attention(query [B,S,H,D], key [B,S,KVH,D], value [B,S,KVH,D],
                    k_cache [B,KVH,C,D], v_cache [B,KVH,C,D], cache_position int [B], scale,
                    cos_cache [P,D/2] = None, sin_cache [P,D/2] = None) -> output [B,S,H,D]

The caches are updated in place (the plugin's contract, like ONNX Runtime's shared past/present
buffer): row b's new keys and values land at `cache_position[b] ..`, in the KV layout the artifact
records ([batch, kv_heads, capacity, head_dim]). Three steps, each one kernel launch:

1. `_rope_write`: optional rotary (rotate-half) on the new queries and keys at their positions, and
   the new keys/values written into the caches.
2. prefill (S > 1), `_prefill`: flash attention over the cache — one program per (query block,
   batch x head), online softmax in fp32, causal by absolute position, a block of keys at a time.
3. decode (S == 1), flash-decoding: `_decode_split` gives each (batch x head, split) program a slice
   of the row's keys and writes a partial (max, sum, weighted values); `_decode_reduce` merges the
   splits. Splitting the keys keeps a GPU busy when batch x heads alone is too few programs.

The same op in one launch, for the TensorRT plugin, is in kernels_aot.py.

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

BLOCK_M, BLOCK_N = 16, 32  # prefill: queries per program, keys per inner step
DECODE_BLOCK = 32  # decode: keys per inner step


@triton.jit
def _rope_write(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr,
                S, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, C,
                HALF: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr):
    """One program per (b, s): rotate q (into qo) and k, write k and v into the caches at pos + s."""
    row = tl.program_id(0)
    b = row // S
    s = row % S
    pos = tl.load(pos_ptr + b).to(tl.int64) + s
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    if ROTARY:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * HALF + (d % HALF), mask=in_d, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + (d % HALF), mask=in_d, other=0.0).to(tl.float32)
    for h in range(H):
        base = (row * H + h) * D
        x = tl.load(q_ptr + base + d, mask=in_d, other=0.0).to(tl.float32)
        if ROTARY:
            x = x * cos + sign * tl.load(q_ptr + base + partner, mask=in_d, other=0.0).to(tl.float32) * sin
        tl.store(qo_ptr + base + d, x.to(qo_ptr.dtype.element_ty), mask=in_d)
    for g in range(KVH):
        base = (row * KVH + g) * D
        x = tl.load(k_ptr + base + d, mask=in_d, other=0.0).to(tl.float32)
        if ROTARY:
            x = x * cos + sign * tl.load(k_ptr + base + partner, mask=in_d, other=0.0).to(tl.float32) * sin
        slot = ((b * KVH + g) * C + pos) * D
        tl.store(kc_ptr + slot + d, x.to(kc_ptr.dtype.element_ty), mask=in_d)
        tl.store(vc_ptr + slot + d, tl.load(v_ptr + base + d, mask=in_d, other=0.0).to(vc_ptr.dtype.element_ty),
                 mask=in_d)


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
def _prefill(q_ptr, kc_ptr, vc_ptr, o_ptr, pos_ptr, scale, S, C,
             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    """One program per (query block, b * H + h): flash attention over cache positions 0 .. pos + i.
    UPCAST: tiles go to the dots as fp32 (set only under the interpreter for bf16, whose dot there
    reads bfloat16 bit patterns as integers: NumPy has no bfloat16)."""
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
    cache = (b * KVH + kv) * C * D
    for start_n in range(0, last, BLOCK_N):
        n_idx = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (n_idx[:, None] < last) & (d[None, :] < D)
        k = tl.load(kc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PRECISION) * scale
        visible = n_idx[None, :] <= pos + m_idx[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i)
        v = tl.load(vc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(m_idx[:, None] < S) & (d[None, :] < D))


@triton.jit
def _decode_split(q_ptr, kc_ptr, vc_ptr, part_acc, part_m, part_l, pos_ptr, scale, C, keys_per_split,
                  H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (b * H + h, split): partial softmax over the split's slice of keys 0 .. pos."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    kv = (bh % H) // (H // KVH)
    length = tl.load(pos_ptr + b).to(tl.int64) + 1
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + bh * D + d, mask=d < D, other=0.0).to(tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, length)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    cache = (b * KVH + kv) * C * D
    for start_n in range(lo, hi, BLOCK_N):
        n_idx = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (n_idx[:, None] < hi) & (d[None, :] < D)
        k = tl.load(kc_ptr + cache + n_idx[:, None] * D + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(n_idx < hi, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
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
def _decode_reduce(part_acc, part_m, part_l, o_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One program per b * H + h: merge the splits' partial softmaxes."""
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_m + bh * SPLITS + s)
    l = tl.load(part_l + bh * SPLITS + s)
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(part_acc + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def decode_splits(batch_heads: int, longest: int, target_programs: int = 264) -> int:
    """How many key splits per (batch, head): enough programs to fill a GPU (~2 per SM on an
    H100's 132), never slices shorter than one key block; a power of two."""
    want = max(1, min(target_programs // max(batch_heads, 1), longest // DECODE_BLOCK))
    return 1 << (want.bit_length() - 1)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, cache_position: torch.Tensor, scale: float,
                    cos_cache: torch.Tensor | None = None, sin_cache: torch.Tensor | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """`llmc::attention` with the caches updated in place; returns the output [B, S, H, D]."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    assert all(t.is_contiguous() for t in (query, key, value, k_cache, v_cache)), "contiguous tensors expected"
    block_d = triton.next_power_of_2(d)
    rotary = cos_cache is not None
    rotated = torch.empty_like(query)
    dummy = query  # stands in for absent rotary tables (never read when ROTARY is off)
    _rope_write[(b * s,)](query, key, value, k_cache, v_cache, rotated, cache_position,
                          cos_cache if rotary else dummy, sin_cache if rotary else dummy,
                          s, h, kvh, d, capacity, d // 2, block_d, rotary)
    out = torch.empty_like(query)
    if s > 1:
        precision = "ieee" if query.dtype == torch.float32 else "tf32"  # fp32 stays fp32 on tensor cores
        upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        _prefill[(triton.cdiv(s, BLOCK_M), b * h)](rotated, k_cache, v_cache, out, cache_position, scale, s,
                                                   capacity, h, kvh, d, BLOCK_M, BLOCK_N, block_d, precision, upcast)
        return out
    longest = int(cache_position.max()) + 1
    splits = splits or decode_splits(b * h, longest)
    keys_per_split = max(DECODE_BLOCK, math.ceil(longest / splits / DECODE_BLOCK) * DECODE_BLOCK)
    part_acc = torch.empty((b * h, splits, d), dtype=torch.float32, device=query.device)
    part_m = torch.empty((b * h, splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty((b * h, splits), dtype=torch.float32, device=query.device)
    _decode_split[(b * h, splits)](rotated, k_cache, v_cache, part_acc, part_m, part_l, cache_position, scale,
                                   capacity, keys_per_split, h, kvh, d, splits, DECODE_BLOCK, block_d)
    _decode_reduce[(b * h,)](part_acc, part_m, part_l, out, d, splits, block_d)
    return out

