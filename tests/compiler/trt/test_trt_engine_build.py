"""The TensorRT engine path up to the TensorRT calls: profile shapes per network input, builder
options, the engine-vs-ONNX Runtime comparison (Polygraphy) on two ONNX Runtime runners, and the
load-time compatibility check. The build and run themselves are marked `tensorrt`."""

import numpy as np
import pytest

from llmc.compiler.tensorrt.engine import plugin_capability
from llmc.compiler.tensorrt.profiles import Profile, profile_shapes
from llmc.compiler.spec import TensorRTSpec, parse_spec
from llmc.compiler.tensorrt.verify_engine import compare_runners
from llmc.errors import EngineError, SpecError
from llmc.runtime.manifest import TensorRTInfo
from llmc.runtime.runners.trt import EngineLoadError, check_engine

KV = {"past_key_values.*": ((1, 2, 64, 8), (4, 2, 64, 8), (4, 2, 64, 8))}


def test_profile_shapes_expand_patterns_to_every_network_input():
    profile = Profile("decode", {"input_ids": ((1, 1), (4, 1), (4, 1)), "cache_position": ((1,), (4,), (4,)), **KV})
    names = ["input_ids", "cache_position", "past_key_values.0.key", "past_key_values.0.value",
             "past_key_values.1.key"]
    shapes = profile_shapes(profile, names)
    assert list(shapes) == names and shapes["past_key_values.1.key"] == KV["past_key_values.*"]
    with pytest.raises(EngineError, match="profile decode: no shape for the network input 'attention_mask'"):
        profile_shapes(profile, [*names, "attention_mask"])


def test_tensorrt_options_validate_and_pick_the_plugin_ptx_generation():
    assert plugin_capability(TensorRTSpec(), 90) == 90
    assert plugin_capability(TensorRTSpec(hardware_compatibility="ampere_plus"), 90) == 80
    with pytest.raises(SpecError, match="optimization_level"):
        parse_spec({"name": "t", "source": "x", "target": "tensorrt", "tensorrt": {"optimization_level": 6}})
    with pytest.raises(SpecError, match="hardware_compatibility"):
        parse_spec({"name": "t", "source": "x", "target": "tensorrt", "tensorrt": {"hardware_compatibility": "any"}})


def _info(**changes):
    base = dict(version="10.14.1", gpu="NVIDIA H100", compute_capability="9.0", hardware_compatibility="none",
                version_compatible=False, precision="fp16", profiles={})
    return TensorRTInfo(**{**base, **changes})


def test_an_engine_for_another_tensorrt_or_gpu_is_refused_with_what_to_change():
    check_engine(_info(), "10.14.1", "NVIDIA H100", 90)
    with pytest.raises(EngineLoadError, match="built by TensorRT 10.14.1 .* has TensorRT 11.4.0.*version_compatible"):
        check_engine(_info(), "11.4.0", "NVIDIA H100", 90)
    check_engine(_info(version_compatible=True), "11.4.0", "NVIDIA H100", 90)
    with pytest.raises(EngineLoadError, match=r"compute capability 9.0 .*this GPU \(NVIDIA A100\) has 8.0.*ampere_plus"):
        check_engine(_info(), "10.14.1", "NVIDIA A100", 80)
    check_engine(_info(hardware_compatibility="ampere_plus"), "10.14.1", "NVIDIA A100", 80)
    with pytest.raises(EngineLoadError, match="Ampere or later"):
        check_engine(_info(hardware_compatibility="ampere_plus"), "10.14.1", "Tesla T4", 75)


class _Noisy:
    """A Runner whose logits are off by noise of amplitude `amp` (what a broken engine looks like)."""

    def __init__(self, runner, amp):
        self.runner, self.amp, self.rows, self.capacity, self.layout = runner, amp, runner.rows, runner.capacity, runner.layout

    def step(self, *args, **kwargs):
        logits = self.runner.step(*args, **kwargs)
        return logits + self.amp * np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)

    def close(self):
        self.runner.close()


