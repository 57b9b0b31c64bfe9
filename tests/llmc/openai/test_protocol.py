"""The OpenAI API's request bodies (llmc/openai/protocol.py) without a server: integers the model's
INT32 / UINT64 inputs cannot hold are refused naming the field (a cast would wrap them silently)."""

import pytest
from pydantic import ValidationError

from llmc.openai.protocol import MAX_N, ChatRequest, CompletionRequest, model_inputs


@pytest.mark.parametrize("field, value", [("max_tokens", 2**31), ("top_k", -2**31 - 1), ("min_tokens", 2**40),
                                          ("seed", 2**64 - MAX_N), ("seed", -1)])
def test_integers_past_the_models_inputs_are_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(model="m", prompt="p", **{field: value})
    assert err.value.errors()[0]["loc"] == (field,)


def test_the_largest_seed_still_fits_every_choice():
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], seed=2**64 - 1 - MAX_N, n=MAX_N)
    assert model_inputs(req, MAX_N - 1)["seed"] < 2**64
