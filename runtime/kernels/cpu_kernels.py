"""llmc's CPU kernels for ONNX Runtime: the 4-bit matmul `matmul_nbits4*.c` and the op around it,
`cpu_kernels.c`, and paged attention `paged_attention*.c` (the op `llmc.PagedAttention`,
ONNX Runtime's com.microsoft.PagedAttention contract on CPU), built into one library registered as a
custom-op library.

`llmc.PagedAttention` runs on any x86 CPU (portable loops besides AVX2 and AVX512), and a paged graph
cannot run without it: `prepare` registers the library whenever a graph has the node (`paged_library()`
builds it whatever `LLMC_CPU_KERNELS` says, or raises naming what is missing) and gives each node the
session's thread count.

The tensor-parallel collectives `llmc.AllReduce` and `llmc.AllGather` (collective/) run between the rank
processes of one model instance over a shared-memory group (collective.py's `Group`); `prepare(...,
group=name)` gives their nodes the group's name and registers the library, as for PagedAttention.

`MatMulNBits4` (domain `llmc`) is a drop-in for ONNX Runtime's `MatMulNBits` with bits=4,
block_size 32, 64 or 128 and accuracy_level=4: same inputs, attributes and packed layout (repacked into the kernel's
own when the session opens, so its weights must be initializers), faster at batch-1 decode
(matmul_nbits4.c says why and how), with kernels for AVX512-VNNI and for AVX2 + FMA CPUs.
Stored graphs keep the standard op, so they run on any ONNX Runtime and in onnxruntime-genai;
`make_session` swaps the op type in memory when `library()` is available here (graph_edits.py, which
also folds an Add of a bias after a swapped node into it), and otherwise the graph runs as stored.

`LoraDelta` (domain `llmc`, lora_delta/) is one LoRA site's four-node branch (compiler/lora/graph.py) as one op that
reads each token's own adapter slot only, where the branch multiplies every token by every bound slot. Stored LoRA
graphs keep the branch; `make_session` fuses it in memory (lora_fusion.py) under the same condition as the 4-bit
swap (`library()` available: `LLMC_CPU_KERNELS=0` turns it off with the others), and `LLMC_LORA_FUSION=0` turns off
this fusion alone (the four-node branch then runs as stored; llmc's other kernels stay on). `MoeLora` (moe_lora/) is
a mixture layer's expert-LoRA branch (compiler/lora/experts.py) as one op over each adapter token's routed experts,
fused the same way and under the same switches (moe_lora_fusion.py).

`library()` finds or builds the shared library: a prebuilt copy next to this module (what a packaged
model repository carries, so a serving host needs no compiler), else one in the cache
(`$LLMC_CACHE_DIR`, default `~/.cache/llmc`), else it compiles the C files with `$CC` (default `cc`)
into the cache. None — and ONNX Runtime's own kernels — where this CPU has neither instruction set,
no compiler is found, ONNX Runtime is older than 1.17, or `LLMC_CPU_KERNELS=0`.
`LLMC_CPU_KERNELS=avx2` (or `avx512vnni`) pins one instruction set; by default the best one runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from llmc.runtime.kernels.collective import GROUP_ENV
from llmc.runtime.kernels.graph_edits import COLLECTIVE_OPS, PAGED_OP, accelerate, configure_collective, configure_paged
from llmc.runtime.kernels.lora_fusion import enabled as lora_fusion_enabled
from llmc.runtime.kernels.lora_fusion import fuse_lora
from llmc.runtime.kernels.moe_lora_fusion import configure_experts, fuse_experts

HERE = Path(__file__).parent
SOURCE = HERE / "cpu_kernels.c"  # the ops' registration; it includes each kernel's header
# Each kernel has its folder (its own C files and headers); the library is one compile of them all.
INCLUDE_DIRS = (HERE, HERE / "matmul_nbits4", HERE / "paged_attention", HERE / "collective",
                HERE / "lora_delta", HERE / "moe_lora")
SOURCES = tuple(HERE / name for name in (
    "cpu_kernels.c", "ort_abi.h", "matmul_nbits4/matmul_nbits4.h", "matmul_nbits4/matmul_nbits4.c",
    "matmul_nbits4/matmul_nbits4_isa.h", "matmul_nbits4/matmul_nbits4_avx512.c", "matmul_nbits4/matmul_nbits4_avx2.c",
    "paged_attention/paged_attention.h", "paged_attention/paged_attention.c",
    "paged_attention/paged_attention_portable.c", "paged_attention/paged_attention_avx2.c",
    "paged_attention/paged_attention_avx512.c", "paged_attention/paged_attention_checks.h",
    "paged_attention/paged_attention_checks.c", "paged_attention/paged_attention_op.h",
    "paged_attention/paged_attention_op.c", "collective/collective.h", "collective/collective.c",
    "collective/collective_data.h", "collective/collective_data.c", "collective/collective_op.h",
    "collective/collective_op.c", "lora_delta/lora_delta.h", "lora_delta/lora_delta.c",
    "lora_delta/lora_delta_isa.c", "lora_delta/lora_delta_op.h", "lora_delta/lora_delta_op.c",
    "moe_lora/moe_lora.h", "moe_lora/moe_lora.c", "moe_lora/moe_lora_q4.c", "moe_lora/moe_lora_op.h",
    "moe_lora/moe_lora_op.c"))
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]
LIBS = ["-lm", "-lpthread", "-lrt"]  # -lrt: shm_open, in libc itself only from glibc 2.34
SWITCH = "LLMC_CPU_KERNELS"  # "0" keeps ONNX Runtime's own kernels; an instruction set's name pins it
log = logging.getLogger(__name__)


class Kernels(NamedTuple):
    library: Path
    isas: tuple[str, ...]  # the instruction sets this CPU runs the kernel on, best first
    isa: str  # the one swapped graphs run on


def library_name() -> str:
    """The file name of the library built from this source with these flags."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS + LIBS).encode()).hexdigest()[:16]
    return f"libllmc_cpu_kernels-{digest}.so"


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_CACHE_DIR") or Path.home() / ".cache" / "llmc") / "kernels"


