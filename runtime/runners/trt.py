"""Run a TensorRT engine as a `Runner` (runtime/runners/protocol.py), like `OrtRunner`, the KV cache on the GPU.

    step(input_ids [n, S], cache_position [n], first_row[, sequence_lengths]) -> logits [n, S, vocab] (host, float32)

Same KV layout as the ONNX graph it was built from: one key and one value buffer per layer,
`[max_batch, kv_heads, capacity, head_dim]`, allocated once on the GPU; rows `first_row ..+n` of
every buffer are one contiguous block, so a step binds `base + first_row * row_bytes` as both the
`past_key_values.*` input and (`layout.in_place`: the plugin's aliased outputs) the `present.*`
output — nothing is copied. Graphs that return a new cache (the reference lowering) write into a
scratch set whose rows are copied back on the device. Steps with several tokens per row use the
engine's prefill profile (one row), one-token steps its decode profile; each profile has its own
execution context, and everything runs on one CUDA stream (`execute_async_v3`). `close()` frees
the device buffers, the contexts, the engine and the stream. The attention plugins' key-split workspace and
counters, when the engine has them, are allocated and zeroed once and bound on every step (trt_split.py).

With `lora` (an engine built from a LoRA graph: compiler/tensorrt/stage.py) each step binds the LoRA inputs too: the
stacks of its rows' distinct adapters (runtime/lora/stacks.py: StepStacks, copied to the GPU only when the set
changes) and a mask row per token, [n, S, width], in the engine's types, into buffers allocated once at the largest
width (lora.max_slots x the site's modules x lora.max_rank). A base-only step binds stacks zero slots wide. Written
against TensorRT's API like the rest of this module, never run (docs/tensorrt.md).

`check_engine(info, ...)` refuses, before deserializing, an engine built by another TensorRT
version (unless version-compatible) or for another GPU generation, or whose attention plugin's PTX this
driver or GPU cannot run (trt_ptx.py), with a message that says which and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from llmc.runtime.layout import ITEMSIZE, SEQUENCE_LENGTHS, KVLayout, check_step, step_lengths
from llmc.runtime.lora.sites import Site, a_name, b_name, mask_name, stack_shapes
from llmc.runtime.lora.stacks import AdapterWeights, StepStacks
from llmc.runtime.manifest import TensorRTInfo
from llmc.runtime.runners.protocol import RunnerClosed
from llmc.runtime.runners.trt_ptx import ptx_problem
from llmc.runtime.runners.trt_split import SplitBuffers

PREFILL, DECODE = 0, 1  # optimization profile indices (compiler/tensorrt/profiles.py order)


class EngineLoadError(RuntimeError):
    """The engine cannot run here (TensorRT version, GPU, or a corrupt plan)."""


def _capability(text: str) -> int:
    major, minor = text.split(".")
    return 10 * int(major) + int(minor)


def check_engine(info: TensorRTInfo, tensorrt_version: str, gpu: str, capability: int,
                 cuda_driver_version: int | None = None) -> None:
    """Raise EngineLoadError when an engine described by `info` cannot load under this TensorRT, GPU and CUDA
    driver (cudaDriverGetVersion's number; None: not checked)."""
    built = _capability(info.compute_capability)
    if tensorrt_version != info.version and not info.version_compatible:
        raise EngineLoadError(
            f"the engine was built by TensorRT {info.version} and this server has TensorRT {tensorrt_version}; "
            "rebuild it with this version, or build with tensorrt.version_compatible: true")
    if info.hardware_compatibility == "ampere_plus":
        ok = capability >= 80
        wanted = "an Ampere or later GPU (compute capability 8.0+)"
    else:
        ok = capability == built
        wanted = f"a GPU of compute capability {info.compute_capability} (built on {info.gpu})"
    if not ok:
        raise EngineLoadError(
            f"the engine needs {wanted}; this GPU ({gpu}) has {capability // 10}.{capability % 10}. Rebuild on this "
            "GPU, or build with tensorrt.hardware_compatibility: ampere_plus")
    if info.plugin_ptx_isa and info.plugin_ptx_target and cuda_driver_version is not None:
        problem = ptx_problem(info.plugin_ptx_isa, info.plugin_ptx_target, cuda_driver_version, capability)
        if problem:
            raise EngineLoadError(f"{problem} (GPU: {gpu})")


def cuda_driver_version() -> int:
    """The CUDA version the installed driver supports, as cudaDriverGetVersion gives it (13000: CUDA 13.0)."""
    return int(_ok(_cuda().cudaDriverGetVersion()))


def _cuda():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # cuda-python < 12.6
        from cuda import cudart
    return cudart


def _ok(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else values


def _free(pointers) -> None:
    """cudaFree every device pointer, then raise for the first that failed (the rest are freed still)."""
    cudart = _cuda()
    errors = [cudart.cudaFree(ptr)[0] for ptr in pointers]  # each call returns (cudaError_t,)
    failed = [err for err in errors if int(err) != 0]
    if failed:
        raise RuntimeError(f"CUDA error {failed[0]} freeing device memory")


def gpu_identity() -> tuple[str, int]:
    """(name, capability as 10*major+minor) of CUDA device 0."""
    cudart = _cuda()
    props = _ok(cudart.cudaGetDeviceProperties(0))
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00"), 10 * props.major + props.minor


class DeviceKVCache:
    """The per-layer key/value buffers on the GPU, `[k0, v0, k1, v1, ...]`, as device addresses."""

    def __init__(self, layout: KVLayout, max_batch: int, capacity: int):
        self.layout, self.max_batch, self.capacity = layout, max_batch, capacity
        self.row_bytes = layout.num_kv_heads * capacity * layout.head_dim * ITEMSIZE[layout.dtype]
        cudart = _cuda()
        self.buffers = [_ok(cudart.cudaMalloc(self.row_bytes * max_batch)) for _ in range(2 * layout.num_layers)]
        for ptr in self.buffers:  # stale memory is never read, but zeros make a fresh cache deterministic
            _ok(cudart.cudaMemset(ptr, 0, self.row_bytes * max_batch))

    def rows(self, first: int) -> list[int]:
        return [ptr + first * self.row_bytes for ptr in self.buffers]

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.max_batch * len(self.buffers)

    def close(self) -> None:
        """Free the buffers; calling it again does nothing."""
        buffers, self.buffers = self.buffers, []
        _free(buffers)


class TrtRunner:
    """A `Runner` on a TensorRT engine, its KV cache on the GPU."""

    def __init__(self, engine_path: Path, layout: KVLayout, *, max_batch: int, capacity: int, max_num_tokens: int,
                 info: TensorRTInfo | None = None, lora: tuple[Sequence[Site], int, int] | None = None):
        """`lora`: (the sites, lora.max_slots, lora.max_rank) of an engine built with the LoRA branch."""
        try:
            import tensorrt as trt

            cudart = _cuda()
        except ImportError as err:
            raise EngineLoadError(f"{Path(engine_path).name} is a TensorRT engine and this Python lacks {err.name}: install "
                                  "the model's requirements.txt (tensorrt, cuda-python) on a machine with an NVIDIA "
                                  "GPU") from None
        gpu, capability = gpu_identity()
        if info is not None:
            check_engine(info, trt.__version__, gpu, capability,
                         cuda_driver_version() if info.plugin_ptx_isa else None)
        self.layout, self.trt, self.rows, self.capacity = layout, trt, max_batch, capacity
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise EngineLoadError(f"{engine_path}: TensorRT {trt.__version__} could not deserialize the engine (built "
                                  "by another version or for another GPU, or the file is damaged); rebuild it here")
        self.split = SplitBuffers(self.engine, cudart, _ok)  # the attention plugins' key-split buffers (trt_split.py)
        self.stream = _ok(cudart.cudaStreamCreate())
        self.contexts = []
        for profile in (PREFILL, DECODE):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(profile, self.stream)
            self.contexts.append(context)
        self.cache = DeviceKVCache(layout, max_batch, capacity)
        self.scratch = None if layout.in_place else DeviceKVCache(layout, max_batch, capacity)
        self.vocab_size = int(self.engine.get_tensor_shape("logits")[-1])
        self._logits_type = self._dtype("logits")
        tokens = max(max_num_tokens, max_batch)
        self._ids = _ok(cudart.cudaMalloc(tokens * 8))
        self._positions = _ok(cudart.cudaMalloc(max_batch * 8))
        self._logits = _ok(cudart.cudaMalloc(tokens * self.vocab_size * np.dtype(self._logits_type).itemsize))
        self._io = (self._ids, self._positions, self._logits, *self.split.pointers.values())  # freed by close()
        if layout.step_inputs:  # LongRoPE's sequence_lengths
            self._seq_lens = _ok(cudart.cudaMalloc(max_batch * 8))
            self._io += (self._seq_lens,)
        self.lora, self._lora_buffers, self._lora_stacked = None, {}, -1
        if lora is not None:
            sites, max_slots, max_rank = lora
            self.lora = StepStacks(sites)
            for site in sites:
                widest = stack_shapes(site, max_slots * len(site.members) * max_rank)
                for name, shape in zip((a_name(site), b_name(site)), widest):
                    self._lora_buffers[name] = self._lora_malloc(name, int(np.prod(shape)))
            for members in sorted({len(site.members) for site in sites}):
                widest = max(tokens, max_batch) * max_slots * members * max_rank
                self._lora_buffers[mask_name(members)] = self._lora_malloc(mask_name(members), widest)

    def _lora_malloc(self, name: str, elements: int) -> int:
        """A device buffer for the LoRA input `name`, `elements` of the engine's type for it (one at least)."""
        ptr = _ok(_cuda().cudaMalloc(max(elements, 1) * np.dtype(self._dtype(name)).itemsize))
        self._io += (ptr,)
        return ptr

    def _dtype(self, name: str):
        """The numpy type the engine takes `name` in (bfloat16: its bits, uint16)."""
        dtype = self.engine.get_tensor_dtype(name)
        return np.uint16 if dtype == self.trt.bfloat16 else self.trt.nptype(dtype)

    def _host(self, name: str, value: np.ndarray) -> np.ndarray:
        """`value` (float32) in the engine's type for `name`, contiguous."""
        dtype = self._dtype(name)
        if dtype is np.uint16:  # bfloat16: the high half of each float32, rounded to nearest even
            bits = np.ascontiguousarray(value, np.float32).view(np.uint32)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.ascontiguousarray(value, dtype=dtype)

    def _bind_lora(self, context, adapters, shape: tuple[int, int], h2d) -> list[np.ndarray]:
        """Bind the step's LoRA inputs on `context`; the host arrays the queued copies read (kept until the step
        syncs)."""
        cudart = _cuda()
        inputs = self.lora.inputs(list(adapters) if adapters is not None else [None] * shape[0], shape)
        restacked = self.lora.num_stackings != self._lora_stacked
        self._lora_stacked = self.lora.num_stackings
        held = []
        for name, value in inputs.items():
            if restacked or name.startswith("lora_mask"):  # the stacks stay on the GPU while the set stays
                host = self._host(name, value)
                held.append(host)
                _ok(cudart.cudaMemcpyAsync(self._lora_buffers[name], host.ctypes.data, host.nbytes, h2d, self.stream))
            context.set_input_shape(name, value.shape)
            context.set_tensor_address(name, self._lora_buffers[name])
        return held

    def close(self) -> None:
        """Wait for the stream, then free the KV cache and the step buffers, destroy the execution
        contexts before the engine and the engine before its runtime (TensorRT frees an object when
        its last Python reference goes), and destroy the stream last. Calling it again does nothing."""
        if self.stream is None:
            return
        cudart = _cuda()
        _ok(cudart.cudaStreamSynchronize(self.stream))
        for cache in (self.cache, self.scratch):
            if cache is not None:
                cache.close()
        io, self._io = self._io, ()
        _free(io)
        self.contexts = []
        self.engine = None
        self._runtime = None
        stream, self.stream = self.stream, None
        _ok(cudart.cudaStreamDestroy(stream))

    def step(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int = 0,
             sequence_lengths: np.ndarray | None = None,
             adapters: Sequence[AdapterWeights | None] | None = None) -> np.ndarray:
        """`adapters`: each row's LoRA adapter (None: the base), for an engine built with the LoRA branch."""
        if self.stream is None:
            raise RunnerClosed("step on a closed TrtRunner")
        if self.lora is None and adapters is not None and any(a is not None for a in adapters):
            raise ValueError("a step with LoRA adapters on an engine built without the LoRA branch")
        cudart = _cuda()
        h2d, d2h, d2d = (cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                         cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        cache_position = np.ascontiguousarray(cache_position, dtype=np.int64)
        n, s = input_ids.shape
        check_step(self.layout, self.rows, self.capacity, (n, s), cache_position, first_row)
        context = self.contexts[PREFILL if s > 1 else DECODE]
        _ok(cudart.cudaMemcpyAsync(self._ids, input_ids.ctypes.data, input_ids.nbytes, h2d, self.stream))
        _ok(cudart.cudaMemcpyAsync(self._positions, cache_position.ctypes.data, cache_position.nbytes, h2d,
                                   self.stream))
        context.set_input_shape("input_ids", (n, s))
        context.set_tensor_address("input_ids", self._ids)
        context.set_input_shape(self.layout.positions, (n,))
        context.set_tensor_address(self.layout.positions, self._positions)
        seq_lens = step_lengths(self.layout, cache_position, s, sequence_lengths)
        if seq_lens is not None:
            _ok(cudart.cudaMemcpyAsync(self._seq_lens, seq_lens.ctypes.data, seq_lens.nbytes, h2d, self.stream))
            context.set_input_shape(SEQUENCE_LENGTHS, (n,))
            context.set_tensor_address(SEQUENCE_LENGTHS, self._seq_lens)
        kv_shape = self.layout.shape(n, self.capacity)
        present_rows = (self.scratch or self.cache).rows(first_row)
        for past, present, rows, out in zip(self.layout.past_names(), self.layout.present_names(),
                                            self.cache.rows(first_row), present_rows):
            context.set_input_shape(past, kv_shape)
            context.set_tensor_address(past, rows)
            context.set_tensor_address(present, out)
        context.set_tensor_address("logits", self._logits)
        self.split.bind(context)
        held = self._bind_lora(context, adapters, (n, s), h2d) if self.lora is not None else []
        if not context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT failed to run the step (see the log)")
        if self.scratch is not None:
            for rows, out in zip(self.cache.rows(first_row), present_rows):
                _ok(cudart.cudaMemcpyAsync(rows, out, n * self.cache.row_bytes, d2d, self.stream))
        logits = np.empty((n, s, self.vocab_size), dtype=self._logits_type)
        _ok(cudart.cudaMemcpyAsync(logits.ctypes.data, self._logits, logits.nbytes, d2h, self.stream))
        _ok(cudart.cudaStreamSynchronize(self.stream))
        del held  # the LoRA inputs' host copies, read by the copies queued above
        if self._logits_type is np.uint16:  # bfloat16: the high half of a float32
            return (logits.astype(np.uint32) << 16).view(np.float32)
        return logits.astype(np.float32, copy=False)
