"""FP8 (e4m3) KV caches in the attention kernels: a cache entry is stored as fp8(x / scale) and read back as
float(stored) * scale, with one scale per KV head for keys and one for values (`k_scale`, `v_scale`: fp32 [KVH]),
as TensorRT-LLM and vLLM keep an fp8 KV cache. The format is e4m3 with no infinities (OCP "e4m3fn",
`torch.float8_e4m3fn`): largest finite 448, values past it saturate to +-448, rounding to nearest even. The
reference (plugins/op/attention.py `_encode` / `_decode`) defines the same.

Written by hand, because no library does it for every GPU these kernels compile for: Triton refuses its own
e4m3 type (`fp8e4nv`) below capability 89 ("type fp8e4nv not supported in this architecture"), so an A100
(sm_80) cannot compile a kernel that converts to or from it, and the interpreter's fp32 -> fp8 conversion drops
the carry of a rounding that overflows the mantissa. So the kernels see an fp8 cache as bytes (the PyTorch
launches pass `cache.view(torch.uint8)`, the ahead-of-time compiles a `*u8` pointer), and convert with the
integer operations below: the same bits on sm_80, sm_90 and the interpreter, equal to PyTorch's cast
(tests/gpu/test_fp8_kv.py checks every code and the rounding ties).

On a GPU that has it (capability 8.9 on: Ada, Hopper and later), a PyTorch launch reads the cache with the GPU's
own conversion instead (FP8_KV = NATIVE: the bytes bitcast to `fp8e4nv`, converted two at a time by one
instruction). Writing stays by hand on every GPU: it happens once a new token.

The kernels read the codes' values unscaled (`load_kv`: exact in fp16, so in the dots' fp16 or bf16 too) and
apply the per-head scales after the dots: the key scale with the softmax scale on the logits, the value scale on
the output (the partials of a split and a sink are linear in the values, so it commutes with their merge).
Measured on an H200 (2026-11-30) when each element was scaled before its dot (decoded to fp32, multiplied,
rounded to the dot's type): an fp8 decode step was no faster than the fp16 one with either conversion (the paged
two-launch kernel's step 0.47-0.78x as fast as fp16's by hand, 0.49-0.96x natively). Scaling after the dots
leaves one conversion an element (natively, one instruction for two); not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.kernels import INTERPRETED

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# FP8_KV, the kernels' compile-time switch: 0 (False) a 16-bit or fp32 cache; 1 (True) an fp8 cache converted by
# hand (every GPU, the interpreter, the plugins' ahead-of-time compiles); NATIVE, read with the GPU's conversion
NATIVE = 2


@triton.jit
def fp8_encode(x):
    """fp32 -> e4m3fn byte (uint8), to nearest even, saturating at +-448. Normal results (|x| >= 2^-6): the fp32
    bit pattern's mantissa rounded to 3 bits by adding half an ulp less one plus the kept lowest bit (a carry
    moves into the exponent, as it should), then the exponent rebiased from 127 to 7. Subnormal results: |x| in
    multiples of 2^-9, rounded to nearest even by the fp32 adder (adding then subtracting 2^23)."""
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint32)
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def fp8_decode(code):
    """e4m3fn byte (uint8) -> fp16, exactly (every e4m3 value is an fp16 one): its bits moved into an fp16's (sign,
    exponent and mantissa shifted by 7; subnormals land on fp16 subnormals), whose exponent bias (15) is 8 more
    than e4m3's (7): times 2^8, exact in fp16."""
    c = code.to(tl.uint16)
    half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def bf16_rounded(x):
    """fp32 `x` rounded to bfloat16 (to nearest even) and kept in fp32: what `.to(tl.bfloat16)` does on a GPU, by
    hand for the interpreter's bf16 paths (UPCAST), whose cast truncates instead."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def in_type(x, ptr, UPCAST: tl.constexpr):
    """fp32 `x` rounded to the element type of `ptr` and back to fp32 (bfloat16 under UPCAST, by hand)."""
    if UPCAST:  # (one return after the branches: Triton types every return of a function alike)
        y = bf16_rounded(x)
    else:
        y = x.to(ptr.dtype.element_ty).to(tl.float32)
    return y


@triton.jit
def load_kv(ptr, offsets, mask, FP8_KV: tl.constexpr):
    """Cache entries at `offsets` in the cache's units: a 16-bit or fp32 cache's in its type; with FP8_KV the e4m3
    codes' values as fp16 (exact; FP8_KV == NATIVE: converted by the GPU, two a instruction), not yet times the
    head's scale: the kernels fold the key scale into the logits' and the value scale into the output's (one
    multiply a logit and an output element, where a scaled tile cost a conversion to fp32, a multiply and a
    rounding back a cache element)."""
    if FP8_KV == 2:  # NATIVE (a literal: a jit function reads only constexpr globals)
        x = tl.load(ptr + offsets, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FP8_KV:
        x = fp8_decode(tl.load(ptr + offsets, mask=mask, other=0))
    else:
        x = tl.load(ptr + offsets, mask=mask, other=0.0)
    return x


@triton.jit
def store_kv(ptr, offsets, x, mask, scale, FP8_KV: tl.constexpr):
    """`x` into the cache at `offsets`: the cache's type, or with FP8_KV e4m3 bytes of x / scale (an IEEE
    division, as the reference's: an approximate one would move ties)."""
    if FP8_KV:
        tl.store(ptr + offsets, fp8_encode(tl.div_rn(x.to(tl.float32), scale)), mask=mask)
    else:
        tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def as_stored(x, ptr, scale, FP8_KV: tl.constexpr):
    """`x` (fp32) as the cache will hold it, read back in load_kv's units and type: what a later step reads of it
    (the one-launch kernels attend to the new keys from their inputs, so they round them like the cache first)."""
    if FP8_KV:
        y = fp8_decode(fp8_encode(tl.div_rn(x, scale)))
    else:
        y = x.to(ptr.dtype.element_ty)
    return y


