"""The split-KV buffers of a TensorRT engine's attention plugins, as the runner binds them.

The plugins' kernels split a tile's keys over several programs when a step's grid leaves the GPU idle (a small
batch at a long context), and merge the partial results in the same launch (plugins/gpu/split_kv.py). That takes
a workspace for the partials and a counter per tile that starts at zero and persists between launches: scratch
memory an ahead-of-time TensorRT plugin cannot get from TensorRT. So they are two engine inputs of a fixed size
(compiler/tensorrt/split_kv.py threads one pair through every attention node, in layer order), each aliased to an
engine output. The runner allocates each once, zeroes it (the counters must start at zero; each launch sets back
what it counted) and binds the same memory as the input and the output on every execution context. Launches on
one stream never overlap, so one pair serves every layer and both profiles.

Written against TensorRT's and cuda-python's API like trt.py, never run (no GPU or TensorRT here).
"""

from __future__ import annotations

import numpy as np

# input -> its aliased output
SPLIT_BUFFERS = {"attention_split_partials": "attention_split_partials_out",
                 "attention_split_counters": "attention_split_counters_out"}
SPLIT_TYPES = {"attention_split_partials": np.float32, "attention_split_counters": np.int32}


class SplitBuffers:
    """The engine's split buffers on the GPU, zeroed; none when the engine has none (a reference-lowering engine,
    or one built before key splits)."""

    def __init__(self, engine, cudart, ok):
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        sizes = {}  # checked before anything is allocated
        for name, aliased in SPLIT_BUFFERS.items():
            if name not in names:
                continue
            if aliased not in names:
                raise RuntimeError(f"the engine takes {name} but does not return {aliased}: rebuild it")
            shape = tuple(engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"the engine's {name} has no fixed shape ({shape}): rebuild it")
            sizes[name] = max(int(np.prod(shape)), 1) * np.dtype(SPLIT_TYPES[name]).itemsize
        self.pointers: dict[str, int] = {}
        for name, nbytes in sizes.items():
            self.pointers[name] = ok(cudart.cudaMalloc(nbytes))
            ok(cudart.cudaMemset(self.pointers[name], 0, nbytes))

    def bind(self, context) -> None:
        """Bind each buffer as its input and its aliased output on `context`."""
        for name, ptr in self.pointers.items():
            context.set_tensor_address(name, ptr)
            context.set_tensor_address(SPLIT_BUFFERS[name], ptr)
