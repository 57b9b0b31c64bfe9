"""Sampling a step's rows: one vectorized pass (`sample_rows`) against a Python loop calling
`sample` row by row (what the engines did before), on the same logits in the same run.

Rows of SmolLM2's vocabulary (49,152) with logits drawn like a language model's (a few likely
tokens over a long flat tail), at 1, 4, 16 and 64 rows, for three mixes: all greedy, all sampled
(temperature 0.8, top-p 0.95, top-k 50), and mixed (half greedy, a quarter sampled, a quarter with
repetition and frequency penalties over 300 prompt and 64 output tokens). Each pass times both
ways in turns (the order alternating), REPEAT calls each; the medians of PASSES passes are
printed with their ratio (loop / batched: above 1 the batched pass is faster).

    .venv/bin/python -m llmc.bench sampling [--passes 7] [--rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llmc.bench.harness import in_turn, median, median_ratio
from llmc.runtime.decoding.sampling import SamplingParams, sample, sample_rows

VOCAB, REPEAT = 49_152, 20
MIXES = {
    "greedy": lambda i: SamplingParams(),
    "sampled": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=i),
    "mixed": lambda i: [SamplingParams(), SamplingParams(),
                        SamplingParams(temperature=0.8, top_p=0.95, seed=i),
                        SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, seed=i)][i % 4],
}


def _rows(n: int, mix: str, rng: np.random.Generator):
    logits = rng.normal(0, 1, (n, VOCAB)).astype(np.float32)
    logits[np.arange(n)[:, None], rng.integers(0, VOCAB, (n, 5))] += 12.0  # a few likely tokens
    params = [MIXES[mix](i) for i in range(n)]
    prompts = [rng.integers(0, VOCAB, 300) for _ in range(n)]
    outputs = [rng.integers(0, VOCAB, 64).tolist() for _ in range(n)]
    return logits, params, prompts, outputs


def _time(fn) -> float:
    start = time.perf_counter()
    for _ in range(REPEAT):
        fn()
    return (time.perf_counter() - start) / REPEAT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--rows", default="1,4,16,64", help="row counts to time, comma-separated (default 1,4,16,64)")


def run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    print(f"{'mix':8} {'rows':>4} {'loop ms':>9} {'batched ms':>11} {'ratio':>6}")
    for mix in MIXES:
        for n in (int(r) for r in args.rows.split(",")):
            logits, params, prompts, outputs = _rows(n, mix, rng)
            rngs = [p.make_rng() for p in params]
            out_arrays = [np.asarray(o, np.int64) for o in outputs]

            def loop():
                return [sample(logits[i], params[i], prompts[i], out_arrays[i], rngs[i]) for i in range(n)]

            def batched():
                return sample_rows(logits, params, prompts, outputs, rngs)

            loops, batches = [], []
            for p in range(args.passes):
                t = {fn: _time(fn) for fn in in_turn((loop, batched), p)}
                loops.append(t[loop]), batches.append(t[batched])
            print(f"{mix:8} {n:>4} {median(loops) * 1e3:>9.2f} {median(batches) * 1e3:>11.2f} "
                  f"{median_ratio(loops, batches):>5.2f}x")
