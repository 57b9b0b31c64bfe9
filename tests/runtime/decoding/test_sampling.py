"""Sampling: validation, greedy, penalties, top-k/top-p/min-p filtering, seeds, batches of rows."""

import numpy as np
import pytest
from pydantic import ValidationError

from llmc.runtime.decoding.sampling import SamplingParams, apply_penalties, penalize, sample, sample_rows

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


def _mixed_batch(vocab=4000, seed=0):
    """Rows with every kind of parameters side by side, each with its own seeded generator."""
    rng = np.random.default_rng(seed)
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=1.3, min_p=0.1, seed=3),
              SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=0.9, frequency_penalty=1.0,
                                                                     presence_penalty=0.5, seed=4),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.5, seed=5), SamplingParams(min_tokens=3, end_ids=(7,)),
              SamplingParams(temperature=1.0, top_p=0.95, seed=6)]
    logits = rng.normal(0, 3, (len(params), vocab)).astype(np.float32)
    logits[-1] = rng.normal(0, 0.1, vocab)  # flat: its nucleus reaches past the first candidates
    logits[7, 7] = 100.0  # the end id, masked until min_tokens
    prompts = [rng.integers(0, vocab, 8) for _ in params]
    outputs = [rng.integers(0, vocab, 5).tolist() if i in (4, 5) else [] for i in range(len(params))]
    return logits, params, prompts, outputs


def test_a_batch_samples_each_row_as_it_would_be_sampled_alone():
    logits, params, prompts, outputs = _mixed_batch()
    for _ in range(3):  # several steps: each row's generator advances by one draw a step, batched or not
        alone_rngs, batch_rngs = [p.make_rng() for p in params], [p.make_rng() for p in params]
        for step in range(4):
            alone = [sample(logits[i], p, prompts[i], np.array(outputs[i], np.int64), alone_rngs[i])
                     for i, p in enumerate(params)]
            together = sample_rows(logits, params, prompts, outputs, batch_rngs)
            assert together.tolist() == alone
        assert together[7] != 7  # min_tokens kept the end id out


def test_batched_penalties_equal_each_rows_own():
    logits, params, prompts, outputs = _mixed_batch(vocab=300, seed=1)
    together = penalize(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        np.testing.assert_array_equal(together[i], apply_penalties(logits[i], p, prompts[i], np.array(outputs[i])))
    two = logits[:2]
    assert penalize(two, [SamplingParams(), SamplingParams(temperature=1.0)], prompts[:2], outputs[:2]) is two  # no copy
    untouched = logits[:2].copy()
    penalize(logits[:2], [SamplingParams(repetition_penalty=2.0)] * 2, prompts[:2], outputs[:2])
    np.testing.assert_array_equal(logits[:2], untouched)  # the caller's logits are never written


def test_batched_draws_follow_each_rows_filtered_distribution():
    probs = np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, top_k=2, seed=4)]
    rngs = [p.make_rng() for p in params]
    draws = np.array([sample_rows(np.log(probs), params, [EMPTY] * 2, [[], []], rngs) for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws[:, 0], minlength=4) / 4000, probs[0], atol=0.03)
    np.testing.assert_allclose(np.bincount(draws[:, 1], minlength=4) / 4000, [0, 0, 3 / 7, 4 / 7], atol=0.03)


def _allowed(logits, p):
    """The tokens top-k, then top-p over the top-k set's renormalized mass, then min-p allow: by a full sort."""
    order = np.argsort(-logits, kind="stable")
    probs = np.exp((logits[order] - logits.max()) / p.temperature)
    if 0 < p.top_k < logits.size:
        order, probs = order[:p.top_k], probs[:p.top_k]
    probs = probs / probs.sum()
    keep = np.cumsum(probs) - probs < p.top_p
    keep &= probs >= p.min_p * probs.max()
    return set(order[keep].tolist())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=2000, top_p=0.9, seed=1),  # k past the candidates
                                    SamplingParams(temperature=0.7, top_p=0.99, seed=2),  # nucleus past them
                                    SamplingParams(temperature=1.0, top_k=40, top_p=0.5, min_p=0.3, seed=3),
                                    SamplingParams(temperature=2.0, min_p=0.5, seed=4)])
def test_batched_draws_stay_within_a_full_sorts_allowed_set(params):
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 0.5, (3, 3000)).astype(np.float32)
    allowed = [_allowed(row, params) for row in logits]
    rngs = [np.random.default_rng(i) for i in range(3)]
    draws = np.array([sample_rows(logits, [params] * 3, [EMPTY] * 3, [[]] * 3, rngs) for _ in range(300)])
    for r in range(3):
        assert set(draws[:, r].tolist()) <= allowed[r] and len(set(draws[:, r].tolist())) > 1
