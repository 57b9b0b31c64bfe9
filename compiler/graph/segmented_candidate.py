"""The verify stage's candidate in a streamed build: the paged graph run a segment of weights at a time
(segments.py), in the steps paged_greedy runs (rows joining a step apart, prompts in chunks, then a token a
step over the KV cache), each row fed its prompt and then a continuation fixed in advance.

A decode's next token is known only once the whole graph has run the step: a segment at a time, every step would
open every segment again (at 8B, read 30 GiB from disk a step). Fed tokens known in advance, each segment opens
once and runs every step of every case in order, its layers' KV cache carried from one step to the next
(SegmentedGraph.run's chain) as the whole graph's is: the decode path (one token a step over the cache, blocks
shared out of one pool, prompts in chunks) is the one serving runs. The reference (streamed_reference.py) is fed
the same tokens, so both compute every position on the same inputs: logits compared at each, and the argmax
at each step (verify.compare). What this leaves out is the candidate choosing its own tokens, which checks no
arithmetic that the forced steps do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc.compiler.graph.greedy import Decoded, PagedSchedule
from llmc.compiler.graph.segments import SegmentedGraph
from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged import RowStep, pack


def continuations(prompts: list[list[int]], steps: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The tokens each prompt is continued with: `steps` - 1 fed (the last step's logits need no token after them),
    drawn at random (seeded): the check is of the function, which any tokens exercise."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, steps - 1).tolist() for _ in prompts]


def forced_cases(graph_file: Path, layout: KVLayout, cases: list[list[list[int]]], fed: list[list[list[int]]],
                 steps: int, chunks: list[int | None], vocab_size: int, *, num_threads: int = 0,
                 progress: Callable[[int, int], None] | None = None,
                 adapters: list[list | None] | None = None,
                 extra: Callable[[int, Sequence[RowStep]], dict[str, np.ndarray]] | None = None
                 ) -> list[list[Decoded]]:
    """Each case's rows (`cases[c]`: its prompts) decoded by `graph_file` (a paged graph) a segment at a time, row r
    of case c fed `fed[c][r]` after its prompt (continuations), its prompt in chunks of `chunks[c]` (None: whole):
    per case, each row's Decoded as paged_greedy gives it. A LoRA graph's: `adapters[c][r]`, row r's adapter in case c
    (its RowSteps carry it), and `extra(c, rows)`, the LoRA inputs of case c's step of `rows` (compiler/lora/
    verify.py)."""
    forced = lambda c: (lambda r, k, out: fed[c][r][k] if k < len(fed[c][r]) else 0)  # noqa: E731
    plans = []  # per case: its steps' rows, and its pool's size
    for c, (prompts, chunk) in enumerate(zip(cases, chunks)):
        schedule = PagedSchedule(prompts, steps, layout.block_size, layout.longrope_switch, chunk,
                                 adapters=adapters[c] if adapters else None)
        rows = []
        while not schedule.finished():  # the steps are known before any runs: the tokens are
            rows.append(schedule.next_rows())
            schedule.take(np.zeros((sum(r.num_logits for r in rows[-1]), 0), np.float32), forced(c))
        plans.append((rows, sum(map(len, schedule.blocks)), schedule.blocks))
    items = [(c, t) for c, (rows, _, _) in enumerate(plans) for t in range(len(rows))]

    def inputs(k: int) -> dict[str, np.ndarray]:
        c, t = items[k]
        rows, blocks, _ = plans[c]
        step = pack(rows[t], block_size=layout.block_size, num_blocks=blocks,
                    max_num_tokens=sum(len(r.token_ids) for r in rows[t]), vocab_size=vocab_size,
                    sequence_lengths=bool(layout.step_inputs))
        # a pool apiece: the graph writes the step's entries into the pool it is given (layout.in_place)
        return {**step.feeds(), **{name: np.zeros(layout.block_shape(blocks), dtype=layout.dtype)
                                   for name in layout.past_names()}, **(extra(c, rows[t]) if extra else {})}

    logits: dict[int, np.ndarray] = {}
    with SegmentedGraph(graph_file, num_threads=num_threads) as graph:
        for k, values in graph.run(len(items), inputs, ["logits"], progress,
                                   chain=dict(zip(layout.present_names(), layout.past_names())),
                                   previous=lambda k: k - 1 if items[k][1] > 0 else None):
            logits[k] = values["logits"]
    decoded, k = [], 0
    for c, (prompts, chunk) in enumerate(zip(cases, chunks)):
        schedule = PagedSchedule(prompts, steps, layout.block_size, layout.longrope_switch, chunk, plans[c][2])
        while not schedule.finished():
            schedule.next_rows()
            schedule.take(logits.pop(k), forced(c))
            k += 1
        decoded.append(schedule.decoded())
    return decoded
