"""The files an ONNX graph is kept in: `model.onnx`, and its weights in `model.onnx.data` past a threshold,
written with the graph's file mode and read back by llmc itself (onnx's loader refuses the hard-linked data
files llmc's stage cache makes)."""

from __future__ import annotations

import shutil
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

    external = sum(t.ByteSize() for t in proto.graph.initializer) > external_threshold
    onnx.save_model(proto, out_dir / ONNX_NAME, save_as_external_data=external, all_tensors_to_one_file=True,
                    location=EXTERNAL_DATA_NAME, size_threshold=1024)
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
            where = {e.key: e.value for e in tensor.external_data}
            if where.get("location") != EXTERNAL_DATA_NAME:
                raise ExportError(f"{path}: {tensor.name} is stored in {where.get('location')!r}, not in llmc's "
                                  f"{EXTERNAL_DATA_NAME}")
            data.seek(int(where.get("offset", 0)))
            tensor.raw_data = data.read(int(where["length"]))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return model
