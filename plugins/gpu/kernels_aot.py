"""The attention kernels compiled ahead of time to PTX, without a GPU: for the TensorRT plugin (`plugin_kernel`:
one_launch.py's kernel, the whole op in one launch, cut to TensorRT's calling convention) and for inspection
and the resource test (`kernel_sources`, `compile_ptx`: the one-launch kernel with and without key splits,
over a 16-bit or an fp8 cache).

The plugin's kernel splits keys (split_kv.py) when its launch's grid leaves the GPU idle: its workspace and counters,
which an ahead-of-time plugin cannot get from TensorRT, are two more inputs, engine inputs bound once by the runner
(compiler/tensorrt/split_kv.py, docs/tensorrt.md), aliased to two more outputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton

from llmc.plugins.gpu.configs import attention_config
from llmc.plugins.gpu.one_launch import _attention_one_launch, one_launch_attention  # noqa: F401  (API)
from llmc.plugins.gpu.ptx import PTX_ISA, entry_params, plain_target, trim_params  # noqa: F401  (entry_params: API)
from llmc.plugins.gpu.slot_prefill import PLUGIN_PREFILL_CONFIGS, _slot_prefill, slot_prefill_grid
from llmc.plugins.gpu.split_kv import plugin_splits


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
PLUGIN_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "sink_ptr", "part_ptr",
                 "lock_ptr")
PLUGIN_SCALARS = ("S", "C")
PLUGIN_OUTPUTS = ("o_ptr", "kc_out", "vc_out", "part_out", "lock_out")
# the split workspace and counters, inputs and their aliased outputs (read only with SPLITS > 1), then, after the
# outputs, an fp8 cache's per-KV-head scales, read only with FP8_KV (a plugin's PTX drops them with Triton's scratch
# pointers: trim_params)
BUFFER_PARAMS = {"part_ptr": "*fp32", "lock_ptr": "*i32", "part_out": "*fp32", "lock_out": "*i32",
                 "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
CACHES = ("kc_ptr", "vc_ptr", "kc_out", "vc_out")
SHARED_MEM_LIMIT = 48 * 1024  # what a kernel launch gets without opting in to more


@dataclass(frozen=True)
class PluginKernel:
    """The one-launch kernel compiled for one model and GPU generation, as `@trtp.aot_impl` returns it."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int
    splits: int = 1  # the most key splits a launch takes (the node's key_splits)
    slots: int = 0  # the partials its workspace holds (split_slots)
    prefill: bool = False  # slot_prefill.py's kernel: BLOCK_M tokens of one query head a program

    def grid(self, tokens, batch, num_heads: int, num_kv_heads: int, capacity, cdiv=triton.cdiv, **ops):
        """(grid_x, grid_y, key splits) for `tokens` new tokens per row, `batch` rows and a cache of `capacity`
        tokens a row; works on ints and on TensorRT's symbolic shape expressions alike (pass `trtp.cdiv` and
        split_kv.plugin_splits' `minimum`, `maximum`, `constant` as TensorRT's)."""
        if self.prefill:
            return slot_prefill_grid(tokens, batch, num_heads, self.block_m, cdiv)
        x, y = cdiv(tokens * (num_heads // num_kv_heads), self.block_m), batch * num_kv_heads
        return x, y, plugin_splits(x * y, capacity, self.splits, self.slots, **ops)


def _compile(fn, signature: dict[str, str], constexprs: dict, capability: int, *, aligned: bool = False, **options):
    """`fn` compiled for sm_<capability> without a GPU (its constexprs' defaults for those `constexprs` leaves out),
    to PTX (no_cubin): what a plugin hands TensorRT, and what the checks read (shared memory, IR, PTX). The cubin
    Triton would assemble is of its arch-specific PTX (sm_90a), which ships nowhere; the plugin's own PTX, on the
    plain target, is assembled by tests/gpu/test_ptx_target.py. `aligned`: as a launch from PyTorch specializes
    it, on pointers 16-byte aligned (torch's allocations are), which lets Triton turn the loop's loads into
    buffered asynchronous copies: the larger shared-memory footprint of the two. `options`: Triton's
    (num_warps, num_stages, ptx_version)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a compile-time constant left out takes its default (PAGE, the paged kernels' block size: 0, read at run time)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default
                     and p.name not in signature}, **constexprs}
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    ordered = {arg: signature[arg] for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if aligned and ordered[arg].startswith("*")}
    constants = {(fn.arg_names.index(c),): v for c, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=ordered, constexprs=constants, attrs=attrs)
    with no_cubin():
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


def plugin_config(fn, source_for, capability: int, configs, what: str):
    """The first of `configs` whose kernel, compiled for a plugin launch on sm_<capability> (`source_for(config)`:
    its signature and constexprs), fits the shared memory a plugin launch gets. The one chosen is compile_for_plugin's
    next compile, which Triton's cache then answers."""
    for config in configs:
        compiled = _compile(fn, *source_for(config), capability, ptx_version=PTX_ISA, **config.launch())
        if compiled.metadata.shared <= SHARED_MEM_LIMIT:
            return config
    raise ValueError(f"{what} fits the {SHARED_MEM_LIMIT} bytes of shared memory a plugin launch gets in none of "
                     f"{configs}")


@contextlib.contextmanager
def no_cubin():
    """Triton's compile without its last stage, ptxas (the shared memory a kernel needs is fixed at the LLVM stage;
    ptxas took minutes and 1.7 GB for the widest prefill tiles, which are the ones pruned, and a tenth to a quarter
    of every other compile here): the cubin stage replaced by an empty binary through Triton's stage hook
    (`knobs.runtime.add_stages_inspection_hook`, which also changes the cache key, so no real kernel's cache entry
    is shadowed). Written by hand: Triton has no "stop at PTX" option. A Triton without the hook compiles in full."""
    runtime = triton.knobs.runtime
    if not hasattr(runtime, "add_stages_inspection_hook"):
        yield
        return

    def hook(*args):
        if not args:  # asked for its part of the cache key
            return "llmc-no-cubin", "llmc-no-cubin"
        args[1]["cubin"] = lambda src, metadata: b""

    saved = runtime.add_stages_inspection_hook
    runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        runtime.add_stages_inspection_hook = saved


_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}


def _one_launch_source(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, t: str, rotary: bool,
                       position_type: str, rotary_dim: int | None = None, softcap: float = 0.0, window: int = -1,
                       sinks: bool = False, splits: int = 1, fp8_kv: bool = False):
    config = attention_config(head_dim, _ITEMSIZE[t], paged=False)
    signature = {**{n: f"*{t}" for n in PLUGIN_INPUTS + PLUGIN_OUTPUTS}, "pos_ptr": f"*{position_type}",
                 **{n: "i32" for n in PLUGIN_SCALARS}, **BUFFER_PARAMS,
                 **({n: "*u8" for n in CACHES} if fp8_kv else {})}  # an fp8 cache as bytes (fp8.py)
    constexprs = {"SCALE": float(scale), "H": num_heads, "KVH": num_kv_heads, "D": head_dim,
                  "HALF": (rotary_dim or head_dim) // 2 if rotary else 1,
                  "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": triton.next_power_of_2(head_dim),
                  "ROTARY": rotary, "DOT_PRECISION": "ieee" if t == "fp32" else "tf32", "UPCAST": False,
                  "SOFTCAP": float(softcap), "WINDOW": int(window), "SINKS": bool(sinks),
                  "SPLITS": splits, "FP8_KV": fp8_kv}
    return signature, constexprs, config


def plugin_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str, capability: int, *,
                  rotary: bool, rotary_dim: int | None = None, softcap: float = 0.0, window: int = -1,
                  sinks: bool = False, splits: int = 1, slots: int = 0) -> PluginKernel:
    """The plugin's kernel for `dtype` ("fp16", "bf16", "fp32") on sm_<capability>, for rotary over
    `rotary_dim` channels (default: all), a logit softcap, a window and sinks as the node sets them, and up to
    `splits` key splits over a workspace of `slots` partials (split_kv.py; the node's key_splits and split_slots).
    TensorRT launches it with exactly its inputs, integer extras and outputs, so the parameters the PTX
    declares after those (the fp8 scales, unused here, and the global/profile scratch pointers newer Tritons
    append) are removed; its target is the plain sm_<capability> (ptx.py), which later GPUs run too."""
    if splits > 1 and slots < 2:
        raise ValueError(f"a plugin kernel of {splits} key splits needs a workspace of 2 partials at least, not {slots}")
    signature, constexprs, config = _one_launch_source(num_heads, num_kv_heads, head_dim, scale, dtype, rotary, "i32",
                                                       rotary_dim, softcap, window, sinks, splits)
    what = f"the attention kernel for head_dim {head_dim} ({dtype})"
    compiled = compile_for_plugin(_attention_one_launch, (signature, constexprs), capability, what, config)
    meta = compiled.metadata
    ptx = trim_params(compiled.asm["ptx"], meta.name, len(PLUGIN_INPUTS + PLUGIN_SCALARS + PLUGIN_OUTPUTS))
    return PluginKernel(meta.name, plain_target(ptx, what), meta.num_warps, meta.shared, config.block_m, splits,
                        slots if splits > 1 else 0)


