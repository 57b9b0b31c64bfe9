"""The paged engine's step-cost model (runtime/engine/step_cost.py): it learns a + b·rows + c·tokens from the
steps it sees and caps prompt tokens so a step stays within `ratio` decode steps of the same rows."""

import numpy as np
import pytest

from llmc.runtime.engine.step_cost import StepCost

A, B, C = 0.015, 0.005, 0.002  # SmolLM2 on 2 cores, roughly: seconds a step, a decode row, a prompt token


def _cost(rows, tokens):
    return A + B * rows + C * tokens


def test_no_cap_before_two_steps_nor_without_a_decode_row_and_a_small_one_while_steps_are_alike():
    cost = StepCost(ratio=2.5)
    cost.observe(0, 256, _cost(0, 256))
    assert cost.prompt_cap(4) is None
    cost.observe(0, 256, _cost(0, 256))  # two prompt steps alike: a decode step looks almost free
    assert cost.prompt_cap(0) is None  # no decode row: nothing to protect
    assert cost.prompt_cap(4) == cost.min_tokens
    for rows, tokens in ((4, 16), (4, 0), (3, 16), (4, 0)):
        cost.observe(rows, tokens, _cost(rows, tokens))
    assert cost.prompt_cap(4) == pytest.approx(1.5 * _cost(4, 0) / C, rel=0.15)  # learned from the small steps


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
