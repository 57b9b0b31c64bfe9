"""The model inputs the clients make (llmc/client/generation.py): a float past FP32's range is refused
naming the parameter, instead of reaching the model as inf (numpy's cast only warns)."""

import warnings

import numpy as np
import pytest
import tritonclient.grpc as grpc

from llmc.client.generation import make_inputs


@pytest.mark.parametrize("name, value", [("temperature", 1e300), ("top_p", -1e39), ("repetition_penalty", 3.5e38)])
def test_a_float_past_fp32_is_refused_by_name(name, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning on the way either
        with pytest.raises(ValueError, match=f"^{name}: .* FP32"):
            make_inputs(grpc, "p", False, {name: value})


def test_floats_within_fp32_and_infinities_asked_for_pass_as_given():
    """inf itself is the caller's value (the model judges it); the largest finite FP32 is a value like any other."""
    inputs = {i.name(): i for i in make_inputs(grpc, "p", False, {"temperature": 0.7, "top_p": float(np.finfo(np.float32).max),
                                                                  "min_p": float("inf")})}
    assert set(inputs) >= {"temperature", "top_p", "min_p"} and inputs["temperature"].datatype() == "FP32"
