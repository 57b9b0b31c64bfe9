"""Decode speed with no prefill in flight, in process (`python -m llmc.bench paged`'s `decode` section):
the slot graph under SlotEngine against the paged graph under PagedEngine, fp32 and
int4-weight-only (round to nearest, blocks of 32), batch 1 and 16.

Each engine gets its rows (distinct 256-token prompts, greedy, too many tokens asked to finish) and
steps until every row decodes: that prefill is not timed. Then each pass times STEPS engine steps
on both graphs, ROUND steps at a time in turns (the order alternating pass by pass), so a burst of
load on the shared host falls on both alike: tokens/s = rows x STEPS / seconds, a
step being the whole of what a server's step does (scheduling, the graph call, sampling). Both
graphs hold 1024 tokens of KV a row (slots of 1024; pools of 1024 tokens a row in blocks of 16), 2
ONNX Runtime threads each.
"""

from __future__ import annotations

import time

import numpy as np

from llmc.bench.builds import work_graph
from llmc.bench.harness import in_turn

STEPS, ROUND, PROMPT, CAPACITY = 64, 8, 256, 1024
BATCHES = (1, 16)


def _engine(graph: str, folder, artifact, rows: int):
    if graph == "slot":
        from llmc.runtime.engine.slot_engine import SlotEngine
        from llmc.runtime.runners.ort import OrtRunner

        runner = OrtRunner(folder / artifact.onnx, artifact.kv_layout, max_batch=rows, capacity=CAPACITY, num_threads=2)
        return SlotEngine(runner, max_num_tokens=8192)
    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.runners.paged import PagedRunner

    blocks = rows * CAPACITY // artifact.kv_layout.block_size
    runner = PagedRunner(folder / artifact.onnx, artifact.kv_layout, num_blocks=blocks, max_num_tokens=256,
                         num_threads=2)
    return PagedEngine(runner, max_rows=rows, max_seq_len=CAPACITY, max_num_tokens=256)


def _prefilled(engine, rows: int, seed: int):
    """`engine` with `rows` requests that have all sampled their first token."""
    from llmc.runtime.decoding.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    for i in range(rows):
        engine.add_request(f"r{i}", rng.integers(100, 20000, PROMPT).tolist(),
                           SamplingParams(max_tokens=CAPACITY - PROMPT - 1))
    started: set[str] = set()
    while len(started) < rows:
        started.update(o.request_id for o in engine.step() if o.token_ids)
    return engine


def _time_steps(engines: dict, rows: int, order: list[str]) -> dict[str, float]:
    """tokens/s of each engine over STEPS steps, taken ROUND steps at a time in turns, so a burst of
    load on the shared host falls on both graphs alike."""
    seconds = dict.fromkeys(order, 0.0)
    for _ in range(STEPS // ROUND):
        for g in order:
            start = time.perf_counter()
            tokens = sum(len(o.token_ids) for _ in range(ROUND) for o in engines[g].step())
            seconds[g] += time.perf_counter() - start
            assert tokens == rows * ROUND, f"{g}: {tokens} tokens from {ROUND} steps of {rows} rows"
    return {g: rows * STEPS / s for g, s in seconds.items()}


def measure(rec, passes: int) -> None:
    """Record `<graph> <precision> batch <rows> decode tok/s` for every pass."""
    for quant, precision in (("none", "fp32"), ("int4-weight-only", "int4")):
        graphs = {"slot": work_graph("fused", quant), "paged": work_graph("paged", quant)}
        engines = {(g, rows): _prefilled(_engine(g, *graphs[g], rows), rows, seed=rows)
                   for rows in BATCHES for g in graphs}
        for p in range(passes):
            for rows in BATCHES:
                order = in_turn(["slot", "paged"], p)
                rec.busy(f"pass {p + 1} decode {precision} batch {rows}")
                speeds = _time_steps({g: engines[(g, rows)] for g in order}, rows, order)
                for g in ("slot", "paged"):
                    rec.add(f"{g} {precision} batch {rows} decode tok/s", speeds[g])
        for engine in engines.values():
            engine.runner.close()
