"""A tensor-parallel rank's engine: what the build asks of TensorRT beyond a one-GPU engine.

prep.py has rewritten the rank's `llmc.AllReduce` / `llmc.AllGather` nodes to TensorRT's ONNX op `DistCollective`
(plugins/trt/collective_node.py), so TensorRT's ONNX parser makes the IDistCollectiveLayers itself. Here:

    expected_collectives(path)   the DistCollective nodes of the prepared ONNX (read without its weights)
    check_network(trt, network, expected, name)
                                 after parsing: as many layers of type LayerType.DIST_COLLECTIVE as the graph has
                                 nodes, else EngineError (a parser that dropped or did not know them)
    parse_hint(trt, expected)    what to add to a parser error about a graph with collectives: the op came with
                                 TensorRT 10.16's parser
    enable_multi_device(trt, config)
                                 TensorRT 10.16 ships multi-device execution as a preview feature
                                 (PreviewFeature.MULTIDEVICE_RUNTIME_10_16, as NVIDIA's sampleDistCollective sets
                                 it); TensorRT 11 has it generally available and no such flag: nothing to set

Each rank's engine is a separate build with its own graph (its weights are its shard); the collectives meet at run
time through the NCCL communicator each execution context is given (runtime/runners/parallel/trt_rank.py). Functions
take the `tensorrt` module as an argument and are called from engine.py's loaders, which import it when called.
"""

from __future__ import annotations

from pathlib import Path

from llmc.errors import EngineError
from llmc.plugins.trt.collective_node import dist_collectives

MULTI_DEVICE_PREVIEW = "MULTIDEVICE_RUNTIME_10_16"  # trt.PreviewFeature member in TensorRT 10.16 only
FIRST_VERSION = (10, 16)  # the first TensorRT whose ONNX parser imports DistCollective


def expected_collectives(path: Path) -> list[dict]:
    """The attributes of each DistCollective node of the ONNX file `path` (its weights are not read)."""
    import onnx

    return dist_collectives(onnx.load(str(path), load_external_data=False))


def _version(trt) -> tuple[int, int]:
    major, minor = trt.__version__.split(".")[:2]
    return int(major), int(minor)


def parse_hint(trt, expected: list[dict]) -> str:
    """A clause for a parser error about a graph holding `expected` collectives ('' when it holds none)."""
    if not expected:
        return ""
    if _version(trt) < FIRST_VERSION:
        return (f"; the graph holds {len(expected)} DistCollective nodes (tensor parallelism), which TensorRT's ONNX "
                f"parser imports from TensorRT 10.16 on, and this is TensorRT {trt.__version__}")
    return f"; the graph holds {len(expected)} DistCollective nodes (tensor parallelism)"


def collective_layers(trt, network) -> int:
    """How many layers of `network` are IDistCollectiveLayers."""
    kind = trt.LayerType.DIST_COLLECTIVE
    return sum(network.get_layer(i).type == kind for i in range(network.num_layers))


def check_network(trt, network, expected: list[dict], name: str) -> None:
    """Refuse a parsed rank network whose collectives are not the graph's, one layer per DistCollective node."""
    if not expected:
        return
    found = collective_layers(trt, network)
    if found != len(expected):
        raise EngineError(f"TensorRT {trt.__version__}'s ONNX parser made {found} IDistCollectiveLayers from the "
                          f"{len(expected)} DistCollective nodes of {name}; a rank's engine needs every collective")


def enable_multi_device(trt, config) -> bool:
    """Turn on TensorRT 10.16's multi-device preview where this TensorRT has it; returns whether it did."""
    preview = getattr(trt, "PreviewFeature", None)
    if preview is None or not hasattr(preview, MULTI_DEVICE_PREVIEW):
        return False
    config.set_preview_feature(getattr(preview, MULTI_DEVICE_PREVIEW), True)
    return True
