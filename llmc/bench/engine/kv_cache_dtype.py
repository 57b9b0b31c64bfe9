"""export.kv_cache_dtype on SmolLM2: perplexity and decode speed of the paged graph with fp32, fp16 and
int8 KV pools, measured in one run (docs/build.md records the results).

    .venv/bin/python -m llmc.bench kv-cache-dtype [--passes 5] [--rows 16] [--past 512]

Builds (export only, cached under build/kv-<dtype>) SmolLM2 with `export.attention: paged` and each
cache type; perplexity on the built-in held-out text (the quantize stage's quality.perplexity over the
windows of 256 tokens it holds, 5, through the paged graph behind the slot protocol) and, against fp32's
logits at every position, the mean KL divergence (nats per token: what perplexity's average over the text
dilutes), the largest |dlogit| and how often the top token agrees; decode steps of `rows` rows each at
`past` cached tokens, timed step by step, the dtypes taken in turns each pass so host load falls on all
alike; medians per pass and each pass's ratio to fp32 (`--passes 0`: quality only).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llmc.bench.builds import REPO, SMOLLM2
from llmc.bench.harness import in_turn, median, median_ratio
from llmc.compiler import build
from llmc.compiler.quantize.quality import perplexity
from llmc.compiler.textdata import builtin_documents, token_windows
from llmc.compiler.source import inspect_source, load_tokenizer
from llmc.compiler.spec import parse_spec
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.paged_slots import slot_runner

DTYPES = ("fp32", "fp16", "int8")


def export(dtype: str):
    spec = parse_spec({"name": f"kv-{dtype}", "source": str(SMOLLM2),
                       "export": {"attention": "paged", "kv_cache_dtype": dtype}})
    folder = REPO / "build" / f"kv-{dtype}"
    result = build(spec, output=folder, until="export")
    return folder / "export" / result.exported.onnx, result.exported.kv_layout, spec


class Recording:
    """A slot runner that keeps every step's logits (float64), so the perplexity pass also feeds the comparison."""

    def __init__(self, runner):
        self.runner, self.logits = runner, []

    def step(self, *args, **kwargs):
        out = self.runner.step(*args, **kwargs)
        self.logits.append(out[0].astype(np.float64))
        return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def against(reference: list[np.ndarray], logits: list[np.ndarray], windows: list[np.ndarray]) -> str:
    """Mean KL(reference || logits) per position, largest |dlogit|, top-token agreement, and the change in the
    text's next-token log-likelihood: its mean with the standard error (perplexity's noise) and mean magnitude."""
    ref, got = np.concatenate(reference), np.concatenate(logits)
    log_ref, log_got = log_softmax(ref), log_softmax(got)
    kl = (np.exp(log_ref) * (log_ref - log_got)).sum(-1)
    at = np.cumsum([0] + [len(w) for w in windows])
    rows = np.concatenate([np.arange(a, b - 1) for a, b in zip(at[:-1], at[1:])])
    change = (log_got - log_ref)[rows, np.concatenate([w[1:] for w in windows])]
    return (f"KL vs fp32 {kl.mean():.2e} nats/token, max |dlogit| {np.abs(ref - got).max():.3f}, top-1 agrees "
            f"{(ref.argmax(-1) == got.argmax(-1)).mean():.2%}, text log-likelihood change {change.mean():+.5f} +- "
            f"{change.std() / np.sqrt(change.size):.5f} (mean |change| {np.abs(change).mean():.4f})")


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
    return median(times[2:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--past", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)


def run(args: argparse.Namespace) -> None:
    graphs = {d: export(d) for d in DTYPES}
    tokenizer = load_tokenizer(inspect_source(graphs["fp32"][2].source))
    windows = token_windows(tokenizer, builtin_documents("heldout"), 256, 8, "heldout", "the built-in held-out text")
    reference = []
    for dtype, (path, layout, _) in graphs.items():
        runner = Recording(slot_runner(path, layout, max_batch=1, capacity=256, num_threads=args.threads))
        ppl = perplexity(runner, windows, lambda: None)
        runner.runner.close()
        reference = reference or runner.logits  # fp32's, the first
        print(f"{dtype}: perplexity {ppl:.4f} over {len(windows)} x 256 tokens, {layout.bytes_per_token()} KV bytes "
              f"per token" + (f"; {against(reference, runner.logits, windows)}" if dtype != "fp32" else ""), flush=True)
    per_pass = {d: [] for d in DTYPES}
    for p in range(args.passes):
        for dtype in in_turn(DTYPES, p):
            path, layout, _ = graphs[dtype]
            per_pass[dtype].append(decode_times(path, layout, args.rows, args.past, args.steps, args.threads))
        print(f"pass {p}: " + ", ".join(f"{d} {per_pass[d][-1] * 1e3:.1f} ms ({per_pass['fp32'][-1] / per_pass[d][-1]:.2f}x)"
                                        for d in DTYPES), flush=True)
    for dtype in DTYPES if args.passes else ():
        ratios = [f / t for f, t in zip(per_pass["fp32"], per_pass[dtype])]  # the range printed beside the median
        print(f"{dtype}: decode step median {median(per_pass[dtype]) * 1e3:.1f} ms, "
              f"{args.rows / median(per_pass[dtype]):.0f} tok/s, vs fp32 per pass {min(ratios):.2f}-"
              f"{max(ratios):.2f}x (median {median_ratio(per_pass['fp32'], per_pass[dtype]):.2f}x)")
