"""Property-based tests (hypothesis) of the request parser, which takes untrusted input: any tensors either parse
with the meaning they were given, or are refused with a RequestError naming the tensor at fault. (The sampling
parameters' and the spec loader's properties: tests/runtime/decoding/, tests/compiler/spec/.)"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.runtime.serving.request import SCALARS, Limits, RequestError, parse_request

LIMITS = Limits(max_seq_len=512, default_max_tokens=16, max_stop_words=4)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

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
