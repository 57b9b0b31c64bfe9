"""Run a paged graph (the `paged` lowering, runtime/layout.py) on ONNX Runtime over block pools.

`PagedRunner` holds one key and one value pool per layer, `[num_blocks, block_size, KVH, D]`
(contiguous numpy), bound through IO binding as both `past_key_values.*` input and `present.*`
output, so the graph's PagedAttention writes the new tokens' entries into them in place and a step
copies no cache. `step(rows)` runs any mix of rows in one call (decoding rows, prompt chunks,
several tokens to verify) and returns the logits of each row's last `num_logits` tokens, in row
order. Which blocks a row owns is the caller's business (the block manager); `copy_blocks` copies
whole blocks across every pool (copy-on-write of a shared block).

One IO binding serves every step: the pools are bound once, a step binds its six small inputs (seven
with LongRoPE's `sequence_lengths`, taken from each row's `seq_len`) and
a fresh logits array. (Persistent bindings for decode-only steps, as OrtRunner keeps, were measured
and dropped: with the logits copied out they cost more Python time than rebinding, 94 vs 41 us a
16-row step of SmolLM2; with a fresh logits array 38 vs 41 us; whole steps showed no difference
through the noise of a shared 2-core host.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from llmc.runtime.layout import KVLayout, PAGED_INPUTS
from llmc.runtime.runners.ort import make_session
from llmc.runtime.runners.paged_batch import RowStep, pack
from llmc.runtime.runners.protocol import RunnerClosed

__all__ = ["PagedRunner", "RowStep"]


class PagedRunner:
    """A paged graph and its block pools: `step(rows) -> logits [sum(num_logits), vocab]`."""

    def __init__(self, onnx_path: Path, layout: KVLayout, *, num_blocks: int, max_num_tokens: int,
                 num_threads: int = 0, spin_after_run: bool = True, group: str | None = None):
        """`group`: the collective group of a tensor-parallel rank's graph (runtime/runners/parallel/ort_group.py)."""
        if not layout.paged:
            raise ValueError("PagedRunner runs paged graphs (kv_layout.paged); this layout is the slot form")
        if num_blocks < 1 or max_num_tokens < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and max_num_tokens ({max_num_tokens}) must be at least 1")
        self.layout, self.num_blocks, self.max_num_tokens = layout, num_blocks, max_num_tokens
        self.session = make_session(onnx_path, num_threads, spin_after_run=spin_after_run, group=group)
        expected = ["input_ids", layout.positions, *PAGED_INPUTS, *layout.past_names(), *layout.step_inputs]
        got = [i.name for i in self.session.get_inputs()]
        if got != expected:
            at = next(i for i, (g, e) in enumerate(zip([*got, None], [*expected, None])) if g != e)
            raise ValueError(f"{onnx_path} is not the paged graph kv_layout describes: its input {at} is "
                             f"{got[at] if at < len(got) else 'missing'!r}, expected "
                             f"{expected[at] if at < len(expected) else 'none'!r} (kv_layout.longrope_switch "
                             f"{layout.longrope_switch}: the LongRoPE input {'expected' if layout.step_inputs else 'none'})")
        self.vocab_size = int(self.session.get_outputs()[0].shape[-1])
        shape = layout.block_shape(num_blocks)
        self.pools = [np.zeros(shape, dtype=layout.dtype) for _ in range(2 * layout.num_layers)]
        self._binding = self._bind_pools()  # the small inputs and the logits are rebound each step

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def close(self) -> None:
        """Drop the session, its bindings and the pools."""
        self.session, self.pools, self._binding = None, None, None

    def step(self, rows: Sequence[RowStep]) -> np.ndarray:
        """Run the rows in one call; the logits of each row's last `num_logits` tokens, in row order."""
        if self.session is None:
            raise RunnerClosed("step on a closed PagedRunner")
        packed = pack(rows, block_size=self.block_size, num_blocks=self.num_blocks, max_num_tokens=self.max_num_tokens,
                      vocab_size=self.vocab_size, sequence_lengths=bool(self.layout.step_inputs))
        logits = np.empty((len(packed.logits_indices), self.vocab_size), dtype=np.float32)
        for name, value in packed.feeds().items():
            self._binding.bind_cpu_input(name, value)
        self._binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(self._binding)
        return logits

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block `src` onto block `dst` in every pool, for each `(src, dst)`."""
        pairs = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2)
        if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= self.num_blocks):
            raise ValueError(f"copy_blocks: block ids must be in 0..{self.num_blocks - 1}; got {pairs.tolist()}")
        for src, dst in pairs.tolist():  # a block at a time: slices copy in place, no gathered temporary
            for pool in self.pools:
                pool[dst] = pool[src]

    def _bind_pools(self):
        """A new IO binding with every pool as both its past input and its present output."""
        binding = self.session.io_binding()
        for past, present, pool in zip(self.layout.past_names(), self.layout.present_names(), self.pools):
            assert pool.flags.c_contiguous  # a strided view would be copied by ONNX Runtime and the writes lost
            args = ("cpu", 0, pool.dtype.type, list(pool.shape), pool.ctypes.data)
            binding.bind_input(past, *args)
            binding.bind_output(present, *args)
        return binding
