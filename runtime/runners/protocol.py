"""The runner: a model and its KV cache, stepped one batch at a time. What the engine drives, and
what the build's verify stage, the quantization quality check and the TensorRT engine check drive
the same way.

The cache has `rows` slots (the largest batch) of `capacity` positions each (max_seq_len). A step
runs a contiguous range of slots, `first_row .. first_row + n`, each on its own tokens:

    step(input_ids [n, S], cache_position [n], first_row[, sequence_lengths [n]]) -> logits [n, S, vocab]
                                                                                  (float32, host)

Row i's S tokens take positions `cache_position[i] ..+S` of slot `first_row + i`, whose earlier
positions hold what earlier steps wrote. `sequence_lengths` matters to LongRoPE graphs only
(runtime/layout.py): row i's whole sequence length, which picks its RoPE table; left out, it is
`cache_position[i] + S`, the row's tokens taken as its whole sequence. A runner over a LoRA graph (its `lora` set:
OrtRunner, TrtRunner) also takes `adapters`, each row's adapter weights (None: the base); the others take none.
`close()` frees the model and the cache (device memory for
TensorRT); a closed runner cannot step. Implemented by `OrtRunner` (runtime/runners/ort.py, ONNX
Runtime, cache in host memory) and `TrtRunner` (runtime/runners/trt.py, TensorRT, cache on the GPU).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from llmc.runtime.layout import KVLayout


@runtime_checkable
class Runner(Protocol):
    @property
    def layout(self) -> KVLayout:
        """The graph's KV layout (runtime/layout.py): what its inputs are."""
        ...

    @property
    def rows(self) -> int:
        """Cache slots, the largest batch a step can run: slots 0 .. rows - 1."""
        ...

    @property
    def capacity(self) -> int:
        """Positions per slot (the longest sequence, prompt and output together)."""
        ...

    def step(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int = 0,
             sequence_lengths: np.ndarray | None = None) -> np.ndarray:
        """Run slots `first_row ..+n` on `input_ids` [n, S] at `cache_position` [n]: logits [n, S, vocab]."""
        ...

    def close(self) -> None:
        """Free the model and the cache; calling it again does nothing."""
        ...


class RunnerClosed(RuntimeError):
    """A step on a runner whose model and cache were freed by close()."""


class RunnerBroken(RuntimeError):
    """A runner that cannot step again (a rank of a split model failed or died): its owner builds a new one."""
