"""export.kv_cache_dtype on SmolLM2: perplexity and decode speed of the paged graph with fp32, fp16 and
int8 KV pools, measured in one run (docs/build.md records the results).

    .venv/bin/python scripts/bench_kv_cache_dtype.py [--passes 5] [--rows 16] [--past 512]

Builds (export only, cached under build/kv-<dtype>) SmolLM2 with `export.attention: paged` and each
cache type; perplexity on the built-in held-out text (the quantize stage's quality.perplexity, 8 windows
of 256 tokens through the paged graph behind the slot protocol); decode steps of `rows` rows each at
`past` cached tokens, timed step by step, the dtypes taken in turns each pass so host load falls on all
alike; medians per pass and each pass's ratio to fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from llmc.compiler import build
from llmc.compiler.quantize.quality import perplexity
from llmc.compiler.quantize.textdata import builtin_documents, token_windows
from llmc.compiler.source import inspect_source, load_tokenizer
from llmc.compiler.spec import parse_spec
from llmc.runtime.paged_runner import PagedRunner, RowStep
from llmc.runtime.paged_slots import slot_runner

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("fp32", "fp16", "int8")


def export(dtype: str):
    spec = parse_spec({"name": f"kv-{dtype}", "source": str(ROOT / "models" / "smollm2"),
                       "export": {"attention": "paged", "kv_cache_dtype": dtype}})
    folder = ROOT / "build" / f"kv-{dtype}"
    result = build(spec, output=folder, until="export")
    return folder / "export" / result.exported.onnx, result.exported.kv_layout, spec


def decode_times(path, layout, rows: int, past: int, steps: int, threads: int) -> float:
    """Median seconds of a decode step of `rows` rows at `past` cached tokens (the cache filled first)."""
    blocks = -(-(past + steps + 1) // layout.block_size)
    runner = PagedRunner(path, layout, num_blocks=rows * blocks, max_num_tokens=max(rows, past), num_threads=threads)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    rng = np.random.default_rng(0)
    for table in tables:
        runner.step([RowStep(rng.integers(0, 49152, past).tolist(), 0, table)])
    times = []
    for k in range(steps):
        start = time.perf_counter()
        runner.step([RowStep([int(rng.integers(0, 49152))], past + k, t) for t in tables])
        times.append(time.perf_counter() - start)
    runner.close()
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--past", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    graphs = {d: export(d) for d in DTYPES}
    tokenizer = load_tokenizer(inspect_source(graphs["fp32"][2].source))
    windows = token_windows(tokenizer, builtin_documents("heldout"), 256, 8, "heldout", "the built-in held-out text")
    for dtype, (path, layout, _) in graphs.items():
        runner = slot_runner(path, layout, max_batch=1, capacity=256, num_threads=args.threads)
        print(f"{dtype}: perplexity {perplexity(runner, windows, lambda: None):.4f}, "
              f"{layout.bytes_per_token()} KV bytes per token", flush=True)
        runner.close()
    per_pass = {d: [] for d in DTYPES}
    for p in range(args.passes):
        order = DTYPES if p % 2 == 0 else DTYPES[::-1]
        for dtype in order:
            path, layout, _ = graphs[dtype]
            per_pass[dtype].append(decode_times(path, layout, args.rows, args.past, args.steps, args.threads))
        print(f"pass {p}: " + ", ".join(f"{d} {per_pass[d][-1] * 1e3:.1f} ms ({per_pass['fp32'][-1] / per_pass[d][-1]:.2f}x)"
                                        for d in DTYPES), flush=True)
    for dtype in DTYPES:
        ratios = [f / t for f, t in zip(per_pass["fp32"], per_pass[dtype])]
        print(f"{dtype}: decode step median {statistics.median(per_pass[dtype]) * 1e3:.1f} ms, "
              f"{args.rows / statistics.median(per_pass[dtype]):.0f} tok/s, vs fp32 per pass {min(ratios):.2f}-"
              f"{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
