"""A tensor-parallel rank's TensorRT engine as a `Runner`: `TrtRunner` (trt.py) on the rank's GPU, its execution
contexts given the rank's NCCL communicator, so the engine's IDistCollectiveLayers (the graph's DistCollective
nodes, plugins/trt/collective_node.py) meet the other ranks' in NCCL.

    group = RankGroup(rank, world_size, unique_id, device)     the same unique_id on every rank
    runner = TrtRankRunner(rank_engine, layout, group=group, max_batch=..., capacity=..., max_num_tokens=...)

What TensorRT asks (TensorRT 11's multi-device runtime; NVIDIA's sampleDistCollective and the Python cookbook):
an NCCL communicator made by `ncclCommInitRank` on every rank, handed to each execution context with
`IExecutionContext.set_communicator(capsule)` before it runs, the capsule a PyCapsule named "ncclComm_t" around
the `ncclComm_t` pointer (C++: `IExecutionContext::setCommunicator`); the communicator must outlive the contexts
that use it. Every rank then runs the same step (`execute_async_v3` on its own stream), and the collectives inside
the engines wait for each other.

NCCL is reached through its C API by ctypes (`Nccl`: ncclGetUniqueId, ncclCommInitRank, ncclCommDestroy,
ncclCommAbort, ncclGetErrorString, as vLLM's pynccl wrapper does), from the `nvidia-nccl-cu12` wheel (which
torch's CUDA wheels install) or the system's libnccl.so.2 (`LLMC_NCCL_LIBRARY` names another): that API is stable
and documented, and it hands out the raw pointer set_communicator needs (cupy's NcclCommunicator keeps its
pointer private). Rank 0 makes the unique id (128 bytes) and passes it to the other ranks' processes with their
other settings (trt_group.py's TrtTensorParallelRunner sends each worker its spec); `ncclCommInitRank`
blocks until every rank has joined. The device is selected (cudaSetDevice) before NCCL or TensorRT touch it, as NCCL requires.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

from llmc.runtime.runners.trt import EngineLoadError, TrtRunner, _cuda, _ok

NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
CAPSULE_NAME = b"ncclComm_t"  # the name TensorRT's set_communicator reads the pointer under


class NcclError(RuntimeError):
    """An NCCL call failed; the message is NCCL's."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


def find_nccl() -> str:
    """The NCCL library to load: $LLMC_NCCL_LIBRARY, the nvidia-nccl-cu12 wheel's, or the system's libnccl.so.2."""
    if os.environ.get("LLMC_NCCL_LIBRARY"):
        return os.environ["LLMC_NCCL_LIBRARY"]
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        wheel = Path(folder) / "lib" / "libnccl.so.2"
        if wheel.is_file():
            return str(wheel)
    return "libnccl.so.2"


class Nccl:
    """The few NCCL calls a rank needs, on the library at `path` (default: find_nccl())."""

    def __init__(self, path: str | None = None):
        path = path or find_nccl()
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            raise EngineLoadError(f"a tensor-parallel TensorRT engine needs NCCL, and {path} does not load ({err}); "
                                  "install nvidia-nccl-cu12 or set LLMC_NCCL_LIBRARY") from None
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        self.lib = lib

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            raise NcclError(f"{call} failed: {self.lib.ncclGetErrorString(result).decode()} (ncclResult {result})")

    def unique_id(self) -> bytes:
        """A new group's id (rank 0 makes it once; every rank passes the same bytes to init_rank)."""
        uid = _UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    def init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """This process's communicator, as the ncclComm_t pointer; blocks until all `world_size` ranks joined."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm.value

    def destroy(self, comm: int) -> None:
        self._check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def abort(self, comm: int) -> None:
        """End the communicator at once, releasing collectives that wait for a rank that died."""
        self._check(self.lib.ncclCommAbort(comm), "ncclCommAbort")


def communicator_capsule(comm: int):
    """The PyCapsule named "ncclComm_t" around the communicator pointer, which set_communicator takes."""
    if not comm:
        raise ValueError("no NCCL communicator (a null pointer)")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.c_void_p(comm), CAPSULE_NAME, None)


class RankGroup(NamedTuple):
    rank: int
    world_size: int
    unique_id: bytes  # Nccl.unique_id() of rank 0, the same on every rank
    device: int  # the CUDA device this rank runs on

    def check(self) -> None:
        if self.world_size < 2 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of a group of {self.world_size}: a split model has 2+ ranks, "
                             "numbered from 0")
        if len(self.unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, not {len(self.unique_id)}")


class TrtRankRunner(TrtRunner):
    """One rank of a split model on TensorRT: its engine on `group.device`, each execution context (prefill and
    decode profiles) given the rank's NCCL communicator. close() frees the engine, then the communicator."""

    def __init__(self, engine_path: Path, layout, *, group: RankGroup, nccl: Nccl | None = None, **options):
        group.check()
        _ok(_cuda().cudaSetDevice(group.device))  # before NCCL and TensorRT use the device
        self.group, self.nccl = group, nccl or Nccl()
        self.comm = self.nccl.init_rank(group.world_size, group.unique_id, group.rank)
        try:
            super().__init__(engine_path, layout, **options)
        except BaseException:
            self.nccl.destroy(self.comm)
            self.comm = None
            raise
        self._capsule = communicator_capsule(self.comm)
        refused = [p for p, context in enumerate(self.contexts) if not context.set_communicator(self._capsule)]
        if refused:  # (no context is left referenced here: close() frees them before the communicator)
            self.close()
            raise EngineLoadError(f"rank {group.rank}: TensorRT refused the NCCL communicator for optimization "
                                  f"profile {refused[0]}'s execution context (an engine built without its "
                                  "collectives, or a TensorRT without multi-device execution)")

    def step(self, *args, **kwargs):
        """TrtRunner.step on the rank's device: the current device is a thread's, and the runner may have been made
        on another thread (the leader makes rank 0's on one while it watches the workers)."""
        _ok(_cuda().cudaSetDevice(self.group.device))
        return super().step(*args, **kwargs)

    def abort(self) -> None:
        """Abort the communicator now (ncclCommAbort), from any thread: a step waiting in a collective for a rank
        that failed or died ends. The runner cannot step again; close() then frees the rest."""
        comm, self.comm = self.comm, None
        if comm:
            self.nccl.abort(comm)

    def close(self) -> None:
        """TrtRunner.close (the contexts and the engine go first: they use the communicator), then destroy the
        communicator. Calling it again does nothing."""
        if getattr(self, "stream", None) is not None:
            _ok(_cuda().cudaSetDevice(self.group.device))  # the stream and buffers are that device's
        super().close()
        comm, self.comm = self.comm, None
        if comm:
            self._capsule = None
            self.nccl.destroy(comm)
