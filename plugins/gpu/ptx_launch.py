"""The TensorRT plugins' own kernels launched without TensorRT: their PTX loaded through the CUDA driver (CuPy's
RawModule) and launched with exactly the grid, block, shared memory and parameters a TensorRT AOT plugin launch
gives them, so a GPU machine without TensorRT runs, checks and times what an engine built by llmc would run.

TensorRT launches an AOT plugin's kernel with its parameters in one order (`tensorrt.plugin.aot_impl`: the kernel's
inputs, then the extra integer arguments the implementation returns as SymIntExprs, then its outputs), each tensor
as a device pointer and each extra as an int32. `plugin_arguments` lays them out in that order, and
`check_arguments` holds them against the parameters the PTX entry declares (ptx.py), so a calling convention that
drifts from the kernel fails on CPU, before any GPU. Outputs TensorRT aliases to inputs (the KV caches) are the same
pointers.

Written against CuPy's documented API (`cupy.RawModule(path=...)`, `RawKernel.__call__(grid, block, args,
shared_mem=...)`, `max_dynamic_shared_size_bytes`); CuPy is not installed here, the GPU machines have it. The
launch itself has not run yet: the CPU tests stop at the argument check.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from llmc.plugins.gpu.ptx import entry_params

_POINTER_TYPES = (".u64", ".b64")  # how Triton declares a pointer parameter
_INT32_TYPES = (".u32", ".s32", ".b32")


def plugin_arguments(inputs: Sequence[int], extras: Sequence[int], outputs: Sequence[int]) -> list:
    """The kernel's arguments in TensorRT's order: input pointers, the int32 extras, output pointers (pointers
    as the device addresses `tensor.data_ptr()` gives)."""
    return ([np.uint64(p) for p in inputs] + [np.int32(x) for x in extras] + [np.uint64(p) for p in outputs])


def check_arguments(ptx: str, kernel_name: str, arguments: Sequence[Any]) -> None:
    """Raise ValueError unless `arguments` match the PTX entry's parameters one for one: a pointer for each
    .u64/.b64, an int32 for each 32-bit integer, naming the first parameter that does not."""
    params = entry_params(ptx, kernel_name)
    if len(params) != len(arguments):
        raise ValueError(f"{kernel_name} declares {len(params)} parameters; the launch passes {len(arguments)}")
    for i, ((kind, name), arg) in enumerate(zip(params, arguments)):
        wanted = np.uint64 if kind in _POINTER_TYPES else np.int32 if kind in _INT32_TYPES else None
        if wanted is None or not isinstance(arg, wanted):
            raise ValueError(f"{kernel_name} parameter {i} ({name}, {kind}) gets a {type(arg).__name__}")


class PtxKernel:
    """One PTX entry loaded through the CUDA driver (CuPy), launched as TensorRT launches a plugin's kernel."""

    def __init__(self, ptx: str, kernel_name: str, shared_mem: int):
        import cupy

        with tempfile.TemporaryDirectory(prefix="llmc-ptx-") as folder:  # RawModule reads PTX from a file
            path = Path(folder) / f"{kernel_name}.ptx"
            path.write_text(ptx)
            self._module = cupy.RawModule(path=str(path))
            self._kernel = self._module.get_function(kernel_name)
        self.ptx, self.name, self.shared_mem = ptx, kernel_name, shared_mem
        if shared_mem > 48 * 1024:  # past the default, a kernel must opt in to more dynamic shared memory
            self._kernel.max_dynamic_shared_size_bytes = shared_mem

    def launch(self, grid: tuple[int, ...], block_x: int, arguments: Sequence[Any], stream: Any = None) -> None:
        """One launch on `stream` (CuPy's current one when None) with the plugin's grid and block."""
        check_arguments(self.ptx, self.name, arguments)
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if stream is None:
            self._kernel(grid, (block_x, 1, 1), tuple(arguments), shared_mem=self.shared_mem)
        else:
            with stream:
                self._kernel(grid, (block_x, 1, 1), tuple(arguments), shared_mem=self.shared_mem)
