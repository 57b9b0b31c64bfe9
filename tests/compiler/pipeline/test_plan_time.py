"""Each stage's time estimate in the build plan (compiler/pipeline/timing.py): one for exactly the stages the build
runs, growing with the model, the calibration text and fewer cores, and landing within the stated tolerance of the
build times llmc measured on its 2-core host (so a coefficient changed past the fit fails here)."""

import json

import pytest

from llmc.compiler.models.config import Dims
from llmc.compiler.pipeline import timing
from llmc.compiler.pipeline.plan import plan_build
from llmc.compiler.spec import parse_spec

TOLERANCE = 0.30  # timing.py's docstring: the worst fitted figure is -25%
TOLERANCE_8B = 0.20  # the 8B builds on a quiet host (issue 53: the plan said 22 min for an 11.8-minute build)


def _dims(layers, hidden, intermediate, vocab, linear, other, model_type="llama", tied=True):
    return Dims(model_type=model_type, num_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                num_heads=hidden // 64, num_kv_heads=max(hidden // 256, 1), head_dim=64, vocab_size=vocab,
                tied_embeddings=tied, max_position_embeddings=8192, linear_params=linear, other_params=other)


# read_dims of each shape (llmc/bench/checkpoints.py's SHAPES, llmc.bench streamed's Llama, models/smollm2)
QWEN_05B = _dims(24, 896, 4864, 151936, 357_826_560, 136_206_208, "qwen2")
LLAMA_1B = _dims(16, 2048, 8192, 128256, 973_078_528, 262_735_872)
SMOLLM2 = _dims(30, 576, 1536, 49152, 106_168_320, 28_346_688)
STREAMED = {4: _dims(4, 2048, 8192, 49152, 243_269_632, 100_681_728),
            16: _dims(16, 2048, 8192, 49152, 973_078_528, 100_730_880)}
# llmc.bench streamed --shape llama-3.1-8b (LM head untied, in linear_params)
LLAMA_8B = {4: _dims(4, 4096, 14336, 128256, 1_397_751_808, 525_373_440, tied=False),
            32: _dims(32, 4096, 14336, 128256, 7_504_658_432, 525_602_816, tied=False)}
MODES = {"fp32": None, "int4": "int4-weight-only", "int8": "int8-weight-only", "int4-rtn": "int4-weight-only"}
# (what, dims, mode, source.load, checkpoint bytes a parameter, measured build seconds (low, high)): docs/changelog.md
# (`python -m llmc.bench sizes`: fp32 safetensors, max_batch_size 16; after the export began stamping layers),
# docs/build.md (the example, SmolLM2: cold build) and `python -m llmc.bench streamed` (bf16 shards, verify; fp32,
# or at the 8B shape quantized, max_batch_size 4)
FITTED = [
    ("Qwen2.5-0.5B fp32", QWEN_05B, "fp32", "whole", 4, (50, 58)),
    ("Qwen2.5-0.5B int4", QWEN_05B, "int4", "whole", 4, (137, 155)),
    ("Qwen2.5-0.5B int8-weight-only", QWEN_05B, "int8", "whole", 4, (155, 155)),
    ("Llama-3.2-1B fp32", LLAMA_1B, "fp32", "whole", 4, (102, 102)),
    ("Llama-3.2-1B int4", LLAMA_1B, "int4", "whole", 4, (304, 355)),
    ("SmolLM2 fp32", SMOLLM2, "fp32", "whole", 4, (25, 25)),
    ("streamed 4 layers, whole", STREAMED[4], "fp32", "whole", 2, (32, 32)),
    ("streamed 4 layers, layers", STREAMED[4], "fp32", "layers", 2, (28, 28)),
    ("streamed 16 layers, whole", STREAMED[16], "fp32", "whole", 2, (117, 117)),
    ("streamed 16 layers, layers", STREAMED[16], "fp32", "layers", 2, (77, 77)),
    # int4 AWQ at the 8B shape, on a host shared with test runs (docs/build.md: 23.5 min)
    ("8B int4, layers, busy host", LLAMA_8B[32], "int4", "layers", 2, (1410, 1410)),
    ("8B shape 4 layers int4, layers, busy host", LLAMA_8B[4], "int4", "layers", 2, (346, 346)),
]
# the 8B builds on a quiet host (docs/build.md, docs/benchmarks.md), held within TOLERANCE_8B: int4 round to
# nearest 11.8 min, int8-weight-only (AWQ) 20.3 min
FITTED_8B = [
    ("8B int4 round to nearest", LLAMA_8B[32], "int4-rtn", "layers", 2, (708, 708)),
    ("8B int8-weight-only", LLAMA_8B[32], "int8", "layers", 2, (1218, 1218)),
]
# stages measured within such builds: (what, dims, mode, source.load, stage, seconds (low, high)); the 1B quantize
# stage's from the build before the stamping, which changed the export only; the 8B's from docs/build.md
FITTED_STAGES = [("SmolLM2", SMOLLM2, "fp32", "whole", "export", (15, 15)),
                 ("SmolLM2", SMOLLM2, "fp32", "whole", "verify", (8, 8)),
                 ("Qwen2.5-0.5B", QWEN_05B, "fp32", "whole", "export", (17, 19)),
                 ("Qwen2.5-0.5B", QWEN_05B, "fp32", "whole", "verify", (18, 22)),
                 ("Qwen2.5-0.5B", QWEN_05B, "int4", "whole", "quantize", (75, 85)),
                 ("Llama-3.2-1B", LLAMA_1B, "int4", "whole", "quantize", (245, 245)),
                 ("streamed 16 layers", STREAMED[16], "fp32", "layers", "export", (35, 35)),
                 ("streamed 16 layers", STREAMED[16], "fp32", "layers", "verify", (35, 35)),
                 ("8B round to nearest", LLAMA_8B[32], "int4-rtn", "layers", "export", (192, 192)),
                 ("8B round to nearest", LLAMA_8B[32], "int4-rtn", "layers", "verify", (176, 176)),
                 ("8B round to nearest", LLAMA_8B[32], "int4-rtn", "layers", "quantize", (298, 298)),
                 ("8B int8-weight-only", LLAMA_8B[32], "int8", "layers", "export", (231, 231)),
                 ("8B int8-weight-only", LLAMA_8B[32], "int8", "layers", "verify", (187, 187)),
                 ("8B int8-weight-only", LLAMA_8B[32], "int8", "layers", "quantize", (761, 761))]

