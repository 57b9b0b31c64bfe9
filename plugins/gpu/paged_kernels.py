"""OpenAI Triton kernels for the paged attention op (ONNX Runtime's PagedAttention contract;
semantics: plugins/op/attention.py `reference_paged_attention`) on a GPU, called from PyTorch.

    paged_attention(query [T, H*D] (or packed [T, (H + 2 KVH) * D]), key/value [T, KVH*D] or None,
                    key_cache/value_cache [num_blocks, block_size, KVH, D],
                    cumulative_sequence_length int [B + 1], past_seqlens int [B], block_table int [B, max_blocks],
                    num_heads, kv_num_heads, scale=0, cos_cache=None, sin_cache=None, *, slot_mapping=None,
                    rotary_interleaved=False, softcap=0, local_window_size=-1, is_causal=True, head_sink=None)
      -> (output [T, H*D], key_cache, value_cache)      the caches updated in place

Two launches:
1. `_paged_write`, one program per packed token: finds the token's row (binary search over
   `cumulative_sequence_length`), rotates its keys at its position (rotate-half or interleaved, over
   the tables' width) and writes keys and values into the slot the block table (or `slot_mapping`) names.
2. `_paged_attention`: flash attention over the block pools. A program holds up to BLOCK_M
   (token, query head) pairs of one row and one KV group, so a group's keys are loaded once for all of
   its heads and a decode row fills a block with them. Rows are packed without padding: program i
   belongs to the row whose first block index `cu[b] * G // BLOCK_M + b` is the last one <= i
   (a binary search); `T * G // BLOCK_M + B` programs (rounded up) cover every row however the tokens are split,
   the spare ones mask everything. Keys are gathered position by position through the block table,
   so any block size works; unmapped entries (outside [0, num_blocks)) are masked out.

The same attention kernel with FRESH=1 is the whole op in one launch (the TensorRT plugin's kernel,
paged_kernels_aot.py): keys at or past a row's cached length come from the inputs, rotated on the fly,
and the programs holding a group's first head write them into the blocks.

softcap, local_window_size and head_sink (SINKS: each head's sink logit joins its softmax's denominator
when the softmax is finished, `with_sink`) are the contract's, as compile-time constants.

Split-KV (flash-decoding, SPLITS > 1, split_kv.py): a third grid axis divides each program's keys among SPLITS
programs, merged by the tile's last one in the same launch; with FRESH=1 the first split writes the new keys.
fp16, bf16 and fp32; accumulation in fp32. Runs on CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

# (token, head) pairs per program, keys per inner step, and the stages by head size: configs.py
from llmc.plugins.gpu.configs import BLOCK_M, KernelConfig, attention_config
from llmc.plugins.gpu.fp8 import as_stored, head_scale, kv_scales, kv_view, load_kv, store_kv
from llmc.plugins.gpu.kernels import fold_keys, rows, with_sink
# the launches' argument handling, shared with paged_kernels_aot.py and prefill.py
from llmc.plugins.gpu.paged_launch import int32, kernel_options, sinks, split_packed  # noqa: F401  (API)
from llmc.plugins.gpu.split_kv import launch_capability, merge_splits, split_buffers, split_keys, tile_and_split


@triton.jit
def find_row(cu_ptr, B, target, G: tl.constexpr, BLOCK_M: tl.constexpr, PER_BLOCK: tl.constexpr):
    """The last row b in [0, B) whose start is <= target: the start is cu[b] (a token index), or with
    PER_BLOCK the row's first program index cu[b] * G // BLOCK_M + b."""
    lo = 0
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_ptr + mid)
        if PER_BLOCK:
            start = start * G // BLOCK_M + mid
        ok = start <= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, src, dst, d, mask, positions, cos_ptr, sin_ptr, k_scale, v_scale,
             HALF: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, FP8_KV: tl.constexpr):
    """New keys (rotated at `positions` when ROTARY) and values, read from the inputs at row offsets `src`,
    stored into the block pools at `dst` (with FP8_KV as e4m3 bytes under the heads' scales): the separate
    write kernel's and the one-launch kernel's step."""
    store_kv(kc_ptr, dst, rows(k_ptr, src, d, mask, positions, cos_ptr, sin_ptr, HALF, ROTARY, INTERLEAVED), mask,
             k_scale, FP8_KV)
    store_kv(vc_ptr, dst, tl.load(v_ptr + src + d[None, :], mask=mask, other=0.0), mask, v_scale, FP8_KV)


