"""Property-based tests (hypothesis) of the sampling parameters and the sampler: any parameters either draw an
allowed token, the same one for the same seed, or are refused by the rule they break."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.runtime.decoding.sampling import SamplingParams, sample

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_PARAMS = st.builds(SamplingParams, temperature=st.floats(0.0, 5.0), top_k=st.integers(0, 40),
                    top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 1.0), repetition_penalty=st.floats(0.5, 2.0),
                    frequency_penalty=st.floats(-2.0, 2.0), presence_penalty=st.floats(-2.0, 2.0),
                    seed=st.integers(0, 2**32))
_LOGITS = st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=64).map(lambda v: np.array(v, np.float32))


@FAST
@given(_PARAMS, _LOGITS, st.lists(st.integers(0, 1), max_size=6))
def test_sampling_returns_an_allowed_token_and_the_same_one_for_the_same_seed(params, logits, history):
    prompt, output = np.array([0, 1], np.int64), np.array(history, np.int64) % logits.size
    first = sample(logits, params, prompt, output, params.make_rng())
    assert 0 <= first < logits.size
    assert sample(logits, params, prompt, output, params.make_rng()) == first  # same seed, same token
    if params.top_k == 1 or params.is_greedy:
        from llmc.runtime.decoding.sampling import apply_penalties

        penalized = apply_penalties(logits, params, prompt, output)
        assert penalized[first] == penalized.max()


@FAST
@given(st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 6), "beam_width": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0]), "top_k": st.integers(0, 2), "seed": st.none() | st.integers(0, 3),
    "stop_words": st.lists(st.sampled_from(["", "x", "yz"]), max_size=2).map(tuple)}))
def test_sampling_params_refuse_exactly_the_combinations_llmc_rules_out(fields):
    """SamplingParams' own rules across fields (not pydantic's limits on one): min_tokens above
    max_tokens, an empty stop word, and a beam request with anything that shapes a draw are refused,
    the first broken rule named; every other combination is accepted."""
    from pydantic import ValidationError

    p = {"max_tokens": 256, "min_tokens": 0, "beam_width": 1, "temperature": 0.0, "top_k": 0, "seed": None,
         "stop_words": (), **fields}
    beam = p["beam_width"] > 1
    broken = [message for message, bad in [
        ("min_tokens", p["min_tokens"] > p["max_tokens"]), ("stop_words must not contain", "" in p["stop_words"]),
        ("temperature:", beam and p["temperature"] not in (0.0, 1.0)), ("top_k:", beam and p["top_k"] != 0),
        ("seed:", beam and p["seed"] is not None), ("stop_words:", beam and bool(p["stop_words"]))] if bad]
    try:
        SamplingParams(**fields)
    except ValidationError as err:
        assert broken and broken[0] in err.errors()[0]["msg"], (broken, err)
    else:
        assert not broken
