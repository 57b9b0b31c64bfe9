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


def test_trt_runner_binds_the_split_buffers_zeroed_as_input_and_aliased_output(monkeypatch, tmp_path):
    """An engine with the attention plugins' key-split workspace and counters (compiler/tensorrt/split_kv.py): each
    allocated once at the engine's fixed shape, zeroed (the counters must start at 0), bound as the input and its
    aliased output on the step's context, and freed by close()."""
    from llmc.runtime.runners import trt as trt_runner
    from llmc.runtime.runners.trt_split import SPLIT_BUFFERS

    cuda, addresses, zeroed = Cuda(), {}, []
    cuda.cudaMemset = lambda ptr, value, size: zeroed.append((ptr, value, size)) or (0,)
    fixed = {"attention_split_partials": (264 * 16 * 10,), "attention_split_counters": (264,),
             "attention_split_partials_out": (264 * 16 * 10,), "attention_split_counters_out": (264,)}
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt([], fixed=fixed, addresses=addresses))
    monkeypatch.setattr(trt_runner, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    (tmp_path / "model.plan").write_bytes(b"plan")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", in_place=True)
    runner = trt_runner.TrtRunner(tmp_path / "model.plan", layout, max_batch=4, capacity=64, max_num_tokens=32)
    pointers = runner.split.pointers
    assert cuda.sizes[pointers["attention_split_partials"]] == 264 * 16 * 10 * 4
    assert cuda.sizes[pointers["attention_split_counters"]] == 264 * 4
    assert {(p, 0, cuda.sizes[p]) for p in pointers.values()} <= set(zeroed)
    runner.step(np.array([[1]]), np.array([0]))
    for name, aliased in SPLIT_BUFFERS.items():
        assert addresses[name] == addresses[aliased] == pointers[name]
    runner.close()
    assert not cuda.live


def test_an_engine_that_takes_split_buffers_without_returning_them_is_refused(monkeypatch, tmp_path):
    from llmc.runtime.runners import trt as trt_runner

    cuda = Cuda()
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt([], fixed={"attention_split_counters": (264,)}))
    monkeypatch.setattr(trt_runner, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    (tmp_path / "model.plan").write_bytes(b"plan")
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16", in_place=True)
    with pytest.raises(RuntimeError, match="takes attention_split_counters but does not return "
                                           "attention_split_counters_out: rebuild it"):
        trt_runner.TrtRunner(tmp_path / "model.plan", layout, max_batch=4, capacity=64, max_num_tokens=32)
    assert not cuda.live  # refused before anything was allocated
