"""Sampling: validation, greedy, penalties, top-k/top-p/min-p filtering, seeds."""

import numpy as np
import pytest
from pydantic import ValidationError

from llmc.runtime.sampling import SamplingParams, apply_penalties, sample

EMPTY = np.array([], dtype=np.int64)


def _logits(values):
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0},
                                 {"min_tokens": 5, "max_tokens": 2}, {"top_k": -1}, {"seed": -1},
                                 {"stop_words": ("",)}, {"unknown": 1}])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_greedy_is_the_default_and_takes_the_argmax():
    params = SamplingParams()
    assert params.is_greedy
    assert sample(_logits([0.1, 3.0, 2.9]), params, EMPTY, EMPTY, params.make_rng()) == 1


def test_penalties():
    logits = _logits([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), np.array([0]), np.array([1]))
    np.testing.assert_allclose(rep, [1.0, -4.0, 1.0, 0.5])  # positive divided, negative multiplied
    freq = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), EMPTY,
                           np.array([2, 2, 3]))
    np.testing.assert_allclose(freq, [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25])
    early = apply_penalties(logits, SamplingParams(min_tokens=2, end_ids=(0,)), EMPTY, np.array([3]))
    assert early[0] == -np.inf and sample(logits, SamplingParams(min_tokens=2, end_ids=(0,)), EMPTY,
                                          np.array([3]), np.random.default_rng(0)) == 2


def _draws(params, logits, n=2000):
    rng = params.make_rng()
    return np.array([sample(logits, params, EMPTY, EMPTY, rng) for _ in range(n)])


def test_filters_restrict_the_candidates():
    logits = np.log(_logits([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1), logits)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.6, seed=1), logits)) == {0, 1}  # 0.5 < 0.6 -> 2nd stays
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.5, seed=1), logits)) == {0}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.2, seed=1), logits)) == {0, 1, 2}
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, seed=3), logits, 4000), minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_p_over_a_large_vocabulary_matches_a_full_sort():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, 50_000).astype(np.float32)  # flat: the first candidates do not reach top_p
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    draws = _draws(params, logits, 300)
    order = np.argsort(-logits)
    probs = np.exp(logits[order] - logits.max())
    probs /= probs.sum()
    allowed = set(order[np.cumsum(probs) - probs < 0.9].tolist())
    assert set(draws.tolist()) <= allowed and len(allowed) > 1024


def test_same_seed_same_tokens_and_temperature_sharpens():
    logits = np.random.default_rng(1).normal(0, 2, 1000).astype(np.float32)
    a = _draws(SamplingParams(temperature=0.8, seed=42), logits, 50)
    b = _draws(SamplingParams(temperature=0.8, seed=42), logits, 50)
    assert (a == b).all()
    cold = _draws(SamplingParams(temperature=0.05, seed=1), logits, 200)
    assert (cold == np.argmax(logits)).mean() > 0.95