@triton.jit
def slot_of(table_ptr, b, positions, valid, MB, NB, BS, PAGE: tl.constexpr = 0):
    """Cache slot (block * BS + offset) of each position of row b through the block table, and whether
    it is mapped (the entry exists and names a block in [0, NB)). PAGE > 0: the block size BS as a compile-time
    constant (the PyTorch launches'), which turns the two divisions a key into shifts or a multiply (a runtime
    divisor costs a few dozen instructions each: 44-163 of them in a compiled key loop); the plugins' kernels,
    whose block size is a shape TensorRT passes at run time, divide."""
    if PAGE > 0:
        index = positions // PAGE
        offset = positions % PAGE
    else:
        index = positions // BS
        offset = positions % BS
    block = tl.load(table_ptr + b * MB + index, mask=valid & (index < MB), other=-1).to(tl.int64)
    mapped = valid & (block >= 0) & (block < NB)
    return block * BS + offset, mapped


@triton.jit
def _paged_write(k_ptr, v_ptr, kc_ptr, vc_ptr, cu_ptr, past_ptr, table_ptr, slots_ptr, cos_ptr, sin_ptr,
                 B, MB, NB, BS, ks_ptr, vs_ptr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
                 SLOTS: tl.constexpr, FP8_KV: tl.constexpr = False, PAGE: tl.constexpr = 0):
    """One program per packed token: its keys (rotated) and values into its cache slot, all KV heads."""
    t = tl.program_id(0)
    b = find_row(cu_ptr, B, t, 1, 1, False)
    position = tl.load(past_ptr + b) + t - tl.load(cu_ptr + b)
    g = tl.arange(0, BLOCK_KVH)
    d = tl.arange(0, BLOCK_D)
    heads = g < KVH
    positions = tl.zeros([BLOCK_KVH], tl.int32) + position
    if SLOTS:
        slot = tl.load(slots_ptr + t + 0 * g).to(tl.int64)
        ok = heads & (slot >= 0) & (slot < NB * BS)
    else:
        slot, ok = slot_of(table_ptr, b, positions, heads, MB, NB, BS, PAGE)
    mask = ok[:, None] & (d < D)[None, :]
    src = (t * KVH + g).to(tl.int64)[:, None] * D
    dst = (slot * KVH + g)[:, None] * D + d[None, :]
    k_scale = head_scale(ks_ptr, tl.minimum(g, KVH - 1), FP8_KV)  # one per KV head
    v_scale = head_scale(vs_ptr, tl.minimum(g, KVH - 1), FP8_KV)
    if FP8_KV:
        k_scale, v_scale = k_scale[:, None], v_scale[:, None]
    write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, src, dst, d, mask, positions, cos_ptr, sin_ptr, k_scale, v_scale, HALF,
             ROTARY, INTERLEAVED, FP8_KV)


