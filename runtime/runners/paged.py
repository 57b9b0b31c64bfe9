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

A step's rows, packed into the graph's inputs (`pack`):

A `RowStep` is one row: its new `token_ids`, the `past_len` tokens it already has in the cache,
the `block_ids` holding its KV (position p lives in block `block_ids[p // block_size]`, which the
caller allocated, so they cover `past_len + len(token_ids)` positions), and how many of its last
tokens need logits (`num_logits`: 1 to continue a row, more to verify draft tokens), and for a
LongRoPE graph (runtime/layout.py: `longrope_switch`) the length of the whole sequence the row
belongs to (`seq_len`; unset, the row's last position + 1: its tokens as if they were all). `pack` checks
the rows against the pool and the step budget, with errors that name the row and field at fault,
and lays them out as the paged graph takes them (runtime/layout.py): tokens packed with no padding,
block tables padded with -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from llmc.runtime.kernels import cpu_kernels
from llmc.runtime.layout import KVLayout, PAGED_INPUTS, SEQUENCE_LENGTHS
from llmc.runtime.lora.sites import Site
from llmc.runtime.lora.stacks import AdapterWeights
from llmc.runtime.runners.ort import make_session
from llmc.runtime.runners.paged_lora import LoraGraph
from llmc.runtime.runners.protocol import RunnerClosed

@dataclass(frozen=True)
class RowStep:
    token_ids: Sequence[int]
    past_len: int
    block_ids: Sequence[int]
    num_logits: int = 1
    seq_len: int | None = None  # LongRoPE graphs: the sequence's whole length (None: past_len + len(token_ids))
    adapter: AdapterWeights | None = None  # the LoRA adapter its tokens run under (None: the base model)


@dataclass(frozen=True)
class PackedStep:
    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T]
    cumulative_sequence_length: np.ndarray  # int32 [B + 1]
    past_seqlens: np.ndarray  # int32 [B]
    block_table: np.ndarray  # int32 [B, max_blocks], -1 past a row's blocks
    logits_indices: np.ndarray  # int64 [L]
    sequence_lengths: np.ndarray | None = None  # int64 [B], LongRoPE graphs only

    def feeds(self) -> dict[str, np.ndarray]:
        feeds = {"input_ids": self.input_ids, "position_ids": self.position_ids,
                 "cumulative_sequence_length": self.cumulative_sequence_length, "past_seqlens": self.past_seqlens,
                 "block_table": self.block_table, "logits_indices": self.logits_indices}
        if self.sequence_lengths is not None:
            feeds[SEQUENCE_LENGTHS] = self.sequence_lengths
        return feeds


