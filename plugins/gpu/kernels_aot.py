"""`llmc::attention` in a single kernel launch, and the kernels compiled ahead of time to PTX.

A TensorRT ahead-of-time plugin (`@trtp.aot_impl`) hands TensorRT one kernel per layer, so the
three launches of kernels.py (rotary + cache write, attention, split merge) do not fit it.
`_attention_one_launch` is the whole op in one: its rows pack the query heads of a KV group (each
KV head's keys are loaded once for all of them, and a decode step fills a block with the group's
heads), and it reads the new keys and values from the inputs rather than the cache, so no program
waits for another's cache write; the programs holding a group's first head write the new entries.
No key splitting: at serving batch sizes batch x KV heads already gives a GPU enough programs.
The attention features are kernels.py's: partial rotary (HALF = the tables' width), softcap and window as
compile-time constants, sinks read from the head_sink input (a placeholder the kernel skips when SINKS is off,
since the plugin's inputs are fixed).

`compile_ptx` compiles every kernel for one model's shapes and a GPU generation without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.configs import DECODE_BLOCK, attention_config, default_config
from llmc.plugins.gpu.kernels import (_decode_reduce, _decode_split, _prefill, _rope_write, capped, rotated,
                                      softmax_block, with_sink)
from llmc.plugins.gpu.ptx import PTX_ISA, entry_params, plain_target, trim_params  # noqa: F401  (entry_params: API)


@triton.jit
def _attention_one_launch(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, sink_ptr, S, C,
                          o_ptr, kc_out, vc_out,
                          SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                          SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr):
    """One program per (query-row block, b * KVH + kv head); rows are (new token s, query head of
    the group) pairs. Keys before the row's position come from the cache, the new ones straight from
    the inputs (rotated on the fly over the tables' 2 * HALF channels).

    Parameters are in TensorRT's AOT-plugin calling convention: the plugin's input tensors (query,
    key, value, k_cache, v_cache, cache_position, cos, sin, head_sink), then integer scalars (S, C), then
    its output tensors (output, k_cache', v_cache' — the caches aliased to the inputs, so the same
    memory); the softmax scale, softcap and window are compile-time constants (AOT extra arguments are
    integers only), SINKS says whether head_sink is read (else it is a placeholder)."""
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
    if ROTARY:
        q = rotated(q_ptr, q_off, d, q_mask, pos + s, cos_ptr, sin_ptr, HALF, False)
    else:
        q = tl.load(q_ptr + q_off + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = pos + tl.minimum(tl.max(tl.where(row_ok, s, 0), 0) + 1, S)  # keys any row here can see
    first = 0
    if WINDOW > 0:  # the first row's window (rows are in token order)
        first = tl.maximum(pos + start_m // G - WINDOW + 1, 0)
    cache = (b * KVH + kv) * C * D
    for start_n in range(first, last, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        old = n < pos
        new_s = n - pos  # row of the new-token inputs for keys at or past the position
        fresh = (n >= pos) & (n < last)
        mask_old = old[:, None] & d_ok[None, :]
        mask_new = fresh[:, None] & d_ok[None, :]
        new_off = ((b * S + new_s) * KVH + kv)[:, None] * D
        k = tl.load(kc_ptr + cache + n[:, None] * D + d[None, :], mask=mask_old, other=0.0).to(tl.float32)
        if ROTARY:
            k_new = rotated(k_ptr, new_off, d, mask_new, n, cos_ptr, sin_ptr, HALF, False)
        else:
            k_new = tl.load(k_ptr + new_off + d[None, :], mask=mask_new, other=0.0).to(tl.float32)
        k = tl.where(mask_new, k_new.to(kc_ptr.dtype.element_ty).to(tl.float32), k)  # as the cache will hold it
        v = tl.load(vc_ptr + cache + n[:, None] * D + d[None, :], mask=mask_old, other=0.0)
        v = tl.where(mask_new, tl.load(v_ptr + new_off + d[None, :], mask=mask_new, other=0.0), v)
        if not UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            v = v.to(tl.float32)
        scores = capped(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE, SOFTCAP)
        visible = (n[None, :] <= (pos + s)[:, None]) & row_ok[:, None]
        if WINDOW > 0:
            visible = visible & (n[None, :] > (pos + s)[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SINKS:
        acc, l_i = with_sink(acc, m_i, l_i, tl.load(sink_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32))
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_off + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)
    # the new keys and values into the cache: once per token, by the row holding the group's first head
    writer = row_ok & (r % G == 0)
    w_mask = writer[:, None] & d_ok[None, :]
    kv_off = ((b * S + s) * KVH + kv)[:, None] * D
    if ROTARY:
        k_w = rotated(k_ptr, kv_off, d, w_mask, pos + s, cos_ptr, sin_ptr, HALF, False)
    else:
        k_w = tl.load(k_ptr + kv_off + d[None, :], mask=w_mask, other=0.0).to(tl.float32)
    slot = cache + (pos + s)[:, None] * D + d[None, :]
    tl.store(kc_out + slot, k_w.to(kc_out.dtype.element_ty), mask=w_mask)
    tl.store(vc_out + slot, tl.load(v_ptr + kv_off + d[None, :], mask=w_mask, other=0.0), mask=w_mask)


def one_launch_attention(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None,
                         head_sink=None, softcap: float = 0.0, local_window_size: int = -1):
    """`llmc::attention` in one kernel launch (the TensorRT plugin's kernel), caches updated in place."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    assert head_sink is None or head_sink.shape == (h,), f"head_sink is not [num_heads {h}]"
    rotary = cos_cache is not None
    out = torch.empty_like(query)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    config = attention_config(d, query.element_size(), fresh=True)
    grid = (triton.cdiv(s * (h // kvh), config.block_m), b * kvh)
    _attention_one_launch[grid](query, key, value, k_cache, v_cache, cache_position,
                                cos_cache if rotary else query, sin_cache if rotary else query,
                                head_sink.contiguous() if head_sink is not None else query, s, capacity,
                                out, k_cache, v_cache, float(scale), h, kvh, d, cos_cache.shape[1] if rotary else 1,
                                config.block_m, config.block_n, triton.next_power_of_2(d), rotary, precision, upcast,
                                float(softcap), int(local_window_size), head_sink is not None, **config.launch())
    return out


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
PLUGIN_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "sink_ptr")
PLUGIN_SCALARS = ("S", "C")
PLUGIN_OUTPUTS = ("o_ptr", "kc_out", "vc_out")
SHARED_MEM_LIMIT = 48 * 1024  # what a kernel launch gets without opting in to more


@dataclass(frozen=True)
class PluginKernel:
    """The one-launch kernel compiled for one model and GPU generation, as `@trtp.aot_impl` returns it."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int

    def grid(self, tokens, batch, num_heads: int, num_kv_heads: int, cdiv=triton.cdiv):
        """(grid_x, grid_y) for `tokens` new tokens per row and `batch` rows; works on ints and on
        TensorRT's symbolic shape expressions alike (pass `trtp.cdiv`)."""
        return cdiv(tokens * (num_heads // num_kv_heads), self.block_m), batch * num_kv_heads


def _compile(fn, signature: dict[str, str], constexprs: dict, capability: int, *, aligned: bool = False, **options):
    """`fn` compiled for sm_<capability> without a GPU. `aligned`: as a launch from PyTorch specializes it, on
    pointers 16-byte aligned (torch's allocations are), which lets Triton turn the loop's loads into buffered
    asynchronous copies: the larger shared-memory footprint of the two. `options`: Triton's (num_warps,
    num_stages, ptx_version)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    ordered = {arg: signature[arg] for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if aligned and ordered[arg].startswith("*")}
    constants = {(fn.arg_names.index(c),): v for c, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=ordered, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options or None)


def compile_for_plugin(fn, source: tuple[dict, dict], capability: int, what: str, config):
    """`fn` compiled for a TensorRT AOT plugin launch with `config` (configs.py, the PyTorch launch's too), its
    PTX for ISA PTX_ISA (ptx.py: what every CUDA 12 driver reads): within the shared memory a launch gets and
    needing no Triton scratch memory, which a plugin cannot provide; `what` names the kernel and shape in the
    errors."""
    compiled = _compile(fn, *source, capability, ptx_version=PTX_ISA, **config.launch())
    meta = compiled.metadata
    if meta.shared > SHARED_MEM_LIMIT:
        raise ValueError(f"{what} needs {meta.shared} bytes of shared memory, over the {SHARED_MEM_LIMIT} a plugin "
                         "launch gets")
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{meta.name} needs Triton scratch memory, which a TensorRT AOT plugin cannot provide")
    return compiled


_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}


def _one_launch_source(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, t: str, rotary: bool,
                       position_type: str, rotary_dim: int | None = None, softcap: float = 0.0, window: int = -1,
                       sinks: bool = False):
    config = attention_config(head_dim, _ITEMSIZE[t], fresh=True)
    signature = {**{n: f"*{t}" for n in PLUGIN_INPUTS + PLUGIN_OUTPUTS}, "pos_ptr": f"*{position_type}",
                 **{n: "i32" for n in PLUGIN_SCALARS}}
    constexprs = {"SCALE": float(scale), "H": num_heads, "KVH": num_kv_heads, "D": head_dim,
                  "HALF": (rotary_dim or head_dim) // 2 if rotary else 1,
                  "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "ROTARY": rotary, "DOT_PRECISION": "ieee" if t == "fp32" else "tf32", "UPCAST": False,
                  "SOFTCAP": float(softcap), "WINDOW": int(window), "SINKS": bool(sinks)}
    return signature, constexprs, config


def plugin_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str, capability: int, *,
                  rotary: bool, rotary_dim: int | None = None, softcap: float = 0.0, window: int = -1,
                  sinks: bool = False) -> PluginKernel:
    """The plugin's kernel for `dtype` ("fp16", "bf16", "fp32") on sm_<capability>, for rotary over
    `rotary_dim` channels (default: all), a logit softcap, a window and sinks as the node sets them.
    TensorRT launches it with exactly its inputs, integer extras and outputs, so the parameters the PTX
    declares after those (the global/profile scratch pointers newer Tritons append, unused here) are removed;
    its target is the plain sm_<capability> (ptx.py), which later GPUs run too."""
    signature, constexprs, config = _one_launch_source(num_heads, num_kv_heads, head_dim, scale, dtype, rotary, "i32",
                                                       rotary_dim, softcap, window, sinks)
    what = f"the attention kernel for head_dim {head_dim} ({dtype})"
    compiled = compile_for_plugin(_attention_one_launch, (signature, constexprs), capability, what, config)
    meta = compiled.metadata
    ptx = trim_params(compiled.asm["ptx"], meta.name, len(PLUGIN_INPUTS + PLUGIN_SCALARS + PLUGIN_OUTPUTS))
    return PluginKernel(meta.name, plain_target(ptx, what), meta.num_warps, meta.shared, config.block_m)


def kernel_sources(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, rotary: bool,
                   splits: int = 8, position_type: str = "i32", scale: float = 0.125, rotary_dim: int | None = None,
                   softcap: float = 0.0, window: int = -1, sinks: bool = False) -> dict[str, tuple]:
    """Every kernel of this module for one model's shapes and attention features, as (fn, signature,
    constexprs, config): what compile_ptx compiles and the resource test checks."""
    t = _TRITON_TYPES[dtype]
    block_d = triton.next_power_of_2(head_dim)
    heads = {"H": num_heads, "KVH": num_kv_heads, "D": head_dim}
    features = {"SOFTCAP": float(softcap), "WINDOW": int(window)}
    prefill = attention_config(head_dim, _ITEMSIZE[t], fresh=False)
    return {
        "rope_write": (_rope_write, {**{n: f"*{t}" for n in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "qo_ptr",
                                                             "cos_ptr", "sin_ptr")},
                                     "pos_ptr": f"*{position_type}", "S": "i32", "C": "i32"},
                       {**heads, "HALF": (rotary_dim or head_dim) // 2, "BLOCK_D": block_d, "ROTARY": rotary},
                       default_config()),  # no loop over keys: Triton's defaults, as its PyTorch launch uses
        "prefill": (_prefill, {**{n: f"*{t}" for n in ("q_ptr", "kc_ptr", "vc_ptr", "o_ptr", "sink_ptr")},
                               "pos_ptr": f"*{position_type}", "scale": "fp32", "S": "i32", "C": "i32"},
                    {**heads, "BLOCK_M": prefill.block_m, "BLOCK_N": prefill.block_n, "BLOCK_D": block_d,
                     "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": False, **features,
                     "SINKS": sinks}, prefill),
        "decode_split": (_decode_split, {**{n: f"*{t}" for n in ("q_ptr", "kc_ptr", "vc_ptr")},
                                         **{n: "*fp32" for n in ("part_acc", "part_m", "part_l")},
                                         "pos_ptr": f"*{position_type}", "scale": "fp32", "C": "i32",
                                         "keys_per_split": "i32"},
                         {**heads, "SPLITS": splits, "BLOCK_N": DECODE_BLOCK, "BLOCK_D": block_d, **features},
                         default_config()),
        "decode_reduce": (_decode_reduce, {**{n: "*fp32" for n in ("part_acc", "part_m", "part_l")},
                                           **{n: f"*{t}" for n in ("o_ptr", "sink_ptr")}},
                          {"H": num_heads, "D": head_dim, "SPLITS": splits, "BLOCK_D": block_d, "SINKS": sinks},
                          default_config()),
        "attention_one_launch": (_attention_one_launch,
                                 *_one_launch_source(num_heads, num_kv_heads, head_dim, scale, t, rotary,
                                                     position_type, rotary_dim, softcap, window, sinks)),
    }


def compile_ptx(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capability: int,
                **features) -> dict[str, str]:
    """PTX of every kernel for one model's shapes, attention features (kernel_sources' keywords) and a GPU
    generation (80: A100, 90: H100), compiled ahead of time without a GPU, each with its configuration, for
    PTX ISA PTX_ISA and the plain target."""
    return {name: plain_target(_compile(fn, signature, constexprs, capability, ptx_version=PTX_ISA,
                                        **config.launch()).asm["ptx"], name)
            for name, (fn, signature, constexprs, config) in
            kernel_sources(num_heads, num_kv_heads, head_dim, dtype, **features).items()}
