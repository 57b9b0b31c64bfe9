"""The paged attention op in one kernel launch, and the paged kernels compiled ahead of time to PTX.

A TensorRT ahead-of-time plugin hands TensorRT one kernel per node, so the two launches of
paged_kernels.py (cache write, then attention) do not fit it. `_paged_attention` with FRESH=1 is the
whole op: it reads the keys and values at or past each row's cached length from the new-token inputs
(rotated on the fly) instead of the cache, so no program waits for another's write, and the programs
holding a KV group's first head write them into the blocks. Its grid is a shape expression
(`attention_grid`: packed tokens x group size / BLOCK_M, plus the row count), so TensorRT can launch it
for any batch without knowing how the tokens split among the rows.

`slot_mapping` is not part of this form: the new keys are read where the block table puts them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from llmc.plugins.gpu.configs import BLOCK_M, KernelConfig, attention_config, block_d, default_config
from llmc.plugins.gpu.fp8 import FP8, kv_scales, kv_view
from llmc.plugins.gpu.kernels_aot import (BUFFER_PARAMS, CACHES, _TRITON_TYPES, _compile, compile_for_plugin,
                                         plugin_config)
from llmc.plugins.gpu.ptx import PTX_ISA, plain_target, trim_params
from llmc.plugins.gpu.paged_kernels import (_paged_attention, _paged_write, attention_grid, busy_tiles, int32,
                                            kernel_options, sinks, split_packed)
from llmc.plugins.gpu.split_kv import launch_capability, plugin_splits, split_buffers, split_workspace

PAGED_PLUGIN_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "cu_ptr", "past_ptr", "table_ptr", "cos_ptr",
                       "sin_ptr", "sink_ptr", "part_ptr", "lock_ptr")
PAGED_PLUGIN_SCALARS = ("B", "MB", "NB", "BS")  # rows, block-table width, blocks in the pool, block size
PAGED_PLUGIN_OUTPUTS = ("o_ptr", "kc_out", "vc_out", "part_out", "lock_out")
_INTS = ("cu_ptr", "past_ptr", "table_ptr")


def paged_attention_one_launch(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
                               block_table, num_heads: int, kv_num_heads: int, scale: float = 0.0, cos_cache=None,
                               sin_cache=None, *, slot_mapping=None, rotary_interleaved: bool = False,
                               softcap: float = 0.0, local_window_size: int = -1, is_causal: bool = True,
                               head_sink=None, splits: int | None = None, k_scale=None, v_scale=None,
                               slots: int = 0, config: KernelConfig | None = None):
    """`reference_paged_attention` in one launch (the TensorRT plugin's kernel), caches updated in place;
    `splits`, and `k_scale` / `v_scale` of an fp8 cache, as paged_attention's. `slots`: launched as the plugin
    launches it, `splits` the most a launch takes over a workspace of `slots` partials (split_kv.plugin_splits).
    `config`: keys per step, warps and stages (default: configs.attention_config's; rows stay BLOCK_M)."""
    if slot_mapping is not None:
        raise ValueError("the one-launch paged kernel reads the new keys where block_table puts them: "
                         "no slot_mapping (use paged_kernels.paged_attention)")
    query, key, value = split_packed(query, key, value, num_heads, kv_num_heads)
    options = kernel_options(query, key_cache, num_heads, kv_num_heads, scale, cos_cache, rotary_interleaved,
                             softcap, local_window_size, is_causal, head_sink)
    cu, past, table = int32(cumulative_sequence_length, past_seqlens, block_table)
    cos, sin = (cos_cache.contiguous(), sin_cache.contiguous()) if cos_cache is not None else (query, query)
    _, k_scale, v_scale = kv_scales(key_cache, k_scale, v_scale, kv_num_heads, query)
    kc, vc = kv_view(key_cache), kv_view(value_cache)
    out = torch.empty_like(query)
    if query.shape[0]:
        config = config or attention_config(options["D"], query.element_size(), paged=True,
                                            capability=None if slots else launch_capability(query))
        options["BLOCK_N"] = config.block_n
        options["PAGE"] = 0 if slots else key_cache.shape[1]  # as the plugin: its block size a run-time scalar
        grid_x = attention_grid(query.shape[0], past.shape[0], num_heads, kv_num_heads)[0]
        keys = table.shape[1] * key_cache.shape[1]
        if slots and splits and splits > 1:  # as the plugin launches it: the grid's third axis from its shapes
            options["SPLITS"], z = splits, plugin_splits(grid_x * kv_num_heads, keys, splits, slots)
            part, counters = split_workspace(query.device, slots, 1, BLOCK_M, options["D"])
        else:
            options["SPLITS"], part, counters = split_buffers(query, grid_x, kv_num_heads, keys, options["D"], splits,
                                                              busy_tiles(query.shape[0], past.shape[0], num_heads,
                                                                         kv_num_heads))
            z = options["SPLITS"]
        _paged_attention[attention_grid(query.shape[0], past.shape[0], num_heads, kv_num_heads, splits=z)](
            query, key, value, kc, vc, cu, past, table, cos, sin, sinks(head_sink, num_heads, query), part, counters,
            past.shape[0], table.shape[1], key_cache.shape[0], key_cache.shape[1], out, kc, vc, part,
            counters, k_scale, v_scale, FRESH=True, **options, **config.launch())
    return out, key_cache, value_cache


@dataclass(frozen=True)
class PagedPluginKernel:
    """The one-launch paged kernel compiled for one model and GPU generation, as `@trtp.aot_impl` returns it."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int
    splits: int = 1  # the most key splits a launch takes (the node's key_splits)
    slots: int = 0  # the partials its workspace holds (split_slots)

    def grid(self, tokens, rows, num_heads: int, num_kv_heads: int, keys, cdiv=triton.cdiv, **ops):
        """(grid_x, grid_y, key splits) for `tokens` packed tokens of `rows` rows whose block tables reach `keys`
        tokens; ints or TensorRT shape expressions (kernels_aot.PluginKernel.grid's `cdiv` and `ops`)."""
        x, y, _ = attention_grid(tokens, rows, num_heads, num_kv_heads, self.block_m, cdiv)
        return x, y, plugin_splits(x * y, keys, self.splits, self.slots, **ops)


def _attention_source(num_heads: int, num_kv_heads: int, head_size: int, scale: float, t: str, *, rotary_dim: int,
                      interleaved: bool, softcap: float, window: int, fresh: bool, causal: bool = True,
                      sinks: bool = False, splits: int = 1, fp8_kv: bool = False):
    names = PAGED_PLUGIN_INPUTS + PAGED_PLUGIN_OUTPUTS
    signature = {**{n: "*i32" if n in _INTS else f"*{t}" for n in names}, **{n: "i32" for n in PAGED_PLUGIN_SCALARS},
                 **BUFFER_PARAMS, **({n: "*u8" for n in CACHES} if fp8_kv else {})}  # an fp8 cache as bytes
    dtype = {v: k for k, v in _TRITON_TYPES.items()}[t]
    cache = torch.empty((1, 1, num_kv_heads, head_size), dtype=FP8 if fp8_kv else dtype)
    cos = torch.empty((1, rotary_dim // 2)) if rotary_dim else None
    constexprs = kernel_options(torch.empty((1, num_heads * head_size), dtype=dtype), cache, num_heads, num_kv_heads,
                                scale, cos, interleaved, softcap, window, causal,
                                torch.empty(num_heads) if sinks else None, splits)
    config = attention_config(head_size, dtype.itemsize, paged=True)
    return signature, {**constexprs, "FRESH": fresh, "UPCAST": False}, config


def paged_plugin_kernel(num_heads: int, num_kv_heads: int, head_size: int, scale: float, dtype: str, capability: int,
                        *, rotary_dim: int, interleaved: bool = False, softcap: float = 0.0, window: int = -1,
                        causal: bool = True, sinks: bool = False, splits: int = 1,
                        slots: int = 0) -> PagedPluginKernel:
    """The plugin's kernel for `dtype` ("fp16", "bf16", "fp32") on sm_<capability>, up to `splits` key splits over
    a workspace of `slots` partials (kernels_aot.plugin_kernel's), its parameters cut to what TensorRT passes
    (inputs, int32 extras, outputs; the fp8 scales and Triton's trailing scratch pointers removed)."""
    if splits > 1 and slots < 2:
        raise ValueError(f"a plugin kernel of {splits} key splits needs a workspace of 2 partials at least, not {slots}")
    signature, constexprs, config = _attention_source(
        num_heads, num_kv_heads, head_size, scale, dtype, rotary_dim=rotary_dim, interleaved=interleaved,
        softcap=softcap, window=window, fresh=True, causal=causal, sinks=sinks, splits=splits)
    what = f"the paged attention kernel for head_size {head_size} ({dtype})"
    # its configuration's stages, or one where their buffers pass a plugin launch's shared memory (fp32: unaligned,
    # a plugin's 4-byte loads are still copied asynchronously and buffered; 16-bit ones are not)
    config = plugin_config(_paged_attention, lambda c: (signature, constexprs), capability,
                           (config, replace(config, num_stages=1)), what)
    compiled = compile_for_plugin(_paged_attention, (signature, constexprs), capability, what, config)
    meta = compiled.metadata
    count = len(PAGED_PLUGIN_INPUTS + PAGED_PLUGIN_SCALARS + PAGED_PLUGIN_OUTPUTS)
    ptx = plain_target(trim_params(compiled.asm["ptx"], meta.name, count), what)
    return PagedPluginKernel(meta.name, ptx, meta.num_warps, meta.shared, config.block_m, splits,
                             slots if splits > 1 else 0)


def paged_kernel_sources(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, *, rotary_dim: int,
                         softcap: float = 0.0, window: int = -1, sinks: bool = False,
                         splits: int = 8, fp8_kv: bool = False) -> dict[str, tuple]:
    """The paged kernels (cache write, attention over the cache, the one-launch form, both attention forms also
    with `splits` key splits, as their PyTorch launches get at a small batch) for one model's shapes and
    attention features, as (fn, signature, constexprs, config): what compile_paged_ptx compiles and the
    resource test checks. `fp8_kv`: over fp8 caches (bytes, with per-KV-head scales: fp8.py)."""
    t = _TRITON_TYPES[dtype]
    cache_type = "*u8" if fp8_kv else f"*{t}"
    write_signature = {**{n: f"*{t}" for n in ("k_ptr", "v_ptr", "cos_ptr", "sin_ptr")},
                       **{n: cache_type for n in ("kc_ptr", "vc_ptr")}, **{n: "*i32" for n in _INTS},
                       "slots_ptr": "*i64", **{n: "i32" for n in PAGED_PLUGIN_SCALARS},
                       "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    write_constexprs = {"KVH": num_kv_heads, "D": head_size, "HALF": max(rotary_dim // 2, 1),
                        "BLOCK_KVH": triton.next_power_of_2(num_kv_heads), "BLOCK_D": block_d(head_size),
                        "ROTARY": rotary_dim > 0, "INTERLEAVED": False, "SLOTS": False, "FP8_KV": fp8_kv}
    kernels = {"paged_write": (_paged_write, write_signature, write_constexprs, default_config())}  # no key loop
    for name, fresh, split in (("paged_attention", False, 1), ("paged_attention_one_launch", True, 1),
                               ("paged_attention_split", False, splits),
                               ("paged_attention_one_launch_split", True, splits)):
        kernels[name] = (_paged_attention, *_attention_source(num_heads, num_kv_heads, head_size, 0.125, t,
                                                              rotary_dim=rotary_dim, interleaved=False,
                                                              softcap=softcap, window=window, fresh=fresh,
                                                              sinks=sinks, splits=split, fp8_kv=fp8_kv))
    return kernels


def compile_paged_ptx(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, capability: int,
                      **features) -> dict[str, str]:
    """PTX of the paged kernels for one model's shapes, attention features (paged_kernel_sources' keywords) and
    a GPU generation (80: A100, 90: H100), compiled without a GPU with their configurations, for PTX ISA
    PTX_ISA and the plain target."""
    return {name: plain_target(_compile(fn, signature, constexprs, capability, ptx_version=PTX_ISA,
                                        **config.launch()).asm["ptx"], name)
            for name, (fn, signature, constexprs, config) in
            paged_kernel_sources(num_heads, num_kv_heads, head_size, dtype, **features).items()}
