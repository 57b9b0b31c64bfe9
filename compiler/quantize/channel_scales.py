"""What a per-channel scaling (AWQ, SmoothQuant: smoothquant.apply_scales) did to the graph's activations, recorded
beside the quantized graph for what must read them in the scaled graph's coordinates: a LoRA adapter's branch
(compiler/lora/fold.py) reads a projection's input and adds to its output, both as the scaled graph holds them.

    inputs    tensor -> s       a tensor read by linear layers now holds x / s (its producer was divided; the
                                readers' weight rows were multiplied by s)
    outputs   tensor -> (c, s)  a MatMul's output columns c .. c + len(s) now hold y / s (its weight's columns were
                                divided: a gated MLP's up projection, whose reader took the s)

The file (`channel_scales.safetensors` in the quantize stage's folder) holds `in:<tensor>` and `out:<tensor>`
vectors, each output's first column in the header's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FILENAME = "channel_scales.safetensors"


@dataclass
class ChannelScales:
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    def save(self, folder: Path) -> str:
        """Write the file into `folder`; returns its name."""
        from safetensors.numpy import save_file

        tensors = {f"in:{k}": np.ascontiguousarray(v, np.float32) for k, v in self.inputs.items()}
        tensors.update({f"out:{k}": np.ascontiguousarray(s, np.float32) for k, (_, s) in self.outputs.items()})
        save_file(tensors, str(folder / FILENAME), metadata={f"out:{k}": str(c) for k, (c, _) in self.outputs.items()})
        return FILENAME

    @classmethod
    def load(cls, path: Path) -> "ChannelScales":
        from safetensors import safe_open

        scales = cls()
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                kind, tensor = key.split(":", 1)
                if kind == "in":
                    scales.inputs[tensor] = f.get_tensor(key)
                else:
                    scales.outputs[tensor] = (int(metadata[key]), f.get_tensor(key))
        return scales
