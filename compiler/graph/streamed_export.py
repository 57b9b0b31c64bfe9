"""The export, streamed: the graph traced on the first period of layers (loaded), every later layer's weights
read from the checkpoint only when the graph is written.

stamp.py grows the traced period into the whole graph; here every stamped layer's weight is an
`onnx_ir.LazyTensor` whose function loads its layer into the streamed model (model.py), rebuilds the decoder
over it (its derived tensors: fused QKV, experts) and returns the tensor (`LayerTensors`). onnx_ir's external
data writer then evaluates the initializers one at a time, in the order the layers were stamped, and writes
each to `model.onnx.data` (`save_streamed`): one layer in memory at a time. The exporter's own folding of a
weight's Transpose (onnxscript folds it whatever the size) would evaluate every layer at once, so a lazy
weight's Transpose is folded lazily first (`fold_lazy_transposes`). Written here: onnx_ir has lazy tensors and
a streaming writer, but nothing that ties a tensor to the layer a model must load for it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from llmc.compiler.graph import stamp
from llmc.compiler.graph.files import EXTERNAL_DATA_NAME
from llmc.compiler.graph.passes import simplify
from llmc.compiler.graph.tracing import quiet, trace_stamped, traced
from llmc.compiler.stream.model import StreamedModel
from llmc.errors import UnsupportedError

_INDEX = re.compile(r"^[^.]+\.[^.]+\.(\d+)(?:\.|$)")  # `decoder.<per-layer container>.<layer>...`


class LayerTensors:
    """The traced module's tensors of one layer at a time. `build(hf_model, layer)` makes the module that was traced
    (the decoder over the HF model, wrapped for its cache form), its tensors of `layer` real; the period's layers
    stay loaded. A layer's vectors (norms, biases: a hidden size or a few) are kept once read: the exporter's
    optimizer reads them by value (onnxscript's rewriter matching constants) on each of its passes, and each read
    loaded their layer again; it still reads each layer's first, so a stamped layer is read twice."""

    def __init__(self, streamed: StreamedModel, build: Callable, period: int):
        self.streamed, self.build, self.period = streamed, build, period
        self._layer: int | None = None
        self._named: dict = {}
        self._vectors: dict = {}  # name -> a copy, of every layer read so far
        self.loads = 0  # layers read: once for the optimizer's first read of its vectors, once when written

    def lazy(self, name: str) -> Callable[[], object]:
        """A function returning the traced module's tensor `name` (a per-layer one), read when called."""
        match = _INDEX.match(name)
        if match is None:
            raise ValueError(f"{name} is no per-layer tensor")
        layer = int(match[1])
        return lambda: self.get(name, layer)

    def get(self, name: str, layer: int):
        if name in self._vectors:
            return self._vectors[name]
        if self._layer != layer:
            if self._layer is not None and self._layer >= self.period:
                self.streamed.release_layer(self._layer)
            self._named = {}
            self.streamed.load_layer(layer)
            self._layer, self.loads = layer, self.loads + 1
            module = self.build(self.streamed.model, layer)
            self._named = dict([*module.named_parameters(remove_duplicate=False),
                                *module.named_buffers(remove_duplicate=False)])
            self._vectors.update({n: t.detach().clone() for n, t in self._named.items() if t.dim() <= 1
                                  and (m := _INDEX.match(n)) is not None and int(m[1]) == layer})
        return self._named[name].detach()

    @staticmethod
    def fold(graph) -> int:
        """What tracing runs on the stamped graph before the exporter's optimizer: fold_lazy_transposes."""
        return fold_lazy_transposes(graph)

    def close(self) -> None:
        self._named, self._vectors = {}, {}
        if self._layer is not None and self._layer >= self.period:
            self.streamed.release_layer(self._layer)
        self._layer = None


def export_streamed(streamed: StreamedModel, decoder, info, layout, table: dict, opset: int, out_dir: Path,
                    progress=None, rank: int = 0, ranks: int = 1):
    """The graph of `streamed` (its `decoder` built over the skeleton: shapes only) traced on its first period of
    layers, stamped, simplified and written to `out_dir`'s data file a layer at a time: (its proto, weights
    referring to that file; how many layers were stamped). `progress(done, total, what)`: layers done. With
    `ranks` > 1, rank `rank`'s graph (`info` and `layout`: the rank's heads and pools)."""
    from llmc.compiler.models import decoder_for
    from llmc.compiler.models.parallel import shard

    def cut(decoder, layers=None):  # the rank's share: of every layer loaded, or of `layers` only
        return decoder if ranks == 1 else shard.shard(decoder, rank, ranks, layers)

    period = stamp.layer_period(decoder)
    if period is None:
        raise UnsupportedError(f"{info.model_type}: its layers do not repeat, so its graph cannot be traced on a "
                               "period of them and stamped; set `source.load: whole`")
    for i in range(period):
        streamed.load_layer(i)
    layers = LayerTensors(streamed, lambda hf_model, layer: traced(cut(decoder_for(hf_model), {layer}), info, layout)[0],
                          period)
    try:
        decoder = cut(decoder_for(streamed.model))  # its period's derived tensors (fused QKV, experts, slices) loaded
        module, _, _, in_names = traced(decoder, info, layout)
        program, stamped = trace_stamped(decoder, period, module, info, layout, table, in_names,
                                         ["logits", *layout.present_names()], opset, layers=layers)
        if program is None:
            raise UnsupportedError(f"{info.model_type}: its traced layers are not self-contained, so the graph "
                                   "cannot be stamped; set `source.load: whole`")
        with quiet()[0]:
            simplify(program.model)
        what = "layers read and written" + (f" (rank {rank} of {ranks})" if ranks > 1 else "")
        written = None if progress is None else (
            lambda done, total: progress(period + layers.loads, info.num_layers, what))
        return save_streamed(program.model, out_dir, EXTERNAL_DATA_NAME, written), stamped
    finally:
        layers.close()
        for i in range(period):
            streamed.release_layer(i)


def fold_lazy_transposes(graph) -> int:
    """Each `Transpose` of a lazy initializer read by it alone becomes a lazy initializer of the transposed
    tensor (the exporter writes a Linear's weight as Transpose(W) and would fold it by evaluating W). Returns
    how many were folded."""
    import numpy as np
    import onnx_ir as ir

    folded = 0
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
        if source is None or not source.is_initializer() or not isinstance(source.const_value, ir.LazyTensor) \
                or len(list(source.uses())) != 1:
            continue
        out = node.outputs[0]
        perm = node.attributes.get_ints("perm", None) or list(reversed(range(len(source.shape))))
        tensor = source.const_value
        shape = ir.Shape([source.shape[p] for p in perm])
        lazy = ir.LazyTensor(lambda t=tensor, p=tuple(perm), n=out.name: ir.tensor(np.transpose(t.numpy(), p), name=n),
                             dtype=tensor.dtype, shape=shape, name=out.name)
        weight = ir.Value(name=out.name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
        graph.register_initializer(weight)
        out.replace_all_uses_with(weight)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        folded += 1
    return folded


def save_streamed(model, out_dir: Path, data_name: str, progress: Callable[[int, int], None] | None = None):
    """Write `model`'s initializers to `out_dir/data_name` one at a time (lazy ones evaluated as they are
    written) and return the model's proto, its weights referring to that file."""
    import onnx_ir as ir

    def written(tensor, info) -> None:
        if progress:
            progress(info.index + 1, info.total)

    (out_dir / data_name).unlink(missing_ok=True)
    ir.external_data.unload_from_model(model, out_dir, data_name, size_threshold_bytes=1024, max_workers=1,
                                       callback=written)
    return ir.serde.serialize_model(model)