def build(dest_dir: Path) -> Path:
    """Compile the library into `dest_dir` (written under a temporary name, then renamed into place)."""
    return compile_library([p for p in SOURCES if p.suffix == ".c"], dest_dir / library_name(), FLAGS,
                           INCLUDE_DIRS, LIBS)


def compile_library(sources, dest: Path, flags, includes=(), libs=()) -> Path:
    """Compile C `sources` into the shared library `dest` with `$CC` (default `cc`), written under a
    temporary name beside it and renamed into place; a RuntimeError names a missing compiler or what
    it printed when it failed. (Also the build's: compiler/quantize/blockwise.py.)"""
    dest.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC)")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / dest.name
        command = [compiler, *flags, *(f"-I{d}" for d in includes), "-o", str(out), *map(str, sources), *libs]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed on {', '.join(Path(p).name for p in sources)}:\n"
                               f"{result.stderr.strip()}")
        os.replace(out, dest)
    return dest


@functools.cache
def load() -> Kernels | None:
    """The loadable library for this host and the instruction set it runs, or None (the reason logged once)."""
    switch = os.environ.get(SWITCH, "1")
    if switch == "0":
        return None
    import onnxruntime as ort

    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 17):
        log.info("llmc CPU kernels: ONNX Runtime %s is older than 1.17", ort.__version__)
        return None
    try:
        path = _find_or_build()
        listing = ctypes.CDLL(str(path)).llmc_cpu_kernels_isas
        listing.restype = ctypes.c_char_p
        isas = tuple(filter(None, listing().decode().split(",")))
    except (OSError, RuntimeError) as err:
        log.warning("llmc CPU kernels unavailable, using ONNX Runtime's own: %s", err)
        return None
    if not isas:
        log.info("llmc CPU kernels: this CPU has neither AVX2 + FMA nor AVX512-VNNI; using ONNX Runtime's own")
        return None
    if switch != "1" and switch not in isas:
        log.warning("llmc CPU kernels: %s=%s is not an instruction set this CPU runs them on (%s); using ONNX "
                    "Runtime's own", SWITCH, switch, ", ".join(isas))
        return None
    return Kernels(path, isas, switch if switch in isas else isas[0])


def _find_or_build() -> Path:
    """The library: a prebuilt copy next to this module, else the cache's, else one compiled into the cache."""
    name = library_name()
    path = next((p for p in (HERE / name, cache_dir() / name) if p.is_file()), None)
    return path or build(cache_dir())


@functools.cache
def paged_library() -> Path:
    """The library for llmc.PagedAttention, which every x86 CPU runs (a portable path besides AVX2 and
    AVX512) and a paged graph cannot run without: found or built whatever `LLMC_CPU_KERNELS` says, or a
    RuntimeError saying what is missing."""
    return _required_library("llmc.PagedAttention")


