"""The machine's memory, and the check that refuses a build whose largest stage cannot fit in it.

A build's stages hold the whole model, or with `source.load: layers` a layer of it beside what stays loaded
(plan.BUILD_PEAK and plan.stage_peaks hold their peaks); a build that cannot fit is killed by the kernel's OOM
killer minutes or hours in, so `llmc build` (and `--dry-run`) refuse it up front.
"""

from __future__ import annotations

import math
from pathlib import Path

from llmc.errors import ResourceError

GiB = 2**30
MEMINFO = Path("/proc/meminfo")
# The container's own limit: cgroup v2's unified file, else v1's memory controller (as Docker mounts them)
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number; anything past 2**60 is that
UNLIMITED = 2**60
# The override: `llmc build --ignore-memory-check`, or this variable for a build run from Python or a script
OVERRIDE_ENV = "LLMC_IGNORE_MEMORY_CHECK"


def available_bytes(meminfo: Path = MEMINFO, cgroup_limits: tuple[Path, ...] = CGROUP_LIMITS) -> int | None:
    """What a build can use: MemAvailable (free memory plus the page cache the kernel can drop), capped by
    the cgroup's memory limit where one is set, since a container is OOM-killed at its limit however much
    the host has free. None when /proc/meminfo is unreadable (not Linux): then nothing is checked.

    Read from /proc rather than with psutil: psutil is no dependency of llmc, and these two files are all
    it would read here."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        value, _, unit = fields["MemAvailable"].strip().partition(" ")
        available = int(value) * (1024 if unit.strip() == "kB" else 1)
    except (OSError, KeyError, ValueError):
        return None
    for path in cgroup_limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text != "max" and text.isdigit() and int(text) < UNLIMITED:  # v2 writes "max" for no limit
            available = min(available, int(text))
    return available


def memory_refusal(stage_peaks: dict[str, int], available: int | None, other_fixes: tuple[str, ...] = ()) -> str | None:
    """Why the build cannot fit (the largest stage, its estimate, the machine's memory, what would make it
    fit), or None when it fits or the machine's memory is unknown."""
    if available is None or not stage_peaks:
        return None
    stage, peak = max(stage_peaks.items(), key=lambda item: item[1])
    if peak <= available:
        return None
    others = max((p for s, p in stage_peaks.items() if s != stage), default=0)
    fixes = [f"a machine with at least {math.ceil(peak / GiB)} GiB available", *other_fixes]
    # only the spec fields that remove the stage at fault, and only where the rest of the build then fits
    if others <= available:
        if stage == "quantize":
            fixes.append(f"quantization.mode: none (the build's other stages peak at {others / GiB:.1f} GiB)")
        elif stage in ("verify", "verify-adapters"):
            fixes.append(f"verify.enabled: false (the build's other stages peak at {others / GiB:.1f} GiB)")
    return (f"the {stage} stage needs about {peak / GiB:.1f} GiB (estimate), "
            f"but this machine has {available / GiB:.1f} GiB available; it would fit on "
            + " or with ".join(fixes) + f". To build anyway: --ignore-memory-check (or {OVERRIDE_ENV}=1)")


def check_memory(stage_peaks: dict[str, int], available: int | None, *, ignore: bool = False,
                 other_fixes: tuple[str, ...] = ()) -> None:
    """Raise ResourceError when the largest of `stage_peaks` exceeds `available`, unless `ignore`d (the
    flag, or LLMC_IGNORE_MEMORY_CHECK set to anything but empty or 0)."""
    import os

    if ignore or os.environ.get(OVERRIDE_ENV, "") not in ("", "0"):
        return
    reason = memory_refusal(stage_peaks, available, other_fixes)
    if reason is not None:
        raise ResourceError(reason)


# return_freed_memory's floor: a build whose weights are smaller frees less than this a stage, not worth the full
# garbage collection it starts with (0.5 s or more with PyTorch loaded: a fifth of a tiny model's whole build).
TRIM_FLOOR = 256 * 2**20


def return_freed_memory() -> bool:
    """Hand the memory a finished stage freed back to the system, so that the next stage starts from what is
    still held. Python frees a stage's arrays into glibc's heaps, which keep freed chunks for reuse rather than
    returning them (per thread: ONNX Runtime's and PyTorch's worker threads each have an arena), so a stage's
    peak stays resident under the next one. `malloc_trim(0)` releases every arena's free pages. Written by hand
    through ctypes: neither the standard library nor psutil exposes it. False where the C library has no
    malloc_trim (musl, macOS): there freed memory stays as the allocator keeps it."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
