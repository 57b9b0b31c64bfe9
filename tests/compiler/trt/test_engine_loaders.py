"""The engine build's loaders (compiler/tensorrt/engine.py) and their composition in build_engine,
over a stand-in `tensorrt` module that records what the build asks of TensorRT's Python API (the
real build is marked `tensorrt`, test_tensorrt.py): nothing runs until the composed loader is
called; then the network is parsed, the config gets the options, one profile per entry with a shape
for every network input, the timing cache read and written back, progress reported, and failures
raise EngineError naming the ONNX file."""

import contextlib
import enum
import functools
import sys
import types

import pytest

from llmc.compiler.spec import TensorRTSpec
from llmc.compiler.tensorrt.engine import build_engine, create_config, engine_from_network, network_from_onnx
from llmc.compiler.tensorrt.profiles import Profile
from llmc.errors import EngineError

INPUTS = ["input_ids", "cache_position", "past_key_values.0.key", "past_key_values.0.value"]
KV = ((1, 2, 64, 8), (4, 2, 64, 8), (4, 2, 64, 8))
PROFILES = [Profile("prefill", {"input_ids": ((1, 2), (1, 32), (1, 64)), "cache_position": ((1,), (1,), (1,)),
                                "past_key_values.*": ((1, 2, 64, 8),) * 3}),
            Profile("decode", {"input_ids": ((1, 1), (4, 1), (4, 1)), "cache_position": ((1,), (4,), (4,)),
                               "past_key_values.*": KV})]


class _Config:
    progress_monitor = None

    def __init__(self):
        self.profiles, self.flags, self.cache = [], [], None

    def set_memory_pool_limit(self, pool, size):
        self.pool = (pool, size)

    def set_flag(self, flag):
        self.flags.append(flag)

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)

    def create_timing_cache(self, data):
        return types.SimpleNamespace(serialize=lambda: data + b"+timed")

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache = cache

    def get_timing_cache(self):
        return self.cache


class _Builder:
    def __init__(self, trt, logger):
        self.trt = trt
        trt.calls.append("builder")

    def create_network(self, flags):
        self.trt.calls.append(f"network flags {flags}")
        inputs = [types.SimpleNamespace(name=n) for n in INPUTS]
        return types.SimpleNamespace(num_inputs=len(inputs), get_input=inputs.__getitem__)

    def create_builder_config(self):
        self.trt.config = _Config()
        return self.trt.config

    def create_optimization_profile(self):
        shapes = {}
        return types.SimpleNamespace(shapes=shapes, set_shape=lambda name, *s: shapes.__setitem__(name, s))

    def build_serialized_network(self, network, config):
        self.trt.calls.append("build")
        m = config.progress_monitor
        if m is not None:  # an outer phase of two steps around an inner one
            m.phase_start("Build", None, 2)
            m.phase_start("Tactics", "Build", 7)
            m.step_complete("Tactics", 0)
            for step in range(2):
                m.step_complete("Build", step)
            m.phase_finish("Build")
        return self.trt.built


class _Parser:
    def __init__(self, trt, network, logger):
        self.trt, self.errors = trt, []

    def parse_from_file(self, path):
        self.trt.calls.append(f"parse {path}")
        self.errors = ["node 3: unsupported operator"] if path.endswith("bad.onnx") else []
        return not self.errors

    num_errors = property(lambda self: len(self.errors))

    def get_error(self, i):
        return self.errors[i]


def _fake_tensorrt(built: bytes | None):
    """The parts of TensorRT's Python API the build uses; `built` is what the builder returns."""
    trt = types.ModuleType("tensorrt")
    trt.__version__, trt.built, trt.calls = "10.14.1", built, []
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 5})
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    trt.HardwareCompatibilityLevel = enum.Enum("HardwareCompatibilityLevel", "AMPERE_PLUS SAME_COMPUTE_CAPABILITY")
    trt.BuilderFlag = enum.Enum("BuilderFlag", "VERSION_COMPATIBLE")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity: None})
    trt.IProgressMonitor = type("IProgressMonitor", (), {"__init__": lambda self: None})
    trt.Builder, trt.OnnxParser = functools.partial(_Builder, trt), functools.partial(_Parser, trt)
    return trt


@pytest.fixture
def fake_trt(monkeypatch):
    from llmc.plugins.trt import plugin as trt_plugin
    from llmc.runtime.runners import trt as trt_runner

    with contextlib.suppress(ImportError):  # notes at import whether TensorRT is here: must see the real answer
        import modelopt.onnx.trt_utils  # noqa: F401

    def install(built: bytes | None = b"engine bytes"):
        trt = _fake_tensorrt(built)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
        monkeypatch.setattr(trt_plugin, "set_target_capability", lambda c: trt.calls.append(f"plugin sm {c}"))
        monkeypatch.setattr(trt_plugin, "register", lambda: trt.calls.append("plugin registered"))
        return trt

    return install


