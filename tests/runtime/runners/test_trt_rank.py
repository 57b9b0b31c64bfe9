"""A split model's rank on TensorRT (runtime/runners/parallel/trt_rank.py), up to the GPU: the NCCL calls through ctypes
against a stand-in libnccl compiled here (the unique id passed by value, the communicator pointer handed out), the
PyCapsule set_communicator takes, and TrtRankRunner over stand-ins for TensorRT and cuda-python: the device chosen
before NCCL and TensorRT, every execution context given the communicator, the communicator destroyed after the
contexts and the engine, and a refusal or a failed load leaving nothing behind. The real 2-GPU run is
tests/gpu/test_tensorrt_parallel.py."""

import ctypes
import subprocess
import sys
import types

import numpy as np
import pytest
from trt_stand_ins import Cuda as _RuntimeCuda

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.parallel import trt_rank as trt_parallel
from llmc.runtime.runners.trt import EngineLoadError
from llmc.runtime.runners.parallel.trt_rank import (CAPSULE_NAME, Nccl, NcclError, RankGroup, TrtRankRunner,
                                               communicator_capsule)

STUB = r"""
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
char last_id[128]; int last_nranks = -1, last_rank = -1; void *destroyed = 0;
int ncclGetUniqueId(ncclUniqueId *id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(3 * i + 1); return 0; }
int ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
    if (rank >= nranks) return 4;
    memcpy(last_id, id.internal, 128); last_nranks = nranks; last_rank = rank;
    *comm = (void *)(0x5000 + 16 * rank); return 0;
}
int ncclCommDestroy(void *comm) { destroyed = comm; return 0; }
int ncclCommAbort(void *comm) { destroyed = comm; return 0; }
const char *ncclGetErrorString(int result) { return result == 4 ? "invalid argument" : "unknown"; }
"""


@pytest.fixture(scope="module")
def stub_nccl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nccl")
    (folder / "nccl.c").write_text(STUB)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libnccl.so.2"), str(folder / "nccl.c")], check=True)
    return str(folder / "libnccl.so.2")


def test_nccl_calls_pass_the_unique_id_by_value_and_return_the_communicator(stub_nccl, monkeypatch):
    monkeypatch.setenv("LLMC_NCCL_LIBRARY", stub_nccl)
    nccl = Nccl()
    uid = nccl.unique_id()
    assert uid == bytes((3 * i + 1) % 256 for i in range(128))
    comm = nccl.init_rank(4, uid[::-1], 3)
    lib = nccl.lib
    assert comm == 0x5000 + 48 and ctypes.c_int.in_dll(lib, "last_nranks").value == 4
    assert ctypes.c_int.in_dll(lib, "last_rank").value == 3
    assert bytes((ctypes.c_char * 128).in_dll(lib, "last_id")) == uid[::-1]
    nccl.destroy(comm)
    assert ctypes.c_void_p.in_dll(lib, "destroyed").value == comm
    with pytest.raises(NcclError, match=r"ncclCommInitRank failed: invalid argument \(ncclResult 4\)"):
        nccl.init_rank(2, uid, 2)
    with pytest.raises(ValueError, match="128 bytes, not 16"):
        nccl.init_rank(2, uid[:16], 0)


def test_a_missing_nccl_is_named(tmp_path):
    with pytest.raises(EngineLoadError, match="needs NCCL, and .*nope.so does not load.*nvidia-nccl-cu12"):
        Nccl(str(tmp_path / "nope.so"))


def test_the_capsule_holds_the_pointer_under_tensorrts_name():
    capsule = communicator_capsule(0xDEAD00)
    api = ctypes.pythonapi
    api.PyCapsule_IsValid.restype, api.PyCapsule_IsValid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert CAPSULE_NAME == b"ncclComm_t" and api.PyCapsule_IsValid(capsule, CAPSULE_NAME)
    assert not api.PyCapsule_IsValid(capsule, b"other")
    assert api.PyCapsule_GetPointer(capsule, CAPSULE_NAME) == 0xDEAD00
    with pytest.raises(ValueError, match="null pointer"):
        communicator_capsule(0)


class _Cuda(_RuntimeCuda):
    """tests/trt_stand_ins.py's cuda-python stand-in, with the device each rank selects recorded (and synchronizing not)."""

    def cudaSetDevice(self, device):
        self.events.append(f"device {device}")
        return (0,)

    def cudaStreamSynchronize(self, stream):
        return (0,)


