"""Prefill over the slot cache in one launch, in FlashAttention-2's form: the TensorRT plugin's second kernel.

The one-launch kernel (one_launch.py) packs a KV group's query heads into 16-row tiles: right for decode, where a
row has one query and the group's heads fill the tile, but a prompt of S tokens then loads every key once per 16 /
G tokens. `_slot_prefill` takes BLOCK_M queries of one head a program (64 rows by default: a quarter of the key
loads), with the one-launch kernel's parameters, so the plugin offers both as tactics and TensorRT keeps the faster
for each optimization profile (the decode profile's one token a row, the prefill profile's prompt chunk).

    one program per (BLOCK_M of the row's S new tokens, b * H + query head)

Keys come in two parts, each split so that masks are computed only where they cut the tile:
1. the cached ones, [window start, pos): from the cache; every query of the tile sees them (masked only by a
   window);
2. the new ones, from the inputs (rotated on the fly, rounded as the cache holds them, as one_launch.py reads
   them): the blocks before the tile's first query (seen by every query but for a window), then the diagonal
   (masked); the blocks past the tile's last query are never visited.
The programs of a group's first head write the tile's new keys and values into the cache, once per token; no
program reads the new part from the cache, so none waits for another.

Everything else is one_launch.py's: rotary over the tables' 2 * HALF channels, softcap, window and sinks, fp32 /
fp16 / bf16, an fp8 cache (fp8.py). No key splits: a prefill's tiles fill the GPU (the workspace and counters are
in the parameters because the plugin passes them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.configs import KernelConfig
from llmc.plugins.gpu.fp8 import as_stored, head_scale, in_type, kv_scales, kv_view, load_kv
from llmc.plugins.gpu.kernels import INTERPRETED, fold_keys, rows, with_sink
from llmc.plugins.gpu.one_launch import query_tile, write_new_kv

# The tiles a plugin launch can take within the 48 KiB of shared memory it gets without opting in (kernels_aot
# SHARED_MEM_LIMIT), in order of preference; kernels_aot.plugin_prefill_kernel keeps the first that compiles within
# it. FlashAttention-2's 128-row tiles need 66-99 KiB at head 128.
PLUGIN_PREFILL_CONFIGS = (KernelConfig(64, 32, 4, 2), KernelConfig(64, 32, 4, 1), KernelConfig(32, 32, 4, 1),
                          KernelConfig(16, 32, 4, 1))


@triton.jit
def _new_keys(k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, b, S, kv, j, pos, d, d_ok, k_scale, v_scale,
              KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROTARY: tl.constexpr, UPCAST: tl.constexpr,
              FP8_KV: tl.constexpr):
    """The new tokens `j` [N] of row b (valid below S): keys rotated at their positions and values, each as the
    cache will hold it ([N, D], in load_kv's units), and which exist."""
    ok = j < S
    at = ((b * S + j) * KVH + kv)[:, None] * D
    mask = ok[:, None] & d_ok[None, :]
    k = rows(k_ptr, at, d, mask, pos + j, cos_ptr, sin_ptr, HALF, ROTARY, False)
    if FP8_KV:  # the op rotates keys in the inputs' type, then stores them
        k = in_type(k, k_ptr, UPCAST)
    v = tl.load(v_ptr + at + d[None, :], mask=mask, other=0.0).to(tl.float32)
    return as_stored(k, kc_ptr, k_scale, FP8_KV), as_stored(v, vc_ptr, v_scale, FP8_KV), ok


@triton.jit
def _slot_prefill(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, sink_ptr, part_ptr, lock_ptr, S, C,
                  o_ptr, kc_out, vc_out, part_out, lock_out, ks_ptr, vs_ptr,
                  SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                  SINKS: tl.constexpr, FP8_KV: tl.constexpr = False):
    """One program per (BLOCK_M new tokens of row b, b * H + query head). Parameters: one_launch.py's, the
    plugin's calling convention (the split workspace and counters unused)."""
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    G: tl.constexpr = H // KVH
    kv = h // G
    pos = tl.load(pos_ptr + b).to(tl.int64)
    m0 = tl.program_id(0) * BLOCK_M
    m = m0 + tl.arange(0, BLOCK_M)
    row_ok = m < S
    qpos = tl.where(row_ok, pos + m, -1)  # -1: a spare row sees nothing
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = ((b * S + m) * H + h)[:, None] * D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = query_tile(q_ptr, q_off, d, q_mask, pos + m, cos_ptr, sin_ptr, HALF, ROTARY, UPCAST)
    cache = (b * KVH + kv) * C * D
    k_scale = head_scale(ks_ptr, kv, FP8_KV)
    v_scale = head_scale(vs_ptr, kv, FP8_KV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t1 = tl.minimum(m0 + BLOCK_M, S)  # one past the tile's last new token
    # 1. the cached keys, from the window's start (the tile's first query's)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(pos + m0 - WINDOW + 1, 0)
    for step in range(0, tl.cdiv(tl.maximum(pos - lo, 0), BLOCK_N)):  # counted from 0: Triton pipelines a trip count
        n = lo + step * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = n < pos
        k = load_kv(kc_ptr, cache + n[:, None] * D + d[None, :], ok[:, None] & d_ok[None, :], FP8_KV)
        v = load_kv(vc_ptr, cache + n[:, None] * D + d[None, :], ok[:, None] & d_ok[None, :], FP8_KV)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, ok, row_ok, qpos, k_scale, SCALE, SOFTCAP, WINDOW, False,
                                  DOT_PRECISION)
    # 2. the new keys before the tile's first query (every query sees them but for a window), then the diagonal
    f_lo = 0
    if WINDOW > 0:
        f_lo = tl.maximum(m0 - WINDOW + 1, 0)
    full = tl.maximum(m0 - f_lo, 0) // BLOCK_N  # whole blocks before the diagonal
    for step in range(0, full):
        j = f_lo + step * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v, ok = _new_keys(k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, b, S, kv, j, pos, d, d_ok, k_scale,
                             v_scale, KVH, D, HALF, ROTARY, UPCAST, FP8_KV)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, pos + j, ok, row_ok, qpos, k_scale, SCALE, SOFTCAP, WINDOW,
                                  False, DOT_PRECISION)
    for start in range(f_lo + full * BLOCK_N, t1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        k, v, ok = _new_keys(k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, b, S, kv, j, pos, d, d_ok, k_scale,
                             v_scale, KVH, D, HALF, ROTARY, UPCAST, FP8_KV)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, pos + j, ok & (j < t1), row_ok, qpos, k_scale, SCALE,
                                  SOFTCAP, WINDOW, True, DOT_PRECISION)
    if SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + h + 0 * m).to(tl.float32))
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # the values' fp8 scale (1 otherwise)
    tl.store(o_ptr + q_off + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)
    if h % G == 0:  # the tile's new keys and values into the cache, by the group's first head
        write_new_kv(k_ptr, v_ptr, kc_out, vc_out, ((b * S + m) * KVH + kv)[:, None] * D,
                     cache + (pos + m)[:, None] * D + d[None, :], d, q_mask, pos + m, cos_ptr, sin_ptr, k_scale,
                     v_scale, HALF, ROTARY, UPCAST, FP8_KV)