def plugin_prefill_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str,
                          capability: int, *, rotary: bool, rotary_dim: int | None = None, softcap: float = 0.0,
                          window: int = -1, sinks: bool = False) -> PluginKernel:
    """The plugin's prefill tactic (slot_prefill.py): plugin_kernel's arguments and calling convention, in the first
    of PLUGIN_PREFILL_CONFIGS' tiles whose compiled kernel fits the shared memory a plugin launch gets (measured
    without ptxas, no_cubin). For capability 90 and later it is compiled for sm_80: Triton gives tiles of
    64 rows Hopper's `wgmma`, which only the arch-specific sm_90a target has (ptx.py), and the engine's PTX must
    run on later GPUs too; sm_80's `mma.sync` runs on all of them."""
    signature, constexprs, _ = _one_launch_source(num_heads, num_kv_heads, head_dim, scale, dtype, rotary, "i32",
                                                  rotary_dim, softcap, window, sinks)
    del constexprs["SPLITS"]
    target = capability if capability < 90 else 80
    what = f"the prefill attention kernel for head_dim {head_dim} ({dtype})"

    def source(config):
        return signature, {**constexprs, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}

    config = plugin_config(_slot_prefill, source, target, PLUGIN_PREFILL_CONFIGS, what)
    compiled = compile_for_plugin(_slot_prefill, source(config), target, what, config)
    meta = compiled.metadata
    ptx = trim_params(compiled.asm["ptx"], meta.name, len(PLUGIN_INPUTS + PLUGIN_SCALARS + PLUGIN_OUTPUTS))
    return PluginKernel(meta.name, plain_target(ptx, what), meta.num_warps, meta.shared, config.block_m, prefill=True)


def kernel_sources(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, rotary: bool,
                   splits: int = 8, position_type: str = "i32", scale: float = 0.125, rotary_dim: int | None = None,
                   softcap: float = 0.0, window: int = -1, sinks: bool = False, fp8_kv: bool = False) -> dict[str, tuple]:
    """The slot cache's kernel for one model's shapes and attention features, unsplit (the plugin's) and split `splits`
    ways (its PyTorch launch's at a small batch), as (fn, signature, constexprs, config): what compile_ptx compiles
    and the resource test checks. `fp8_kv`: over an fp8 cache (bytes, per-KV-head scales: fp8.py)."""
    t = _TRITON_TYPES[dtype]
    return {
        "attention_one_launch": (_attention_one_launch,
                                 *_one_launch_source(num_heads, num_kv_heads, head_dim, scale, t, rotary,
                                                     position_type, rotary_dim, softcap, window, sinks,
                                                     fp8_kv=fp8_kv)),
        "attention_one_launch_split": (_attention_one_launch,  # the PyTorch launch's form at a small batch
                                       *_one_launch_source(num_heads, num_kv_heads, head_dim, scale, t, rotary,
                                                           position_type, rotary_dim, softcap, window, sinks,
                                                           splits, fp8_kv)),
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