@functools.cache
def collective_library() -> Path:
    """The library for llmc.AllReduce / llmc.AllGather (plain C: every x86 CPU runs them), which a
    tensor-parallel graph cannot run without: found or built whatever `LLMC_CPU_KERNELS` says, or a
    RuntimeError saying what is missing."""
    return _required_library("llmc.AllReduce/AllGather")


def _required_library(ops: str) -> Path:
    import onnxruntime as ort

    if tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 17):
        raise RuntimeError(f"{ops} needs ONNX Runtime >= 1.17 (custom-op API 17); this is {ort.__version__}")
    try:
        path = _find_or_build()
        ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        raise RuntimeError(f"this graph's {ops} nodes run only on llmc's CPU kernel library, which could "
                           f"not be found or built ({', '.join(p.name for p in SOURCES if p.suffix == '.c')} with "
                           f"$CC, default cc): {err}") from err
    return path


def paged_isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs llmc.PagedAttention's loops on, best first ("portable" last)."""
    listing = ctypes.CDLL(str(paged_library())).llmc_paged_attention_isas
    listing.restype = ctypes.c_char_p
    return tuple(listing().decode().split(","))


def library() -> Path | None:
    """The loadable library for this host, or None."""
    kernels = load()
    return kernels.library if kernels else None


def _check_sequential(options) -> None:
    """Collectives pair up by order: every rank must run its nodes one at a time, in the graph's order."""
    import onnxruntime as ort

    if options.execution_mode == ort.ExecutionMode.ORT_PARALLEL:
        raise ValueError("a tensor-parallel graph runs its collectives in one order on every rank: open it with "
                         "ExecutionMode.ORT_SEQUENTIAL (the default), not ORT_PARALLEL")


def fuses_lora() -> bool:
    """Whether `prepare` fuses a LoRA graph's sites into llmc.LoraDelta here (lora_fusion.py), which reads each
    token's own slot only: the runtime may then leave stale adapters in their slots, at no cost a step."""
    return lora_fusion_enabled() and load() is not None


def prepare(onnx_path: Path, options, *, group: str | None = None) -> str | bytes:
    """What to open an ONNX Runtime session on: the graph with llmc's 4-bit kernel swapped in where this host
    has it and the graph has nodes it takes, each LoRA site's branch fused into llmc.LoraDelta (lora_fusion.py;
    the same condition, and `LLMC_LORA_FUSION` not "0"), and with the library registered on `options` (its
    llmc.PagedAttention nodes given the thread count, its llmc.AllReduce / AllGather nodes the rank
    `group`'s name, by default the process's: collective.GROUP_ENV) when any of those ops is there; else the
    file's path as it is. A graph with
    llmc.PagedAttention or collective nodes cannot run without the library: a RuntimeError says why it is
    missing; a graph with collective nodes and no `group` is a ValueError. The edited graph goes to ONNX
    Runtime as bytes; external data, if any, is read by ONNX Runtime from beside the file, as for the file
    itself."""
    import mmap

    onnx_path = Path(onnx_path)
    with open(onnx_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        mentions_q4, mentions_paged = data.find(b"MatMulNBits") >= 0, data.find(PAGED_OP.encode()) >= 0
        mentions_collective = any(data.find(op.encode()) >= 0 for op in COLLECTIVE_OPS)
        mentions_lora = lora_fusion_enabled() and data.find(b"lora_mask") >= 0
    kernels = load() if mentions_q4 or mentions_lora else None  # no parse for graphs with none of the ops
    if kernels is None and not mentions_paged and not mentions_collective:
        return str(onnx_path)
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    threads = options.intra_op_num_threads or os.cpu_count() or 1
    swapped = accelerate(model, threads, kernels.isa) if kernels and mentions_q4 else 0
    swapped += fuse_lora(model, threads) + fuse_experts(model, threads) if kernels and mentions_lora else 0
    paged = configure_paged(model, threads) + configure_experts(model, threads)  # both need the library
    collective = configure_collective(model, group or os.environ.get(GROUP_ENV))
    if collective:
        _check_sequential(options)
    if not swapped and not paged and not collective:
        return str(onnx_path)
    needed = paged_library() if paged else collective_library() if collective else kernels.library
    options.register_custom_ops_library(str(needed))
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(onnx_path.parent))
    return model.SerializeToString()