@triton.jit
def _fresh_keys(k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, n, end, slot, mapped, past, start, kv, d_ok, d,
                k_scale, v_scale, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ROTARY: tl.constexpr,
                INTERLEAVED: tl.constexpr, FP8_KV: tl.constexpr):
    """The one-launch form's block of keys and values at positions n (up to `end`, exclusive) around the row's
    cached length `past`, in the cache's units (fp8.py load_kv): those before it from the cache, those at or past
    it from the new-token inputs (rotated, rounded as the cache holds them), read only if the block reaches them
    (their rounding into an fp8 cache, an IEEE division and an encode per element, bounded every block
    otherwise)."""
    at = (slot * KVH + kv)[:, None] * D + d[None, :]
    cached = (mapped & (n < past))[:, None] & d_ok[None, :]
    k = load_kv(kc_ptr, at, cached, FP8_KV)
    v = load_kv(vc_ptr, at, cached, FP8_KV)
    if end > past:
        new = (mapped & (n >= past))[:, None] & d_ok[None, :]
        src = ((start + n - past).to(tl.int64) * KVH + kv)[:, None] * D
        k_new = rows(k_ptr, src, d, new, n, cos_ptr, sin_ptr, HALF, ROTARY, INTERLEAVED)
        k = tl.where(new, as_stored(k_new, kc_ptr, k_scale, FP8_KV), k)
        v_new = tl.load(v_ptr + src + d[None, :], mask=new, other=0.0).to(tl.float32)
        v = tl.where(new, as_stored(v_new, vc_ptr, v_scale, FP8_KV), v)
    return k, v


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, cu_ptr, past_ptr, table_ptr, cos_ptr, sin_ptr, sink_ptr,
                     part_ptr, lock_ptr, B, MB, NB, BS, o_ptr, kc_out, vc_out, part_out, lock_out, ks_ptr, vs_ptr,
                     SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr, ROTARY: tl.constexpr,
                     INTERLEAVED: tl.constexpr, FRESH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SINKS: tl.constexpr,
                     SPLITS: tl.constexpr, FP8_KV: tl.constexpr = False, PAGE: tl.constexpr = 0):
    """One program per (block of a row's (token, group head) pairs, KV head, key split). Parameters in
    TensorRT's AOT-plugin order: input tensors (the split workspace and counters last), int32 scalars, output
    tensors (the caches, workspace and counters aliased to the inputs); SPLITS > 1 compiles the key splits, as
    many as the grid's third axis (a plugin's launch sizes it: split_kv.plugin_splits), and only then are the
    workspace and counters read; then the fp8 caches' per-KV-head scales, read only with FP8_KV (fp8.py: the
    caches then hold e4m3 bytes). PAGE: the block size when compiled (slot_of; 0: BS at run time).
    UPCAST: tiles reach the dots as fp32 (under the interpreter for bf16, which NumPy lacks)."""
    G: tl.constexpr = H // KVH
    kv = tl.program_id(1)
    b = find_row(cu_ptr, B, tl.program_id(0), G, BLOCK_M, True)
    start = tl.load(cu_ptr + b)
    past = tl.load(past_ptr + b)
    r = (tl.program_id(0) - start * G // BLOCK_M - b) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (r >= 0) & (r < (tl.load(cu_ptr + b + 1) - start) * G)
    s = r // G
    pos = past + s
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_at = ((start + s).to(tl.int64) * H + kv * G + r % G)[:, None] * D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = rows(q_ptr, q_at, d, q_mask, pos, cos_ptr, sin_ptr, HALF, ROTARY, INTERLEAVED)
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)
    if CAUSAL:
        hi = tl.max(tl.where(row_ok, pos + 1, 0), 0)
    else:
        hi = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, past + tl.load(cu_ptr + b + 1) - start, 0)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(tl.min(tl.where(row_ok, pos, hi), 0) - WINDOW + 1, 0)
    if SPLITS > 1:  # this program's slice of the keys (slot_of masks the keys past its end)
        lo, hi, active = split_keys(lo, hi, tl.num_programs(2), BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_scale = head_scale(ks_ptr, kv, FP8_KV)
    v_scale = head_scale(vs_ptr, kv, FP8_KV)
    # The keys from the cache alone: all of them, or with FRESH the whole blocks before the row's new keys, in a loop
    # without the new keys' branch (with it, the one-launch form ran at half the two-launch one's rate on the H200);
    # counted from 0: Triton 3.9 buffers 3 of this loop's 9 loads when it starts at a runtime bound (a key split's
    # or a window's start: 13568 bytes of shared memory against 21760 at fp16 head 128), all 9 from a trip count
    if FRESH:
        steps = tl.maximum(tl.minimum(hi, past) - lo, 0) // BLOCK_N
    else:
        steps = tl.cdiv(hi - lo, BLOCK_N)
    for step in range(0, steps):
        n = lo + step * BLOCK_N + tl.arange(0, BLOCK_N)
        slot, mapped = slot_of(table_ptr, b, n, n < hi, MB, NB, BS, PAGE)
        at = (slot * KVH + kv)[:, None] * D + d[None, :]
        k = load_kv(kc_ptr, at, mapped[:, None] & d_ok[None, :], FP8_KV)
        v = load_kv(vc_ptr, at, mapped[:, None] & d_ok[None, :], FP8_KV)
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, mapped, row_ok, pos, k_scale, SCALE, SOFTCAP, WINDOW,
                                  CAUSAL, DOT_PRECISION)
    if FRESH:  # the rest: the block holding the row's cached length and those after it (a decode row's last), not
        rest = lo + steps * BLOCK_N  # pipelined (one stage: its seven loads, buffered, would double the shared memory)
        for step in tl.range(0, tl.cdiv(hi - rest, BLOCK_N), num_stages=1):
            n = rest + step * BLOCK_N + tl.arange(0, BLOCK_N)
            slot, mapped = slot_of(table_ptr, b, n, n < hi, MB, NB, BS, PAGE)
            k, v = _fresh_keys(k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, n, rest + (step + 1) * BLOCK_N, slot,
                               mapped, past, start, kv, d_ok, d, k_scale, v_scale, KVH, D, HALF, ROTARY, INTERLEAVED,
                               FP8_KV)
            acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, mapped, row_ok, pos, k_scale, SCALE, SOFTCAP,
                                      WINDOW, CAUSAL, DOT_PRECISION)
    writes = tl.full([BLOCK_M, 1], 1, tl.int1)  # whether this program writes the output: with splits, the tile's
    if SPLITS > 1:  # last to finish
        if tl.num_programs(2) > 1:  # a launch sized to one split touches no workspace
            tile, split = tile_and_split()
            acc, m_i, l_i, writes = merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, tile, split, active, d, D,
                                                 tl.num_programs(2), BLOCK_M)
    if SINKS:
        head = kv * G + r % G
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32))
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # the values' fp8 scale (1 otherwise)
    tl.store(o_ptr + q_at + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask & writes)
    if FRESH:  # the row's new keys and values into the blocks, once per token: by its group's first head, in the
        writer = row_ok & (r % G == 0) & (tl.program_id(2) + 0 * r == 0)  # first split (the others read the inputs)
        slot, mapped = slot_of(table_ptr, b, pos, writer, MB, NB, BS, PAGE)
        w_mask = mapped[:, None] & d_ok[None, :]
        src = ((start + s).to(tl.int64) * KVH + kv)[:, None] * D
        dst = (slot * KVH + kv)[:, None] * D + d[None, :]
        write_kv(k_ptr, v_ptr, kc_out, vc_out, src, dst, d, w_mask, pos, cos_ptr, sin_ptr, k_scale, v_scale, HALF,
                 ROTARY, INTERLEAVED, FP8_KV)


