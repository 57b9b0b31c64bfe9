"""What torch.onnx.export traces for a KV layout: the module, its example inputs, its dynamic shapes and the graph's
input names. The slot form is here (the decoder with its caches as one flat tuple); the paged form is
compiler/paged_decoder.py's."""

from __future__ import annotations

from llmc.compiler.artifacts import ModelInfo
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
