"""Stand-ins for TensorRT and cuda-python that record what a TrtRunner (runtime/runners/trt.py) does with them: the
device memory it allocates, copies into and frees, the shapes it sets, and when TensorRT's objects are freed. The real
engine runs in tests/gpu/test_tensorrt.py, on a GPU."""

from __future__ import annotations

import types

import numpy as np


class Cuda:
    """cuda-python's runtime calls TrtRunner makes, each returning (error, *values) as cuda-python does."""

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3

    def __init__(self, events: list[str] | None = None):
        self.events = events if events is not None else []
        self.live, self.sizes, self.copies, self.next = set(), {}, [], 0x1000

    def cudaMalloc(self, size):
        self.next += size + 256
        self.live.add(self.next)
        self.sizes[self.next] = size
        return 0, self.next

    def cudaMemset(self, ptr, value, size):
        return (0,)

    def cudaFree(self, ptr):
        self.live.remove(ptr)  # a pointer freed twice, or never allocated, fails here
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        if kind == self.cudaMemcpyKind.cudaMemcpyHostToDevice:
            assert nbytes <= self.sizes[dst], "a copy past the end of its device buffer"
        self.copies.append((dst, nbytes, kind))
        return (0,)

    def cudaStreamCreate(self):
        return 0, "stream"

    def cudaStreamSynchronize(self, stream):
        self.events.append("synchronized")
        return (0,)

    def cudaStreamDestroy(self, stream):
        self.events.append(f"{stream} destroyed")
        return (0,)


def tensorrt(events: list[str], shapes: dict | None = None, fixed: dict | None = None,
             addresses: dict | None = None) -> types.ModuleType:
    """TensorRT's runtime objects; each records in `events` when its last reference goes (when TensorRT frees it), and
    an execution context records in `shapes` each input shape it is given and in `addresses` each tensor's address.
    `fixed`: the engine's I/O tensors of a fixed shape (name -> shape) besides the logits, listed by the engine."""
    shapes = shapes if shapes is not None else {}
    addresses = addresses if addresses is not None else {}
    fixed = fixed or {}
    names = ["input_ids", "logits", *fixed]

    def freed(name):
        return {"__del__": lambda self: events.append(f"{name} freed")}

    context = type("Context", (), {
        **freed("context"), "set_optimization_profile_async": lambda self, p, s: True,
        "set_input_shape": lambda self, name, shape: shapes.__setitem__(name, tuple(shape)),
        "set_tensor_address": lambda self, name, ptr: addresses.__setitem__(name, ptr),
        "execute_async_v3": lambda self, stream: True})
    engine = type("Engine", (), {**freed("engine"), "create_execution_context": lambda self: context(),
                                 "num_io_tensors": len(names), "get_tensor_name": lambda self, i: names[i],
                                 "get_tensor_shape": lambda self, name: fixed.get(name, (-1, -1, 50)),
                                 "get_tensor_dtype": lambda self, name: "float16"})
    runtime = type("Runtime", (), {**freed("runtime"), "__init__": lambda self, logger: None,
                                   "deserialize_cuda_engine": lambda self, data: engine()})
    trt = types.ModuleType("tensorrt")
    trt.__version__, trt.bfloat16, trt.nptype = "10.14.1", "bfloat16", lambda dtype: np.float16
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity: None})
    trt.Runtime = runtime
    return trt
