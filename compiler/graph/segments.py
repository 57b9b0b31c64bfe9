"""An exported graph run one segment at a time: a build's passes over the unquantized graph (AWQ's calibration,
the quality report's reference) in the memory of a segment, not of the model.

A session over the whole fp32 graph maps every weight: 4.6 GiB at 1.2B, 30 GiB at 8B, more than a 24 GB host
holds beside anything else. Here the graph's nodes, in topological order, are cut into segments of at most
`budget` bytes of weights each (a node holding more is a segment of its own). Each segment is a graph of its own,
its weights referring to the same data file (hard-linked beside it), its inputs the values earlier segments
made or the graph's inputs, its outputs what later segments read and what the caller asked for. The segments run
in order, each over every input (each window), so a segment's session opens once: what runs at a time is one
segment's weights, and what is kept is the values that cross a cut (the hidden state, the rotary tables), per
window.

Only a forward from given inputs to given outputs runs this way (a prefill from an empty cache): a decode that
carries a KV cache from step to step would open every segment again at every step. Written here because ONNX
Runtime runs a graph whole (its external-data loading has no notion of a part) and onnx's `Extractor` cuts by
names, with no notion of a weight budget or of values carried between the cuts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, ONNX_NAME

SEGMENT_BYTES = 1 << 30  # weights per segment: a decoder layer of an 8B (0.8 GiB fp32), or several smaller ones


def _inputs(node) -> list[str]:
    """The values `node` reads: its inputs, and those its subgraphs read from the enclosing graph."""
    import onnx

    names = [n for n in node.input if n]
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for graph in graphs:
            inner = {n for g in [graph] for n in [*(i.name for i in g.input), *(t.name for t in g.initializer)]}
            for sub in graph.node:
                names += [n for n in _inputs(sub) if n not in inner]
                inner.update(sub.output)
    return names


def _weight_bytes(tensor) -> int:
    where = {e.key: e.value for e in tensor.external_data}
    return int(where["length"]) if "length" in where else len(tensor.raw_data)


def cut(graph, budget: int) -> list[list[int]]:
    """Indices of `graph`'s nodes (topologically ordered) per segment, each segment's weights at most `budget`
    bytes (a node whose own weights pass it alone: a segment of its own)."""
    sizes = {t.name: _weight_bytes(t) for t in graph.initializer}
    segments: list[list[int]] = [[]]
    held, seen = 0, set()
    for i, node in enumerate(graph.node):
        new = {n for n in _inputs(node) if n in sizes and n not in seen}
        cost = sum(sizes[n] for n in new)
        if segments[-1] and cost and held + cost > budget:
            segments.append([])
            held, seen = 0, set()
            new = {n for n in _inputs(node) if n in sizes}
            cost = sum(sizes[n] for n in new)
        segments[-1].append(i)
        held += cost
        seen |= new
    return segments


class SegmentedGraph:
    """The graph at `graph_file` (external weights in its data file) cut into segments (`cut`). `run` runs
    them; `close` (or the context manager) removes the segments' files."""

    def __init__(self, graph_file: Path, *, budget: int | None = None, num_threads: int = 0):
        import onnx

        graph_file = Path(graph_file)
        self.model = onnx.load(str(graph_file), load_external_data=False)
        self.num_threads = num_threads
        graph = self.model.graph
        self.segments = cut(graph, budget or SEGMENT_BYTES)
        self._dir = Path(tempfile.mkdtemp(prefix="llmc-segments-"))
        data = graph_file.parent / EXTERNAL_DATA_NAME
        if data.is_file():  # the segments' weights keep their location: ONNX Runtime refuses a symbolic link out
            try:  # of the model's folder, so a hard link
                os.link(data, self._dir / EXTERNAL_DATA_NAME)
            except OSError:  # across file systems (a tmpfs /tmp): beside the graph, never a copy (30 GB at 8B)
                shutil.rmtree(self._dir)
                self._dir = Path(tempfile.mkdtemp(prefix=".llmc-segments-", dir=graph_file.parent))
                os.link(data, self._dir / EXTERNAL_DATA_NAME)
        # the last segment reading each value, and which segment makes it (-1: a graph input)
        self._made = {n: -1 for n in (i.name for i in graph.input)}
        self._last: dict[str, int] = {}
        for s, indices in enumerate(self.segments):
            for i in indices:
                node = graph.node[i]
                for name in _inputs(node):
                    self._last[name] = s
                for name in node.output:
                    self._made[name] = s

    def __enter__(self) -> "SegmentedGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def run(self, count: int, inputs: Callable[[int], dict[str, np.ndarray]], wanted: list[str],
            progress: Callable[[int, int], None] | None = None, *, chain: Mapping[str, str] | None = None,
            previous: Callable[[int], int | None] | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Run the graph on `count` inputs (`inputs(k)`: the k-th's graph inputs, made again as each segment
        asks: an empty KV cache per layer need not be held for every input at once) and yield
        `(k, {name: value})` as each segment makes the `wanted` values for input k: a value is yielded once, by
        the segment that makes it; the values of one name come in the order of k.

        Steps of a sequence (a decode): `chain` maps an output to the graph input the sequence's next step reads
        it as (a layer's present KV to its past), and `previous(k)` names the earlier input whose chained outputs
        input k reads (None: `inputs(k)`'s own). Each segment then runs a sequence's steps in order, its KV cache
        carried from step to step as the whole graph's would be."""
        missing = [n for n in [*wanted, *(chain or {})] if n not in self._made]
        if missing:
            raise KeyError(f"the graph has no value {missing[0]}")
        chain = dict(chain or {})
        initializers = {t.name for t in self.model.graph.initializer}
        carried: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
        total, done = count * len(self.segments), 0
        for s in range(len(self.segments)):
            needs, outputs = self._interface(s, initializers, set(wanted) | set(chain))
            links = {out: chain[out] for out in outputs if out in chain}
            held: dict[int, dict[str, np.ndarray]] = {}  # input k -> its chained outputs, under the names read
            if not outputs:  # what it makes nothing reads (the KV cache's outputs, the logits of a calibration)
                done += count
                if progress:
                    progress(done, total)
                continue
            session = None
            for k in range(count):
                before = previous(k) if previous is not None else None
                given = inputs(k) if any(self._made[n] < 0 for n in needs) else {}
                if before is not None:
                    given = {**given, **held.pop(before, {})}
                feeds = {n: carried[k][n] if self._made[n] >= 0 else given[n] for n in needs}
                if session is None:
                    session = self._session(s, feeds, outputs)
                values = dict(zip(outputs, session.run(outputs, feeds)))
                if links:
                    held[k] = {name: values[out] for out, name in links.items()}
                for name in [n for n in carried[k] if self._last.get(n, -1) <= s]:
                    del carried[k][name]
                carried[k].update({n: v for n, v in values.items() if self._last.get(n, -1) > s})
                done += 1
                if progress:
                    progress(done, total)
                got = {n: values[n] for n in wanted if n in values}
                if got:
                    yield k, got
            del session

    def _interface(self, s: int, initializers: set[str], wanted: set[str]) -> tuple[list[str], list[str]]:
        """Segment `s`'s inputs (made before it) and outputs (read after it, or wanted)."""
        nodes = [self.model.graph.node[i] for i in self.segments[s]]
        made = {n for node in nodes for n in node.output if n}
        needs = list(dict.fromkeys(n for node in nodes for n in _inputs(node)
                                   if n not in made and n not in initializers))
        outputs = [n for n in dict.fromkeys(made) if self._last.get(n, -1) > s or n in wanted]
        return needs, outputs

    def _session(self, s: int, feeds: dict[str, np.ndarray], outputs: list[str]):
        """Segment `s` as a graph of its own (its inputs typed after `feeds`), saved beside the data file, and
        a session over it that reads its weights from the mapped file (no prepacked copy, no prefetch of the
        whole file)."""
        import onnx
        from onnx import helper

        from llmc.runtime.runners.ort import make_session

        graph = self.model.graph
        nodes = [graph.node[i] for i in self.segments[s]]
        read = {n for node in nodes for n in _inputs(node)}
        part = helper.make_graph(
            nodes, f"{graph.name}.segment{s}",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), None) for n, v in feeds.items()],
            [helper.make_value_info(n, onnx.TypeProto()) for n in outputs],
            [t for t in graph.initializer if t.name in read])
        model = helper.make_model(part, opset_imports=self.model.opset_import, ir_version=self.model.ir_version)
        model.functions.extend(self.model.functions)
        path = self._dir / f"segment{s}.{ONNX_NAME}"
        onnx.save(model, str(path))
        return make_session(path, self.num_threads, prepack=False, prefetch=False)
