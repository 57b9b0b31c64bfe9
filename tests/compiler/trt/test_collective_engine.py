"""A tensor-parallel rank's engine build (compiler/tensorrt/collectives.py through engine.py's loaders), over a
stand-in `tensorrt` whose parser makes the layers the test asks for: every DistCollective node of the graph must
come out as an IDistCollectiveLayer, a parser too old for the op is named in the error, and the builder config
turns on TensorRT 10.16's multi-device preview (TensorRT 11 has no such flag). The real 2-GPU build runs in
tests/gpu/test_tensorrt_parallel.py."""

import enum
import sys
import types

import pytest

from llmc.compiler.spec import TensorRTSpec
from llmc.compiler.tensorrt.engine import build_engine, create_config, network_from_onnx
from llmc.compiler.tensorrt.profiles import Profile
from llmc.errors import EngineError
from llmc.plugins.trt.collective_node import dist_collective_attributes

LayerType = enum.Enum("LayerType", "MATRIX_MULTIPLY SHUFFLE DIST_COLLECTIVE")
EXPECTED = [dist_collective_attributes("all_reduce", 2)] * 2 + [dist_collective_attributes("all_gather", 2)]
PROFILE = [Profile("decode", {"x": ((1, 8), (4, 8), (4, 8))})]


def _fake_tensorrt(version, layers, parses=True, preview=False):
    """`layers`: the layer types the parser's network holds; `preview`: TensorRT 10.16's PreviewFeature member."""
    trt = types.ModuleType("tensorrt")
    trt.__version__, trt.calls, trt.LayerType = version, [], LayerType
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 5})
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity: None})
    if preview:
        trt.PreviewFeature = enum.Enum("PreviewFeature", "MULTIDEVICE_RUNTIME_10_16 OTHER")
    network = types.SimpleNamespace(num_layers=len(layers), get_layer=lambda i: types.SimpleNamespace(type=layers[i]),
                                    num_inputs=1, get_input=lambda i: types.SimpleNamespace(name="x"))

    class Config:
        def set_memory_pool_limit(self, pool, size):
            pass

        def set_preview_feature(self, feature, on):
            trt.calls.append(f"preview {feature.name} {on}")

        def add_optimization_profile(self, profile):
            pass

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return network

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return types.SimpleNamespace(set_shape=lambda *a: None)

        def build_serialized_network(self, network, config):
            trt.calls.append("build")
            return b"rank engine"

    class Parser:
        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            return parses

        num_errors = 1

        def get_error(self, i):
            return "In node 7 (DistCollective): No importer registered for op: DistCollective"

    trt.Builder, trt.OnnxParser = Builder, Parser
    return trt


def _install(monkeypatch, trt):
    from llmc.plugins.trt import plugin as trt_plugin
    from llmc.runtime.runners import trt as trt_runner

    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    monkeypatch.setattr(trt_plugin, "set_target_capability", lambda c: None)
    monkeypatch.setattr(trt_plugin, "register", lambda: None)
    return trt


RANK_LAYERS = [LayerType.MATRIX_MULTIPLY, LayerType.DIST_COLLECTIVE, LayerType.DIST_COLLECTIVE, LayerType.SHUFFLE,
               LayerType.DIST_COLLECTIVE, LayerType.SHUFFLE]


def test_a_rank_network_keeps_every_collective_and_builds_with_the_10_16_preview(monkeypatch, tmp_path):
    trt = _install(monkeypatch, _fake_tensorrt("10.16.0", RANK_LAYERS, preview=True))
    build_engine(tmp_path / "rank0.onnx", PROFILE, TensorRTSpec(), "fp16", tmp_path / "engine", collectives=EXPECTED)
    assert trt.calls == ["preview MULTIDEVICE_RUNTIME_10_16 True", "build"]
    assert (tmp_path / "engine" / "model.plan").read_bytes() == b"rank engine"


def test_tensorrt_11_needs_no_preview_and_a_one_gpu_graph_asks_for_nothing(monkeypatch, tmp_path):
    trt = _install(monkeypatch, _fake_tensorrt("11.4.0", RANK_LAYERS))
    build_engine(tmp_path / "rank0.onnx", PROFILE, TensorRTSpec(), "fp16", tmp_path / "engine", collectives=EXPECTED)
    assert trt.calls == ["build"]
    trt = _install(monkeypatch, _fake_tensorrt("10.16.0", [LayerType.MATRIX_MULTIPLY], preview=True))
    build_engine(tmp_path / "whole.onnx", PROFILE, TensorRTSpec(), "fp16", tmp_path / "whole")
    assert trt.calls == ["build"]  # no collectives: no multi-device preview


def test_a_network_missing_collectives_is_refused(monkeypatch, tmp_path):
    _install(monkeypatch, _fake_tensorrt("11.4.0", RANK_LAYERS[:3]))
    with pytest.raises(EngineError, match=r"made 2 IDistCollectiveLayers from the 3 DistCollective nodes of r0.onnx"):
        network_from_onnx(tmp_path / "r0.onnx", EXPECTED)()


@pytest.mark.parametrize("version, hint", [
    ("10.15.1", r"parser imports from TensorRT 10.16 on, and this is TensorRT 10.15.1"),
    ("11.4.0", r"; the graph holds 3 DistCollective nodes \(tensor parallelism\)$")])
def test_a_parser_error_on_a_rank_graph_names_the_collectives(monkeypatch, tmp_path, version, hint):
    _install(monkeypatch, _fake_tensorrt(version, [], parses=False))
    with pytest.raises(EngineError, match=r"rejected r0.onnx: In node 7 .*" + hint):
        network_from_onnx(tmp_path / "r0.onnx", EXPECTED)()


def test_create_config_sets_the_preview_only_when_asked(monkeypatch):
    trt = _install(monkeypatch, _fake_tensorrt("10.16.0", [], preview=True))
    builder, network = trt.Builder(None), types.SimpleNamespace(num_inputs=1, get_input=lambda i: types.SimpleNamespace(
        name="x"))
    create_config(TensorRTSpec(), PROFILE)(builder, network)
    assert trt.calls == []
    create_config(TensorRTSpec(), PROFILE, multi_device=True)(builder, network)
    assert trt.calls == ["preview MULTIDEVICE_RUNTIME_10_16 True"]

