"""One step of the paged graph: the rows the caller asks for, packed into the graph's inputs.

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
from typing import Sequence

import numpy as np

from llmc.runtime.layout import SEQUENCE_LENGTHS


@dataclass(frozen=True)
class RowStep:
    token_ids: Sequence[int]
    past_len: int
    block_ids: Sequence[int]
    num_logits: int = 1
    seq_len: int | None = None  # LongRoPE graphs: the sequence's whole length (None: past_len + len(token_ids))


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
