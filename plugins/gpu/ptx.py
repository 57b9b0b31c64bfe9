"""PTX that the drivers and GPUs an engine claims can read: the ISA version and target the plugin's kernels
are compiled for (the engine's manifest records both; runtime/runners/trt_ptx.py checks them against the
serving machine's driver and GPU before an engine loads), and the PTX text helpers the plugins use.

A TensorRT engine embeds the plugin's PTX, and the CUDA driver on the serving machine JIT-compiles it when
the engine loads. Two things in the PTX header decide where that works:

- `.version` (the PTX ISA): a driver reads ISA versions up to its own CUDA version's (CUDA 12.0: 8.0, 12.8:
  8.7, 13.0: 9.0). Triton stamps the ISA of the ptxas it ships unless told otherwise (Triton 3.9 for
  capability 90: 9.4, which a CUDA 13.0 driver refuses), so the plugin compiles with `ptx_version=PTX_ISA`:
  8.0, what every CUDA 12 driver reads. TensorRT's own wheels (tensorrt-cu12, -cu13) need a CUDA 12 driver
  at least, so nothing older is lost.
- `.target`: PTX for sm_80 or plain sm_90 is compiled forward by the driver for any later GPU; `sm_90a`
  (what Triton writes for every capability 90+) runs on capability 9.0 only. The kernels here use none of
  the arch-specific instructions (`wgmma`, `setmaxnreg`: their tiles are 16 rows, under wgmma's 64), so
  `plain_target` rewrites the header to the plain target after checking that; a kernel that did use them
  fails the build instead of making an engine that dies on a newer GPU.
"""

from __future__ import annotations

import re

PTX_ISA = 80  # 10 * major + minor: PTX ISA 8.0, read by CUDA 12.0 and later drivers
# instructions only an arch-specific ("a") target has: Hopper's warpgroup MMA and register reallocation,
# Blackwell's tensor memory
ARCH_SPECIFIC = ("wgmma.", "setmaxnreg.", "tcgen05.")

_VERSION = re.compile(r"^\.version\s+(\d+)\.(\d+)\s*$", re.M)
_TARGET = re.compile(r"^\.target\s+sm_(\d+)(a?)\b", re.M)


def isa_text(isa: int) -> str:
    return f"{isa // 10}.{isa % 10}"


def ptx_target(capability: int) -> str:
    """The plain target the plugin's PTX declares for a compile for `capability`."""
    return f"sm_{capability}"


def ptx_header(ptx: str) -> tuple[str, str]:
    """(ISA version "8.0", target "sm_90" or "sm_90a") declared by a PTX module."""
    version, target = _VERSION.search(ptx), _TARGET.search(ptx)
    if version is None or target is None:
        raise ValueError("no .version / .target header in the PTX")
    return f"{version.group(1)}.{version.group(2)}", f"sm_{target.group(1)}{target.group(2)}"


def plain_target(ptx: str, kernel: str) -> str:
    """`ptx` with an arch-specific target (sm_90a) made the plain one (sm_90), which later GPUs also run;
    refused when the body uses an instruction only the arch-specific target has."""
    used = sorted({op for op in ARCH_SPECIFIC if op in ptx})
    if used:
        raise ValueError(f"{kernel} uses {', '.join(used)}, which only an arch-specific (sm_XXa) target has: its "
                         "PTX would run on one GPU generation only. Compile it for capability 80 instead")
    return _TARGET.sub(lambda m: f".target sm_{m.group(1)}", ptx, count=1)


_PARAM = re.compile(r"\.param\s+(\.\w+)\s+(?:\.ptr\s+\S+\s+)?(?:\.align\s+\d+\s+)?(\w+)")


def _entry(ptx: str, kernel_name: str) -> re.Match:
    header = re.search(rf"(\.entry\s+{re.escape(kernel_name)}\s*\()(.*?)(\))", ptx, re.S)
    if header is None:
        raise ValueError(f"no .entry {kernel_name} in the PTX")
    return header


def entry_params(ptx: str, kernel_name: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of the PTX entry `kernel_name`, in order."""
    return [m.groups() for p in _entry(ptx, kernel_name).group(2).split(",") if (m := _PARAM.search(p))]


def trim_params(ptx: str, kernel_name: str, count: int) -> str:
    """Keep the first `count` parameters of the PTX entry `kernel_name`; the ones after them (the
    global/profile scratch pointers newer Tritons append) must be unused by the body, and go."""
    header = _entry(ptx, kernel_name)
    params, body = header.group(2).split(","), ptx[header.end():]
    for extra in params[count:]:
        name = _PARAM.search(extra).group(2)
        if re.search(rf"\[{re.escape(name)}(\+\d+)?\]", body):
            raise ValueError(f"{kernel_name} reads its parameter {name} beyond the first {count}")
    return ptx[:header.start(2)] + ",".join(params[:count]).rstrip() + "\n" + ptx[header.end(2):]