def check_row(i: int, row: RowStep, block_size: int) -> None:
    """Refuse a row whose fields do not make a step: no tokens, a negative past, logits for tokens it
    does not bring, or too few blocks for its tokens."""
    n = len(row.token_ids)
    if n == 0:
        raise ValueError(f"row {i}: token_ids is empty; a row brings at least one new token")
    if row.past_len < 0:
        raise ValueError(f"row {i}: past_len is {row.past_len}; it counts tokens already cached, so >= 0")
    if not 1 <= row.num_logits <= n:
        raise ValueError(f"row {i}: num_logits is {row.num_logits}; expected 1 to {n} (its new tokens)")
    if row.seq_len is not None and row.seq_len <= row.past_len:
        raise ValueError(f"row {i}: seq_len is {row.seq_len}; its tokens start at position {row.past_len}, so its "
                         f"sequence is longer than that")
    needed = -(-(row.past_len + n) // block_size)
    if len(row.block_ids) < needed:
        raise ValueError(f"row {i}: {len(row.block_ids)} block(s) in block_ids cover {len(row.block_ids) * block_size} "
                         f"positions; past_len {row.past_len} + {n} new tokens need {needed} of {block_size}")


def _block_table(rows: Sequence[RowStep], widths: list[int], width: int, num_blocks: int) -> np.ndarray:
    """[rows, width] int32: each row's first `widths[b]` block ids, then -1; refuses ids outside the pool."""
    flat: list[int] = []
    for b, (row, used) in enumerate(zip(rows, widths)):
        ids = row.block_ids[:used]
        if min(ids) < 0 or max(ids) >= num_blocks:
            raise ValueError(f"row {b}: block_ids {list(ids)} name blocks outside the pool's 0..{num_blocks - 1}")
        flat.extend(ids)
        flat.extend([-1] * (width - used))
    return np.array(flat, dtype=np.int32).reshape(len(rows), width)


def pack(rows: Sequence[RowStep], *, block_size: int, num_blocks: int, max_num_tokens: int,
         vocab_size: int, sequence_lengths: bool = False) -> PackedStep:
    """The rows as the paged graph's inputs (the block table as wide as the row that reaches furthest);
    `sequence_lengths`: with the LongRoPE input.

    Every step packs, right after a graph run has left the caches cold, where each small numpy call
    costs ~10 us: the checks run on Python lists, and a step of decoding rows only (one token each,
    batch-1 decode's every step) builds its arrays straight from them."""
    if not rows:
        raise ValueError("a step needs at least one row")
    lengths = [len(r.token_ids) for r in rows]
    widths = [-(-(r.past_len + n) // block_size) for r, n in zip(rows, lengths)]
    for i, (row, n, used) in enumerate(zip(rows, lengths, widths)):
        if n == 0 or row.past_len < 0 or not 1 <= row.num_logits <= n or len(row.block_ids) < used or \
                row.seq_len is not None and row.seq_len <= row.past_len:
            check_row(i, row, block_size)
    total = sum(lengths)
    if total > max_num_tokens:
        raise ValueError(f"the step has {total} tokens; this runner takes at most max_num_tokens={max_num_tokens}")
    ids = [t for r in rows for t in r.token_ids]
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"token ids must be in 0..{vocab_size - 1}; got {min(ids)}..{max(ids)}")
    table = _block_table(rows, widths, max(widths), num_blocks)
    past = [r.past_len for r in rows]
    seq_lens = None
    if sequence_lengths:
        seq_lens = np.array([r.past_len + n if r.seq_len is None else r.seq_len for r, n in zip(rows, lengths)],
                            dtype=np.int64)
    if total == len(rows):  # decoding rows only: a token each at its row's next position, each with logits
        return PackedStep(np.array(ids, dtype=np.int64), np.array(past, dtype=np.int64),
                          np.arange(total + 1, dtype=np.int32), np.array(past, dtype=np.int32), table,
                          np.arange(total, dtype=np.int64), seq_lens)
    lengths_np = np.array(lengths, dtype=np.int64)
    past_np = np.array(past, dtype=np.int64)
    ends = np.cumsum(lengths_np)
    position_ids = np.arange(total, dtype=np.int64) + np.repeat(past_np - (ends - lengths_np), lengths_np)
    counts = np.array([r.num_logits for r in rows], dtype=np.int64)
    logits_indices = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(ends - np.cumsum(counts), counts)
    return PackedStep(np.array(ids, dtype=np.int64), position_ids, np.concatenate([[0], ends]).astype(np.int32),
                      past_np.astype(np.int32), table, logits_indices, seq_lens)


class PagedRunner:
    """A paged graph and its block pools: `step(rows) -> logits [sum(num_logits), vocab]`."""

    def __init__(self, onnx_path: Path, layout: KVLayout, *, num_blocks: int, max_num_tokens: int,
                 num_threads: int = 0, spin_after_run: bool = True, group: str | None = None, prepack: bool = True,
                 lora: tuple[Path, Sequence[Site]] | None = None, share_lora_session: bool | None = None):
        """`group`: the collective group of a tensor-parallel rank's graph (runtime/runners/parallel/ort_group.py);
        `prepack`: make_session's (False: a build's own check of a big fp32 graph reads it from the mapped file);
        `lora`: the LoRA graph and its sites (paged_lora.py), run for the steps whose rows carry an adapter;
        `share_lora_session`: the LoRA graph's session runs base-only steps too, and no session is opened over the
        base graph (ONNX Runtime packs a session's weights for itself: two sessions hold two packed copies of the
        base). Default: where the sites run fused (llmc.LoraDelta, whose rows without a slot read no adapter)."""
        if not layout.paged:
            raise ValueError("PagedRunner runs paged graphs (kv_layout.paged); this layout is the slot form")
        if num_blocks < 1 or max_num_tokens < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and max_num_tokens ({max_num_tokens}) must be at least 1")
        self.layout, self.num_blocks, self.max_num_tokens = layout, num_blocks, max_num_tokens
        shared = lora is not None and (cpu_kernels.fuses_lora() if share_lora_session is None else share_lora_session)
        opened = lora[0] if shared else onnx_path
        self.session = make_session(opened, num_threads, spin_after_run=spin_after_run, group=group, prepack=prepack)
        expected = ["input_ids", layout.positions, *PAGED_INPUTS, *layout.past_names(), *layout.step_inputs]
        got = [i.name for i in self.session.get_inputs()][:len(expected) if shared else None]  # LoRA inputs follow
        if got != expected:
            at = next(i for i, (g, e) in enumerate(zip([*got, None], [*expected, None])) if g != e)
            raise ValueError(f"{opened} is not the paged graph kv_layout describes: its input {at} is "
                             f"{got[at] if at < len(got) else 'missing'!r}, expected "
                             f"{expected[at] if at < len(expected) else 'none'!r} (kv_layout.longrope_switch "
                             f"{layout.longrope_switch}: the LongRoPE input {'expected' if layout.step_inputs else 'none'})")
        self.vocab_size = int(self.session.get_outputs()[0].shape[-1])
        shape = layout.block_shape(num_blocks)
        self.pools = [np.zeros(shape, dtype=layout.dtype) for _ in range(2 * layout.num_layers)]
        self._binding = self._bind_pools(self.session)  # the small inputs and the logits are rebound each step
        self.lora = None
        if shared:
            self.lora = LoraGraph(self.session, lora[1], expected, lora[0], keep_stale=True, shared=True)
            self.lora.binding = self._binding
        elif lora is not None:  # it takes turns with the base session: its threads stop spinning after its runs
            session = make_session(lora[0], num_threads, spin_after_run=False, group=group, prepack=prepack)
            self.lora = LoraGraph(session, lora[1], expected, lora[0], keep_stale=cpu_kernels.fuses_lora())
            self.lora.binding = self._bind_pools(session)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def close(self) -> None:
        """Drop the session, its bindings and the pools."""
        self.session, self.pools, self._binding = None, None, None
        if self.lora is not None:
            self.lora.close()

    def step(self, rows: Sequence[RowStep]) -> np.ndarray:
        """Run the rows in one call; the logits of each row's last `num_logits` tokens, in row order."""
        if self.session is None:
            raise RunnerClosed("step on a closed PagedRunner")
        packed = pack(rows, block_size=self.block_size, num_blocks=self.num_blocks, max_num_tokens=self.max_num_tokens,
                      vocab_size=self.vocab_size, sequence_lengths=bool(self.layout.step_inputs))
        logits = np.empty((len(packed.logits_indices), self.vocab_size), dtype=np.float32)
        session, binding = self.session, self._binding
        if self.lora is not None and (self.lora.shared or any(row.adapter is not None for row in rows)):
            session, binding = self.lora.session, self.lora.binding
            self.lora.bind([row.adapter for row in rows], [len(row.token_ids) for row in rows])
        for name, value in packed.feeds().items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        session.run_with_iobinding(binding)
        return logits

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block `src` onto block `dst` in every pool, for each `(src, dst)`."""
        pairs = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2)
        if pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= self.num_blocks):
            raise ValueError(f"copy_blocks: block ids must be in 0..{self.num_blocks - 1}; got {pairs.tolist()}")
        for src, dst in pairs.tolist():  # a block at a time: slices copy in place, no gathered temporary
            for pool in self.pools:
                pool[dst] = pool[src]

    def _bind_pools(self, session):
        """A new IO binding of `session` with every pool as both its past input and its present output."""
        binding = session.io_binding()
        for past, present, pool in zip(self.layout.past_names(), self.layout.present_names(), self.pools):
            assert pool.flags.c_contiguous  # a strided view would be copied by ONNX Runtime and the writes lost
            args = ("cpu", 0, pool.dtype.type, list(pool.shape), pool.ctypes.data)
            binding.bind_input(past, *args)
            binding.bind_output(present, *args)
        return binding