def slot_prefill_grid(tokens, batch, num_heads: int, block_m: int, cdiv=triton.cdiv):
    """(tiles of a row's new tokens, rows x query heads): shapes only, so ints or TensorRT shape expressions."""
    return cdiv(tokens, block_m), batch * num_heads, 1


def slot_prefill(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None,
                 head_sink=None, softcap: float = 0.0, local_window_size: int = -1, *, k_scale=None, v_scale=None,
                 config: KernelConfig = PLUGIN_PREFILL_CONFIGS[0]):
    """`llmc::attention` (one_launch_attention's arguments) through the prefill kernel, launched as the plugin's
    prefill tactic launches it; caches updated in place."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    rotary = cos_cache is not None
    fp8, k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale, kvh, query)
    out = torch.empty_like(query)
    upcast = query.dtype == torch.bfloat16 and INTERPRETED
    kc, vc = kv_view(k_cache), kv_view(v_cache)
    _slot_prefill[slot_prefill_grid(s, b, h, config.block_m)](
        query, key, value, kc, vc, cache_position, cos_cache if rotary else query, sin_cache if rotary else query,
        head_sink.contiguous() if head_sink is not None else query, query, query, s, capacity, out, kc, vc, query,
        query, k_scale, v_scale, float(scale), h, kvh, d, cos_cache.shape[1] if rotary else 1, config.block_m,
        config.block_n, max(16, triton.next_power_of_2(d)), rotary, "ieee" if query.dtype == torch.float32 else "tf32",
        upcast, float(softcap), int(local_window_size), head_sink is not None, fp8, **config.launch())
    return out