def _spec(path, mode="fp32", **extra):
    data = {"name": "t", "source": str(path), "target": "onnxruntime", "precision": "fp32",
            "limits": {"max_batch_size": 16, "max_seq_len": 2048}, **extra}
    if MODES[mode]:
        data["quantization"] = {"mode": MODES[mode], **({"algorithm": "rtn"} if mode.endswith("-rtn") else {}),
                                **data.get("quantization", {})}
    return parse_spec(data)


@pytest.fixture
def ckpt(tmp_path):
    """A config-only checkpoint (the plan reads config.json; the weights file only has to be there)."""
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def _total(path, dims, mode="fp32", load="whole", nbytes=None, cores=2, **extra):
    spec = _spec(path, mode, **extra)
    stages = ["source", "export", "verify", *(["quantize"] if MODES[mode] else []), "package"]
    return sum(timing.stage_seconds(spec, dims, stages, load, nbytes, cores).values())


def _error(estimate, measured):
    """How far `estimate` lies outside the measured range, as a share of its nearer end."""
    low, high = measured
    return (low - estimate) / low if estimate < low else max(estimate - high, 0) / high


@pytest.mark.parametrize("what, dims, mode, load, per_param, measured", FITTED, ids=[f[0] for f in FITTED])
def test_the_estimate_lands_within_its_tolerance_of_each_measured_build(ckpt, what, dims, mode, load, per_param,
                                                                        measured):
    estimate = _total(ckpt, dims, mode, load, per_param * dims.total_params)
    assert _error(estimate, measured) <= TOLERANCE, f"{what}: estimate {estimate:.0f} s, measured {measured} s"


@pytest.mark.parametrize("what, dims, mode, load, per_param, measured", FITTED_8B, ids=[f[0] for f in FITTED_8B])
def test_the_estimate_lands_within_20_percent_of_each_8b_build(ckpt, what, dims, mode, load, per_param, measured):
    estimate = _total(ckpt, dims, mode, load, per_param * dims.total_params)
    assert _error(estimate, measured) <= TOLERANCE_8B, f"{what}: estimate {estimate:.0f} s, measured {measured} s"


@pytest.mark.parametrize("what, dims, mode, load, stage, measured", FITTED_STAGES,
                         ids=[f"{f[0]} {f[4]}" for f in FITTED_STAGES])
def test_the_measured_stages_land_within_its_tolerance(ckpt, what, dims, mode, load, stage, measured):
    estimate = timing.stage_seconds(_spec(ckpt, mode), dims, [stage], load, None, 2)[stage]
    assert _error(estimate, measured) <= TOLERANCE, f"{what} {stage}: estimate {estimate} s, measured {measured} s"


