"""TrtRunner as a Runner (runtime/runners/protocol.py), over stand-ins for TensorRT and cuda-python that
record what it allocates and frees: close() frees every device buffer once, the contexts before the
engine before its runtime, the stream last. The real engine runs in test_tensorrt.py, on a GPU."""

import sys
import types

import numpy as np
import pytest

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.protocol import Runner, RunnerClosed


class _Cuda:
    """cuda-python's runtime calls TrtRunner makes, each returning (error, *values) as cuda-python does."""

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice = 1, 2, 3

    def __init__(self, events: list[str]):
        self.events, self.live, self.next = events, set(), 0x1000

    def cudaMalloc(self, size):
        self.next += size + 256
        self.live.add(self.next)
        return 0, self.next

    def cudaMemset(self, ptr, value, size):
        return (0,)

    def cudaFree(self, ptr):
        self.live.remove(ptr)  # a pointer freed twice, or never allocated, fails here
        return (0,)

    def cudaStreamCreate(self):
        return 0, "stream"

    def cudaStreamSynchronize(self, stream):
        self.events.append("synchronized")
        return (0,)

    def cudaStreamDestroy(self, stream):
        self.events.append(f"{stream} destroyed")
        return (0,)


def _tensorrt(events: list[str]):
    """TensorRT's runtime objects; each records when its last reference goes (when TensorRT frees it)."""
    def freed(name):
        return {"__del__": lambda self: events.append(f"{name} freed")}

    context = type("Context", (), {**freed("context"), "set_optimization_profile_async": lambda self, p, s: True})
    engine = type("Engine", (), {**freed("engine"), "create_execution_context": lambda self: context(),
                                 "get_tensor_shape": lambda self, name: (-1, -1, 50),
                                 "get_tensor_dtype": lambda self, name: "float16"})
    runtime = type("Runtime", (), {**freed("runtime"), "__init__": lambda self, logger: None,
                                   "deserialize_cuda_engine": lambda self, data: engine()})
    trt = types.ModuleType("tensorrt")
    trt.__version__, trt.bfloat16, trt.nptype = "10.14.1", "bfloat16", lambda dtype: np.float16
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity: None})
    trt.Runtime = runtime
    return trt


@pytest.mark.parametrize("in_place", [True, False])
def test_trt_runner_close_frees_every_device_buffer_and_the_engine_once(monkeypatch, tmp_path, in_place):
    from llmc.runtime.runners import trt as trt_runner

    events = []
    cuda = _Cuda(events)
    monkeypatch.setitem(sys.modules, "tensorrt", _tensorrt(events))
    monkeypatch.setattr(trt_runner, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    (tmp_path / "model.plan").write_bytes(b"plan")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", in_place=in_place)
    runner = trt_runner.TrtRunner(tmp_path / "model.plan", layout, max_batch=4, capacity=64, max_num_tokens=32)
    assert isinstance(runner, Runner) and (runner.rows, runner.capacity) == (4, 64)
    # 2 layers x (key, value), a scratch set too when the graph returns a new cache; ids, positions, logits
    assert len(cuda.live) == 4 * (1 if in_place else 2) + 3
    runner.close()
    assert not cuda.live
    assert events == ["synchronized", "context freed", "context freed", "engine freed", "runtime freed",
                      "stream destroyed"]
    runner.close()  # a second close does nothing
    assert len(events) == 6
    with pytest.raises(RunnerClosed):
        runner.step(np.array([[1]]), np.array([0]))
