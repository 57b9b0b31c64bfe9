"""The files an ONNX graph is kept in: `model.onnx`, and its weights in `model.onnx.data` past a threshold,
written with the graph's file mode and read back by llmc itself (onnx's loader refuses the hard-linked data
files llmc's stage cache makes)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from llmc.errors import ExportError

ONNX_NAME = "model.onnx"
EXTERNAL_DATA_NAME = "model.onnx.data"
# Weights above this many bytes go to model.onnx.data (protobuf caps a file at 2 GiB in any case). A session
# then reads them from that file, and an edit of the graph before a session (cpu_kernels.prepare's op swap
# and paged threads, calibration's extra outputs) loads and re-serializes the graph alone: inline, SmolLM2's
# 540 MB made a session take 5.2 s (1.1 s now), and a 0.5B graph three copies in memory.
EXTERNAL_THRESHOLD = 64 * 2**20


def save_model(proto, out_dir: Path, external_threshold: int = EXTERNAL_THRESHOLD) -> bool:
    """Write `out_dir/model.onnx`, weights in `model.onnx.data` when they pass `external_threshold` bytes.
    Returns whether they went to external data."""
    import onnx
    from onnx import external_data_helper

    # raw_data's length, not ByteSize(): protobuf's ByteSize walks every field and cost 1.9 s over a 0.5B graph
    external = sum(len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()
                   for t in proto.graph.initializer) > external_threshold
    if external:
        # What onnx.save_model(save_as_external_data=True) does, less its check that `location` does not exist,
        # which it makes relative to the working directory, not the model's folder (onnx 1.2x): a build run from a
        # folder holding a model.onnx.data (a rank's worker in its graph's) would fail. onnx appends to an existing
        # data file, so the one there is removed first.
        (out_dir / EXTERNAL_DATA_NAME).unlink(missing_ok=True)
        for tensor in external_data_helper._get_initializer_tensors(proto):
            if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= 1024:  # as onnx measures
                external_data_helper.set_external_data(tensor, EXTERNAL_DATA_NAME)
    onnx.save_model(proto, out_dir / ONNX_NAME)
    if external:  # onnx writes the data file owner-only (0600): give it the graph's mode, for a server's user
        shutil.copymode(out_dir / ONNX_NAME, out_dir / EXTERNAL_DATA_NAME)
    return external


def load_graph(path: Path):
    """`path`'s ONNX model with its weights, its data file read here rather than by onnx: onnx's loader
    refuses a data file with more than one hard link (its guard against a graph naming a linked system
    file), and llmc hard-links its own outputs (a cached stage into the next build, a graph into the
    repository), so a rebuild that re-quantized a cached export could not load it."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return model
    with open(path.parent / EXTERNAL_DATA_NAME, "rb") as data:
        for tensor in external:
            offset, length = external_span(tensor, path)
            data.seek(offset)
            tensor.raw_data = data.read(length)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return model


def external_span(tensor, graph: Path, location: str = EXTERNAL_DATA_NAME) -> tuple[int, int]:
    """(offset, length) of an external `tensor` of the graph at `graph` in its data file `location`; an
    ExportError naming the tensor when it is stored anywhere else."""
    where = {e.key: e.value for e in tensor.external_data}
    if where.get("location") != location:
        raise ExportError(f"{graph}: {tensor.name} is stored in {where.get('location')!r}, not in llmc's {location}")
    return int(where.get("offset", 0)), int(where["length"])
