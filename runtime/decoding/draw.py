"""The arithmetic under sampling.py's draws: a row's weights at its temperature, the candidates
top-k and top-p leave (ranked by logit), and the token a uniform draw lands on (an inverse CDF in
two levels, blocks of tokens then one block, with float64 sums). Rows are numpy arrays [R, V];
nothing here knows a request."""

from __future__ import annotations

import numpy as np

_CANDIDATES = 1024  # top-p sorts each row's most likely tokens first; a full sort is the fallback
_BLOCK = 256  # the draw sums weights in blocks of this many tokens, then walks one block
_TINY_TEMPERATURE = 1e-30  # float32 division by a smaller temperature would make the winner 0 / 0


class Uniforms:
    """Uniform numbers drawn ahead, handed out in order by `random()` as a generator's would be: the
    draws of a row whose uniforms were taken from its generator before it knew which draws it needs
    (a guided row's unmasked draw and masked redraw, sampling.py's sample_guided and engine/speculation/speculator.py)."""

    def __init__(self, values: np.ndarray):
        self._values = iter(np.asarray(values, dtype=np.float64).tolist())

    def random(self) -> float:
        return next(self._values)


def weights(logits: np.ndarray, top: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """exp((logits - top) / temperature) in float32, `top` being each row's largest logit:
    unnormalized probabilities, the most likely token's exactly 1. Shifting before scaling sends a
    tiny temperature's runners-up to 0 instead of overflowing (the property tests found NaN
    probabilities that way once)."""
    with np.errstate(over="ignore"):
        z = (logits - top[:, None]) / np.maximum(temperature, _TINY_TEMPERATURE)[:, None]
    return np.exp(z, dtype=np.float32)


def rows_where(mask: np.ndarray) -> slice | np.ndarray | None:
    """Index for the rows in `mask`: all of them as a slice (a view, no copy), none as None."""
    if mask.all():
        return slice(None)
    return np.nonzero(mask)[0] if mask.any() else None


def inverse_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The token each row's uniform draw `u` lands on, under its nonnegative weights [R, V]: the
    block its share of the total falls in (sums in float64), then the token inside that block."""
    rows, vocab = weights.shape
    pad = -vocab % _BLOCK
    blocked = (np.pad(weights, ((0, 0), (0, pad))) if pad else weights).reshape(rows, -1, _BLOCK)
    cum = np.cumsum(blocked.sum(axis=2, dtype=np.float64), axis=1)
    target = u * cum[:, -1]
    last_block = cum.shape[1] - 1 - (np.diff(cum, axis=1, prepend=0.0)[:, ::-1] > 0).argmax(axis=1)
    block = np.minimum((cum <= target[:, None]).sum(axis=1), last_block)
    r = np.arange(rows)
    before = np.where(block > 0, cum[r, np.maximum(block - 1, 0)], 0.0)
    return block * _BLOCK + _pick(blocked[r, block], target - before)


def _pick(weights: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, the first index whose running sum of `weights` passes `target` (a draw rounding up to
    the total takes the last index with weight)."""
    cum = np.cumsum(weights, axis=1, dtype=np.float64)
    index = (cum <= target[:, None]).sum(axis=1)
    last = weights.shape[1] - 1 - (weights[:, ::-1] > 0).argmax(axis=1)
    return np.minimum(index, last)


def draw_ranked(logits: np.ndarray, top: np.ndarray, temperature: np.ndarray, k: np.ndarray, top_p: np.ndarray,
                 min_p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rows with top-k or top-p: rank each row's most likely tokens by logit, keep what top-k, then
    top-p (renormalized over the top-k set), then min-p allow, and draw among them."""
    cand, w = ranked_weights(logits, top, temperature, k, top_p, min_p)
    index = _pick(w, u * w.sum(axis=1))
    return np.take_along_axis(cand, index[:, None], axis=1)[:, 0]


def ranked_weights(logits: np.ndarray, top: np.ndarray, temperature: np.ndarray, k: np.ndarray, top_p: np.ndarray,
                    min_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their weights): what top-k, then top-p, then min-p leave of each row."""
    vocab = logits.shape[1]
    # top-k alone needs its k candidates; top-p the first _CANDIDATES (or its k), the whole row if they fall short
    width = min(vocab, int(np.max(np.where(top_p < 1.0, np.minimum(k, _CANDIDATES), k))))
    cand, w, complete = _ranked(logits, top, temperature, k, top_p, width)
    if not complete.all():
        redo = np.nonzero(~complete)[0]
        full_cand, full_w, _ = _ranked(logits[redo], top[redo], temperature[redo], k[redo], top_p[redo], vocab)
        cand, w = _widen(cand, vocab), _widen(w, vocab)
        cand[redo], w[redo] = full_cand, full_w
    return cand, np.where(w >= min_p[:, None], w, 0.0)


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    """`a` [R, w] padded with zeros to [R, width]: a zero weight is never drawn."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def _ranked(logits: np.ndarray, top: np.ndarray, temperature: np.ndarray, k: np.ndarray, top_p: np.ndarray,
            width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's `width` most likely tokens, best first, with their weights zeroed where top-k or
    top-p drop them: (token ids [R, width], weights [R, width] float64, whether each row's answer
    is final: its nucleus ended within them, or it asked none)."""
    vocab = logits.shape[1]
    cand = np.argpartition(logits, vocab - width, axis=1)[:, vocab - width:] if width < vocab else \
        np.broadcast_to(np.arange(vocab), logits.shape)
    order = np.argsort(-np.take_along_axis(logits, cand, axis=1), axis=1, kind="stable")
    cand = np.take_along_axis(cand, order, axis=1)
    w = weights(np.take_along_axis(logits, cand, axis=1), top, temperature).astype(np.float64)
    w[np.arange(width)[None, :] >= k[:, None]] = 0.0  # top-k
    nucleus = top_p < 1.0
    # the top-k set's mass: within the candidates, or the whole row's when k does not limit it (a k
    # between the two leaves it unknown: such a row is not complete and is ranked again in full)
    total = np.where(k <= width, w.sum(axis=1), 1.0)
    whole = np.nonzero(nucleus & (k >= vocab))[0]
    if whole.size:
        total[whole] = weights(logits[whole], top[whole], temperature[whole]).sum(axis=1, dtype=np.float64)
    mass = np.cumsum(w, axis=1) / total[:, None]
    w[nucleus[:, None] & (mass - w / total[:, None] >= top_p[:, None])] = 0.0  # the token crossing top_p stays
    complete = ~nucleus | (k <= width) | (width >= vocab) | ((k >= vocab) & (mass[:, -1] >= top_p))
    return cand, w, complete
