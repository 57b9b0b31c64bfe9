"""The OpenAI API's request bodies (llmc/openai/protocol.py) without a server: integers the model's
INT32 / UINT64 inputs cannot hold are refused naming the field (a cast would wrap them silently), and so are
floats past FP32's range (a cast would make them inf)."""

import pytest
from pydantic import ValidationError

from llmc.openai.protocol import MAX_N, ChatRequest, CompletionRequest, model_inputs


@pytest.mark.parametrize("field, value", [("max_tokens", 2**31), ("top_k", -2**31 - 1), ("min_tokens", 2**40),
                                          ("seed", 2**64 - MAX_N), ("seed", -1)])
def test_integers_past_the_models_inputs_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(model="m", prompt="p", **{field: value})
    assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("field, value", [("temperature", 1e300), ("top_p", -1e39), ("presence_penalty", 3.5e38),
                                          ("frequency_penalty", -3.5e38), ("min_p", 1e39), ("repetition_penalty", 1e308)])
def test_floats_past_fp32_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as err:
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], **{field: value})
    assert err.value.errors()[0]["loc"] == (field,)
    assert ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], **{field: 3.4e38}) is not None


def test_the_largest_seed_still_fits_every_choice():
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], seed=2**64 - 1 - MAX_N, n=MAX_N)
    assert model_inputs(req, MAX_N - 1)["seed"] < 2**64
