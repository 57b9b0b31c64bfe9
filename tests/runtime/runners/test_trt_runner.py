"""TrtRunner as a Runner (runtime/runners/protocol.py), over stand-ins for TensorRT and cuda-python
(tests/trt_stand_ins.py) that record what it allocates and frees: close() frees every device buffer once, the contexts before the
engine before its runtime, the stream last. The real engine runs in test_tensorrt.py, on a GPU."""

import sys

import numpy as np
import pytest

from trt_stand_ins import Cuda, tensorrt

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.protocol import Runner, RunnerClosed


@pytest.mark.parametrize("in_place", [True, False])
def test_trt_runner_close_frees_every_device_buffer_and_the_engine_once(monkeypatch, tmp_path, in_place):
    from llmc.runtime.runners import trt as trt_runner

    events = []
    cuda = Cuda(events)
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt(events))
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