def test_the_loaders_touch_nothing_until_the_composed_loader_is_called(fake_trt, tmp_path):
    trt = fake_trt()
    cache = tmp_path / "timing.cache"
    build = engine_from_network(network_from_onnx(tmp_path / "model.onnx"),
                                create_config(TensorRTSpec(), PROFILES, timing_cache=cache), save_timing_cache=cache)
    assert trt.calls == [] and not cache.exists()
    engine = build()
    assert engine.serialized == b"engine bytes" and engine.inputs == INPUTS
    assert trt.calls == ["builder", "network flags 32", f"parse {tmp_path / 'model.onnx'}", "build"]
    assert cache.read_bytes() == b"+timed"  # a new cache, written after the build


def test_build_engine_configures_records_profiles_carries_the_timing_cache_and_reports_progress(fake_trt, tmp_path):
    trt = fake_trt()
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"earlier")
    options = TensorRTSpec(workspace_gib=2, optimization_level=5, hardware_compatibility="ampere_plus",
                           version_compatible=True)
    progress = []
    info = build_engine(tmp_path / "model.onnx", PROFILES, options, "fp16", tmp_path / "engine", cache,
                        progress=lambda done, total: progress.append((done, total)))
    assert (tmp_path / "engine" / "model.plan").read_bytes() == b"engine bytes"
    assert trt.calls[:2] == ["plugin sm 80", "plugin registered"]  # ampere_plus PTX, registered before parsing
    config = trt.config
    assert config.pool == (trt.MemoryPoolType.WORKSPACE, 2 * 2**30) and config.builder_optimization_level == 5
    assert config.hardware_compatibility_level is trt.HardwareCompatibilityLevel.AMPERE_PLUS
    assert config.flags == [trt.BuilderFlag.VERSION_COMPATIBLE]
    assert [p.shapes["past_key_values.0.value"] for p in config.profiles] == [((1, 2, 64, 8),) * 3, KV]
    assert cache.read_bytes() == b"earlier+timed" and progress == [(0, 2), (1, 2), (2, 2)]
    assert (info.version, info.gpu, info.compute_capability) == ("10.14.1", "NVIDIA H100", "9.0")
    assert (info.precision, info.hardware_compatibility, info.version_compatible) == ("fp16", "ampere_plus", True)
    assert list(info.profiles) == ["prefill", "decode"] and list(info.profiles["decode"]) == INPUTS
    assert info.profiles["decode"]["input_ids"] == [[1, 1], [4, 1], [4, 1]]


def test_a_rejected_graph_a_failed_build_and_an_input_without_a_shape_raise_engine_errors(fake_trt, tmp_path):
    fake_trt()
    with pytest.raises(EngineError, match="ONNX parser rejected bad.onnx: node 3: unsupported operator"):
        build_engine(tmp_path / "bad.onnx", PROFILES, TensorRTSpec(), "fp16", tmp_path / "engine")
    partial = [Profile("decode", {"input_ids": ((1, 1), (4, 1), (4, 1))})]
    with pytest.raises(EngineError, match="profile decode: no shape for the network input 'cache_position'"):
        build_engine(tmp_path / "model.onnx", partial, TensorRTSpec(), "fp16", tmp_path / "engine")
    fake_trt(built=None)
    with pytest.raises(EngineError, match="could not build an engine from model.onnx .*workspace_gib"):
        build_engine(tmp_path / "model.onnx", PROFILES, TensorRTSpec(), "fp16", tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_the_engine_stage_turns_an_export_into_an_engine_artifact(fake_trt, tiny_llama, tmp_path):
    """make_engine over artifacts (verify off: the comparison runs the engine): prepared in fp16,
    built with the profiles of the export's KV shape, the artifact saved beside model.plan."""
    from llmc.compiler import build
    from llmc.compiler.artifacts import EngineModel
    from llmc.compiler.spec import parse_spec
    from llmc.compiler.tensorrt import stage

    spec = parse_spec({"name": "t", "source": str(tiny_llama), "target": "tensorrt", "precision": "fp16",
                       "limits": {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 32},
                       "serving": {"default_max_tokens": 8}, "verify": {"enabled": False}})
    exported = build(spec, output=tmp_path / "out", until="export").exported
    trt = fake_trt()

    def load_model():
        raise AssertionError("the model is loaded for the engine's verification only")

    engine = stage.make_engine(exported, tmp_path / "out" / "export", exported, spec, tmp_path / "engine",
                               inputs_hash="key", load_model=load_model, source_hash="source")
    assert f"parse {tmp_path / 'engine' / 'prepared' / 'model.onnx'}" in trt.calls
    assert sorted(p.name for p in (tmp_path / "engine").iterdir()) == ["engine.json", "model.plan"]
    assert EngineModel.load_cached(tmp_path / "engine", "key") == engine
    layout = engine.kv_layout
    assert (layout.dtype, layout.in_place, layout.max_prefill_rows) == ("float16", True, 1)
    kv = [exported.model.num_kv_heads, 64, exported.model.head_dim]
    assert engine.tensorrt.profiles["decode"]["past_key_values.0.key"] == [[1, *kv], [4, *kv], [4, *kv]]
    assert stage.summary(engine) == "model.plan: TensorRT 10.14.1, NVIDIA H100 (sm 9.0), fp16, profiles prefill, decode"
