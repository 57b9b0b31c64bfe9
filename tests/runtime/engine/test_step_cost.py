"""The paged engine's step-cost model (runtime/engine/step_cost.py): it learns a + b·rows + c·tokens from the
steps it sees and caps prompt tokens so a step stays within `ratio` decode steps of the same rows."""

import numpy as np
import pytest

from llmc.runtime.engine.step_cost import StepCost

A, B, C = 0.015, 0.005, 0.002  # SmolLM2 on 2 cores, roughly: seconds a step, a decode row, a prompt token


def _cost(rows, tokens):
    return A + B * rows + C * tokens


def test_a_small_cap_while_a_decode_step_is_unmeasured_and_none_without_a_decode_row():
    cost = StepCost(ratio=2.5)
    assert cost.prompt_cap(4) == cost.min_tokens  # nothing measured: a decode row is protected from the start
    cost.observe(0, 256, _cost(0, 256))
    assert cost.prompt_cap(4) == cost.min_tokens  # one prompt step: no measure of a decode step yet
    cost.observe(0, 256, _cost(0, 256))  # two prompt steps alike: a decode step looks almost free
    assert cost.prompt_cap(0) is None  # no decode row: nothing to protect
    assert cost.prompt_cap(4) == cost.min_tokens
    for rows, tokens in ((4, 16), (4, 0), (3, 16), (4, 0)):
        cost.observe(rows, tokens, _cost(rows, tokens))
    assert cost.prompt_cap(4) == pytest.approx(1.5 * _cost(4, 0) / C, rel=0.15)  # learned from the small steps


def test_prompt_steps_of_more_rows_that_ran_faster_still_get_a_cap():
    """The burst that opened a 1B run: every step a full budget of prompt tokens beside a few more decode rows
    than the last, the noise making more rows look cheaper. The unconstrained fit has a negative row term and
    so has a fit of (step, prompt token), which left such steps uncapped; the non-negative fit is (prompt
    token) alone, so a decode step is unmeasured and the cap small."""
    cost = StepCost(ratio=2.5)
    for rows, tokens, seconds in ((0, 256, 1.644), (2, 254, 1.462), (3, 253, 1.550), (5, 251, 1.457)):
        cost.observe(rows, tokens, seconds)
    a, b, c = cost.coefficients()
    assert a == b == 0 and c > 0
    assert cost.prompt_cap(7) == cost.min_tokens


def test_the_fit_is_the_best_one_with_no_negative_term():
    rng = np.random.default_rng(1)
    for _ in range(50):
        cost = StepCost(forget=1.0)
        steps = [(int(rng.integers(0, 17)), int(rng.integers(0, 257)), float(rng.uniform(0.01, 2)))
                 for _ in range(int(rng.integers(2, 12)))]
        for step in steps:
            cost.observe(*step)
        x, y = np.array([(1, r, t) for r, t, _ in steps], float), np.array([s for *_, s in steps])
        fit = cost.coefficients()
        assert fit.min() >= 0
        # no non-negative coefficients drawn near the fit do better
        residual = np.sum((x @ fit - y) ** 2)
        for _ in range(200):
            other = np.maximum(fit + rng.normal(0, 0.05, 3) * np.array([1, 0.05, 0.005]), 0)
            assert np.sum((x @ other - y) ** 2) >= residual - 1e-9


def test_the_cap_keeps_a_step_within_ratio_decode_steps_and_grows_with_the_rows():
    cost, rng = StepCost(ratio=2.5), np.random.default_rng(0)
    for _ in range(200):
        rows, tokens = int(rng.integers(1, 17)), int(rng.choice([0, 0, rng.integers(1, 257)]))
        cost.observe(rows, tokens, _cost(rows, tokens) * rng.uniform(0.95, 1.05))  # a noisy host
    for rows in (4, 16):
        cap = cost.prompt_cap(rows)
        assert cap == pytest.approx(1.5 * _cost(rows, 0) / C, rel=0.15)
        assert _cost(rows, cap) <= 2.5 * 1.1 * _cost(rows, 0)
    assert cost.prompt_cap(4) < cost.prompt_cap(16)


def test_the_cap_never_drops_below_min_tokens_and_bad_settings_are_refused():
    cost = StepCost(ratio=1.1, min_tokens=16)
    for rows, tokens in ((1, 0), (1, 500), (2, 0), (2, 300)):
        cost.observe(rows, tokens, _cost(rows, tokens))
    assert cost.prompt_cap(1) == 16
    with pytest.raises(ValueError, match="ratio"):
        StepCost(ratio=1.0)


def test_a_fit_that_steady_steps_cannot_correct_is_corrected_by_a_decode_only_step():
    """Steps that all carry the cap's prompt tokens beside a few decode rows fit any (a, c) on a line: one slow
    first prompt step (1.56 s for what costs ~0.74) held c at twice its value and every step at min_tokens. A
    decode-only step every `probe_every` steps measures a decode step, and the cap finds its level."""
    a, b, c = 0.095, 0.0025, 0.0025  # 0.5B fp32 on 2 cores, roughly
    caps = {}
    for probe_every in (10**9, 16):
        cost, rng = StepCost(ratio=2.5, probe_every=probe_every), np.random.default_rng(0)
        cost.observe(0, 256, 1.56)
        seen = []
        for step in range(150):
            rows = 4 + step % 5
            cap = cost.prompt_cap(rows)
            seen.append(cap)
            cost.observe(rows, cap, (a + b * rows + c * cap) * rng.uniform(0.95, 1.05))
        caps[probe_every] = seen
    assert set(caps[10**9]) == {cost.min_tokens}  # without probes: stuck
    probes = [i for i, cap in enumerate(caps[16]) if cap == 0]
    assert len(probes) == pytest.approx(150 / 17, abs=2) and all(j - i >= 16 for i, j in zip(probes, probes[1:]))
    settled = [cap for cap in caps[16][-50:] if cap]
    assert np.median(settled) == pytest.approx(1.5 * (a + b * 6) / c, rel=0.15)


def test_a_probe_is_asked_once_and_decode_only_steps_put_it_off():
    cost = StepCost(probe_every=4)
    for _ in range(2):
        cost.observe(4, 0, _cost(4, 0))
    for _ in range(3):
        cost.observe(4, 16, _cost(4, 16))
    assert cost.prompt_cap(4) > 0  # three steps since a decode-only one
    cost.observe(4, 16, _cost(4, 16))
    assert cost.prompt_cap(0) is None  # no decode row: nothing to measure
    assert cost.prompt_cap(4) == 0
    assert cost.prompt_cap(4) > 0  # asked once: a step whose proposals made it no decode-only step is not asked again
    for _ in range(3):
        cost.observe(4, 16, _cost(4, 16))
    cost.observe(4, 0, _cost(4, 0))  # a decode-only step came by itself
    cost.observe(4, 16, _cost(4, 16))
    assert cost.prompt_cap(4) > 0
