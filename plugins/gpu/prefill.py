"""Prefill over the paged KV cache in FlashAttention-2's form: prompt chunks (fresh, or after thousands of cached
tokens) attend to their rows' keys through the block tables, one query head and BLOCK_M queries a program.

    paged_prefill(... reference_paged_attention's arguments ..., config=None)
      -> (output [T, H*D], key_cache, value_cache)      the caches updated in place

Two launches: paged_kernels.py's `_paged_write` (the chunk's keys and values into their blocks), then
`_paged_prefill`. Against `_paged_attention` (paged_kernels.py, which packs a KV group's heads into 16-row tiles
for decode), this kernel's tiles are FlashAttention-2's: 64-128 queries of one head by 32-128 keys, and its key
loop comes in up to three parts, so the causal and window masks are computed only where they cut a tile:

1. from the window's start, the key blocks that some query of the tile sees and some does not (masked);
2. the blocks every query of the tile sees (no causal or window mask: only unmapped block-table entries are
   masked, a column test);
3. the diagonal: blocks past the tile's first query's position, up to its last one's (masked).
Blocks past the tile's last query are never visited (above the diagonal). Without a window part 1 is empty; not
causal, part 3 holds only the row's last partial block.

The tiles come from configs.PREFILL_CONFIGS, per GPU generation (sm_80, sm_90): `fitting_configs` keeps those
whose compiled shared memory fits the GPU (compiled for the target, without a GPU too), and on a GPU
`triton.autotune` times the survivors once per shape class and keeps the fastest. Under the interpreter, or with
`config=`, one configuration is used as given. FP8 caches (fp8.py) and every attention feature of the paged
op (rotary in the kernel, softcap, window, sinks, not causal) as paged_kernels.py has them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.configs import PREFILL_CONFIGS, SHARED_LIMITS, KernelConfig, block_d, generation
from llmc.plugins.gpu.fp8 import head_scale, load_kv
from llmc.plugins.gpu.kernels import INTERPRETED, fold_keys, rows, with_sink
from llmc.plugins.gpu.paged_kernels import find_row, kernel_options, sinks, slot_of, write_new_kv
from llmc.plugins.gpu.pipelining import KeyPipelining, key_pipelining


@triton.jit
def _key_block(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_ptr, b, kv, start_n, hi, pos, row_ok, d, d_ok, k_scale,
               MB, NB, BS, SCALE: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, SOFTCAP: tl.constexpr,
               WINDOW: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
               FP8_KV: tl.constexpr, MASKED: tl.constexpr, PAGE: tl.constexpr):
    """One block of keys from `start_n` folded into the tile's online softmax (kernels.fold_keys). MASKED: apply the
    causal and window masks (parts 1 and 3); otherwise only the keys' own validity (mapped, before `hi`: part 2,
    whose keys every query of the tile sees: its row mask a constant, which the compiler folds away)."""
    n = start_n + tl.arange(0, BLOCK_N)
    slot, mapped = slot_of(table_ptr, b, n, n < hi, MB, NB, BS, PAGE)
    at = ((slot * KVH + kv) * D)[:, None] + d[None, :]  # [N, D]: each key's channels contiguous, as stored
    kv_mask = mapped[:, None] & d_ok[None, :]
    k = load_kv(kc_ptr, at, kv_mask, FP8_KV)  # the cache's units (fp8.py): the key scale joins the logits'
    v = load_kv(vc_ptr, at, kv_mask, FP8_KV)
    if MASKED:
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, mapped, row_ok, pos, k_scale, SCALE, SOFTCAP, WINDOW,
                                  CAUSAL, DOT_PRECISION)
    else:
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k, v, n, mapped, row_ok | True, pos, k_scale, SCALE, SOFTCAP, 0,
                                  False, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _paged_prefill(q_ptr, kc_ptr, vc_ptr, cu_ptr, past_ptr, table_ptr, cos_ptr, sin_ptr, sink_ptr, ks_ptr, vs_ptr,
                   o_ptr, B, MB, NB, BS, SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                   HALF: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                   ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, SINKS: tl.constexpr,
                   FP8_KV: tl.constexpr, PAGE: tl.constexpr = 0):
    """One program per (tile of BLOCK_M queries of one row, query head). Rows are packed: program i belongs to the
    row whose first tile `cu[b] // BLOCK_M + b` is the last one <= i (prefill_grid covers any split of the
    tokens); a spare program finds no query of its row and writes nothing."""
    h = tl.program_id(1)
    kv = h // (H // KVH)
    b = find_row(cu_ptr, B, tl.program_id(0), 1, BLOCK_M, True)
    start = tl.load(cu_ptr + b)
    past = tl.load(past_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    first = (tl.program_id(0) - start // BLOCK_M - b) * BLOCK_M  # the tile's first query, in its row
    m = first + tl.arange(0, BLOCK_M)
    row_ok = (m >= 0) & (m < length)
    pos = past + m
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_at = ((start + m).to(tl.int64) * H + h)[:, None] * D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = rows(q_ptr, q_at, d, q_mask, pos, cos_ptr, sin_ptr, HALF, ROTARY, INTERLEAVED)
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)
    # the tile's queries: t0 .. t1 - 1 of the row (none for a spare program: every part below is empty)
    t0 = tl.maximum(first, 0)
    t1 = tl.maximum(tl.minimum(first + BLOCK_M, length), t0)
    if CAUSAL:
        hi = tl.where(t1 > t0, past + t1, 0)  # past the tile's last query: never visited
        all_see = past + t0 + 1  # keys before it are seen by every query of the tile
    else:
        hi = tl.where(t1 > t0, past + length, 0)
        all_see = hi
    lo = 0
    every = 0  # from here on every query of the tile is inside its window
    if WINDOW > 0:
        lo = tl.maximum(past + t0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        every = tl.maximum(past + t1 - WINDOW, 0)
    full_lo = tl.minimum(tl.cdiv(every, BLOCK_N) * BLOCK_N, hi)  # parts: [lo, full_lo) [full_lo, full_hi) [.., hi)
    full_hi = tl.maximum(tl.minimum(all_see, hi) // BLOCK_N * BLOCK_N, full_lo)
    k_scale = head_scale(ks_ptr, kv, FP8_KV)
    v_scale = head_scale(vs_ptr, kv, FP8_KV)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WINDOW > 0:
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _key_block(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_ptr, b, kv, start_n, hi, pos, row_ok, d,
                                       d_ok, k_scale, MB, NB, BS, SCALE, KVH, D, SOFTCAP, WINDOW, CAUSAL,
                                       BLOCK_N, DOT_PRECISION, FP8_KV, True, PAGE)
    for step in range(0, (full_hi - full_lo) // BLOCK_N):  # counted from 0: Triton pipelines a trip count's loads
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_ptr, b, kv, full_lo + step * BLOCK_N, hi,
                                   pos, row_ok, d, d_ok, k_scale, MB, NB, BS, SCALE, KVH, D, SOFTCAP, WINDOW,
                                   CAUSAL, BLOCK_N, DOT_PRECISION, FP8_KV, False, PAGE)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_ptr, b, kv, start_n, hi, pos, row_ok, d,
                                   d_ok, k_scale, MB, NB, BS, SCALE, KVH, D, SOFTCAP, WINDOW, CAUSAL,
                                   BLOCK_N, DOT_PRECISION, FP8_KV, True, PAGE)
    if SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + h + 0 * m).to(tl.float32))
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # the values' fp8 scale (1 otherwise)
    tl.store(o_ptr + q_at + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)


def prefill_grid(tokens, rows, num_heads: int, block_m: int, cdiv=triton.cdiv):
    """(tiles over the rows' packed tokens, query heads): enough for any split of `tokens` among `rows`."""
    return cdiv(tokens, block_m) + rows, num_heads


def prefill_source(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, config: KernelConfig, *,
                   fp8_kv: bool = False, rotary_dim: int = 0, window: int = -1, softcap: float = 0.0,
                   sinks: bool = False):
    """(fn, signature, constexprs, config) of `_paged_prefill` for one model's shapes and a tile configuration:
    what fitting_configs compiles and the resource test checks (kernels_aot._compile's arguments)."""
    t = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    cache = "*u8" if fp8_kv else f"*{t}"
    signature = {"q_ptr": f"*{t}", "kc_ptr": cache, "vc_ptr": cache, **{n: "*i32" for n in ("cu_ptr", "past_ptr",
                                                                                              "table_ptr")},
                 **{n: f"*{t}" for n in ("cos_ptr", "sin_ptr", "sink_ptr", "o_ptr")}, "ks_ptr": "*fp32",
                 "vs_ptr": "*fp32", **{n: "i32" for n in ("B", "MB", "NB", "BS")}}
    options = kernel_options(torch.empty((1, num_heads * head_size), dtype=dtype),
                             torch.empty((1, 1, num_kv_heads, head_size), dtype=torch.float8_e4m3fn if fp8_kv
                                         else dtype), num_heads, num_kv_heads, 0.0,
                             torch.empty((1, rotary_dim // 2)) if rotary_dim else None, False, softcap, window, True,
                             torch.empty(num_heads) if sinks else None)
    constexprs = {n: v for n, v in options.items() if n in _paged_prefill.arg_names}
    constexprs.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, UPCAST=False)
    return _paged_prefill, signature, constexprs, config


@functools.lru_cache(maxsize=None)
def compiled_facts(capability: int, head_size: int, dtype: torch.dtype, fp8_kv: bool,
                   config: KernelConfig) -> tuple[int, KeyPipelining]:
    """(bytes of shared memory, key-loop pipelining) of `_paged_prefill` compiled for sm_<capability> with `config`,
    as a PyTorch launch specializes it (16-byte-aligned pointers: Triton buffers the pipelined loads). Compiles to
    PTX without a GPU (not under the interpreter, which replaces compiling); Triton caches the result on disk."""
    from llmc.plugins.gpu.kernels_aot import _compile

    fn, signature, constexprs, _ = prefill_source(8, 2, head_size, dtype, config, fp8_kv=fp8_kv)
    compiled = _compile(fn, signature, constexprs, capability, aligned=True, **config.launch())
    return compiled.metadata.shared, key_pipelining(compiled.asm["ttgir"], config.block_n, block_d(head_size))


def compiled_shared(capability: int, head_size: int, dtype: torch.dtype, fp8_kv: bool, config: KernelConfig) -> int:
    """Bytes of shared memory `_paged_prefill` states compiled for sm_<capability> with `config` (compiled_facts)."""
    return compiled_facts(capability, head_size, dtype, fp8_kv, config)[0]


def fitting_configs(capability: int, head_size: int, dtype: torch.dtype, fp8_kv: bool = False,
                    limit: int | None = None) -> tuple[KernelConfig, ...]:
    """The prefill configurations of `capability`'s generation (configs.PREFILL_CONFIGS) whose compiled shared
    memory stays within `limit` (default: the generation's per-block opt-in limit), in order of preference; for
    fp32, the last (smallest) one only."""
    limit = limit or SHARED_LIMITS[generation(capability)]
    candidates = PREFILL_CONFIGS[generation(capability)]
    if dtype.itemsize > 2:  # fp32 runs no tensor-core tiles worth tuning: the smallest (the larger ones' LLVM stage
        candidates = candidates[-1:]  # alone took 2-3 minutes at head 256)
    return tuple(c for c in candidates if compiled_shared(capability, head_size, dtype, fp8_kv, c) <= limit)


def _autotuned_configs(configs, named_args, **kwargs):
    """triton.autotune's early prune: the configurations that fit this GPU (fitting_configs), by tile size."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    fits = fitting_configs(props.major * 10 + props.minor, named_args["D"] if "D" in named_args else kwargs["D"],
                           named_args["q_ptr"].dtype, named_args["kc_ptr"].dtype == torch.uint8,
                           props.shared_memory_per_block_optin)
    wanted = {(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in fits}
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]


_TUNED = triton.autotune(
    configs=[triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                           num_stages=c.num_stages) for gen in PREFILL_CONFIGS.values() for c in gen],
    key=["H", "KVH", "D", "CAUSAL", "WINDOW", "FP8_KV"], prune_configs_by={"early_config_prune": _autotuned_configs},
)(_paged_prefill)


def paged_prefill(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                  num_heads: int, kv_num_heads: int, scale: float = 0.0, cos_cache=None, sin_cache=None, *,
                  slot_mapping=None, rotary_interleaved: bool = False, softcap: float = 0.0,
                  local_window_size: int = -1, is_causal: bool = True, head_sink=None, k_scale=None, v_scale=None,
                  config: KernelConfig | None = None):
    """`reference_paged_attention` through the prefill kernel (any rows; made for prompt chunks): the new keys and
    values written into the blocks (in place), then FlashAttention-2 tiles over them; returns (output [T, H*D],
    key_cache, value_cache). `config`: the tiles (default: autotuned on a GPU, configs.PREFILL_CONFIGS[90][0]'s
    128 x 128 under the interpreter)."""
    w = write_new_kv(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
                     num_heads, kv_num_heads, scale, cos_cache, sin_cache, slot_mapping, rotary_interleaved, softcap,
                     local_window_size, is_causal, head_sink, k_scale, v_scale)
    query, options, tokens, rows = w.query, w.options, w.tokens, w.rows
    out = torch.empty_like(query)
    if not tokens:
        return out, key_cache, value_cache
    constexprs = {n: v for n, v in options.items() if n in _paged_prefill.arg_names and n not in ("BLOCK_M", "BLOCK_N")}
    args = (query, w.kc, w.vc, w.cu, w.past, w.table, w.cos, w.sin, sinks(head_sink, num_heads, query), w.k_scale,
            w.v_scale, out, *w.scalars)
    if config is None and query.is_cuda and not INTERPRETED:
        _TUNED[lambda meta: prefill_grid(tokens, rows, num_heads, meta["BLOCK_M"])](*args, **constexprs)
    else:
        config = config or PREFILL_CONFIGS[90][0]
        _paged_prefill[prefill_grid(tokens, rows, num_heads, config.block_m)](
            *args, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **constexprs, **config.launch())
    return out, key_cache, value_cache
