"""Block-wise weight codes in the format of ONNX Runtime's `MatMulNBits`, with the rounding chosen here.

`MatMulNBits` stores a [K, N] weight as codes 0 .. 2^bits - 1 in blocks of `block` along K, one
scale and one integer zero point per block and column: w = scale * (code - zero_point). ONNX
Runtime's quantizer picks scale and zero point from each block's min and max, blind to how much each
input channel matters. What is written here, because its quantizer lacks it:

- `search`: per block, the scale (a grid of factors around min/max) and the integer zero point
  (rounded, or one step either side) minimizing the activation-weighted error
  sum_k h_k (w_k - w'_k)^2, where h_k = E[x_k^2] over calibration tokens (the importance weighting
  llama.cpp calls an importance matrix). Input channels that carry large activations get the
  accurate codes. `symmetric` codes keep the zero point at 2^(bits-1), the value `MatMulNBits`
  assumes when it gets no zero points, and search the scale alone.
- `minmax`: plain round to nearest over each block's range, what AWQ's scale search scores (awq.py).
- `pack`: codes, scales and zero points laid out as `MatMulNBits` reads them.

Every scale is an fp16 value (where it is a normal one: `half_scales`), chosen before the codes that use it, so
llmc's 4-bit kernel stores a layer's scales in half the bytes with the same products
(runtime/kernels/matmul_nbits4: a decode step streams 10% fewer bytes).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from llmc.runtime.kernels.cpu_kernels import compile_library

SEARCH_SOURCE = Path(__file__).with_name("blockwise_search.c")
# -march=native: the library is compiled on the host that runs it, for this build only;
# -ffp-contract=off: no fused multiply-adds, so its float32 arithmetic is NumPy's
SEARCH_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]
log = logging.getLogger(__name__)

FACTORS = np.linspace(0.7, 1.3, 41).astype(np.float32)  # scale = (max - min) / (2^bits - 1) * factor
ZERO_POINT_STEPS = (-1, 0, 1)
HALF_NORMAL = np.float32(np.finfo(np.float16).tiny)  # the least normal fp16 number, 2^-14
C_MAX_BLOCK = 256  # blockwise_search.c holds a block on its stack; longer ones (a whole row: experts.py) run in NumPy


@dataclass(frozen=True)
class BlockCodes:
    """A [K, N] weight as `MatMulNBits` codes: [blocks, block, N] codes, [blocks, 1, N] scales and zero points."""

    codes: np.ndarray  # uint8
    scales: np.ndarray  # float32
    zero_points: np.ndarray  # uint8
    k: int
    bits: int
    symmetric: bool = False  # zero points all 2^(bits-1): MatMulNBits gets none

    def dequantize(self) -> np.ndarray:
        w = (self.codes.astype(np.float32) - self.zero_points) * self.scales
        return w.reshape(-1, w.shape[-1])[:self.k]


def blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[K, N] -> [ceil(K / block), block, N], zero-padded along K (as `MatMulNBits` pads)."""
    k, n = w.shape
    return np.pad(w, ((0, (-k) % block), (0, 0))).reshape(-1, block, n)


def _codes(b: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmax: int) -> np.ndarray:
    """Codes of blocks `b` for `scale` and `zero` (integers)."""
    return np.clip(np.round(b / scale) + zero, 0, qmax)


def half_scales(scale: np.ndarray) -> np.ndarray:
    """Each float32 scale as the nearest fp16 value where that is a normal fp16 number (round half to even),
    else as it is: a scale below 2^-14 would lose bits as a subnormal, one past 65504 would become inf."""
    with np.errstate(over="ignore"):
        h = scale.astype(np.float16).astype(np.float32)
    return np.where(np.isfinite(h) & (np.abs(h) >= HALF_NORMAL), h, scale).astype(np.float32)


