"""The paged attention launches' argument handling (paged_kernels.py, paged_kernels_aot.py, prefill.py): the
contract's packed QKV split again, the kernels' compile-time constants from the tensors and attributes, sinks and
block tables as the kernels read them."""

from __future__ import annotations

import torch
import triton

from llmc.plugins.gpu.configs import BLOCK_M, BLOCK_N
from llmc.plugins.gpu.fp8 import FP8, fp8_mode
from llmc.plugins.gpu.kernels import INTERPRETED


def split_packed(query, key, value, num_heads: int, kv_num_heads: int):
    """Query, key and value as separate contiguous [T, width] tensors (the contract's packed QKV split)."""
    if key is None:
        head_size = query.shape[1] // (num_heads + 2 * kv_num_heads)
        query, key, value = query.split([num_heads * head_size, kv_num_heads * head_size,
                                         kv_num_heads * head_size], dim=1)
    return query.contiguous(), key.contiguous(), value.contiguous()


def kernel_options(query, key_cache, num_heads, kv_num_heads, scale, cos_cache, rotary_interleaved, softcap,
                   local_window_size, is_causal, head_sink=None, splits: int = 1) -> dict:
    """The attention kernel's compile-time constants for these tensors and attributes."""
    head_size = query.shape[1] // num_heads
    assert num_heads % kv_num_heads == 0 and key_cache.shape[2:] == (kv_num_heads, head_size), key_cache.shape
    return {"SCALE": float(scale or head_size ** -0.5), "H": num_heads, "KVH": kv_num_heads, "D": head_size,
            "HALF": cos_cache.shape[1] if cos_cache is not None else 1, "SOFTCAP": float(softcap),
            "WINDOW": int(local_window_size), "CAUSAL": bool(is_causal), "ROTARY": cos_cache is not None,
            "INTERLEAVED": bool(rotary_interleaved), "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N,
            "BLOCK_D": max(16, triton.next_power_of_2(head_size)),
            "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
            "UPCAST": query.dtype == torch.bfloat16 and INTERPRETED, "SINKS": head_sink is not None, "SPLITS": splits,
            "FP8_KV": fp8_mode(key_cache.device) if key_cache.dtype == FP8 else 0}


def sinks(head_sink, num_heads: int, placeholder):
    """head_sink as the kernel reads it (contiguous [num_heads]), or a placeholder it never reads."""
    if head_sink is None:
        return placeholder
    assert head_sink.shape == (num_heads,), f"head_sink is not [num_heads {num_heads}]"
    return head_sink.contiguous()


def int32(*tensors):
    return [t.to(torch.int32).contiguous() for t in tensors]
