"""Property-based tests (hypothesis) of the spec loader: any mapping either parses, and parses back the same from
what a build records, or is refused with a SpecError naming the field at fault."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.compiler.spec import BuildSpec, parse_spec
from llmc.errors import SpecError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

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