def _tensorrt(events, accepts=True, loads=True):
    """TensorRT's runtime objects; a context records the communicator it is given, each object its freeing."""
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

    def set_communicator(self, capsule):
        events.append(f"communicator {api.PyCapsule_GetPointer(capsule, b'ncclComm_t'):#x}")
        return accepts

    context = type("Context", (), {"__del__": lambda self: events.append("context freed"),
                                   "set_optimization_profile_async": lambda self, p, s: True,
                                   "set_communicator": set_communicator})
    engine = type("Engine", (), {"__del__": lambda self: events.append("engine freed"),
                                 "create_execution_context": lambda self: context(),
                                 "num_io_tensors": 0, "get_tensor_name": lambda self, i: None,  # listed: none
                                 "get_tensor_shape": lambda self, name: (-1, -1, 50),
                                 "get_tensor_dtype": lambda self, name: "float16"})
    trt = types.ModuleType("tensorrt")
    trt.__version__, trt.bfloat16, trt.nptype = "11.4.0", "bfloat16", lambda dtype: np.float16
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity: None})
    trt.Runtime = type("Runtime", (), {"__init__": lambda self, logger: None,
                                       "deserialize_cuda_engine": lambda self, data: engine() if loads else None})
    return trt


class _Nccl:
    def __init__(self, events):
        self.events = events

    def init_rank(self, world_size, unique_id, rank):
        self.events.append(f"nccl rank {rank} of {world_size}")
        return 0x7000 + rank

    def destroy(self, comm):
        self.events.append(f"nccl destroyed {comm:#x}")

    def abort(self, comm):
        self.events.append(f"nccl aborted {comm:#x}")


GROUP = RankGroup(rank=1, world_size=2, unique_id=bytes(128), device=1)
LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16", in_place=True)


def _runner(monkeypatch, tmp_path, events, **fakes):
    from llmc.runtime.runners import trt as trt_runner

    cuda = _Cuda(events)
    monkeypatch.setitem(sys.modules, "tensorrt", _tensorrt(events, **fakes))
    monkeypatch.setattr(trt_runner, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_parallel, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    (tmp_path / "model.plan").write_bytes(b"plan")
    return cuda, lambda: TrtRankRunner(tmp_path / "model.plan", LAYOUT, group=GROUP, nccl=_Nccl(events), max_batch=2,
                                       capacity=16, max_num_tokens=8)


def test_a_rank_runner_gives_each_context_the_communicator_and_frees_it_last(monkeypatch, tmp_path):
    events = []
    cuda, make = _runner(monkeypatch, tmp_path, events)
    runner = make()
    assert events == ["device 1", "nccl rank 1 of 2", "communicator 0x7001", "communicator 0x7001"]
    events.clear()
    runner.close()
    assert events.index("nccl destroyed 0x7001") > max(events.index("engine freed"),
                                                        *[i for i, e in enumerate(events) if e == "context freed"])
    assert events[-1] == "nccl destroyed 0x7001" and not cuda.live
    runner.close()  # again: nothing left to free
    assert events.count("nccl destroyed 0x7001") == 1


@pytest.mark.parametrize("fakes, message", [
    ({"accepts": False}, "rank 1: TensorRT refused the NCCL communicator for optimization profile 0"),
    ({"loads": False}, "could not deserialize the engine")])
def test_a_refused_communicator_or_engine_leaves_nothing_behind(monkeypatch, tmp_path, fakes, message):
    events = []
    cuda, make = _runner(monkeypatch, tmp_path, events, **fakes)
    with pytest.raises(EngineLoadError, match=message):
        make()
    assert events[-1] == "nccl destroyed 0x7001" and not cuda.live


@pytest.mark.parametrize("group, message", [
    (GROUP._replace(rank=2), "rank 2 of a group of 2"), (GROUP._replace(world_size=1, rank=0), "of a group of 1"),
    (GROUP._replace(unique_id=b"x"), "128 bytes, not 1")])
def test_rank_groups_are_checked_before_anything_starts(group, message):
    with pytest.raises(ValueError, match=message):
        TrtRankRunner("model.plan", LAYOUT, group=group, nccl=None, max_batch=1, capacity=8, max_num_tokens=8)


def test_a_rank_steps_and_closes_on_its_device_from_any_thread_and_an_abort_replaces_the_destroy(monkeypatch,
                                                                                                   tmp_path):
    import threading

    events = []
    cuda, make = _runner(monkeypatch, tmp_path, events)
    runner = make()
    monkeypatch.setattr(trt_parallel.TrtRunner, "step", lambda self, *a, **k: events.append("step") or "logits")
    events.clear()
    result = []
    thread = threading.Thread(target=lambda: result.append(runner.step(np.zeros((1, 1)), np.zeros(1))))
    thread.start()
    thread.join()
    assert result == ["logits"] and events == ["device 1", "step"]  # the device is the calling thread's to set
    events.clear()
    runner.abort()  # another rank failed: the communicator ends at once, and is not destroyed after
    runner.abort()
    runner.close()
    assert events[:2] == ["nccl aborted 0x7001", "device 1"] and events.count("nccl aborted 0x7001") == 1
    assert not [e for e in events if e.startswith("nccl destroyed")] and not cuda.live
