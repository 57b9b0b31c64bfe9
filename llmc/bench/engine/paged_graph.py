"""The paged graph's own design choices on SmolLM2 fp32, graph steps timed in process, every ratio within one run:

    .venv/bin/python -m llmc.bench paged-graph [--threads 2] [--passes 7] [--steps 24] [--context 512]

Graphs (exports reused from build/bench/paged-graph/ while unchanged):
  fused        the slot graph (GroupQueryAttention, OrtRunner): the baseline
  paged        the paged graph as exported (QKV packed into PagedAttention, rotary inside the op)
  split-qkv    the paged graph with query, key and value as three inputs (a Split and three Reshapes a layer)
  rope-model   the paged graph with Llama's rotary computed in the model (from position_ids) instead of the op

Measurements, each pass running every graph once in an order that flips pass by pass:
  decode b1/b16   one decode step, every row at `--context` cached tokens (paged rows on their own blocks)
  prefill 256     one 256-token prompt from an empty cache (logits for its last token only on the paged
                  graph, for all 256 on the slot graph, which returns them)
A figure is the fastest of `--steps` runs within a pass (the host is shared: the minimum is what
noise spares), ratios are medians of per-pass ratios; > 1 means faster than the baseline.
`--clock cpu --threads 1` times the process's CPU time instead of the wall clock: the work a step
costs, much steadier than wall time when other jobs share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np

from llmc.bench.builds import BENCH, example_data
from llmc.bench.harness import in_turn, median, median_ratio

ROOT = BENCH / "paged-graph"
GRAPHS = ("fused", "paged", "split-qkv", "rope-model")


def export(graph: str):
    """The graph's export (folder, artifact); variants made by switching one choice off while exporting."""
    from unittest import mock

    from llmc.compiler import build, paged_decoder
    from llmc.compiler.spec import parse_spec
    from llmc.plugins.op import paged_op

    data = example_data(name=f"smollm2-{graph}", export={"attention": "fused" if graph == "fused" else "paged"})
    patches = {"split-qkv": mock.patch.object(paged_op, "pack_qkv", lambda graph: 0),
               "rope-model": mock.patch.object(paged_decoder.PagedDecoder, "__init__", _rotary_in_model)}
    with patches.get(graph, contextlib.nullcontext()):
        result = build(parse_spec(data), output=ROOT / graph, until="export")
    return ROOT / graph / "export", result.exported


def _rotary_in_model(self, decoder):
    import torch

    torch.nn.Module.__init__(self)
    decoder.fuse_rotary = False  # the decoder rotates from positions; the op gets no tables
    self.decoder = decoder


def runners(threads: int, context: int) -> dict:
    from llmc.runtime.runners.ort import OrtRunner
    from llmc.runtime.runners.paged import PagedRunner

    out = {}
    for graph in GRAPHS:
        folder, art = export(graph)
        if art.kv_layout.paged:
            blocks = 16 * -(-(context + 8) // art.kv_layout.block_size)
            out[graph] = PagedRunner(folder / art.onnx, art.kv_layout, num_blocks=blocks, max_num_tokens=512,
                                     num_threads=threads)
        else:
            out[graph] = OrtRunner(folder / art.onnx, art.kv_layout, max_batch=16, capacity=context + 8,
                                   num_threads=threads)
    return out


def step(runner, kind: str, context: int):
    """A callable running one step of `kind` ("decode-1", "decode-16", "prefill-256")."""
    from llmc.runtime.runners.paged import PagedRunner, RowStep

    if kind == "prefill-256":
        ids = np.random.default_rng(0).integers(0, runner.vocab_size, 256)
        if isinstance(runner, PagedRunner):
            return lambda: runner.step([RowStep(ids.tolist(), 0, list(range(16)))])
        return lambda: runner.step(ids[None], np.zeros(1, dtype=np.int64), 0)
    batch = 1 if kind == "decode-1" else 16
    if isinstance(runner, PagedRunner):
        per = runner.num_blocks // 16
        rows = [RowStep([7], context, list(range(r * per, (r + 1) * per))) for r in range(batch)]
        return lambda: runner.step(rows)
    return lambda: runner.step(np.full((batch, 1), 7), np.full(batch, context), 0)


def fastest(fn, steps: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(steps):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


CASES = [  # (measurement, baseline graph and kind, candidates: (label, graph, kind))
    ("decode b1", ("fused", "decode-1"), [(g, g, "decode-1") for g in GRAPHS[1:]]),
    ("decode b16", ("fused", "decode-16"), [(g, g, "decode-16") for g in GRAPHS[1:]]),
    ("prefill 256", ("fused", "prefill-256"), [("paged", "paged", "prefill-256")]),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time per step (with --threads 1: the work a step costs, "
                             "steadier than wall time on a busy host)")


def run(args: argparse.Namespace) -> None:
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    graphs = runners(args.threads, args.context)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.threads} ORT threads, "
          f"{args.clock} clock")
    times: dict[tuple[str, str], list[float]] = {}
    for p in range(args.passes):
        for name, base, candidates in CASES:
            entries = [("baseline", *base), *candidates]
            for label, graph, kind in in_turn(entries, p):
                run = step(graphs[graph], kind, args.context)
                times.setdefault((name, label), []).append(fastest(run, args.steps, clock))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for name, base, candidates in CASES:
        base_t = times[(name, "baseline")]
        print(f"{name}: baseline {base[0]} {median(base_t) * 1e3:.2f} ms")
        for label, _, _ in candidates:
            t = times[(name, label)]
            ratio = median_ratio(base_t, t)
            print(f"  {label:12s} {median(t) * 1e3:8.2f} ms   {ratio:.3f}x the baseline's speed")