@pytest.fixture(scope="module")
def two_lowerings(tiny_checkpoints, tmp_path_factory):
    from llmc.compiler import build

    out = {}
    for lowering in ("fused", "reference"):
        spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": lowering}})
        folder = tmp_path_factory.mktemp(lowering)
        out[lowering] = (build(spec, output=folder, until="export").exported, folder / "export")
    return out


def _runner(two_lowerings, lowering):
    from llmc.runtime.runners.ort import OrtRunner

    exported, folder = two_lowerings[lowering]
    return OrtRunner(folder / exported.onnx, exported.kv_layout, max_batch=3, capacity=64, num_threads=1)


def test_polygraphy_accepts_two_runners_that_agree_and_rejects_a_noisy_one(two_lowerings):
    prompts = [[5, 9, 200, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
    case, accepted = compare_runners(_runner(two_lowerings, "fused"), _runner(two_lowerings, "reference"), prompts,
                                     steps=6, precision="fp16")
    assert accepted and case.passed and case.token_agreement == 1.0 and case.max_abs_logit_diff < 1e-3
    case, accepted = compare_runners(_runner(two_lowerings, "fused"), _Noisy(_runner(two_lowerings, "reference"), 2.0),
                                     prompts, steps=6, precision="fp16")
    assert not accepted and case.max_abs_logit_diff > 1.0


def test_a_tensorrt_build_packages_a_gpu_repository_whose_manifest_describes_the_engine(tiny_llama, tmp_path):
    """The package stage on an engine artifact (the plan's bytes are TensorRT's business): KIND_GPU,
    the TensorRT pin, the manifest's engine record; loading it without TensorRT says what is missing."""
    from llmc.compiler import build
    from llmc.compiler.artifacts import EngineModel, hash_outputs
    from llmc.compiler.repository.package import package
    from llmc.compiler.source import inspect_source
    from llmc.compiler.repository.triton_config import parse
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loop import ServingLoop

    spec = parse_spec({"name": "tiny-trt", "source": str(tiny_llama), "target": "tensorrt", "precision": "fp16"})
    result = build(spec, output=tmp_path / "out", until="export")
    spec, exported = result.spec, result.exported  # the spec with the limits the checkpoint decides
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    (engine_dir / "model.plan").write_bytes(b"serialized engine")
    layout = exported.kv_layout.model_copy(update={"dtype": "float16", "in_place": True, "max_prefill_rows": 1})
    info = _info(profiles={"prefill": {"input_ids": [[1, 2], [1, 512], [1, 8192]]}})
    engine = EngineModel(inputs_hash="x", files=hash_outputs(engine_dir, ["model.plan"]), plan="model.plan",
                         kv_layout=layout, tensorrt=info, verified="")
    manifest = package(spec, exported, engine, engine_dir, inspect_source(spec.source), tmp_path / "repo")
    model_dir = tmp_path / "repo" / "tiny-trt"
    config = parse((model_dir / "config.pbtxt").read_text())
    assert [g.kind for g in config.instance_group] == [config.instance_group[0].KIND_GPU]
    assert "tensorrt==10.14.1" in (model_dir / "requirements.txt").read_text().split()
    assert (model_dir / "1" / "llmc" / "runtime" / "runners" / "trt.py").is_file()
    loaded = RepositoryManifest.load(model_dir / "1")
    assert loaded == manifest and loaded.model_file == "model.plan" and loaded.tensorrt == info
    assert loaded.kv_layout.dtype == "float16" and loaded.kv_layout.bytes_per_token() * 2 == \
        exported.kv_layout.bytes_per_token()
    with pytest.raises(EngineLoadError, match="model.plan is a TensorRT engine .* lacks tensorrt"):
        ServingLoop.from_manifest(model_dir / "1")