@triton.jit
def head_scale(scale_ptr, head, FP8_KV: tl.constexpr):
    """The fp8 scale of KV head(s) `head` (1.0 without FP8_KV: the placeholder pointer is never read)."""
    if FP8_KV:
        scale = tl.load(scale_ptr + head)
    else:
        scale = 1.0
    return scale


def kv_view(cache: torch.Tensor) -> torch.Tensor:
    """A cache as the kernels take it: an fp8 one as its bytes (see the module's note), others as they are."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def fp8_mode(device: torch.device, interpreted: bool = INTERPRETED) -> int:
    """FP8_KV for an fp8 cache on `device`: NATIVE on a GPU of capability 8.9 or later (kernels compiled, not
    `interpreted`), else 1 (by hand)."""
    if device.type != "cuda" or interpreted:
        return 1
    return NATIVE if torch.cuda.get_device_capability(device) >= (8, 9) else 1


def kv_scales(cache: torch.Tensor, k_scale, v_scale, kv_heads: int, placeholder):
    """(FP8_KV, k_scale, v_scale) for a launch: for an fp8 cache its mode (fp8_mode) and fp32 [KVH] scales
    (required); 0 and placeholders the kernel never reads otherwise."""
    if cache.dtype != FP8:
        assert k_scale is None and v_scale is None, "k_scale / v_scale are for an fp8 (float8_e4m3fn) cache"
        return 0, placeholder, placeholder
    assert k_scale is not None and v_scale is not None, "an fp8 KV cache needs k_scale and v_scale ([kv_heads])"
    scales = [s.to(device=cache.device, dtype=torch.float32).reshape(-1).contiguous() for s in (k_scale, v_scale)]
    assert all(s.numel() == kv_heads for s in scales), f"k_scale / v_scale are one per KV head ({kv_heads})"
    return fp8_mode(cache.device), *scales
