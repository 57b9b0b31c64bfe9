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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FACTORS = np.linspace(0.7, 1.3, 41)  # scale = (max - min) / (2^bits - 1) * factor
ZERO_POINT_STEPS = (-1, 0, 1)


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


def _round(b: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes of blocks `b` for `scale` and `zero` (integers), and the values they stand for."""
    codes = np.clip(np.round(b / scale) + zero, 0, qmax)
    return codes, (codes - zero) * scale


def _range(b: np.ndarray, qmax: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each block's minimum and the scale that spans its range: min..max, or -amax..amax around
    the middle code when `symmetric`."""
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    if symmetric:
        amax = np.maximum(-lo, hi)
        return lo, np.where(amax > 0, amax / ((qmax + 1) // 2), 1.0).astype(b.dtype)
    return lo, np.where(hi > lo, (hi - lo) / qmax, 1.0).astype(b.dtype)


def _candidates(lo: np.ndarray, base: np.ndarray, qmax: int, symmetric: bool):
    """(scale, zero point) pairs per block: the range's own first, then the search grid."""
    if symmetric:
        zero = np.full_like(lo, (qmax + 1) // 2)
        yield base, zero
        for factor in FACTORS:
            yield base * factor, zero
        return
    yield base, np.clip(np.round(-lo / base), 0, qmax)
    for factor in FACTORS:
        scale = base * factor
        rounded = np.round(-lo / scale)
        for step in ZERO_POINT_STEPS:
            yield scale, np.clip(rounded + step, 0, qmax)


def minmax(w: np.ndarray, bits: int, block: int, symmetric: bool = False) -> BlockCodes:
    """Round to nearest: each block's min and max (or its largest magnitude, `symmetric`) span the codes."""
    qmax = 2**bits - 1
    b = blocks(w.astype(np.float32), block)
    scale, zero = next(_candidates(*_range(b, qmax, symmetric), qmax, symmetric))
    codes, _ = _round(b, scale, zero, qmax)
    return BlockCodes(codes.astype(np.uint8), scale, zero.astype(np.uint8), w.shape[0], bits, symmetric)


def fake_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = False) -> np.ndarray:
    """`w` as `minmax` codes would give it back."""
    return minmax(w, bits, block, symmetric).dequantize()


def search(w: np.ndarray, importance: np.ndarray, bits: int, block: int, symmetric: bool = False) -> BlockCodes:
    """Per block and column, the scale and zero point (`symmetric`: the scale alone) minimizing
    sum_k importance_k (w_k - w'_k)^2. `importance` [K] is E[x_k^2] of the layer's input; `minmax`'s
    codes are the first candidate, so the weighted error is never worse than theirs."""
    qmax = 2**bits - 1
    b = blocks(w.astype(np.float32), block)
    h = blocks(importance.astype(np.float32)[:, None], block)  # [blocks, block, 1]; padding weighs 0
    lo, base = _range(b, qmax, symmetric)
    best_err = np.full(lo.shape, np.inf, dtype=np.float32)
    best_codes, best_scale, best_zero = np.zeros_like(b), base, np.zeros_like(lo)
    for scale, zero in _candidates(lo, base, qmax, symmetric):
        codes, values = _round(b, scale, zero, qmax)
        err = (h * np.square(values - b)).sum(1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_codes = np.where(better, codes, best_codes)
        best_scale = np.where(better, scale, best_scale)
        best_zero = np.where(better, zero, best_zero)
    return BlockCodes(best_codes.astype(np.uint8), best_scale.astype(np.float32), best_zero.astype(np.uint8),
                      w.shape[0], bits, symmetric)


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
