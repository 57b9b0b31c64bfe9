"""`llmc::attention` in a single kernel launch: the TensorRT plugin's kernel (compiled ahead of time in
kernels_aot.py), also launched from PyTorch.

A TensorRT ahead-of-time plugin (`@trtp.aot_impl`) hands TensorRT one kernel per layer, so the three launches of
kernels.py (rotary + cache write, attention, split merge) do not fit it. `_attention_one_launch` is the whole op
in one: its rows pack the query heads of a KV group (each KV head's keys are loaded once for all of them, and a
decode step fills a block with the group's heads), and it reads the new keys and values from the inputs rather
than the cache, so no program waits for another's cache write; one program per tile writes the new entries.

Split-KV (SPLITS > 1, split_kv.py): a third grid axis divides each tile's keys among SPLITS programs, whose
partials the tile's last program merges in the same launch; at a small batch and a long context batch x KV heads
alone leaves a GPU idle. SPLITS = 1 is the kernel without a workspace. A plugin's launch sizes that axis from its
shapes over a workspace and counters of a fixed size, engine inputs bound once (split_kv.plugin_splits;
docs/tensorrt.md: an ahead-of-time plugin gets no scratch memory from TensorRT).

The attention features are kernels.py's: partial rotary (HALF = the tables' width), softcap and window as
compile-time constants, sinks read from the head_sink input (a placeholder the kernel skips when SINKS is off,
since the plugin's inputs are fixed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.configs import KernelConfig, attention_config, decode_splits
from llmc.plugins.gpu.fp8 import as_stored, head_scale, in_type, kv_scales, kv_view, load_kv, store_kv
from llmc.plugins.gpu.kernels import INTERPRETED, fold_keys, rows, with_sink
from llmc.plugins.gpu.split_kv import (launch_capability, merge_splits, num_sms, plugin_splits, split_keys,
                                      split_workspace, tile_and_split)


@triton.jit
def query_tile(q_ptr, q_off, d, q_mask, positions, cos_ptr, sin_ptr, HALF: tl.constexpr, ROTARY: tl.constexpr,
               UPCAST: tl.constexpr):
    """A tile of queries as the slot kernels dot them: rotated at `positions` in their own type (reference_attention
    rotates queries in the inputs' type), in fp32 under UPCAST, else in the inputs' type."""
    q = in_type(rows(q_ptr, q_off, d, q_mask, positions, cos_ptr, sin_ptr, HALF, ROTARY, False), q_ptr, UPCAST)
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)
    return q


@triton.jit
def write_new_kv(k_ptr, v_ptr, kc_out, vc_out, src, slot, d, mask, positions, cos_ptr, sin_ptr, k_scale, v_scale,
                 HALF: tl.constexpr, ROTARY: tl.constexpr, UPCAST: tl.constexpr, FP8_KV: tl.constexpr):
    """The slot kernels' cache write: new keys (rotated at `positions` in the inputs' type) and values read at row
    offsets `src` of the inputs, stored at `slot` in the caches (with FP8_KV as e4m3 bytes under the heads'
    scales)."""
    k = in_type(rows(k_ptr, src, d, mask, positions, cos_ptr, sin_ptr, HALF, ROTARY, False), k_ptr, UPCAST)
    store_kv(kc_out, slot, k, mask, k_scale, FP8_KV)
    store_kv(vc_out, slot, tl.load(v_ptr + src + d[None, :], mask=mask, other=0.0), mask, v_scale, FP8_KV)


@triton.jit
def _attention_one_launch(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, sink_ptr, part_ptr,
                          lock_ptr, S, C, o_ptr, kc_out, vc_out, part_out, lock_out, ks_ptr, vs_ptr,
                          SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                          SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, SPLITS: tl.constexpr,
                          FP8_KV: tl.constexpr = False):
    """One program per (query-row block, b * KVH + kv head, key split); rows are (new token s, query head of
    the group) pairs. Keys before the row's position come from the cache, the new ones straight from
    the inputs (rotated on the fly over the tables' 2 * HALF channels).

    Parameters are in TensorRT's AOT-plugin calling convention: the plugin's input tensors (query,
    key, value, k_cache, v_cache, cache_position, cos, sin, head_sink, the split workspace and counters), then
    integer scalars (S, C), then its output tensors (output, k_cache', v_cache', workspace', counters' — all but
    the output aliased to the inputs, so the same memory; the kernel reads and writes through the inputs'
    pointers); the softmax scale, softcap and window are compile-time constants (AOT extra arguments are
    integers only), SINKS says whether head_sink is read (else it is a placeholder). SPLITS > 1 compiles the key
    splits (split_kv.py), as many as the grid's third axis (a plugin's launch sizes it: split_kv.plugin_splits);
    only then are the workspace and counters read. Last, the fp8 caches' per-KV-head scales (fp8.py), read only
    with FP8_KV (the caches then hold e4m3 bytes)."""
    start_m = tl.program_id(0) * BLOCK_M
    bk = tl.program_id(1)
    b = bk // KVH
    kv = bk % KVH
    G: tl.constexpr = H // KVH
    pos = tl.load(pos_ptr + b).to(tl.int64)
    r = start_m + tl.arange(0, BLOCK_M)
    s = r // G
    head = kv * G + r % G
    row_ok = s < S
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = ((b * S + s) * H + head)[:, None] * D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = query_tile(q_ptr, q_off, d, q_mask, pos + s, cos_ptr, sin_ptr, HALF, ROTARY, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = pos + tl.minimum(tl.max(tl.where(row_ok, s, 0), 0) + 1, S)  # keys any row here can see
    first = 0
    if WINDOW > 0:  # the first row's window (rows are in token order)
        first = tl.maximum(pos + start_m // G - WINDOW + 1, 0)
    if SPLITS > 1:  # this program's slice of them
        first, last, active = split_keys(first, last, tl.num_programs(2), BLOCK_N)
    cache = (b * KVH + kv) * C * D
    k_scale = head_scale(ks_ptr, kv, FP8_KV)
    v_scale = head_scale(vs_ptr, kv, FP8_KV)
    rows_at = pos + s  # each row's position
    # The cached keys in whole blocks before the new ones, in a loop without the new keys' branch (the paged kernel
    # ran at half its two-launch form's rate on the H200 with it); counted from 0, so Triton pipelines it fully
    steps = tl.maximum(tl.minimum(last, pos) - first, 0) // BLOCK_N
    for step in range(0, steps):
        n = first + step * BLOCK_N + tl.arange(0, BLOCK_N)
        at = cache + n[:, None] * D + d[None, :]
        k = load_kv(kc_ptr, at, d_ok[None, :], FP8_KV)  # the cache's units (fp8.py)
        v = load_kv(vc_ptr, at, d_ok[None, :], FP8_KV)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, n < last, row_ok, rows_at, k_scale, SCALE, SOFTCAP,
                                  WINDOW, True, DOT_PRECISION)
    # the rest: the block holding the position and those after it (a decode row's last), its keys from the cache
    # before the position and from the inputs from it on (rotated on the fly, rounded as the cache will hold them);
    # one stage: its seven loads, buffered, would more than double the kernel's shared memory
    rest = first + steps * BLOCK_N
    for step in tl.range(0, tl.cdiv(last - rest, BLOCK_N), num_stages=1):
        n = rest + step * BLOCK_N + tl.arange(0, BLOCK_N)
        ours = n < last  # a block past a split's end belongs to the next split
        mask_old = ((n < pos) & ours)[:, None] & d_ok[None, :]
        mask_new = ((n >= pos) & ours)[:, None] & d_ok[None, :]
        new_off = ((b * S + n - pos) * KVH + kv)[:, None] * D  # rows of the new-token inputs
        k = load_kv(kc_ptr, cache + n[:, None] * D + d[None, :], mask_old, FP8_KV)
        v = load_kv(vc_ptr, cache + n[:, None] * D + d[None, :], mask_old, FP8_KV)
        k_new = rows(k_ptr, new_off, d, mask_new, n, cos_ptr, sin_ptr, HALF, ROTARY, False)
        if FP8_KV:  # the op rotates keys in the inputs' type, then stores them (reference_attention)
            k_new = in_type(k_new, k_ptr, UPCAST)
        k = tl.where(mask_new, as_stored(k_new, kc_ptr, k_scale, FP8_KV), k)
        v_new = tl.load(v_ptr + new_off + d[None, :], mask=mask_new, other=0.0).to(tl.float32)
        v = tl.where(mask_new, as_stored(v_new, vc_ptr, v_scale, FP8_KV), v)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, ours, row_ok, rows_at, k_scale, SCALE, SOFTCAP, WINDOW,
                                  True, DOT_PRECISION)
    writes = tl.full([BLOCK_M, 1], 1, tl.int1)  # whether this program writes the tile's output: with splits, the
    if SPLITS > 1:  # tile's last to finish
        if tl.num_programs(2) > 1:  # a launch sized to one split touches no workspace
            tile, split = tile_and_split()
            acc, m_i, l_i, writes = merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, tile, split, active, d, D,
                                                 tl.num_programs(2), BLOCK_M)
    if SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32))
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # the values' fp8 scale (1 otherwise)
    tl.store(o_ptr + q_off + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask & writes)
    # the new keys and values into the cache: once per token, by the row holding the group's first head, in the
    # first split (any one would do: the other programs read the new keys from the inputs, never from the cache)
    writer = row_ok & (r % G == 0) & (tl.program_id(2) + 0 * r == 0)
    w_mask = writer[:, None] & d_ok[None, :]
    write_new_kv(k_ptr, v_ptr, kc_out, vc_out, ((b * S + s) * KVH + kv)[:, None] * D,
                 cache + (pos + s)[:, None] * D + d[None, :], d, w_mask, pos + s, cos_ptr, sin_ptr, k_scale, v_scale,
                 HALF, ROTARY, UPCAST, FP8_KV)


def one_launch_grid(tokens, batch, num_heads: int, num_kv_heads: int, block_m: int, splits: int = 1,
                    cdiv=triton.cdiv):
    """(row tiles, batch x KV heads, key splits): shapes only, so ints or TensorRT shape expressions."""
    return cdiv(tokens * (num_heads // num_kv_heads), block_m), batch * num_kv_heads, splits


def one_launch_attention(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None,
                         head_sink=None, softcap: float = 0.0, local_window_size: int = -1, splits: int | None = None,
                         *, k_scale=None, v_scale=None, slots: int = 0, config: KernelConfig | None = None):
    """`llmc::attention` in one kernel launch (the TensorRT plugin's kernel), caches updated in place. `splits`:
    ways to split each tile's keys (default: decode_splits from the shapes and the GPU's SMs; 1: none). `slots`:
    launched as the plugin launches it, `splits` the most a launch takes over a workspace of `slots` partials
    (split_kv.plugin_splits). fp8 (float8_e4m3fn) caches take `k_scale` / `v_scale`, fp32 [KVH] (fp8.py;
    `reference_attention`'s). `config`: the tiles and launch (default: configs.attention_config's)."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    assert head_sink is None or head_sink.shape == (h,), f"head_sink is not [num_heads {h}]"
    rotary = cos_cache is not None
    fp8, k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale, kvh, query)
    out = torch.empty_like(query)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    upcast = query.dtype == torch.bfloat16 and INTERPRETED
    # launched as the plugin: the plugin's own configuration (its ahead-of-time compile's), not this GPU's
    config = config or attention_config(d, query.element_size(), paged=False,
                                        capability=None if slots else launch_capability(query))
    tiles = triton.cdiv(s * (h // kvh), config.block_m)
    splits = splits or decode_splits(tiles * b, kvh, capacity, num_sms(query.device))
    compiled = splits  # the kernel's SPLITS: its split code compiled in when > 1
    if slots:  # as the plugin: the grid's third axis from its shapes, a workspace of `slots` partials
        splits = plugin_splits(tiles * b * kvh, capacity, splits, slots)
    grid = one_launch_grid(s, b, h, kvh, config.block_m, splits)
    if compiled > 1:
        part, counters = split_workspace(query.device, *((slots, 1) if slots else (tiles * b * kvh, splits)),
                                         config.block_m, d)
    else:
        part = counters = query  # placeholders the kernel never reads without splits
    kc, vc = kv_view(k_cache), kv_view(v_cache)
    _attention_one_launch[grid](query, key, value, kc, vc, cache_position,
                                cos_cache if rotary else query, sin_cache if rotary else query,
                                head_sink.contiguous() if head_sink is not None else query, part, counters, s,
                                capacity, out, kc, vc, part, counters, k_scale, v_scale, float(scale), h, kvh, d,
                                cos_cache.shape[1] if rotary else 1, config.block_m, config.block_n,
                                triton.next_power_of_2(d), rotary, precision, upcast, float(softcap),
                                int(local_window_size), head_sink is not None, compiled, fp8, **config.launch())
    return out
