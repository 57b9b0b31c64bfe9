"""Run an exported decoder graph on ONNX Runtime, its KV cache kept in preallocated slots.

`KVCache` holds one key and one value buffer per layer, `[max_batch, kv_heads, capacity, head_dim]`;
row r of every buffer is slot r. `OrtRunner` is a `Runner` (runtime/runners/protocol.py):
`step(input_ids, cache_position, first_row)` runs the rows `first_row .. first_row + n` (a
contiguous range, so each buffer's rows are one contiguous block of memory) and returns their logits;
a LongRoPE graph also takes each row's sequence length (`sequence_lengths`, runtime/layout.py).

In-place graphs (`layout.in_place`, the fused lowering) get each slot range bound through IO
binding as both `past_key_values.*` input and `present.*` output: a step writes only the new
tokens' entries. Decode steps (one token per row) go further: their bindings hold every input and
output, the token ids and positions written into buffers bound once and the logits read out of one,
so a step costs ONNX Runtime's run and a few microseconds of Python (binding inputs and a fresh
logits array every step had cost ~100 us, 2-3% of a SmolLM2 int4 step). Other graphs are run with
the rows as inputs and their `present.*` outputs copied back (the whole buffer is swapped instead
when the step covers every row).

With `lora` (the sites of a LoRA graph: compiler/lora/graph.py) the session is the LoRA graph's, and a step's rows may
each carry an adapter: the step binds the stacks of its distinct adapters and a mask row per token (runtime/lora/
stacks.py: StepStacks); a base-only step binds stacks zero slots wide, so where llmc.LoraDelta runs each site it reads
no adapter. Its decode steps go through the general in-place path (the LoRA inputs bound each step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from llmc.runtime.layout import SEQUENCE_LENGTHS, KVLayout, check_step, step_lengths
from llmc.runtime.lora.sites import Site, a_name, mask_names
from llmc.runtime.lora.stacks import AdapterWeights, StepStacks
from llmc.runtime.runners.protocol import RunnerClosed


def make_session(onnx_path: Path, num_threads: int = 0, optimize: bool = True, spin_after_run: bool = True,
                 prepack: bool = True, group: str | None = None, prefetch: bool = True):
    """A CPU session; `optimize=False` turns ONNX Runtime's graph optimizations off (the fp8 reference
    path, which also keeps ONNX Runtime's own kernels). 4-bit MatMulNBits nodes run on llmc's kernel
    where this host has it (runtime/kernels/cpu_kernels.py): the graph is loaded, the op swapped in memory.
    `spin_after_run=False` stops the session's threads spin-waiting once a run ends (they still spin
    between the ops of a run): for two sessions taking turns on the same cores (a draft model and
    its target), where one's pool spinning after its run takes the cores from the other's. SmolLM2 on
    2 cores, a 5-token verify after four int4 draft calls: 66 ms spinning on, 40 ms with spinning off
    altogether, 30 ms stopped after each run (a lone decode call 13 ms, as with spinning on).
    `prepack=False` keeps ONNX Runtime from copying the weights into its packed layouts: the session then
    reads an external-data graph's weights from the mapped file (0.25 GB resident for a 1.6 GB graph
    instead of 1.7), at some speed: for a build's calibration passes over a few windows. `group`: the
    tensor-parallel group a rank's graph sums with (runtime/kernels/collective.py). `prefetch=False`: the data
    file is not read ahead (a graph that reads a part of it: compiler/graph/segments.py)."""
    import onnxruntime as ort

    from llmc.runtime.kernels import cpu_kernels

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = num_threads or (os.cpu_count() or 1)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spin_after_run:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    model = cpu_kernels.prepare(onnx_path, options, group=group) if optimize else str(onnx_path)
    # read in before the session opens: the weights the kernels copy are then read once, and the pages llmc's
    # 4-bit op hands back stay out of the page cache (read after, they came back: 0.2 GB of a 0.5B int4 graph's 0.8)
    if prefetch:
        prefetch_file(Path(onnx_path).with_name(Path(onnx_path).name + ".data"))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def prefetch_file(data_file: Path, chunk: int = 8 << 20) -> None:
    """Read a graph's external weights once, so that they are in the page cache before its session opens.
    ONNX Runtime maps that file and reads the weights in place (ONNX Runtime's own MatMulNBits and llmc's
    4-bit kernel copy their packed weights at load; the embedding table and every unpacked weight do not):
    each page not yet read faulted in from disk during a decode step, 4-10 ms apiece (a 0.5B int4
    step took 40 ms cold against 32 warm, its one-row embedding Gather 2.5 ms of it). The kernel may
    still drop the pages under memory pressure, as it may llama.cpp's mapped weights."""
    if not data_file.is_file():
        return
    buffer = bytearray(chunk)
    with open(data_file, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


class KVCache:
    """The per-layer key/value buffers, `[k0, v0, k1, v1, ...]`, each `[max_batch, KVH, capacity, D]`."""

    def __init__(self, layout: KVLayout, max_batch: int, capacity: int):
        self.layout, self.max_batch, self.capacity = layout, max_batch, capacity
        shape = layout.shape(max_batch, capacity)
        self.buffers = [np.zeros(shape, dtype=layout.dtype) for _ in range(2 * layout.num_layers)]

    def rows(self, first: int, count: int) -> list[np.ndarray]:
        return [b[first:first + count] for b in self.buffers]

    def store(self, first: int, count: int, present: list[np.ndarray]) -> None:
        if first == 0 and count == self.max_batch:
            self.buffers = list(present)
            return
        for buf, new in zip(self.buffers, present):
            buf[first:first + count] = new

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class OrtRunner:
    """A `Runner` on ONNX Runtime: `step(input_ids [n, S], cache_position [n], first_row) -> logits [n, S, vocab]`."""

    def __init__(self, onnx_path: Path, layout: KVLayout, *, max_batch: int, capacity: int, num_threads: int = 0,
                 optimize: bool = True, prepack: bool = True, lora: Sequence[Site] | None = None):
        """`lora`: the sites of the LoRA graph at `onnx_path`, whose inputs each step binds (its rows' adapters)."""
        self.layout, self.rows, self.capacity = layout, max_batch, capacity
        self.session = make_session(onnx_path, num_threads, optimize, prepack=prepack)
        self.lora = None
        if lora is not None:
            names = {i.name for i in self.session.get_inputs()}
            missing = sorted({*mask_names(lora), *(a_name(site) for site in lora)} - names)
            if missing:
                raise ValueError(f"{onnx_path} is not a LoRA graph with the manifest's sites: it lacks {missing[0]}")
            self.lora = StepStacks(lora)
        self.cache = KVCache(layout, max_batch, capacity)
        self.vocab_size = self.session.get_outputs()[0].shape[-1]
        self._bindings: dict[tuple[int, int], object] = {}  # (first_row, n) -> the cache rows bound
        self._decode_bindings: dict[tuple[int, int], object] = {}  # the same, with every input and output
        if layout.in_place:  # decode inputs and output; a step's n rows are the first n of each
            self._ids = np.zeros((max_batch, 1), dtype=np.int64)
            self._positions = np.zeros(max_batch, dtype=np.int64)
            self._seq_lens = np.zeros(max_batch, dtype=np.int64)
            self._logits = np.zeros((max_batch, 1, self.vocab_size), dtype=np.float32)

    def close(self) -> None:
        """Drop the session, its bindings and the cache buffers."""
        self.session, self.cache = None, None
        self._bindings.clear()
        self._decode_bindings.clear()

    def step(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int = 0,
             sequence_lengths: np.ndarray | None = None,
             adapters: Sequence[AdapterWeights | None] | None = None) -> np.ndarray:
        """`adapters`: each row's LoRA adapter (None: the base), for a runner with `lora`."""
        if self.session is None:
            raise RunnerClosed("step on a closed OrtRunner")
        input_ids, cache_position = np.asarray(input_ids), np.asarray(cache_position)
        seq_lens = step_lengths(self.layout, cache_position, input_ids.shape[-1], sequence_lengths)
        if self.lora is None and adapters is not None and any(a is not None for a in adapters):
            raise ValueError("a step with LoRA adapters on a runner without the LoRA graph")
        if self.layout.in_place and input_ids.shape[1:] == (1,) and self.lora is None:
            return self._decode(input_ids, cache_position, first_row, seq_lens)
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        cache_position = np.ascontiguousarray(cache_position, dtype=np.int64)
        n, s = input_ids.shape
        check_step(self.layout, self.rows, self.capacity, (n, s), cache_position, first_row)
        extra = {} if seq_lens is None else {SEQUENCE_LENGTHS: seq_lens}
        if self.lora is not None:
            extra.update(self.lora.inputs(list(adapters) if adapters is not None else [None] * n, (n, s)))
        if self.layout.in_place:
            return self._step_in_place(input_ids, cache_position, first_row, extra)
        names = self.layout.past_names()
        feeds = {"input_ids": input_ids, self.layout.positions: cache_position,
                 **dict(zip(names, self.cache.rows(first_row, n))), **extra}
        logits, *present = self.session.run(["logits", *self.layout.present_names()], feeds)
        self.cache.store(first_row, n, present)
        return logits

    def _step_in_place(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int,
                       extra: dict[str, np.ndarray]) -> np.ndarray:
        n, s = input_ids.shape
        binding = self._bindings.get((first_row, n))
        if binding is None:
            binding = self._bindings[(first_row, n)] = self._bind_cache(first_row, n)
        logits = np.empty((n, s, self.vocab_size), dtype=np.float32)
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input(self.layout.positions, cache_position)
        for name, value in extra.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits

    def _decode(self, input_ids: np.ndarray, cache_position: np.ndarray, first_row: int,
                seq_lens: np.ndarray | None) -> np.ndarray:
        n = len(input_ids)
        check_step(self.layout, self.rows, self.capacity, (n, 1), cache_position, first_row)
        binding = self._decode_bindings.get((first_row, n))
        if binding is None:
            binding = self._decode_bindings[(first_row, n)] = self._bind_decode(first_row, n)
        self._ids[:n] = input_ids  # converts to int64 as it copies
        self._positions[:n] = cache_position
        if seq_lens is not None:
            self._seq_lens[:n] = seq_lens
        self.session.run_with_iobinding(binding)
        return self._logits[:n].copy()  # the caller's to keep (2 us a row of SmolLM2's vocabulary)

    def _bind_decode(self, first_row: int, n: int):
        """`_bind_cache`'s binding plus the first n rows of the decode buffers as input ids,
        positions (and LongRoPE's sequence lengths) and logits."""
        binding = self._bind_cache(first_row, n)
        inputs = [("input_ids", self._ids[:n]), (self.layout.positions, self._positions[:n])]
        inputs += [(SEQUENCE_LENGTHS, self._seq_lens[:n])] if self.layout.step_inputs else []
        for name, buf in inputs:
            binding.bind_input(name, "cpu", 0, np.int64, list(buf.shape), buf.ctypes.data)
        logits = self._logits[:n]
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        return binding

    def _bind_cache(self, first_row: int, n: int):
        """A new IO binding with rows `first_row ..+n` of every buffer as both past input and present output."""
        binding = self.session.io_binding()
        names = zip(self.layout.past_names(), self.layout.present_names(), self.cache.rows(first_row, n))
        for past, present, rows in names:
            assert rows.flags.c_contiguous  # a strided view would be copied by ORT and the writes lost
            args = ("cpu", 0, rows.dtype.type, list(rows.shape), rows.ctypes.data)
            binding.bind_input(past, *args)
            binding.bind_output(present, *args)
        return binding
