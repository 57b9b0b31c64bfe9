"""Activation calibration for static Q/DQ: the range (absolute max) of every activation that enters
a weight MatMul, measured by running the unquantized graph on ONNX Runtime CPU over token windows.

Methods (spec `quantization.calibration.method`):
- `max`: the largest |x| seen over all samples;
- `entropy`: the threshold minimizing the KL divergence between the fp32 and the quantized histogram;
- `percentile`: the 99.99th percentile of |x|, so a few outliers do not stretch the range.
`entropy` and `percentile` use ONNX Runtime's own `HistogramCollector` (the collector behind its
static quantizer); what is written here is `run_tensors` (also used by SmoothQuant and AWQ), which
exposes only the tensors needed, and the sample loop with its progress ticks. `activation_statistics`
gives the weight-only modes, in one pass, AWQ's activation rows and the per-channel importance (blockwise.py).

The result is kept as `calibration.json` next to the quantized graph, keyed by the graph (after
SmoothQuant, when it applies), the samples and the method, and reused while those are unchanged
(switching fp8 <-> int8 without SmoothQuant, or changing the quality gate, reuses it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from pydantic import BaseModel, ConfigDict

from llmc.compiler.hashing import hash_json
from llmc.runtime.layout import SEQUENCE_LENGTHS, KVLayout, step_lengths
from llmc.runtime.runners.paged import RowStep, pack

PERCENTILE, NUM_BINS, NUM_QUANTIZED_BINS = 99.99, 2048, 128
CACHE_NAME = "calibration.json"


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    method: str
    samples: int
    seq_len: int
    amax: dict[str, float]  # activation tensor -> calibrated absolute max

    def save(self, folder: Path) -> None:
        (folder / CACHE_NAME).write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load_cached(cls, folder: Path, key: str) -> "Calibration | None":
        try:
            cached = cls.model_validate(json.loads((folder / CACHE_NAME).read_text()))
        except (OSError, ValueError):
            return None
        return cached if cached.key == key else None


def calibration_key(graph_hash: str, windows: list[np.ndarray], method: str) -> str:
    return hash_json({"graph": graph_hash, "method": method,
                      "tokens": [hash_json(w.tolist()) for w in windows]})


def weight_matmul_inputs(graph) -> list[str]:
    """The activation input of every MatMul whose other input is an initializer (a linear layer)."""
    initializers = {t.name for t in graph.initializer}
    return list(dict.fromkeys(n.input[0] for n in graph.node
                              if n.op_type == "MatMul" and n.input[1] in initializers and n.input[0] not in initializers))


def feeds(layout: KVLayout, ids: np.ndarray) -> dict[str, np.ndarray]:
    """One prefill step of `ids` from an empty cache sized to the window (for a paged graph: one row
    over as many blocks as the window needs, logits for every token as in the slot graph)."""
    if layout.paged:
        blocks = -(-len(ids) // layout.block_size)
        step = pack([RowStep(ids.tolist(), 0, range(blocks), num_logits=len(ids))],  # every token reaches the LM head
                    block_size=layout.block_size, num_blocks=blocks, max_num_tokens=len(ids),
                    vocab_size=np.iinfo(np.int64).max, sequence_lengths=bool(layout.step_inputs))
        empty = np.zeros(layout.block_shape(blocks), dtype=layout.dtype)
        return {**step.feeds(), **{name: empty for name in layout.past_names()}}
    empty = np.zeros(layout.shape(1, len(ids)), dtype=layout.dtype)
    lengths = step_lengths(layout, np.zeros(1, dtype=np.int64), len(ids))  # LongRoPE: the window is the sequence
    return {"input_ids": ids[None].astype(np.int64), layout.positions: np.zeros(1, dtype=np.int64),
            **{name: empty for name in layout.past_names()}, **({SEQUENCE_LENGTHS: lengths} if lengths is not None else {})}


def _same_file_system(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False


def run_tensors(model, layout: KVLayout, windows: list[np.ndarray], tensors: list[str], num_threads: int,
                progress: Callable[[int, int], None] | None, *, graph_file: Path | None = None):
    """Yield, per window, {tensor: value [tokens, channels]} for the named tensors of `model` (an
    onnx ModelProto, weights loaded), run on ONNX Runtime CPU from an empty cache. ONNX Runtime's own
    calibrators would also record every MatMul output (the logits included); this exposes only
    what is asked for. `graph_file`: an ONNX file with external weights computing what `model` computes
    (the export `model` was loaded from, before its LM head was untied): its graph alone is rewritten and
    its weights file hard-linked, where serializing `model` would copy every weight on disk and in memory. The
    session does not prepack weights (it reads them from the mapped file): a pass over a few windows."""
    import onnx

    from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, save_model
    from llmc.runtime.runners.ort import make_session

    linked = graph_file is not None and (graph_file.parent / EXTERNAL_DATA_NAME).is_file()
    augmented = onnx.load(str(graph_file), load_external_data=False) if linked else onnx.ModelProto()
    if not linked:
        augmented.CopyFrom(model)
    del augmented.graph.output[:]
    augmented.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors)
    # the tensors keep their location, model.onnx.data: the export's, hard-linked (ONNX Runtime refuses a symbolic
    # link out of the model's folder); where the system temp folder is another file system (a tmpfs /tmp), the
    # folder goes beside the graph, never a copy of its weights (30 GB at 8B, into memory on a tmpfs)
    where = None if not linked or _same_file_system(graph_file.parent, Path(tempfile.gettempdir())) \
        else graph_file.parent
    with tempfile.TemporaryDirectory(prefix=".llmc-calibrate-" if where else "llmc-calibrate-", dir=where) as tmp:
        if linked:
            onnx.save(augmented, str(Path(tmp) / "model.onnx"))
            os.link(graph_file.parent / EXTERNAL_DATA_NAME, Path(tmp) / EXTERNAL_DATA_NAME)
        else:
            save_model(augmented, Path(tmp))
        del augmented
        session = make_session(Path(tmp) / "model.onnx", num_threads, prepack=False)
        start, tokens = time.perf_counter(), 0
        for done, ids in enumerate(windows, 1):
            values = session.run(tensors, feeds(layout, ids))
            tokens += len(ids)
            if progress:
                progress(done, len(windows), f"calibration windows, {tokens / (time.perf_counter() - start):.0f} tok/s")
            yield {name: v.reshape(-1, v.shape[-1]) for name, v in zip(tensors, values)}


def calibrate(model, layout: KVLayout, windows: list[np.ndarray], method: str, *, key: str, num_threads: int = 0,
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Ranges of `model`'s (an onnx ModelProto, weights loaded) linear-layer inputs over `windows`."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    tensors = weight_matmul_inputs(model.graph)
    collector = None if method == "max" else HistogramCollector(
        method=method, symmetric=True, num_bins=NUM_BINS, num_quantized_bins=NUM_QUANTIZED_BINS,
        percentile=PERCENTILE, scenario="same")
    amax = dict.fromkeys(tensors, 0.0)
    for values in run_tensors(model, layout, windows, tensors, num_threads, progress):
        if collector is None:
            for name, value in values.items():
                amax[name] = max(amax[name], float(np.abs(value).max()))
        else:
            with contextlib.redirect_stdout(io.StringIO()):  # the collector prints a line per call
                collector.collect({name: [value] for name, value in values.items()})
    if collector is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            result = collector.compute_collection_result()
        amax = {name: float(max(abs(result[name][0]), abs(result[name][1]))) for name in tensors}
    return Calibration(key=key, method=method, samples=len(windows), seq_len=len(windows[0]), amax=amax)


def activation_statistics(model, layout: KVLayout, windows: list[np.ndarray], rows_of: list[str], tokens: int, *,
                          num_threads: int = 0, graph_file: Path | None = None, progress=None, segmented: bool = False,
                          complete: Callable[[str, np.ndarray], None] | None = None
                          ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One calibration pass of `model` over `windows`, giving both what AWQ and the block search need:
    up to `tokens` rows [tokens, channels] of each tensor in `rows_of`, spread evenly over the windows
    (the activations AWQ scores its scales on), and E[x_k^2] per input channel of every linear layer's
    input (the importance blockwise.search weighs rounding errors by). A session over a big graph costs
    more than the windows it runs (tens of seconds at 0.5B), so there is one pass, not one per use.
    `graph_file`: see run_tensors. `segmented`: the pass runs `graph_file` a segment of weights at a time
    (graph/segments.py: a streamed build's, whose fp32 weights need not fit in memory at once). `complete(name,
    rows)`: given each tensor's rows as soon as every window has given them (segmented: as the segment making it
    ends), which are then not kept or returned: AWQ searches a layer's scales while the pass goes on, where every
    layer's rows held to the end grew with depth (0.9 GB at 8B)."""
    linear = weight_matmul_inputs(model.graph)
    per_window = max(1, tokens // len(windows))
    rows: dict[str, list[np.ndarray]] = {t: [] for t in rows_of}
    sums: dict[str, np.ndarray] = {}
    seen = dict.fromkeys(rows_of, 0)
    tensors = list(dict.fromkeys([*linear, *rows_of]))
    passes = (_segmented_tensors(graph_file, layout, windows, tensors, num_threads, progress) if segmented else
              enumerate(run_tensors(model, layout, windows, tensors, num_threads, progress, graph_file=graph_file)))
    for _, values in passes:  # a whole pass: every tensor of a window; a segmented one: a segment's, window by window
        for name in linear:
            if name in values:
                sums[name] = sums.get(name, 0.0) + np.square(values[name].astype(np.float64)).sum(0)
        for name in rows_of:
            if name in values:
                value = values[name]
                pick = np.linspace(0, len(value) - 1, min(per_window, len(value))).astype(int)
                rows[name].append(value[pick].astype(np.float32))
                seen[name] += 1
                if complete is not None and seen[name] == len(windows):
                    complete(name, np.concatenate(rows.pop(name))[:tokens])
    count = sum(map(len, windows))
    return ({name: np.concatenate(chunks)[:tokens] for name, chunks in rows.items()},
            {name: sums[name] / count for name in linear})


def _segmented_tensors(graph_file: Path, layout: KVLayout, windows: list[np.ndarray], tensors: list[str],
                       num_threads: int, progress):
    """(window index, {tensor: value [tokens, channels]}) as each segment of `graph_file` makes them."""
    from llmc.compiler.graph.segments import SegmentedGraph

    with SegmentedGraph(graph_file, num_threads=num_threads) as graph:
        start, per_window = time.perf_counter(), sum(map(len, windows)) / len(windows)

        def tick(done: int, total: int) -> None:
            if progress:
                rate = done / len(graph.segments) * per_window / (time.perf_counter() - start)
                progress(done, total, f"calibration windows through {len(graph.segments)} graph segments, "
                                      f"{rate:.0f} tok/s")

        for k, values in graph.run(len(windows), lambda k: feeds(layout, windows[k]), tensors, tick):
            yield k, {name: v.reshape(-1, v.shape[-1]) for name, v in values.items()}
