"""What a step of the paged graph costs, learned from the steps it runs, and how many prompt tokens a
step can carry beside its decode rows without stretching their inter-token latency past `ratio`
times a decode step of the same rows.

On a CPU a step of n decode rows and P prompt tokens takes about a + b·n + c·P seconds: a is the
weights read once a step, b a decode row's attention and LM head, c a prompt token's compute (a
prompt token costs compute, so a fixed token budget that suits 16 decode rows stretches a 4-row
step several times over). The fit is non-negative least squares over the steps run, older steps
weighted down by `forget` each step, so it follows contexts that grow and a host whose speed changes.
Until it has measured a decode step, a step with decode rows carries `min_tokens` prompt tokens.

Under a steady queue of prompts every step carries the cap's worth of prompt tokens beside a similar
number of rows, and such steps cannot tell a step's own cost from its prompt tokens': any (a, c) on a
line fits them, so the fit stays wherever its first steps put it. A first prompt step slowed by a
busy host once held c at over twice its value, every later step at `min_tokens` prompt tokens, and 16
streams of a 0.5B fp32 model at 25 tok/s with TTFT p50 14 s, against 38 tok/s and 2.6 s in the next run
of the same load. So when `probe_every` steps have passed without a decode-only step, the next step with decode
rows carries no prompt tokens (`prompt_cap` 0): one step a decode step's cost is measured anew, and a
step is shorter, not longer, than the cap allows (about 3% of the prompt throughput at full load).
Written here because no library fits step costs online; Sarathi-Serve sizes its token budget from a
latency target the same way, offline.
"""

from __future__ import annotations

import numpy as np


class StepCost:
    def __init__(self, ratio: float = 2.5, forget: float = 0.95, min_tokens: int = 16, probe_every: int = 16):
        if ratio <= 1 or not 0 < forget <= 1 or min_tokens < 1 or probe_every < 1:
            raise ValueError(f"ratio ({ratio}) must be > 1, forget ({forget}) in (0, 1], "
                             f"min_tokens ({min_tokens}) and probe_every ({probe_every}) >= 1")
        self.ratio, self.forget, self.min_tokens, self.probe_every = ratio, forget, min_tokens, probe_every
        self._sums = [0.0] * 10  # x x^T's upper triangle (6), x y (3), y y; x = (1, rows, tokens)
        self.steps = 0
        self._unprobed = 0  # steps since the last decode-only step, or the last probe asked for

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` decode rows and `tokens` prompt tokens took `seconds`. In Python floats:
        every step calls it, right after a graph run has left the caches cold, where numpy's small
        arrays cost ~100 us and these ten products ~10."""
        f, s = self.forget, self._sums
        terms = (1.0, rows, tokens, rows * rows, rows * tokens, tokens * tokens, seconds, rows * seconds,
                 tokens * seconds, seconds * seconds)
        self._sums = [f * a + b for a, b in zip(s, terms)]
        self.steps += 1
        self._unprobed = 0 if rows and not tokens else self._unprobed + 1

    def _normal_equations(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(X^T X, X^T y, y^T y) of the steps observed, each weighed down by `forget` per step since."""
        n, r, t, rr, rt, tt = self._sums[:6]
        return np.array([[n, r, t], [r, rr, rt], [t, rt, tt]]), np.array(self._sums[6:9]), self._sums[9]

    def coefficients(self) -> np.ndarray | None:
        """(a, b, c) in seconds, none negative, or None before two steps: the non-negative least-squares
        fit. Steps alike cannot tell the terms apart: least squares then splits the time between them
        (the smallest solution). Where the unconstrained fit has a negative term (a few prompt steps of
        more rows that happened to run faster), the best fit over the terms' subsets with none negative
        is taken: seven 3x3-or-smaller solves, exact non-negative least squares for three terms (written
        here: scipy's nnls is not among a served model's dependencies), so the fit never predicts a
        cheaper step for more rows."""
        if self.steps < 2:
            return None
        xtx, xty, yy = self._normal_equations()
        best, best_residual = None, float("inf")
        for keep in _SUPPORTS:
            fit = np.zeros(3)
            sub = np.ix_(keep, keep)
            fit[keep] = np.linalg.lstsq(xtx[sub] + 1e-12 * np.eye(len(keep)), xty[keep], rcond=None)[0]
            if fit.min() < 0:
                continue
            if len(keep) == 3:  # the unconstrained minimum, and feasible: nothing fits better
                return fit
            residual = yy - 2 * fit @ xty + fit @ xtx @ fit
            if residual < best_residual:
                best, best_residual = fit, residual
        return best

    def prompt_cap(self, rows: int) -> int | None:
        """Prompt tokens a step with `rows` decode rows may carry (at least `min_tokens`, or 0 where the
        step is to measure a decode step: above); None: no cap (no decode row to protect, or prompt
        tokens measured free). With decode rows but no measure of
        a decode step yet (before two steps, or a fit that puts all the time on prompt tokens) the cap
        is `min_tokens`: such a step is mostly the decode rows', and it teaches the fit what they cost.
        Uncapped, as they were, the first steps after a burst of requests carried a full budget of
        prompt tokens beside their first decode rows: at 1B, 1.5 s steps among 0.2-0.5 s ones."""
        if not rows:
            return None
        if self._unprobed >= self.probe_every:  # a decode-only step, to measure one (above)
            self._unprobed = 0
            return 0
        fit = self.coefficients()
        if fit is None:
            return self.min_tokens
        if fit[2] <= 0:
            return None
        decode = fit[0] + fit[1] * rows
        if decode <= 0:
            return self.min_tokens
        return max(self.min_tokens, int((self.ratio - 1) * decode / fit[2]))


# The term subsets coefficients() fits, the whole first (a, b, c: the step, a decode row, a prompt token).
_SUPPORTS = ([0, 1, 2], [0, 2], [1, 2], [0, 1], [0], [1], [2])
