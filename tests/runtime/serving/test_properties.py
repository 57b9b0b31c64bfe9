"""Property-based tests (hypothesis) of what takes untrusted input: the request parser, the
sampling parameters and sampler, and the spec loader. Each either accepts the input with the
meaning it was given, or refuses it with its own error type that names the field at fault."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.compiler.spec import BuildSpec, parse_spec
from llmc.errors import SpecError
from llmc.runtime.serving.request import SCALARS, Limits, RequestError, parse_request
from llmc.runtime.decoding.sampling import SamplingParams, sample

LIMITS = Limits(max_seq_len=512, default_max_tokens=16, max_stop_words=4)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the request parser ------------------------------------------------------------------------

_DTYPES = [np.int32, np.int64, np.uint64, np.float32, np.float64, np.bool_, np.object_]


@st.composite
def _array(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.sampled_from([(), (1,), (1, 1), (2,), (0,), (1, 1, 1)]))
    if dtype is np.object_:
        values = draw(st.lists(st.one_of(st.binary(max_size=8), st.text(max_size=8)), min_size=1, max_size=2))
    elif dtype is np.bool_:
        values = draw(st.lists(st.booleans(), min_size=1, max_size=2))
    elif np.issubdtype(dtype, np.floating):
        values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=2))
    else:
        info = np.iinfo(dtype)
        values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=2))
    flat = np.array((values * 2)[:max(1, int(np.prod(shape)))], dtype=dtype)
    return flat[:int(np.prod(shape))].reshape(shape) if int(np.prod(shape)) else flat[:0].reshape(shape)


_NAMES = st.sampled_from([*SCALARS, "stop_words", "text_input", "bogus"])


@FAST
@given(st.dictionaries(_NAMES, _array(), max_size=6), st.one_of(st.none(), st.binary(max_size=24)))
def test_any_tensors_parse_or_are_refused_with_a_named_request_error(inputs, prompt):
    if prompt is not None:
        inputs["text_input"] = np.array([prompt], dtype=np.object_)
    try:
        request = parse_request(inputs, LIMITS)
    except RequestError as err:
        assert str(err).split(":")[0] in {*SCALARS, "stop_words", "text_input", "request", "min_tokens",
                                          "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                                          "repetition_penalty", "frequency_penalty", "presence_penalty"}, str(err)
        return
    assert request.prompt and 1 <= request.params.max_tokens <= LIMITS.max_seq_len


@FAST
@given(prompt=st.text(min_size=1, max_size=40), max_tokens=st.integers(1, 512), temperature=st.floats(0, 100),
       top_k=st.integers(0, 1000), top_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**64 - 1),
       stream=st.booleans(), stop=st.lists(st.text(min_size=1, max_size=5), max_size=4))
def test_valid_requests_keep_every_value_they_were_given(prompt, max_tokens, temperature, top_k, top_p, seed, stream,
                                                         stop):
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_),
              "max_tokens": np.array([max_tokens], np.int32), "temperature": np.array([temperature], np.float32),
              "top_k": np.array([top_k], np.int32), "top_p": np.array([top_p], np.float32),
              "seed": np.array([seed], np.uint64), "stream": np.array([stream]),
              "stop_words": np.array([w.encode() for w in stop] or [b""], dtype=np.object_)}
    request = parse_request(inputs, LIMITS)
    p = request.params
    assert request.prompt == prompt and request.stream == stream
    assert (p.max_tokens, p.top_k, p.seed) == (max_tokens, top_k, seed)
    assert p.temperature == pytest.approx(float(np.float32(temperature))) and p.stop_words == tuple(stop)


# -- sampling -----------------------------------------------------------------------------------

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


# -- the spec loader ----------------------------------------------------------------------------

_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 10_000), st.floats(allow_nan=False, width=32),
                    st.text(max_size=12))
_SECTIONS = {
    "target": st.sampled_from(["onnxruntime", "tensorrt", "tpu"]),
    "precision": st.sampled_from(["fp32", "fp16", "bf16", "int3"]),
    "limits": st.fixed_dictionaries({}, optional={"max_batch_size": st.integers(-1, 2000),
                                                  "max_seq_len": st.integers(0, 10_000),
                                                  "max_num_tokens": st.integers(0, 10_000)}),
    "quantization": st.fixed_dictionaries({}, optional={
        "mode": st.sampled_from(["none", "int8", "fp8", "int8-weight-only", "int4-weight-only", "int2"]),
        "block_size": st.sampled_from([8, 16, 32, 64, 128, 256]), "smoothquant": st.one_of(st.none(), st.booleans()),
        "max_perplexity_increase": st.floats(-1, 20)}),
    "export": st.fixed_dictionaries({}, optional={"attention": st.sampled_from(["auto", "fused", "reference",
                                                                                 "plugin", "flash"])}),
    "serving": st.fixed_dictionaries({}, optional={"default_max_tokens": st.integers(0, 5000)}),
    "tensorrt": st.fixed_dictionaries({}, optional={"optimization_level": st.integers(-1, 7),
                                                    "hardware_compatibility": st.sampled_from(
                                                        ["none", "ampere_plus", "any"])}),
    "unknown_section": _SCALAR,
}


@FAST
@given(name=st.one_of(st.just("model"), st.text(max_size=10)),
       sections=st.fixed_dictionaries({}, optional=_SECTIONS))
def test_any_spec_mapping_parses_or_is_refused_naming_a_field(name, sections):
    data = {"name": name, "source": "ckpt", **sections}
    try:
        spec = parse_spec(data)
    except SpecError as err:
        assert str(err).startswith("<spec>: invalid build spec") and "\n  " in str(err), str(err)
        return
    assert isinstance(spec, BuildSpec)
    assert parse_spec(spec.model_dump(mode="json")) == spec  # what a build records parses back the same
