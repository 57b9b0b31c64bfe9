"""`llmc::attention` in a single kernel launch, and the kernels compiled ahead of time to PTX.

A TensorRT ahead-of-time plugin (`@trtp.aot_impl`) hands TensorRT one kernel per layer, so the
three launches of kernels.py (rotary + cache write, attention, split merge) do not fit it.
`_attention_one_launch` is the whole op in one: its rows pack the query heads of a KV group (each
KV head's keys are loaded once for all of them, and a decode step fills a block with the group's
heads), and it reads the new keys and values from the inputs rather than the cache, so no program
waits for another's cache write; the programs holding a group's first head write the new entries.
No key splitting: at serving batch sizes batch x KV heads already gives a GPU enough programs.

`compile_ptx` compiles every kernel for one model's shapes and a GPU generation without a GPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.kernels import (BLOCK_M, BLOCK_N, DECODE_BLOCK, _decode_reduce, _decode_split, _prefill,
                                  _rope_write, softmax_block)


@triton.jit
def _attention_one_launch(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr, S, C,
                          o_ptr, kc_out, vc_out,
                          SCALE: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program per (query-row block, b * KVH + kv head); rows are (new token s, query head of
    the group) pairs. Keys before the row's position come from the cache, the new ones straight from
    the inputs (rotated on the fly).

    Parameters are in TensorRT's AOT-plugin calling convention: the plugin's input tensors (query,
    key, value, k_cache, v_cache, cache_position, cos, sin), then integer scalars (S, C), then its
    output tensors (output, k_cache', v_cache' — the caches aliased to the inputs, so the same
    memory); the softmax scale is a compile-time constant (AOT extra arguments are integers only)."""
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
    if ROTARY:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    q_off = ((b * S + s) * H + head)[:, None] * D
    q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if ROTARY:
        qpos = pos + s
        cos = tl.load(cos_ptr + qpos[:, None] * HALF + (d % HALF)[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        sin = tl.load(sin_ptr + qpos[:, None] * HALF + (d % HALF)[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_partner = tl.load(q_ptr + q_off + partner[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q = q * cos.to(tl.float32) + sign[None, :] * q_partner.to(tl.float32) * sin.to(tl.float32)
    if not UPCAST:
        q = q.to(q_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = pos + tl.minimum(tl.max(tl.where(row_ok, s, 0), 0) + 1, S)  # keys any row here can see
    cache = (b * KVH + kv) * C * D
    for start_n in range(0, last, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        old = n < pos
        new_s = n - pos  # row of the new-token inputs for keys at or past the position
        fresh = (n >= pos) & (n < last)
        mask_old = old[:, None] & d_ok[None, :]
        mask_new = fresh[:, None] & d_ok[None, :]
        new_off = ((b * S + new_s) * KVH + kv)[:, None] * D
        k = tl.load(kc_ptr + cache + n[:, None] * D + d[None, :], mask=mask_old, other=0.0).to(tl.float32)
        k_new = tl.load(k_ptr + new_off + d[None, :], mask=mask_new, other=0.0).to(tl.float32)
        if ROTARY:
            kcos = tl.load(cos_ptr + n[:, None] * HALF + (d % HALF)[None, :], mask=mask_new, other=0.0).to(tl.float32)
            ksin = tl.load(sin_ptr + n[:, None] * HALF + (d % HALF)[None, :], mask=mask_new, other=0.0).to(tl.float32)
            k_partner = tl.load(k_ptr + new_off + partner[None, :], mask=mask_new, other=0.0).to(tl.float32)
            k_new = k_new * kcos + sign[None, :] * k_partner * ksin
        k = tl.where(mask_new, k_new.to(kc_ptr.dtype.element_ty).to(tl.float32), k)  # as the cache will hold it
        v = tl.load(vc_ptr + cache + n[:, None] * D + d[None, :], mask=mask_old, other=0.0)
        v = tl.where(mask_new, tl.load(v_ptr + new_off + d[None, :], mask=mask_new, other=0.0), v)
        if not UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * SCALE
        visible = (n[None, :] <= (pos + s)[:, None]) & row_ok[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_new, l_i = softmax_block(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + q_off + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # the new keys and values into the cache: once per token, by the row holding the group's first head
    writer = row_ok & (r % G == 0)
    w_mask = writer[:, None] & d_ok[None, :]
    kv_off = ((b * S + s) * KVH + kv)[:, None] * D
    k_w = tl.load(k_ptr + kv_off + d[None, :], mask=w_mask, other=0.0).to(tl.float32)
    if ROTARY:
        wcos = tl.load(cos_ptr + (pos + s)[:, None] * HALF + (d % HALF)[None, :], mask=w_mask, other=0.0)
        wsin = tl.load(sin_ptr + (pos + s)[:, None] * HALF + (d % HALF)[None, :], mask=w_mask, other=0.0)
        k_wp = tl.load(k_ptr + kv_off + partner[None, :], mask=w_mask, other=0.0).to(tl.float32)
        k_w = k_w * wcos.to(tl.float32) + sign[None, :] * k_wp * wsin.to(tl.float32)
    slot = cache + (pos + s)[:, None] * D + d[None, :]
    tl.store(kc_out + slot, k_w.to(kc_out.dtype.element_ty), mask=w_mask)
    tl.store(vc_out + slot, tl.load(v_ptr + kv_off + d[None, :], mask=w_mask, other=0.0), mask=w_mask)


def one_launch_attention(query, key, value, k_cache, v_cache, cache_position, scale, cos_cache=None, sin_cache=None):
    """`llmc::attention` in one kernel launch (the TensorRT plugin's kernel), caches updated in place."""
    b, s, h, d = query.shape
    kvh, capacity = key.shape[2], k_cache.shape[2]
    assert h % kvh == 0 and k_cache.shape == v_cache.shape == (b, kvh, capacity, d), (query.shape, k_cache.shape)
    rotary = cos_cache is not None
    out = torch.empty_like(query)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(s * (h // kvh), BLOCK_M), b * kvh)
    _attention_one_launch[grid](query, key, value, k_cache, v_cache, cache_position,
                                cos_cache if rotary else query, sin_cache if rotary else query, s, capacity,
                                out, k_cache, v_cache, float(scale), h, kvh, d, d // 2, BLOCK_M, BLOCK_N,
                                triton.next_power_of_2(d), rotary, precision, upcast)
    return out


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
PLUGIN_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "pos_ptr", "cos_ptr", "sin_ptr")
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


def _compile(fn, signature: dict[str, str], constexprs: dict, capability: int, **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    ordered = {arg: signature[arg] for arg in fn.arg_names}
    source = ASTSource(fn=fn, signature=ordered, constexprs={(fn.arg_names.index(c),): v for c, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options or None)


def compile_for_plugin(fn, source: tuple[dict, dict], capability: int, what: str):
    """`fn` compiled for a TensorRT AOT plugin launch: within the shared memory a launch gets (fp32 tiles
    retry without software pipelining, which buffers too much) and needing no Triton scratch memory,
    which a plugin cannot provide; `what` names the kernel and shape in the errors."""
    compiled = _compile(fn, *source, capability)
    if compiled.metadata.shared > SHARED_MEM_LIMIT:
        compiled = _compile(fn, *source, capability, num_stages=1)
    meta = compiled.metadata
    if meta.shared > SHARED_MEM_LIMIT:
        raise ValueError(f"{what} needs {meta.shared} bytes of shared memory, over the {SHARED_MEM_LIMIT} a plugin "
                         "launch gets")
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{meta.name} needs Triton scratch memory, which a TensorRT AOT plugin cannot provide")
    return compiled


def _one_launch_source(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, t: str, rotary: bool,
                       position_type: str):
    signature = {**{n: f"*{t}" for n in PLUGIN_INPUTS + PLUGIN_OUTPUTS}, "pos_ptr": f"*{position_type}",
                 **{n: "i32" for n in PLUGIN_SCALARS}}
    constexprs = {"SCALE": float(scale), "H": num_heads, "KVH": num_kv_heads, "D": head_dim, "HALF": head_dim // 2,
                  "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "ROTARY": rotary, "DOT_PRECISION": "ieee" if t == "fp32" else "tf32", "UPCAST": False}
    return signature, constexprs


def plugin_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str, capability: int, *,
                  rotary: bool) -> PluginKernel:
    """The plugin's kernel for `dtype` ("fp16", "bf16", "fp32") on sm_<capability>. TensorRT launches
    it with exactly its inputs, integer extras and outputs, so the parameters the PTX declares after
    those (the global/profile scratch pointers newer Tritons append, unused here) are removed."""
    source = _one_launch_source(num_heads, num_kv_heads, head_dim, scale, dtype, rotary, "i32")
    compiled = compile_for_plugin(_attention_one_launch, source, capability,
                                  f"the attention kernel for head_dim {head_dim} ({dtype})")
    meta = compiled.metadata
    ptx = trim_params(compiled.asm["ptx"], meta.name, len(PLUGIN_INPUTS + PLUGIN_SCALARS + PLUGIN_OUTPUTS))
    return PluginKernel(meta.name, ptx, meta.num_warps, meta.shared, BLOCK_M)


_PARAM = re.compile(r"\.param\s+(\.\w+)\s+(?:\.ptr\s+\S+\s+)?(?:\.align\s+\d+\s+)?(\w+)")


def _entry(ptx: str, kernel_name: str) -> re.Match:
    header = re.search(rf"(\.entry\s+{re.escape(kernel_name)}\s*\()(.*?)(\))", ptx, re.S)
    if header is None:
        raise ValueError(f"no .entry {kernel_name} in the PTX")
    return header


def entry_params(ptx: str, kernel_name: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of the PTX entry `kernel_name`, in order."""
    return [m.groups() for p in _entry(ptx, kernel_name).group(2).split(",") if (m := _PARAM.search(p))]


def trim_params(ptx: str, kernel_name: str, count: int) -> str:
    """Keep the first `count` parameters of the PTX entry `kernel_name`; the ones after them (the
    global/profile scratch pointers newer Tritons append) must be unused by the body, and go."""
    header = _entry(ptx, kernel_name)
    params, body = header.group(2).split(","), ptx[header.end():]
    for extra in params[count:]:
        name = _PARAM.search(extra).group(2)
        if re.search(rf"\[{re.escape(name)}(\+\d+)?\]", body):
            raise ValueError(f"{kernel_name} reads its parameter {name} beyond the first {count}")
    return ptx[:header.start(2)] + ",".join(params[:count]).rstrip() + "\n" + ptx[header.end(2):]


def compile_ptx(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, capability: int, *,
                rotary: bool, splits: int = 8, position_type: str = "i32", scale: float = 0.125) -> dict[str, str]:
    """PTX of every kernel for one model's shapes and a GPU generation (80: A100, 90: H100), compiled
    ahead of time without a GPU. `position_type` is the cache_position element type (the plugin
    node carries int32)."""
    t = _TRITON_TYPES[dtype]
    block_d = triton.next_power_of_2(head_dim)
    heads = {"H": num_heads, "KVH": num_kv_heads, "D": head_dim}
    kernels = {
        "rope_write": (_rope_write, {**{n: f"*{t}" for n in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "qo_ptr",
                                                             "cos_ptr", "sin_ptr")},
                                     "pos_ptr": f"*{position_type}", "S": "i32", "C": "i32"},
                       {**heads, "HALF": head_dim // 2, "BLOCK_D": block_d, "ROTARY": rotary}),
        "prefill": (_prefill, {**{n: f"*{t}" for n in ("q_ptr", "kc_ptr", "vc_ptr", "o_ptr")},
                               "pos_ptr": f"*{position_type}", "scale": "fp32", "S": "i32", "C": "i32"},
                    {**heads, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_D": block_d,
                     "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": False}),
        "decode_split": (_decode_split, {**{n: f"*{t}" for n in ("q_ptr", "kc_ptr", "vc_ptr")},
                                         **{n: "*fp32" for n in ("part_acc", "part_m", "part_l")},
                                         "pos_ptr": f"*{position_type}", "scale": "fp32", "C": "i32",
                                         "keys_per_split": "i32"},
                         {**heads, "SPLITS": splits, "BLOCK_N": DECODE_BLOCK, "BLOCK_D": block_d}),
        "decode_reduce": (_decode_reduce, {**{n: "*fp32" for n in ("part_acc", "part_m", "part_l")}, "o_ptr": f"*{t}"},
                          {"D": head_dim, "SPLITS": splits, "BLOCK_D": block_d}),
        "attention_one_launch": (_attention_one_launch,
                                 *_one_launch_source(num_heads, num_kv_heads, head_dim, scale, t, rotary,
                                                     position_type)),
    }
    return {name: _compile(fn, signature, constexprs, capability).asm["ptx"]
            for name, (fn, signature, constexprs) in kernels.items()}
