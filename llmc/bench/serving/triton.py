"""Serving benchmark for issue targets, every ratio measured within one run:

    .venv/bin/python -m llmc.bench triton [--threads 2] [--passes 3]

1. batch-1 decode through Triton vs onnxruntime-genai: one stream at a time through a real Triton
   server (llmc's packaged SmolLM2 fp32 build, gRPC streaming) against onnxruntime-genai's
   `generate()` loop in process on its own fp32 build; both decode tokens/s after the first token,
   same prompt (~128 tokens) and 64 new tokens.
2. 16 concurrent streams vs batch 1: aggregate generated tokens/s of 32 requests at concurrency 16
   against the same requests one at a time (`llmc bench`'s load generator for both).

Each pass measures everything once (genai and Triton alternate first); ratios are medians of
per-pass ratios. Needs scripts/setup.sh (nvidia-pytriton, .venv-serving, onnxruntime-genai).
Writes build/bench/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from llmc.bench.builds import BENCH, SMOLLM2, served_smollm2
from llmc.bench.harness import Runs, in_turn, median_ratio, medians, write_json
from llmc.bench.peers import genai_build, genai_generate

PROMPT_TOKENS, NEW_TOKENS, CONCURRENCY = 128, 64, 16


def prompt_words_for(tokens: int) -> tuple[int, list[int]]:
    """The prompt length in words whose text is about `tokens` SmolLM2 tokens, and its ids."""
    from tokenizers import Tokenizer

    from llmc.bench.load import make_prompt

    tok = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    words = next(n for n in range(8, 4 * tokens) if len(tok.encode(make_prompt(n, 0)).ids) >= tokens)
    return words, tok.encode(make_prompt(words, 0)).ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--passes", type=int, default=3, help="passes over all measurements (default 3)")
    parser.add_argument("--json", type=Path, default=BENCH / "serving.json", help="where to write the results")


def run(args: argparse.Namespace) -> None:
    from llmc.bench.load import run_load
    from llmc.serve import start_server

    genai_dir = genai_build(SMOLLM2, "fp32", BENCH, args.threads)["dir"]
    words, prompt_ids = prompt_words_for(PROMPT_TOKENS)
    server = start_server(served_smollm2(args.threads), None, None, None, None)
    runs = Runs("10.2f", 34)
    record = runs.record

    def load(concurrency: int, requests: int):
        return asyncio.run(run_load(server.grpc_url, None, concurrency=concurrency, num_requests=requests,
                                    prompt_words=words, max_tokens=NEW_TOKENS)).summary()

    try:
        for p in range(args.passes):
            print(f"pass {p + 1}/{args.passes}", file=sys.stderr)
            pair = [("genai b1 decode tok/s", lambda: genai_generate(genai_dir, prompt_ids, 1, NEW_TOKENS)),
                    ("triton b1 decode tok/s", lambda: load(1, 3)["stream_decode_tokens_per_s_p50"])]
            for name, measure in in_turn(pair, p):
                record(name, measure())
            sequential, concurrent = load(1, 4), load(CONCURRENCY, 2 * CONCURRENCY)
            for name, s in (("sequential", sequential), (f"{CONCURRENCY} streams", concurrent)):
                record(f"{name} aggregate tok/s", s["tokens_per_s"])
                record(f"{name} TTFT p50 (ms)", s["ttft_s_p50"] * 1000)
                record(f"{name} ITL p50 (ms)", s["itl_s_p50"] * 1000)
                record(f"{name} errors", s["errors"])
    finally:
        server.stop()

    def paired(a: str, b: str) -> float:
        return median_ratio(runs[a], runs[b])

    rows = [("batch-1 decode, Triton vs onnxruntime-genai generate()", paired("triton b1 decode tok/s", "genai b1 decode tok/s"), 0.9),
            (f"{CONCURRENCY} streams vs sequential, aggregate tok/s",
             paired(f"{CONCURRENCY} streams aggregate tok/s", "sequential aggregate tok/s"), 3.0)]
    med = medians(runs)
    print(f"\nSmolLM2 fp32 through Triton, {args.threads} threads, {args.passes} passes: medians")
    for name, value in med.items():
        print(f"  {name:<34} {value:10.2f}")
    for name, ratio, target in rows:
        print(f"  {name:<56} {ratio:5.2f}x  {'ok' if ratio >= target else f'BELOW target {target}x'}")
    write_json(args.json, {"threads": args.threads, "passes": runs, "medians": med,
                           "ratios": {n: r for n, r, _ in rows}})
