"""Tensor parallelism on one machine: a model split over N ranks (a process and a thread each) against the same model
whole (one process, N threads), in one run:

    .venv/bin/python -m llmc.bench tensor-parallel [--shape qwen2.5-0.5b] [--ranks 2] [--passes 3]
                                                      [--quantization int4-weight-only]

Both are built from one random-weight checkpoint of a real model's shape (llmc/bench/checkpoints.py; fp32,
verify off: tests/compiler/graph/test_tensor_parallel_build.py verifies splits) and run by the packaged engine in
process, one at a time, the order alternating by pass. Per pass: batch-1 decode (a `--prompt-tokens` prompt, then
`--new-tokens` tokens: tokens after the first over their time) and `--streams` requests at once (every generated
token over the wall time; each row's inter-token gaps for ITL p50/p99). Reported: medians over passes, the ratio
split / whole per pass (its median), and what the collectives cost a step: the collective benchmark's AllReduce per call
at the model's hidden size (1 row and `--streams` rows) times the 2 x layers calls a step makes, plus one AllGather
of the LM head's vocabulary slices (what gathering only what sampling needs would save at most).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmc.bench import checkpoints
from llmc.bench.builds import BENCH
from llmc.bench.harness import median, median_ratio, passes, prompt_for, write_json

OUT = BENCH / "tensor_parallel"


def built(checkpoint: Path, ranks: int, args) -> Path:
    """The packaged version folder of `checkpoint` split `ranks` ways (1: whole), built once under --out."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    seq = args.prompt_tokens + args.new_tokens + 16
    quantization = {"mode": args.quantization, "algorithm": "rtn"} if args.quantization != "none" else {}
    spec = parse_spec({"name": f"tp{ranks}", "source": str(checkpoint), "parallel": {"tensor": ranks},
                       "verify": {"enabled": False}, "quantization": quantization,
                       "limits": {"max_batch_size": args.streams, "max_seq_len": seq, "kv_cache_tokens": args.streams * seq,
                                  "max_num_tokens": max(256, args.streams)},
                       "serving": {"num_threads": args.threads, "prefix_caching": False}})
    folder = args.out / checkpoint.name / (f"tp{ranks}" + ("" if args.quantization == "none" else f"-{args.quantization}"))
    return build(spec, output=folder).repository / f"tp{ranks}" / "1"


def prompts(tokenizer_path: Path, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct prompts of `tokens` tokens (llmc bench's, so no two share a KV block)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    return [prompt_for(tokenizer, tokens, seed)[1][:tokens] for seed in range(count)]


def one_pass(version: Path, batch: list[list[int]], new: int) -> dict:
    """The engine of `version` fresh: batch-1 decode tok/s, then len(batch) streams' tok/s and ITL p50/p99."""
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.serving.loop import ServingLoop

    engine = ServingLoop.from_manifest(version).engine
    try:
        def run(rows: list[list[int]]) -> tuple[float, list[list[float]]]:
            stamps: dict[str, list[float]] = {}
            start = time.perf_counter()
            for i, prompt in enumerate(rows):
                engine.add_request(f"r{i}-{start}", prompt, SamplingParams(max_tokens=new, min_tokens=new))
            done = 0
            while done < len(rows):
                for out in engine.step():
                    if out.token_ids:
                        stamps.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.token_ids))
                    done += out.finished
            return time.perf_counter() - start, list(stamps.values())

        run(batch[:1])  # warm: the sessions' first runs, the pages of the weights
        _, (single,) = run(batch[:1])
        wall, rows = run(batch)
    finally:
        engine.close()
    gaps = sorted(b - a for row in rows for a, b in zip(row, row[1:]))
    return {"decode_tok_s": (len(single) - 1) / (single[-1] - single[0]),
            "streams_tok_s": sum(map(len, rows)) / wall,
            "itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(len(gaps) * 0.99)]}


def collective_cost(ranks: int, hidden: int, vocab: int, streams: int, args) -> dict[str, dict[str, float]]:
    """The collective benchmark's microseconds per call, at 1 row and at `streams` rows: the AllReduce of a hidden state and
    the AllGather of the LM head's vocabulary slices."""
    from llmc.bench.kernels import collective

    width = -(-vocab // ranks)
    cost = {}
    for op, size in (("AllReduce", hidden), ("AllGather", width)):
        sizes = f"1x{size},{streams}x{size}"
        measured = collective.measure(ranks, argparse.Namespace(sizes=sizes, calls=args.collective_calls, warmup=20,
                                                           nodes=8 if op == "AllReduce" else 2, threads=1, op=op))
        cost[op] = {"1": measured[f"1x{size}"], str(streams): measured[f"{streams}x{size}"]}
    return cost


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a llmc/bench/checkpoints.py shape (default qwen2.5-0.5b)")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint folder instead of --shape")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="the whole model's threads; each rank gets threads / ranks")
    p.add_argument("--quantization", default="none", choices=["none", "int8-weight-only", "int4-weight-only"],
                   help="weight-only mode of both builds (round to nearest: speed does not depend on AWQ's scales)")
    p.add_argument("--passes", type=int, default=3, help="0: build only (the builds are cached for a later run)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--collective-calls", type=int, default=2000, help="the collective benchmark's timed runs per size")
    p.add_argument("--out", type=Path, default=OUT)


