"""An ONNX Runtime session over an exported decoder graph, driven with past -> present copies.

The plain runner the compiler verifies with; the in-place, in-flight batching runner for serving
builds on the same layout description.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmc.runtime.layout import KVLayout


def make_session(onnx_path: Path, num_threads: int = 0):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or (os.cpu_count() or 1)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


class OrtDecoder:
    """`step(input_ids, attention_mask, position_ids, past) -> (logits, present)` over numpy arrays."""

    def __init__(self, onnx_path: Path, layout: KVLayout, num_threads: int = 0):
        self.layout = layout
        self.session = make_session(onnx_path, num_threads)
        self._past_names = layout.past_names()
        self._output_names = ["logits", *layout.present_names()]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        shape = self.layout.shape(batch, 0)
        return [np.zeros(shape, dtype=self.layout.dtype) for _ in self._past_names]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {
            "input_ids": input_ids.astype(np.int64, copy=False),
            "attention_mask": attention_mask.astype(np.int64, copy=False),
            "position_ids": position_ids.astype(np.int64, copy=False),
            **dict(zip(self._past_names, past)),
        }
        logits, *present = self.session.run(self._output_names, feeds)
        return logits, present