def test_a_plan_estimates_exactly_the_stages_the_build_runs(ckpt):
    fp32 = plan_build(_spec(ckpt))
    assert list(fp32.stage_seconds) == ["source", "export", "verify", "package"] == fp32.stages
    int4 = plan_build(_spec(ckpt, "int4"))
    assert list(int4.stage_seconds) == int4.stages == ["source", "export", "verify", "quantize", "package"]
    unverified = plan_build(_spec(ckpt, verify={"enabled": False}))
    assert list(unverified.stage_seconds) == ["source", "export", "package"]
    assert all(s > 0 for s in int4.stage_seconds.values())
    rows = dict(int4.rows())
    for stage, seconds in int4.stage_seconds.items():
        assert rows[f"build: {stage} time (estimate)"] == f"{seconds:.0f} s"
    assert rows["build: total time (estimate)"].startswith(f"{sum(int4.stage_seconds.values()):.0f} s")


def test_the_adapters_check_is_planned_and_estimated_with_its_adapters(ckpt, tmp_path):
    """verify-adapters runs where `adapters:` is set and verify is on; its time grows with the adapters and lands
    within the tolerance of the build measured with it (SmolLM2, two rank-16 adapters: 29.8 s, docs/lora.md)."""
    two = {"adapters": {"fr": str(tmp_path / "fr"), "sql": str(tmp_path / "sql")}}
    plan = plan_build(_spec(ckpt, **two))
    assert plan.stages == ["source", "export", "verify", "verify-adapters", "package"] == list(plan.stage_seconds)
    assert plan.stage_peak_bytes["verify-adapters"] == plan.stage_peak_bytes["verify"]
    assert "verify-adapters" not in plan_build(_spec(ckpt, verify={"enabled": False}, **two)).stages
    stages = ["verify-adapters"]
    seconds = timing.stage_seconds(_spec(ckpt, **two), SMOLLM2, stages, "whole", None, 2)["verify-adapters"]
    assert _error(seconds, (29.8, 29.8)) <= TOLERANCE, seconds
    four = {"adapters": {n: str(tmp_path / n) for n in "abcd"}}
    assert timing.stage_seconds(_spec(ckpt, **four), SMOLLM2, stages, "whole", None, 2)["verify-adapters"] > seconds


def test_the_estimate_grows_with_parameters_calibration_and_fewer_cores(ckpt):
    assert _total(ckpt, LLAMA_1B) > _total(ckpt, QWEN_05B) > _total(ckpt, SMOLLM2)
    assert _total(ckpt, QWEN_05B, "int4") > _total(ckpt, QWEN_05B, "fp32")
    # the builtin text holds ~1,250 calibration tokens: 64-token windows, 4 of them against 16
    few, many = ({"calibration": {"num_samples": n, "seq_len": 64}} for n in (4, 16))
    assert _total(ckpt, QWEN_05B, "int4", quantization=many) > _total(ckpt, QWEN_05B, "int4", quantization=few)
    assert _total(ckpt, QWEN_05B, "int4", cores=1) > _total(ckpt, QWEN_05B, "int4", cores=2) \
        > _total(ckpt, QWEN_05B, "int4", cores=8)
    # serving.num_threads is what the build's sessions use
    assert _total(ckpt, QWEN_05B, "int4", cores=8, serving={"num_threads": 2}) == _total(ckpt, QWEN_05B, "int4")
    # round to nearest: no scale search, no calibration pass
    rtn = {"algorithm": "rtn"}
    assert _total(ckpt, QWEN_05B, "int4", quantization=rtn) < _total(ckpt, QWEN_05B, "int4")


def test_reading_a_layer_at_a_time_changes_export_and_verify_only(ckpt):
    spec, stages = _spec(ckpt), ["source", "export", "verify", "package"]
    whole = timing.stage_seconds(spec, STREAMED[16], stages, "whole", None, 2)
    layers = timing.stage_seconds(spec, STREAMED[16], stages, "layers", None, 2)
    assert whole["source"] == layers["source"] and whole["package"] == layers["package"]
    assert layers["export"] > whole["export"] and layers["verify"] < whole["verify"]


def test_the_dry_run_prints_each_stage_time_and_its_json_holds_them(ckpt, tmp_path):
    import subprocess
    import sys

    spec = tmp_path / "m.yaml"
    spec.write_text(f"name: m\nsource: {ckpt}\nquantization:\n  mode: int4-weight-only\n")
    llmc = [sys.executable, "-m", "llmc.cli", "build", str(spec), "--dry-run"]
    text = subprocess.run(llmc, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    for stage in ("source", "export", "verify", "quantize", "package", "total"):
        assert f"build: {stage} time (estimate)" in text.stdout
    data = json.loads(subprocess.run([*llmc, "--json"], capture_output=True, text=True, timeout=300).stdout)
    assert list(data["stage_seconds"]) == data["stages"] and all(s > 0 for s in data["stage_seconds"].values())