def run(args: argparse.Namespace) -> None:
    checkpoint = args.checkpoint or checkpoints.checkpoint(args.shape, args.out / "checkpoints")
    config = json.loads((checkpoint / "config.json").read_text())
    versions = {1: built(checkpoint, 1, args), args.ranks: built(checkpoint, args.ranks, args)}
    if args.passes == 0:
        return print("built: " + ", ".join(str(v) for v in versions.values()))
    batch = prompts(versions[1] / "tokenizer.json", args.streams, args.prompt_tokens)
    def show(i: int, n: int, got: dict) -> None:
        print(f"pass {i + 1}, {n} rank(s): " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)

    runs = passes({n: lambda i, version=version: one_pass(version, batch, args.new_tokens)
                   for n, version in versions.items()}, args.passes, show)
    whole, split = runs[1], runs[args.ranks]
    cost = collective_cost(args.ranks, config["hidden_size"], config["vocab_size"], args.streams, args)
    layers = config["num_hidden_layers"]
    print(f"\n{checkpoint.name} ({args.quantization}): whole on {args.threads} threads vs split over {args.ranks} ranks x "
          f"{max(1, args.threads // args.ranks)} thread(s); medians of {args.passes} passes")
    print(f"{'':>16} {'whole':>9} {'split':>9} {'split/whole':>12}")
    table = {}
    for key in whole[0]:
        table[key] = {"whole": median(w[key] for w in whole), "split": median(s[key] for s in split),
                      "ratio": median_ratio([s[key] for s in split], [w[key] for w in whole])}
        print(f"{key:>16} {table[key]['whole']:9.2f} {table[key]['split']:9.2f} {table[key]['ratio']:11.2f}x")
    for rows, step_ms in (("1", 1e3 / table["decode_tok_s"]["split"]), (str(args.streams), table["itl_p50_ms"]["split"])):
        reduce, gather = cost["AllReduce"][rows], cost["AllGather"][rows]
        spent = (2 * layers * reduce + gather) / 1e3
        print(f"collectives at {rows} row(s): {2 * layers} AllReduce x {reduce:.1f} us + the LM head's AllGather "
              f"{gather:.1f} us = {spent:.2f} ms a step, {spent / step_ms:.1%} of the split model's {step_ms:.1f} ms "
              f"step (the gather alone {gather / 1e3 / step_ms:.1%}: what a vocabulary-parallel sampler could save)")
    write_json(args.out / "results.json", {"checkpoint": checkpoint.name, "ranks": args.ranks,
                                           "quantization": args.quantization, "table": table, "collective_us": cost})