def busy_tiles(tokens: int, rows: int, num_heads: int, num_kv_heads: int, block_m: int = BLOCK_M) -> int:
    """The programs along attention_grid's x that hold queries, as the split count's rule counts them: at least one
    a row, or the (token, head) pairs over a tile's rows (the grid's spare tiles mask everything and finish at once;
    counted, they halved the splits of a small decode batch: on an H200, 8 rows x 32k keys ran 0.78x SDPA in 4
    splits and 0.42x in the 2 they gave, in Hopper's configuration; 0.43x and 0.24x in the portable one)."""
    return max(rows, triton.cdiv(tokens * (num_heads // num_kv_heads), block_m))


def attention_grid(tokens, rows, num_heads: int, num_kv_heads: int, block_m: int = BLOCK_M, cdiv=triton.cdiv,
                   splits: int = 1):
    """(programs over the rows' packed (token, head) pairs, KV heads, key splits): enough for any split of
    `tokens` among `rows`; works on ints and on TensorRT's symbolic shape expressions (pass `trtp.cdiv`)."""
    return cdiv(tokens * (num_heads // num_kv_heads), block_m) + rows, num_kv_heads, splits


def write_new_kv(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                 num_heads, kv_num_heads, scale, cos_cache, sin_cache, slot_mapping, rotary_interleaved, softcap,
                 local_window_size, is_causal, head_sink, k_scale, v_scale) -> SimpleNamespace:
    """What a paged call (paged_attention, prefill.paged_prefill) prepares before attention, its new keys and values
    written into the caches (in place) by `_paged_write`: the split query, key and value, the kernels' options, the
    int32 row tensors, the block scalars, rotary tables, fp8 scales and the caches' views."""
    query, key, value = split_packed(query, key, value, num_heads, kv_num_heads)
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "contiguous caches expected"
    options = kernel_options(query, key_cache, num_heads, kv_num_heads, scale, cos_cache, rotary_interleaved,
                             softcap, local_window_size, is_causal, head_sink)
    cu, past, table = int32(cumulative_sequence_length, past_seqlens, block_table)
    tokens, rows, num_blocks, block_size = query.shape[0], past.shape[0], key_cache.shape[0], key_cache.shape[1]
    scalars = (rows, table.shape[1], num_blocks, block_size)
    cos, sin = (cos_cache.contiguous(), sin_cache.contiguous()) if cos_cache is not None else (query, query)
    slots = slot_mapping.to(torch.int64).contiguous() if slot_mapping is not None else cu
    fp8, k_scale, v_scale = kv_scales(key_cache, k_scale, v_scale, kv_num_heads, query)
    kc, vc = kv_view(key_cache), kv_view(value_cache)
    if tokens:
        _paged_write[(tokens,)](key, value, kc, vc, cu, past, table, slots, cos, sin, *scalars, k_scale, v_scale,
                                kv_num_heads, options["D"], options["HALF"], triton.next_power_of_2(kv_num_heads),
                                options["BLOCK_D"], options["ROTARY"], options["INTERLEAVED"], slot_mapping is not None,
                                fp8, PAGE=block_size)
    options["PAGE"] = block_size  # the attention launches' too: a PyTorch launch compiles per block size
    return SimpleNamespace(query=query, key=key, value=value, options=options, cu=cu, past=past, table=table,
                           tokens=tokens, rows=rows, block_size=block_size, scalars=scalars, cos=cos, sin=sin,
                           k_scale=k_scale, v_scale=v_scale, kc=kc, vc=vc)


def paged_attention(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                    num_heads: int, kv_num_heads: int, scale: float = 0.0, cos_cache=None, sin_cache=None, *,
                    slot_mapping=None, rotary_interleaved: bool = False, softcap: float = 0.0,
                    local_window_size: int = -1, is_causal: bool = True, head_sink=None, splits: int | None = None,
                    k_scale=None, v_scale=None, config: KernelConfig | None = None):
    """`reference_paged_attention` on the GPU kernels: the new keys and values written into the caches
    (in place), then attention; returns (output [T, H*D], key_cache, value_cache). `splits`: ways to split
    each program's keys (default: from the shapes and the GPU, split_buffers; 1: none). fp8 (float8_e4m3fn)
    caches take `k_scale` / `v_scale`, fp32 [KVH] (fp8.py). `config`: the attention kernel's keys per step,
    warps and stages (default: configs.attention_config's; its rows stay BLOCK_M)."""
    w = write_new_kv(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                     num_heads, kv_num_heads, scale, cos_cache, sin_cache, slot_mapping, rotary_interleaved, softcap,
                     local_window_size, is_causal, head_sink, k_scale, v_scale)
    query, options, tokens, rows = w.query, w.options, w.tokens, w.rows
    out = torch.empty_like(query)
    if tokens:
        config = config or attention_config(options["D"], query.element_size(), paged=True,
                                            capability=launch_capability(query))
        options["BLOCK_N"] = config.block_n
        grid_x = attention_grid(tokens, rows, num_heads, kv_num_heads)[0]
        options["SPLITS"], part, counters = split_buffers(query, grid_x, kv_num_heads,
                                                          w.table.shape[1] * w.block_size, options["D"], splits,
                                                          busy_tiles(tokens, rows, num_heads, kv_num_heads))
        _paged_attention[attention_grid(tokens, rows, num_heads, kv_num_heads, splits=options["SPLITS"])](
            query, w.key, w.value, w.kc, w.vc, w.cu, w.past, w.table, w.cos, w.sin, sinks(head_sink, num_heads, query),
            part, counters, *w.scalars, out, w.kc, w.vc, part, counters, w.k_scale, w.v_scale, FRESH=False, **options,
            **config.launch())
    return out, key_cache, value_cache
