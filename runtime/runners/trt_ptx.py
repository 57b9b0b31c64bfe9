"""Whether the serving machine's CUDA driver and GPU can JIT-compile the PTX an engine's attention plugin
embeds: the PTX ISA version and target the build recorded (TensorRTInfo.plugin_ptx_isa / plugin_ptx_target,
from plugins/gpu/ptx.py) against the driver's CUDA version and the GPU's compute capability.

- A driver reads PTX ISA versions up to its own CUDA version's: CUDA 12.0-12.5 read ISA 8.0-8.5, 12.6 and
  later 12.x one behind their minor (12.8: 8.7), CUDA 13.x ISA 9.x (13.0: 9.0): Triton's own table
  (`ptx_get_version`). A driver that cannot read the ISA fails the engine's load inside TensorRT with a
  bare CUDA error; this says which side is too old first.
- PTX for a plain target (sm_80, sm_90) runs on that capability and every later one; an arch-specific target
  (sm_90a) only on its own capability.
"""

from __future__ import annotations

import re


def driver_isa(cuda_driver_version: int) -> int:
    """The newest PTX ISA (10 * major + minor) a driver reads, from cudaDriverGetVersion's number (12080: 12.8)."""
    major, minor = cuda_driver_version // 1000, cuda_driver_version % 1000 // 10
    if major >= 13:
        return 90 + (major - 13) * 10 + minor
    if major == 12:
        return 80 + minor - (1 if minor >= 6 else 0)
    if major == 11:
        return 70 + minor
    return 63 + minor


def _dotted(number: int) -> str:
    return f"{number // 10}.{number % 10}"


def ptx_problem(isa: str, target: str, cuda_driver_version: int, capability: int) -> str | None:
    """Why PTX of ISA `isa` ("8.0") for `target` ("sm_90", "sm_90a") cannot run under this driver
    (cudaDriverGetVersion's number) on this GPU (capability 10 * major + minor), naming the driver or the GPU
    and whether it is too old or too new; None when it can."""
    major, minor = (int(part) for part in isa.split("."))
    readable = driver_isa(cuda_driver_version)
    cuda = f"{cuda_driver_version // 1000}.{cuda_driver_version % 1000 // 10}"
    if 10 * major + minor > readable:
        return (f"the CUDA driver is too old: the engine's attention plugin is PTX ISA {isa}, and this driver (CUDA "
                f"{cuda}) reads ISA {_dotted(readable)} at most. Upgrade the driver")
    match = re.fullmatch(r"sm_(\d+)(a?)", target)
    if match is None:
        return f"the engine's attention plugin names an unknown PTX target {target!r}: rebuild it with this llmc"
    built, specific = int(match.group(1)), bool(match.group(2))
    if capability < built:
        return (f"the GPU is too old: the engine's attention plugin is PTX for {target} (compute capability "
                f"{_dotted(built)} and later), and this GPU has {_dotted(capability)}. Rebuild the engine for it, or "
                "with tensorrt.hardware_compatibility: ampere_plus (PTX for sm_80)")
    if specific and capability != built:
        return (f"the GPU is too new: the engine's attention plugin is PTX for {target}, which runs on compute "
                f"capability {_dotted(built)} only, and this GPU has {_dotted(capability)}. Rebuild the engine with "
                "this llmc (plain targets run forward)")
    return None
