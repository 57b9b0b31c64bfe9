"""The cost of one llmc.AllReduce (runtime/kernels/collective/) per call, between rank processes on this machine:

    .venv/bin/python -m llmc.bench collective [--ranks 2,3] [--sizes 1x576,1x896,1x2048,128x896,512x896]

Each rank is its own process (this benchmark again: `python -m llmc.bench collective --worker`) running its own
ONNX Runtime session, opened through cpu_kernels.prepare(..., group=) as a tensor-parallel runner does, over
one shared-memory Group per rank count. Per size (rows x hidden, float32): a graph of `--nodes` AllReduce nodes in a chain, and a graph of
one Identity with the same input and output (the session's own cost per run). A call's cost is
(median chain run - median identity run) / nodes, rank 0's (every rank waits for the slowest, so they agree
within noise). Decode sizes are one row of SmolLM2-135M's (576), Qwen2.5-0.5B's (896) and a 2048 hidden;
prefill sizes are 128 and 512 rows of 896. Runs per size: `--calls` at decode, fewer as sizes grow (at least
30, each `--nodes` calls).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.bench.harness import median, write_json
from llmc.runtime.kernels import cpu_kernels
from llmc.runtime.kernels.collective import Group

LAYERS = {576: ("SmolLM2-135M", 30), 896: ("Qwen2.5-0.5B", 24), 2048: ("Llama-3.2-1B", 16)}  # hidden: a model


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in size.split("x")) for size in text.split(",")]


def chain(rank: int, world: int, nodes: int, op: str = "AllReduce") -> onnx.ModelProto:
    """X -> AllReduce -> ... (nodes of them) -> Y; zero nodes: X -> Identity -> Y. AllGather: `nodes` AllGather
    nodes each of X (an AllGather's output is wider than its input, so they cannot chain); Y is the last's."""
    names = ["X", *(f"t{i}" for i in range(nodes - 1)), "Y"]
    pairs = [("X", name) for name in names[1:]] if op == "AllGather" else list(zip(names, names[1:]))
    made = [helper.make_node(op, [a], [b], name=f"{op}_{i}", domain="llmc", rank=rank, world_size=world)
            for i, (a, b) in enumerate(pairs)]
    made = made if nodes else [helper.make_node("Identity", ["X"], ["Y"])]
    io = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", "hidden"]),
          helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", None])]
    graph = helper.make_graph(made, "bench", io[:1], io[1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1)])


def runs_for(rows: int, hidden: int, calls: int) -> int:
    return min(calls, max(30, calls * 2048 // (rows * hidden)))


def timed(session, x: np.ndarray, runs: int, warmup: int) -> float:
    """The median microseconds of one run."""
    for _ in range(warmup):
        session.run(None, {"X": x})
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        session.run(None, {"X": x})
        times.append(time.perf_counter_ns() - start)
    return median(times) / 1e3


def worker(args) -> None:
    """One rank: per size, the identity's and the chain's median run; a JSON line on stdout."""
    sessions = {}
    for kind in ("identity", "chain"):
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        model = cpu_kernels.prepare(Path(args.dir) / f"{kind}-{args.rank}.onnx", options, group=args.group)
        sessions[kind] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    result = {}
    for rows, hidden in parse_sizes(args.sizes):
        x = np.random.default_rng(args.rank).standard_normal((rows, hidden)).astype(np.float32) * 1e-3
        runs = runs_for(rows, hidden, args.calls)
        result[f"{rows}x{hidden}"] = {kind: timed(session, x, runs, args.warmup) for kind, session in sessions.items()}
    print(json.dumps(result), flush=True)


def measure(world: int, args) -> dict[str, float]:
    """Microseconds per AllReduce call per size, for `world` rank processes (rank 0's medians)."""
    with tempfile.TemporaryDirectory() as folder, Group.create(world) as group:
        for rank in range(world):
            onnx.save(chain(rank, world, args.nodes, args.op), Path(folder) / f"chain-{rank}.onnx")
            onnx.save(chain(rank, world, 0), Path(folder) / f"identity-{rank}.onnx")
        common = ["--worker", "--group", group.name, "--dir", folder, "--sizes", args.sizes, "--calls", str(args.calls),
                  "--warmup", str(args.warmup), "--threads", str(args.threads)]
        processes = [subprocess.Popen([sys.executable, "-m", "llmc.bench", "collective", *common, "--rank", str(rank)], stdout=subprocess.PIPE,
                                      text=True) for rank in range(world)]
        outputs = [p.communicate()[0] for p in processes]
        if any(p.returncode for p in processes):
            group.abort("a rank failed")
            raise SystemExit(f"a rank process failed (exit codes {[p.returncode for p in processes]})")
    first = json.loads(outputs[0].strip().splitlines()[-1])
    return {size: max(0.0, (t["chain"] - t["identity"]) / args.nodes) for size, t in first.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", default="2,3", help="rank counts to time (default 2,3)")
    parser.add_argument("--sizes", default="1x576,1x896,1x2048,128x896,512x896", help="rows x hidden, float32")
    parser.add_argument("--calls", type=int, default=2000, help="timed runs per decode size (fewer for larger sizes)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs first")
    parser.add_argument("--nodes", type=int, default=8, help="AllReduce nodes chained in one graph")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads per rank (default 1)")
    parser.add_argument("--op", default="AllReduce", choices=("AllReduce", "AllGather"),
                        help="the collective timed (AllGather: each rank's rows x hidden gathered)")
    parser.add_argument("--out", type=Path, help="also write the medians here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank process (the benchmark
    parser.add_argument("--group", help=argparse.SUPPRESS)                        # runs itself): these are its
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> None:
    if args.worker:
        return worker(args)
    results = {world: measure(world, args) for world in (int(w) for w in args.ranks.split(","))}
    print(f"llmc.{args.op}, float32, median microseconds per call ({args.threads} thread(s) per rank, "
          f"{args.nodes} chained per run, a run's own cost taken off)")
    print(f"{'rows x hidden':>14} " + " ".join(f"{f'{w} ranks':>9}" for w in results))
    for size in next(iter(results.values())):
        print(f"{size:>14} " + " ".join(f"{results[w][size]:9.1f}" for w in results))
    decode = [(size, int(size.split("x")[1])) for size in next(iter(results.values())) if size.startswith("1x")]
    examples = [f"{LAYERS[h][0]} {2 * LAYERS[h][1]} x {results[min(results)][size]:.1f} us = "
                f"{2 * LAYERS[h][1] * results[min(results)][size] / 1e3:.2f} ms" for size, h in decode if h in LAYERS]
    print("Share of a step, left for the caller: a layer ends attention and the MLP in one AllReduce each, so a "
          f"step spends 2 x layers x the call above ({min(results)} ranks: {'; '.join(examples) or 'no decode size'}); "
          "divide by the step's time.")
    if args.out:
        write_json(args.out, {str(w): r for w, r in results.items()})
