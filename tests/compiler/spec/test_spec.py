"""The build spec: defaults, path resolution, and malformed specs rejected with the field named."""

from pathlib import Path

import pytest

from llmc.compiler.spec import BuildSpec, QuantMode, Target, load_spec, parse_spec
from llmc.errors import SpecError

from checkpoints import write_spec


def test_smallest_spec_gets_defaults(tmp_path):
    spec = load_spec(write_spec(tmp_path, {"name": "m", "source": "ckpt"}))
    assert spec.target is Target.onnxruntime
    assert spec.quantization.mode is QuantMode.none
    assert spec.limits.max_batch_size == 8 and spec.verify.decode_steps == 32
    assert spec.source.path == (tmp_path / "ckpt").resolve()  # relative to the spec file
    assert spec.output_dir == Path("build") / "m"  # relative to the working directory
    assert spec.source.allow_pickle is False


@pytest.mark.parametrize("mode,block_size,block", [("int8-weight-only", None, 128), ("int4-weight-only", None, 32),
                                                   ("int8-weight-only", 32, 32), ("int4-weight-only", 64, 64)])
def test_weight_only_block_size_defaults_by_mode(mode, block_size, block):
    quantization = {"mode": mode, **({"block_size": block_size} if block_size else {})}
    assert parse_spec({"name": "m", "source": "x", "quantization": quantization}).quantization.block == block


def test_source_long_form_and_output_resolved(tmp_path):
    spec = load_spec(write_spec(tmp_path / "specs", {
        "name": "m", "source": {"path": "../ckpt", "allow_pickle": True}, "output": "out/m"}))
    assert spec.source.path == (tmp_path / "ckpt").resolve()
    assert spec.source.allow_pickle is True
    assert spec.output_dir == (tmp_path / "specs" / "out" / "m").resolve()


def test_section_hash_tracks_only_its_sections():
    a = parse_spec({"name": "m", "source": "x"})
    b = parse_spec({"name": "m", "source": "x", "verify": {"decode_steps": 8}})
    c = parse_spec({"name": "m", "source": "x", "limits": {"max_batch_size": 2}})
    assert a.section_hash("verify") != b.section_hash("verify")
    assert a.section_hash("verify") == c.section_hash("verify")


MALFORMED = [
    ({"source": "x"}, "name: required field is missing"),
    ({"name": "m"}, "source: required field is missing"),
    ({"name": "has space", "source": "x"}, "name: use 1-64 letters"),
    ({"name": "m", "source": "x", "colour": "red"}, "colour: unknown field"),
    ({"name": "m", "source": "x", "target": "gpu"}, "target: Input should be 'onnxruntime' or 'tensorrt'"),
    ({"name": "m", "source": "x", "precision": "fp64"}, "precision: Input should be"),
    ({"name": "m", "source": "x", "precision": "fp16"}, "precision fp16 needs target: tensorrt"),
    ({"name": "m", "source": "x", "limits": {"max_batch_size": 0}}, "limits.max_batch_size: Input should be greater than or equal to 1"),
    ({"name": "m", "source": "x", "limits": {"max_seq_len": "long"}}, "limits.max_seq_len: Input should be a valid integer"),
    ({"name": "m", "source": "x", "limits": {"max_batch_size": 16, "max_num_tokens": 8}}, "max_num_tokens (8) must be >= max_batch_size (16)"),
    ({"name": "m", "source": "x", "quantization": {"mode": "int3"}}, "quantization.mode: Input should be"),
    ({"name": "m", "source": "x", "quantization": {"calibration": {"num_samples": 0}}}, "quantization.calibration.num_samples"),
    ({"name": "m", "source": "x", "quantization": {"max_perplexity_increase": -1}}, "quantization.max_perplexity_increase"),
    ({"name": "m", "source": "x", "quantization": {"block_size": 48}}, "quantization.block_size: must be 16, 32"),
    ({"name": "m", "source": "x", "target": "tensorrt", "quantization": {"mode": "int4-weight-only"}},
     "int4-weight-only is ONNX Runtime's MatMulNBits and needs target: onnxruntime"),
    ({"name": "m", "source": {"path": "x", "allow_pickel": True}}, "source.allow_pickel: unknown field"),
    ({"name": "m", "source": "x", "serving": {"default_max_tokens": 4096}, "limits": {"max_seq_len": 1024}},
     "serving.default_max_tokens (4096) must be <= limits.max_seq_len (1024)"),
    ({"name": "m", "source": "x", "verify": {"max_logit_diff": 0}}, "verify.max_logit_diff: Input should be greater than 0"),
    ({"name": "m", "source": 5}, "source"),
    ({"name": "m", "source": "x", "export": {"attention": "paged"}, "speculative": {"method": "draft"}},
     "speculative: method: draft needs a draft section"),
    ({"name": "m", "source": "x", "export": {"attention": "fused"}, "speculative": {"method": "ngram"}},
     "speculative: needs the paged graph, export.attention: paged or auto"),
    ({"name": "m", "source": "x", "export": {"attention": "paged"}, "speculative": {"method": "ngram", "num_tokens": 0}},
     "speculative.num_tokens: Input should be greater than or equal to 1"),
    ({"name": "m", "source": "x", "export": {"attention": "paged"},
      "speculative": {"method": "ngram", "min_n": 3, "max_n": 2}}, "speculative: min_n (3) must be <= max_n (2)"),
    ({"name": "m", "source": "x", "export": {"attention": "paged"}, "speculative": {"method": "ngram", "k": 2}},
     "speculative.k: unknown field"),
]


@pytest.mark.parametrize("data, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_spec_names_the_field(tmp_path, data, message):
    path = write_spec(tmp_path, data)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)  # every error names the file


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path, {"name": "m", "source": "x", "limits": {"max_batch_size": 0, "max_seq_len": 1}}))
    assert "2 problem(s)" in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("", "got empty"),
    ("- a\n- b\n", "got list"),
    ("name: [unclosed\n", "not valid YAML at line"),
])
def test_not_a_mapping_or_not_yaml(tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_spec_is_frozen():
    spec = parse_spec({"name": "m", "source": "x"})
    with pytest.raises(Exception):
        spec.name = "other"  # type: ignore[misc]
    assert isinstance(spec, BuildSpec)


def test_limits_left_unset_come_from_the_model():
    spec = parse_spec({"name": "m", "source": "x"})
    assert spec.limits.max_seq_len is None and spec.serving.default_max_tokens is None
    short, notes = spec.with_model_limits(128)
    assert short.limits.max_seq_len == 128 and short.serving.default_max_tokens == 128
    assert notes == ["limits.max_seq_len 128 (the model's max_position_embeddings is 128)",
                     "serving.default_max_tokens 128 (limits.max_seq_len)"]
    long, notes = spec.with_model_limits(32768)
    assert (long.limits.max_seq_len, long.serving.default_max_tokens) == (2048, 256) and len(notes) == 1
    unknown, _ = spec.with_model_limits(None)
    assert unknown.limits.max_seq_len == 2048


def test_limits_set_explicitly_are_kept_or_refused():
    spec = parse_spec({"name": "m", "source": "x", "limits": {"max_seq_len": 512}, "serving": {"default_max_tokens": 64}})
    kept, notes = spec.with_model_limits(1024)
    assert (kept.limits.max_seq_len, kept.serving.default_max_tokens, notes) == (512, 64, [])
    with pytest.raises(SpecError, match=r"limits.max_seq_len \(512\) exceeds the model's max_position_embeddings \(256\)"):
        spec.with_model_limits(256)
