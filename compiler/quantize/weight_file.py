"""A graph's weights where they lie, read and written one tensor at a time: the weight-only quantizer's store.

The quantizer untied the LM head, scaled weights for AWQ, searched codes and packed them with the whole fp32
graph loaded in memory: three to four times the model at its peak (1B int4: 19-20 GiB). Here the graph is
loaded without its weights; an export whose weights are in `model.onnx.data` has every tensor read from that
file when asked (`array`: a copy of that tensor alone). The export's file, hard-linked into the build's output,
is never written: a tensor given a new value (`write`), or a new tensor (`add`: the untied LM head, a site's own
copy of a shared norm, the packed codes), goes to a scratch file beside the graph being made (in place when it is
there already and as large). AWQ's and SmoothQuant's rescaling is recorded and applied whenever the weight is read:
a reader's rows multiplied (`scale_rows`), a producer's entries divided (`divide`: up_proj's columns for down_proj's
scales, v_proj's for o_proj's, a norm's weight). Every such weight is rescaled and then only read to be rounded, and
written back it was the fp32 model again on disk (30 GB at 8B, beside the export's own: the rows), or its MLP's up
projections (7.5 GB at 8B: the columns, measured at 4 layers of a 1B width as 256 of the scratch's 932 MiB).
`save` writes the graph the runtime runs, its weights copied a tensor at a time. A graph whose weights are inline
(under the export's external-data threshold) stays as it was: in memory.

Written here because onnx and onnx_ir read external data only whole (onnx.load_external_data_for_model) or
as read-only maps (onnx_ir's ExternalTensor), and neither writes a tensor back into its file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from llmc.compiler.graph.files import (EXTERNAL_DATA_NAME, EXTERNAL_THRESHOLD, ONNX_NAME, external_span, load_graph,
                                       save_model)
from llmc.errors import ExportError

SCRATCH = "weights.data"
_ALIGN = 64  # appended tensors start on a 64-byte boundary (vector loads of a mapped tensor)


class WeightFile:
    """The initializers of `model` (an onnx ModelProto): inline ones in the proto, external ones in the files of
    `files` (a location -> its path: the export's data file, read only, and the scratch file `path`)."""

    def __init__(self, model, path: Path | None, graph=None, files: dict[str, Path] | None = None):
        self.model, self.path = model, path
        self.graph = graph if graph is not None else model.graph
        self.files = {**(files or {}), **({SCRATCH: path} if path is not None else {})}
        # tensor -> the rescalings its stored value is read with, in the order they were made (their float32
        # rounding is the order's): ("mul", rows' s) or ("div", (s, axis, start))
        self._scales: dict[str, list[tuple[str, object]]] = {}

    @classmethod
    def open(cls, source: Path, work: Path, *, whole: bool = False) -> "WeightFile":
        """The graph at `source`, its weights (if external) read from its data file, what is written going to a
        scratch file under `work`; `whole`: every weight loaded into the proto instead (what code that reads the
        proto directly needs)."""
        import onnx

        data = source.parent / EXTERNAL_DATA_NAME
        if whole or not data.is_file():
            return cls(load_graph(source), None)
        model = onnx.load(str(source), load_external_data=False)
        for tensor in model.graph.initializer:
            if _external(tensor):
                external_span(tensor, source)  # an ExportError naming a tensor stored anywhere else
        (work / SCRATCH).touch()
        return cls(model, work / SCRATCH, files={EXTERNAL_DATA_NAME: data})

    @classmethod
    def of(cls, graph) -> "WeightFile":
        """A store over `graph` (a GraphProto) whose weights are all in the proto."""
        return cls(None, None, graph)

    @property
    def external(self) -> bool:
        return self.path is not None

    def initializers(self) -> dict:
        return {t.name: t for t in self.graph.initializer}

    def array(self, tensor) -> np.ndarray:
        """`tensor`'s value (a copy), its recorded row scales applied."""
        from onnx import numpy_helper

        if not _external(tensor):
            return numpy_helper.to_array(tensor)
        value = np.frombuffer(self._read(tensor), dtype=_numpy_dtype(tensor.data_type)).reshape(tuple(tensor.dims))
        value = value.copy()
        for op, arg in self._scales.get(tensor.name, ()):
            if op == "mul":
                value *= arg[:, None]  # as the scaled weight was computed and stored before: v * s, in float32
            else:
                value = divided(value, *arg)
        return value

    def scale_rows(self, tensor, s: np.ndarray) -> None:
        """`tensor` [K, N] with row k multiplied by s[k]: recorded and applied as it is read (`array`, `save`)."""
        if not _external(tensor):
            self.write(tensor, self.array(tensor) * s[:, None])
        else:
            self._scales.setdefault(tensor.name, []).append(("mul", np.asarray(s, dtype=np.float32)))

    def divide(self, tensor, s: np.ndarray, axis: int, start: int) -> None:
        """`tensor` with its entries start .. start + len(s) along `axis` divided by s (`divided`): recorded and
        applied as it is read, as `scale_rows` is."""
        if not _external(tensor):
            self.write(tensor, divided(self.array(tensor), s, axis, start))
        else:
            self._scales.setdefault(tensor.name, []).append(("div", (np.asarray(s), axis, start)))

    def write(self, tensor, value: np.ndarray) -> None:
        """`tensor` given `value` (its dtype kept): in the scratch file, in place where it lies there already and
        is as large, else appended (the export's file is never written)."""
        from onnx import numpy_helper

        value = np.ascontiguousarray(value, dtype=_numpy_dtype(tensor.data_type))
        if not _external(tensor):
            if tensor.HasField("raw_data"):
                tensor.raw_data = value.tobytes()  # in place: from_array and CopyFrom would copy it twice more
            else:
                tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
            return
        self._scales.pop(tensor.name, None)
        where, offset, length = self._span(tensor)
        if where == SCRATCH and value.nbytes == length:
            with open(self.path, "r+b") as f:
                f.seek(offset)
                f.write(value.tobytes())
        else:
            _locate(tensor, SCRATCH, self._append(value), value.nbytes)
        del tensor.dims[:]
        tensor.dims.extend(value.shape)

    def add(self, name: str, value: np.ndarray):
        """A new initializer `name` holding `value`, in the graph (appended to the scratch file when external)."""
        from onnx import numpy_helper

        value = np.ascontiguousarray(value)
        if not self.external or value.nbytes < 1024:
            tensor = numpy_helper.from_array(value, name)
        else:
            tensor = numpy_helper.from_array(np.zeros((0,), value.dtype), name)
            tensor.ClearField("raw_data")
            del tensor.dims[:]
            tensor.dims.extend(value.shape)
            _locate(tensor, SCRATCH, self._append(value), value.nbytes)
        self.graph.initializer.append(tensor)
        return self.graph.initializer[-1]  # the graph's own: append copied the message

    def inline(self, tensor) -> None:
        """`tensor`'s bytes into the proto (a small graph saved inline)."""
        if _external(tensor):
            raw = self.array(tensor).tobytes()
            self._scales.pop(tensor.name, None)
            del tensor.external_data[:]
            tensor.data_location = 0  # TensorProto.DEFAULT
            tensor.raw_data = raw

    def save(self, out_dir: Path, external_threshold: int = EXTERNAL_THRESHOLD) -> bool:
        """Write `out_dir/model.onnx` (and `model.onnx.data` past the threshold, as files.save_model decides) with
        the graph's initializers that nodes use; returns whether weights went to external data."""
        import onnx

        graph = self.model.graph
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        for tensor in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(tensor)
        if not self.external:
            return save_model(self.model, out_dir, external_threshold)
        total = sum(self._span(t)[2] if _external(t) else len(t.raw_data) for t in graph.initializer)
        if total <= external_threshold:
            for tensor in graph.initializer:
                self.inline(tensor)
            return save_model(self.model, out_dir, external_threshold)
        data = out_dir / EXTERNAL_DATA_NAME
        # the scratch file's disk blocks go as the graph's data file grows: first what no saved tensor reads (a
        # tied LM head's fp32 copy, once it is quantized), then each tensor once copied, the scratch's first;
        # else the two files are whole on disk at once (the quantize stage's peak: 6 GB more at 8B)
        spans = {t.name: self._span(t) for t in graph.initializer if _external(t)}
        scratch = sorted((offset, length) for where, offset, length in spans.values() if where == SCRATCH)
        _release_blocks(self.path, _gaps(scratch, self.path.stat().st_size))
        with open(data, "wb") as dst:
            for tensor in sorted(graph.initializer, key=lambda t: spans.get(t.name, ("",))[0] != SCRATCH):
                if _external(tensor):
                    where, start, length = spans[tensor.name]
                    raw = self.array(tensor).tobytes() if tensor.name in self._scales else self._read(tensor)
                elif tensor.HasField("raw_data") and len(tensor.raw_data) >= 1024:
                    where, raw = None, tensor.raw_data
                    tensor.ClearField("raw_data")
                else:
                    continue
                offset = _pad(dst)
                dst.write(raw)
                _locate(tensor, EXTERNAL_DATA_NAME, offset, len(raw))
                if where == SCRATCH:
                    _release_blocks(self.path, [(start, length)])
        onnx.save_model(self.model, str(out_dir / ONNX_NAME))
        shutil.copymode(out_dir / ONNX_NAME, data)
        return True

    def _span(self, tensor) -> tuple[str, int, int]:
        """(location, offset, length) of an external `tensor`: the export's data file or the scratch file."""
        where = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if where not in self.files:
            raise ExportError(f"{tensor.name} is stored in {where!r}, not in {' or '.join(map(repr, self.files))}")
        return (where, *external_span(tensor, self.files[where], where))

    def _read(self, tensor) -> bytes:
        """An external `tensor`'s bytes, as stored (no row scales)."""
        where, offset, length = self._span(tensor)
        with open(self.files[where], "rb") as f:
            f.seek(offset)
            return f.read(length)

    def _append(self, value: np.ndarray) -> int:
        with open(self.path, "r+b") as f:
            f.seek(0, 2)
            offset = _pad(f)
            f.write(value.tobytes())
        return offset


def divided(value: np.ndarray, s: np.ndarray, axis: int, start: int) -> np.ndarray:
    """`value` (as float32, a copy) with its entries start .. start + len(s) along `axis` (0 for a vector) divided by
    s: SmoothQuant's and AWQ's producer side."""
    out = value.astype(np.float32, copy=True)
    index = [slice(None)] * out.ndim
    index[axis if out.ndim > 1 else 0] = slice(start, start + len(s))
    out[tuple(index)] /= s if axis == 0 or out.ndim == 1 else s[None, :]
    return out


def _gaps(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges of a file of `size` bytes that none of the sorted (offset, length) `spans` cover."""
    gaps, end = [], 0
    for offset, length in spans + [(size, 0)]:
        if offset > end:
            gaps.append((end, offset - end))
        end = max(end, offset + length)
    return gaps


_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)


def _release_blocks(path: Path, ranges: list[tuple[int, int]]) -> bool:
    """Give the disk blocks of `ranges` of the file at `path` back to the file system (they read as zeros after),
    keeping its size: fallocate's FALLOC_FL_PUNCH_HOLE, through ctypes (os has posix_fallocate, which only
    allocates). False where the C library or the file system cannot (not Linux, or a file system without holes):
    the blocks then stay until the file is removed."""
    import ctypes
    import ctypes.util
    import os

    try:
        fallocate = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).fallocate
    except (OSError, AttributeError):
        return False
    fallocate.argtypes, fallocate.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    fd = os.open(path, os.O_WRONLY)
    try:
        return all(fallocate(fd, _PUNCH_HOLE, offset, length) == 0 for offset, length in ranges if length > 0)
    finally:
        os.close(fd)


def _pad(f) -> int:
    """Pad the open file `f` (at its end) to the alignment; the offset where the next tensor starts."""
    end = f.tell()
    start = -(-end // _ALIGN) * _ALIGN
    f.write(b"\0" * (start - end))
    return start


def _external(tensor) -> bool:
    import onnx

    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _locate(tensor, location: str, offset: int, length: int) -> None:
    import onnx

    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _numpy_dtype(data_type: int):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(data_type)
