"""Request parsing from Triton tensors: every bad input gets a message naming the tensor."""

import numpy as np
import pytest

from llmc.runtime.serving.request import Limits, RequestError, parse_request

LIMITS = Limits(max_seq_len=128, default_max_tokens=16, max_stop_words=2)


def _req(**tensors):
    base = {"text_input": np.array([b"Hello"], dtype=object)}
    return {**base, **tensors}


def test_minimal_request_gets_defaults():
    r = parse_request(_req(), LIMITS)
    assert r.prompt == "Hello" and r.params.max_tokens == 16 and r.params.is_greedy and not r.stream


def test_parameters_in_triton_shapes_and_dtypes():
    r = parse_request(_req(max_tokens=np.array([[5]], np.int32), temperature=np.array([0.7], np.float32),
                           top_p=np.array([0.9], np.float32), top_k=np.array([40], np.int32),
                           seed=np.array([7], np.uint64), stream=np.array([True]), end_id=np.array([2], np.int32),
                           stop_words=np.array([b"\n\n", b"END"], dtype=object)), LIMITS)
    p = r.params
    assert (p.max_tokens, p.top_k, p.seed, p.end_ids, p.stop_words) == (5, 40, 7, (2,), ("\n\n", "END"))
    assert p.temperature == pytest.approx(0.7) and r.stream


@pytest.mark.parametrize(("tensors", "message"), [
    ({"text_input": None}, "text_input: required input is missing"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input: expected one BYTES value"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, "text_input: not valid UTF-8"),
    ({"text_input": np.array([b""], dtype=object)}, "text_input: the prompt is empty"),
    ({"temperature": np.array([-1.0], np.float32)}, "temperature"),
    ({"temperature": np.array([1], np.int32)}, "temperature: wrong dtype int32; expected FP32"),
    ({"top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"top_p": np.array([1.5], np.float32)}, "top_p"),
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens: must be between 1 and 128"),
    ({"max_tokens": np.array([129], np.int32)}, "max_tokens: must be between 1 and 128"),
    ({"max_tokens": np.array([1, 2], np.int32)}, "max_tokens: expected one value"),
    ({"stop_words": np.array([b"a", b"b", b"c"], dtype=object)}, "stop_words: at most 2"),
    ({"stop_words": np.array([b"\xc3"], dtype=object)}, "stop_words: not valid UTF-8"),
])
def test_bad_inputs(tensors, message):
    inputs = {k: v for k, v in _req(**tensors).items() if v is not None}
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        parse_request(inputs, LIMITS)


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


def test_a_guide_is_parsed_from_tensorrt_llms_input_names():
    r = parse_request(_req(guided_decoding_guide_type=_text("json_schema"),
                           guided_decoding_guide=_text('{"type": "integer"}')), LIMITS)
    assert (r.guide.kind, r.guide.text) == ("json_schema", '{"type": "integer"}')
    assert parse_request(_req(guided_decoding_guide_type=_text("json")), LIMITS).guide.text == ""
    assert parse_request(_req(), LIMITS).guide is None


@pytest.mark.parametrize(("tensors", "message"), [
    ({"guided_decoding_guide_type": _text("xml")}, "guided_decoding_guide_type: 'xml' is not one of json, "),
    ({"guided_decoding_guide_type": _text("regex")}, "guided_decoding_guide: a regex guide needs its text"),
    ({"guided_decoding_guide": _text("a+")}, "guided_decoding_guide: needs guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": np.array([b"regex", b"json"], dtype=object)},
     "guided_decoding_guide_type: expected one BYTES value"),
    ({"guided_decoding_guide_type": _text("regex"), "guided_decoding_guide": np.array([b"\xff"], dtype=object)},
     "guided_decoding_guide: not valid UTF-8"),
    ({"guided_decoding_guide_type": _text("json"), "beam_width": np.array([2], np.int32)},
     "guided_decoding_guide_type: not with beam search (beam_width 2)"),
])
def test_bad_guides_name_the_input(tensors, message):
    limits = Limits(max_seq_len=128, default_max_tokens=16, max_stop_words=2, max_beam_width=2)
    with pytest.raises(RequestError) as err:
        parse_request(_req(**tensors), limits)
    assert str(err.value).startswith(message), str(err.value)