def _range(b: np.ndarray, qmax: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each block's minimum and the scale that spans its range: min..max, or -amax..amax around
    the middle code when `symmetric` (an fp16 value: `half_scales`)."""
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    if symmetric:
        amax = np.maximum(-lo, hi)
        return lo, half_scales(np.where(amax > 0, amax / ((qmax + 1) // 2), 1.0).astype(b.dtype))
    return lo, half_scales(np.where(hi > lo, (hi - lo) / qmax, 1.0).astype(b.dtype))


def _candidates(lo: np.ndarray, base: np.ndarray, qmax: int, symmetric: bool):
    """(scale, zero points) per block: the range's own first, then for each factor of the grid its scale
    with the zero points to try (each rounds the same w / scale)."""
    if symmetric:
        zero = np.full_like(lo, (qmax + 1) // 2)
        yield base, [zero]
        for factor in FACTORS:
            yield half_scales(base * factor), [zero]
        return
    yield base, [np.clip(np.round(-lo / base), 0, qmax)]
    for factor in FACTORS:
        scale = half_scales(base * factor)
        rounded = np.round(-lo / scale)
        yield scale, [np.clip(rounded + step, 0, qmax) for step in ZERO_POINT_STEPS]


def minmax(w: np.ndarray, bits: int, block: int, symmetric: bool = False) -> BlockCodes:
    """Round to nearest: each block's min and max (or its largest magnitude, `symmetric`) span the codes."""
    return _block_codes(w, None, bits, block, symmetric)


def fake_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = False,
                  row_scale: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """`w` as `minmax` codes would give it back; with `row_scale` [K] (AWQ's s), Q(w * s) / s: the rows
    scaled before rounding and scaled back after (in C in one pass where this host compiles it).
    `out`: a C-contiguous float32 array of w's shape to write into (a caller that rounds the same weight
    many times reuses one: a fresh one costs a page fault every 4 KiB, more than the rounding)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if out is not None and (out.shape != w.shape or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"out: {out.shape} {out.dtype} array; expected a C-contiguous float32 {w.shape}")
    library = _search_library()
    if library is None:
        scaled = w if row_scale is None else w * row_scale[:, None]
        result = minmax(scaled, bits, block, symmetric).dequantize()
        result = result if row_scale is None else result / row_scale[:, None]
        if out is None:
            return result
        out[...] = result
        return out
    out = np.empty_like(w) if out is None else out
    rs = None if row_scale is None else np.ascontiguousarray(row_scale, dtype=np.float32)
    k, n = w.shape
    _over_columns(n, lambda n0, n1: library.fake_quantize(_ptr(w), _ptr(rs), k, n, n0, n1, bits, block,
                                                          int(symmetric), _ptr(out)), f"bits={bits}, block={block}")
    return out


def search(w: np.ndarray, importance: np.ndarray, bits: int, block: int, symmetric: bool = False) -> BlockCodes:
    """Per block and column, the scale and zero point (`symmetric`: the scale alone) minimizing
    sum_k importance_k (w_k - w'_k)^2. `importance` [K] is E[x_k^2] of the layer's input; `minmax`'s
    codes are the first candidate, so the weighted error is never worse than theirs."""
    return _block_codes(w, importance, bits, block, symmetric)


def _block_codes(w: np.ndarray, importance: np.ndarray | None, bits: int, block: int, symmetric: bool) -> BlockCodes:
    """`search` (importance given) or `minmax` (None): in C where this host compiles blockwise_search.c,
    else in NumPy; both pick the same codes."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
    found = blockwise_search_c(w, importance, bits, block, symmetric)
    if found is None:
        found = search_numpy(w, importance, bits, block, symmetric)
    codes, scales, zeros = found
    return BlockCodes(codes, scales, zeros, w.shape[0], bits, symmetric)


def search_numpy(w: np.ndarray, importance: np.ndarray | None, bits: int, block: int,
                 symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The search in NumPy, float32 throughout (blockwise_search.c computes the same): codes
    [blocks, block, N], scales and zero points [blocks, 1, N]."""
    qmax = 2**bits - 1
    b = blocks(w, block)
    lo, base = _range(b, qmax, symmetric)
    best_scale, (best_zero,) = next(_candidates(lo, base, qmax, symmetric))  # minmax's: the range's own
    if importance is not None:
        h = blocks(importance[:, None], block)  # [blocks, block, 1]; padding weighs 0
        best_err = np.full(lo.shape, np.inf, dtype=np.float32)
        for scale, zeros in _candidates(lo, base, qmax, symmetric):
            rounded = np.round(b / scale)
            for zero in zeros:
                err = (h * np.square((np.clip(rounded + zero, 0, qmax) - zero) * scale - b)).sum(1, keepdims=True)
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best_scale = np.where(better, scale, best_scale)
                best_zero = np.where(better, zero, best_zero)
    return (_codes(b, best_scale, best_zero, qmax).astype(np.uint8), best_scale.astype(np.float32),
            best_zero.astype(np.uint8))


def blockwise_search_c(w: np.ndarray, importance: np.ndarray | None, bits: int, block: int,
                       symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The search by blockwise_search.c, or None where it cannot be compiled here or `block` is longer than
    it takes."""
    library = _search_library()
    if library is None or block > C_MAX_BLOCK:
        return None
    k, n = w.shape
    nblocks = -(-k // block)
    codes = np.empty((nblocks, block, n), np.uint8)
    scales = np.empty((nblocks, 1, n), np.float32)
    zeros = np.empty((nblocks, 1, n), np.uint8)
    factors = FACTORS if importance is not None else np.zeros(0, np.float32)
    _over_columns(n, lambda n0, n1: library.codes(_ptr(w), k, n, n0, n1, _ptr(importance), bits, block, int(symmetric),
                                                  _ptr(factors), len(factors), _ptr(codes), _ptr(scales), _ptr(zeros)),
                  f"bits={bits}, block={block}")
    return codes, scales, zeros


def _ptr(a: np.ndarray | None):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _over_columns(n: int, call, what: str) -> None:
    """`call(n0, n1)` over column ranges (multiples of 64 wide) split across the cores, in threads: ctypes
    lets go of the GIL for the call. A non-zero return is a refusal."""
    threads = max(1, min(os.cpu_count() or 1, n // 64))
    cuts = [n * i // threads // 64 * 64 for i in range(threads)] + [n]
    with ThreadPoolExecutor(threads) as pool:
        if any(pool.map(lambda i: call(cuts[i], cuts[i + 1]), range(threads))):
            raise ValueError(f"blockwise_search.c refused {what}")


class _Search(NamedTuple):
    codes: object  # llmc_block_codes
    fake_quantize: object  # llmc_block_fake_quantize


@functools.cache
def _search_library() -> _Search | None:
    """blockwise_search.c compiled for this host (into a temporary folder, loaded, then removed: a
    compile takes a fraction of a second and a build runs once), or None without a C compiler."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = compile_library([SEARCH_SOURCE], Path(tmp) / "blockwise_search.so", SEARCH_FLAGS, libs=["-lm"])
            library = ctypes.CDLL(str(path))
    except RuntimeError as err:
        log.warning("the block-code search runs in NumPy, many times slower: %s", str(err)[-500:])
        return None
    i64, c_int, pointer = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    codes, fake = library.llmc_block_codes, library.llmc_block_fake_quantize
    codes.argtypes = [pointer, i64, i64, i64, i64, pointer, c_int, c_int, c_int, pointer, c_int, pointer, pointer,
                      pointer]
    fake.argtypes = [pointer, pointer, i64, i64, i64, i64, c_int, c_int, c_int, pointer]
    codes.restype = fake.restype = c_int
    return _Search(codes, fake)


def pack(q: BlockCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`MatMulNBits`' B [N, blocks, block * bits / 8] (4 bits: two codes a byte, the first in the low
    nibble), scales [N, blocks] and zero points [N, ceil(blocks * bits / 8)] (4 bits: two blocks a byte)."""
    codes = np.ascontiguousarray(q.codes.transpose(2, 0, 1))  # [N, blocks, block]
    zero = q.zero_points[:, 0, :].T  # [N, blocks]
    scales = np.ascontiguousarray(q.scales[:, 0, :].T)
    if q.bits == 8:
        return codes, scales, np.ascontiguousarray(zero)
    if q.bits != 4:
        raise ValueError(f"{q.bits}-bit codes: MatMulNBits is packed here for 4 or 8 bits")
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    if zero.shape[1] % 2:
        zero = np.pad(zero, ((0, 0), (0, 1)))
    return packed, scales, np.ascontiguousarray(zero[:, 0::2] | (zero[:, 1::2] << 4))
