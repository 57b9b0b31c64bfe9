"""The shared-memory group the rank processes of one tensor-parallel model instance run their collectives in
(llmc.AllReduce / llmc.AllGather, collective/collective.c; collective/collective.h lays the segment out).

The leader (the supervisor) makes the group, `Group.create(world_size)`, and hands its `.name` to the rank
processes, which open their sessions with `cpu_kernels.prepare(path, options, group=name)`: the C side maps
the segment by that name (shm_open + mmap) when ONNX Runtime creates the kernels. When a rank process dies,
the supervisor calls `abort(reason)`: every rank blocked in a collective returns an error carrying the reason,
and every later call fails at once; a group that was aborted or timed out is not reused, the supervisor makes
a new one. `numa_nodes()` lists the CPUs of each NUMA node, to pin ranks by.

A process that is one rank of a group for its whole life (a worker the build starts to quantize its rank's graph,
compiler/quantize/ranks.py) is given the group's name in its environment, GROUP_ENV: every session it opens on a
rank's graph then sums in that group, with no `group=` passed down through the code that opens them.

The segment is made with the POSIX shm calls CPython's multiprocessing.shared_memory itself uses
(`_posixshmem`), not through SharedMemory: in Python < 3.13 every process that attaches a SharedMemory
registers it with the resource tracker, which unlinks it when that process exits (the group would vanish
under the other ranks). The leader alone registers it, so the tracker removes the segment if the leader dies
without unlinking it. Stores here reach the C side in program order (x86's memory model; the abort flag is
written after its reason).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from pathlib import Path

import _posixshmem

# collective/collective.h's layout
MAGIC, VERSION, MAX_RANKS = 0x434D4C4C, 1, 64
OFF_ABORTED, OFF_FAILED, OFF_REASON, OFF_FAILURE, TEXT = 64, 128, 192, 448, 256
OFF_RANKS, LINE, OFF_DATA = 1024, 64, 16384
GROUP_ENV = "LLMC_COLLECTIVE_GROUP"  # the group of a process that is a rank for its whole life
TIMEOUT_ENV = "LLMC_COLLECTIVE_TIMEOUT_S"  # how long a rank waits for the others in a collective (default 60 s)
DEFAULT_CAPACITY = 1 << 20  # bytes a rank contributes per step; larger inputs go in chunks


class Group:
    """One model instance's rank group: a POSIX shared-memory segment named `name`."""

    def __init__(self, name: str, memory: mmap.mmap, leader: bool):
        self.name, self._memory, self.is_leader, self._linked = name, memory, leader, True
        self.world_size, _, self.capacity_bytes, self.total_bytes = struct.unpack_from("<IIQQ", memory, 8)

    @classmethod
    def create(cls, world_size: int, capacity_bytes: int = DEFAULT_CAPACITY, name: str | None = None) -> Group:
        """A new group for `world_size` ranks, each contributing up to `capacity_bytes` per step (rounded up to
        64; a collective over more goes in several steps). `name` defaults to a fresh unique one."""
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size {world_size} is outside 1..{MAX_RANKS}")
        if capacity_bytes < 64:
            raise ValueError(f"capacity_bytes {capacity_bytes} is below 64")
        slot = -(-capacity_bytes // LINE) * LINE
        total = OFF_DATA + 2 * world_size * slot
        name = name or f"llmc-tp-{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, total)
            memory = mmap.mmap(fd, total)
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        from multiprocessing import resource_tracker

        resource_tracker.register("/" + name, "shared_memory")  # removed if this process dies without unlink()
        struct.pack_into("<IIQQ", memory, 8, world_size, 0, slot, total)
        struct.pack_into("<II", memory, 0, MAGIC, VERSION)  # last: a rank that sees the magic sees the rest
        return cls(name, memory, leader=True)

    @classmethod
    def attach(cls, name: str) -> Group:
        """The existing group `name` (a rank process's or a supervisor's view of it)."""
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            memory = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if len(memory) < OFF_DATA or struct.unpack_from("<II", memory, 0) != (MAGIC, VERSION):
            memory.close()
            raise ValueError(f"shared memory {name!r} is not an llmc collective group of version {VERSION}")
        return cls(name, memory, leader=False)

    def abort(self, reason: str) -> None:
        """Stop the group: every rank blocked in a collective, and every later call, returns an error naming
        `reason` (the first abort's reason stays)."""
        if struct.unpack_from("<I", self._memory, OFF_ABORTED)[0]:
            return
        text = reason.encode()[: TEXT - 1]
        self._memory[OFF_REASON:OFF_REASON + len(text) + 1] = text + b"\0"
        struct.pack_into("<I", self._memory, OFF_ABORTED, 1)

    def aborted_reason(self) -> str | None:
        """abort()'s reason, else the message of a rank that timed out, else None (the group is running)."""
        if struct.unpack_from("<I", self._memory, OFF_ABORTED)[0]:
            return self._text(OFF_REASON)
        if struct.unpack_from("<I", self._memory, OFF_FAILED)[0] == 2:
            return self._text(OFF_FAILURE)
        return None

    def steps(self) -> list[int]:
        """How many collective steps each rank has entered (for a supervisor's diagnostics)."""
        return [struct.unpack_from("<Q", self._memory, OFF_RANKS + r * LINE)[0] for r in range(self.world_size)]

    def _text(self, offset: int) -> str:
        raw = bytes(self._memory[offset:offset + TEXT])
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        """Unmap this process's view (the ranks' sessions keep theirs)."""
        if not self._memory.closed:
            self._memory.close()

    def unlink(self) -> None:
        """Remove the segment's name (the leader's, once the ranks are done): mappings stay valid until closed."""
        from multiprocessing import resource_tracker

        if not self._linked:
            return
        self._linked = False
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
        if self.is_leader:
            resource_tracker.unregister("/" + self.name, "shared_memory")

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.is_leader:
            self.unlink()

    def __repr__(self) -> str:
        return f"Group({self.name!r}, world_size={self.world_size}, capacity_bytes={self.capacity_bytes})"


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[int, list[int]]:
    """The CPUs of each NUMA node, {node: [cpu, ...]}, from sysfs; one node holding every CPU where sysfs
    has no node folders."""
    nodes = {}
    for folder in sorted(root.glob("node[0-9]*")):
        cpus = []
        for part in filter(None, (folder / "cpulist").read_text().strip().split(",")):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        nodes[int(folder.name[4:])] = cpus
    return nodes or {0: list(range(os.cpu_count() or 1))}
