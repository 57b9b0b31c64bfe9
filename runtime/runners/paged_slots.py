"""A paged graph behind the slot-shaped `Runner` protocol (runtime/runners/protocol.py), for the drivers written
against slots: the quantization quality check (perplexity, greedy agreement, decode speed) measures a
paged export through this as it measures a slot export through OrtRunner.

Slot r owns a fixed run of blocks of a `PagedRunner`'s pools, enough for `capacity` positions, and
`step(input_ids [n, S], cache_position [n], first_row)` becomes one paged step of n rows, each asking
for all S of its tokens' logits: `[n, S, vocab]`, as the Runner protocol returns them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.protocol import Runner


class PagedSlots:
    """`rows` slots of `capacity` positions over one PagedRunner."""

    def __init__(self, onnx_path: Path, layout: KVLayout, *, max_batch: int, capacity: int, num_threads: int = 0,
                 prepack: bool = True):
        per_slot = -(-capacity // layout.block_size)
        self.layout, self.rows, self.capacity = layout, max_batch, capacity
        self.runner = PagedRunner(onnx_path, layout, num_blocks=max_batch * per_slot,
                                  max_num_tokens=max_batch * capacity, num_threads=num_threads, prepack=prepack)
        self.blocks = [list(range(r * per_slot, (r + 1) * per_slot)) for r in range(max_batch)]

    def step(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int = 0,
             sequence_lengths: np.ndarray | None = None) -> np.ndarray:
        input_ids, cache_position = np.asarray(input_ids), np.asarray(cache_position)
        n, s = input_ids.shape
        if cache_position.shape != (n,):
            raise ValueError(f"cache_position has shape {cache_position.shape}; expected ({n},), one per row")
        if not 0 <= first_row <= first_row + n <= self.rows:
            raise ValueError(f"rows {first_row}..{first_row + n - 1} are outside the cache's {self.rows} slots")
        if n and int(cache_position.max()) + s > self.capacity:
            raise ValueError(f"KV cache overflow: a row would reach {int(cache_position.max()) + s} tokens; "
                             f"capacity is {self.capacity}")
        lengths = [None] * n if sequence_lengths is None else [int(x) for x in np.asarray(sequence_lengths)]
        rows = [RowStep(ids.tolist(), int(p), self.blocks[first_row + i], num_logits=s, seq_len=length)
                for i, (ids, p, length) in enumerate(zip(input_ids, cache_position, lengths))]
        return self.runner.step(rows).reshape(n, s, -1)

    def close(self) -> None:
        self.runner.close()


def slot_runner(onnx_path: Path, layout: KVLayout, *, max_batch: int, capacity: int, num_threads: int = 0,
                optimize: bool = True, prepack: bool = True) -> Runner:
    """A slot-shaped Runner for any ONNX Runtime export: OrtRunner, or PagedSlots for a paged graph."""
    if layout.paged:
        return PagedSlots(onnx_path, layout, max_batch=max_batch, capacity=capacity, num_threads=num_threads,
                          prepack=prepack)
    return OrtRunner(onnx_path, layout, max_batch=max_batch, capacity=capacity, num_threads=num_threads,
                     optimize=optimize, prepack=prepack)
