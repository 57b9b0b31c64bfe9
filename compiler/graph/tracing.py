"""What torch.onnx.export traces for a KV layout (the module, its example inputs, its dynamic shapes and the graph's
input names: the slot form here, the decoder with its caches as one flat tuple; the paged form is
compiler/paged_decoder.py's), and the trace itself: the whole decoder, or its first layers with the rest stamped
from them (stamp.py)."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

from llmc.compiler.artifacts import ModelInfo
from llmc.compiler.graph import stamp
from llmc.errors import ExportError
from llmc.runtime.layout import KVLayout


def _flat(decoder):
    """The decoder with its caches as one flat tuple `(k0, v0, k1, v1, ...)` in and out."""
    import torch

    class FlatCacheDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = decoder

        def forward(self, input_ids, cache_position, past, sequence_lengths=None):
            logits, keys, values = self.decoder(input_ids, cache_position, list(past[0::2]), list(past[1::2]),
                                                sequence_lengths)
            return (logits, *(t for pair in zip(keys, values) for t in pair))

    return FlatCacheDecoder().eval()


def _example_inputs(info: ModelInfo, layout: KVLayout):
    import torch

    batch, seq, capacity = 2, 3, 16  # all > 1 and distinct, so no dim is specialized to a constant
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, info.vocab_size, (batch, seq), generator=gen)
    cache_position = torch.tensor([4, 2])
    past = tuple(torch.zeros(layout.shape(batch, capacity)) for _ in range(2 * layout.num_layers))
    return (input_ids, cache_position, past) + ((torch.tensor([9, 5]),) if layout.step_inputs else ())


def _dynamic_shapes(layout: KVLayout):
    from torch.export import Dim

    batch, seq, capacity = Dim("batch"), Dim("sequence_length"), Dim(layout.dims[2])
    return {
        "input_ids": {0: batch, 1: seq},
        "cache_position": {0: batch},
        "past": tuple({0: batch, 2: capacity} for _ in range(2 * layout.num_layers)),
        **({"sequence_lengths": {0: batch}} if layout.step_inputs else {}),
    }


def traced(decoder, info: ModelInfo, layout: KVLayout) -> tuple:
    """What torch.onnx.export traces for this layout: the module, example inputs, dynamic shapes and
    the graph's input names (the slot form here, the paged form in paged_decoder.py)."""
    if layout.paged:
        from llmc.compiler import paged_decoder

        return (paged_decoder.PagedDecoder(decoder).eval(), paged_decoder.example_inputs(info.vocab_size, layout),
                paged_decoder.dynamic_shapes(layout), paged_decoder.input_names(layout))
    return (_flat(decoder), _example_inputs(info, layout), _dynamic_shapes(layout),
            ["input_ids", layout.positions, *layout.past_names(), *layout.step_inputs])


def quiet():
    """torch.onnx and the onnx_ir passes print progress and warnings; keep them for the error message only."""
    stack = contextlib.ExitStack()
    buf = io.StringIO()
    stack.enter_context(contextlib.redirect_stdout(buf))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "onnx_ir"):
        logger = logging.getLogger(name)
        level = logger.level
        logger.setLevel(logging.ERROR)
        stack.callback(logger.setLevel, level)
    return stack, buf


def trace(info: ModelInfo, module, inputs, shapes, in_names: list[str], out_names: list[str], table: dict, opset: int,
          *, optimize: bool):
    """torch.onnx.export's ONNXProgram for `module`, quiet unless it fails."""
    import torch

    stack, log = quiet()
    with stack, torch.no_grad():
        try:
            return torch.onnx.export(
                module, inputs, dynamic_shapes=shapes, input_names=in_names, output_names=out_names,
                opset_version=opset, dynamo=True, custom_translation_table=table, optimize=optimize,
                verbose=False, report=False,
            )
        except Exception as err:
            tail = "\n".join(log.getvalue().splitlines()[-20:])
            raise ExportError(f"torch.onnx.export failed for {info.model_type}: {err}\n{tail}".rstrip()) from err


def trace_stamped(decoder, period: int, module, info: ModelInfo, layout: KVLayout, table: dict, in_names: list[str],
                  out_names: list[str], opset: int, layers=None):
    """The graph traced from the decoder's first `period` layers, the rest stamped from them (stamp.py), and how
    many were stamped; (None, None) when the traced graph is not a chain of self-contained layers. `layers`: a
    streamed build's graph.streamed_export.LayerTensors, whose functions give the weights of the layers not loaded."""
    import itertools

    cut = stamp.period_decoder(decoder, period)
    cut_layout = layout.model_copy(update={"num_layers": period})
    cut_module, inputs, shapes, cut_names = traced(cut, info, cut_layout)
    program = trace(info, cut_module, inputs, shapes, cut_names, ["logits", *cut_layout.present_names()],
                    {**table, **stamp.translation()}, opset, optimize=False)
    tensors = dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                                   module.named_buffers(remove_duplicate=False)))
    if layers is not None:
        tensors = {name: layers.lazy(name) if t.device.type == "meta" else t for name, t in tensors.items()}
    try:
        stamped = stamp.stamp(program.model, layout.num_layers, period, tensors,
                              [f"decoder.{name}" for name in stamp.layerwise(decoder)], in_names, out_names,
                              layout.past_names(), layout.present_names())
    except stamp.Unstampable as err:  # traced whole instead: slower, never wrong; say why for whoever looks
        logging.getLogger(__name__).debug("%s: every layer traced: %s", info.model_type, err)
        return None, None
    if layers is not None:  # before the exporter's folding evaluates every lazy weight
        layers.fold(program.model.graph)
    with quiet()[0]:
        program.optimize()
    return program, stamped
