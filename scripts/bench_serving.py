"""Serving benchmark for issue targets, every ratio measured within one run:

    .venv/bin/python scripts/bench_serving.py [--threads 2] [--passes 3]

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
import importlib.util
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "build" / "bench"
PROMPT_TOKENS, NEW_TOKENS, CONCURRENCY = 128, 64, 16


def _attention_bench():
    spec = importlib.util.spec_from_file_location("bench_attention", REPO / "scripts" / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serving_build(threads: int) -> Path:
    from llmc.compiler import build, load_spec
    from llmc.compiler.spec import parse_spec

    spec = load_spec(REPO / "examples" / "smollm2.yaml")
    data = {**spec.model_dump(mode="json", exclude={"output"}), "name": "smollm2"}
    data["serving"]["num_threads"] = threads
    data["verify"]["enabled"] = False  # the example build verifies; this one only changes thread count
    return build(parse_spec(data), output=BENCH / "smollm2-serve").output


def prompt_words_for(tokens: int) -> tuple[int, list[int]]:
    """The prompt length in words whose text is about `tokens` SmolLM2 tokens, and its ids."""
    from tokenizers import Tokenizer

    from llmc.bench import make_prompt

    tok = Tokenizer.from_file(str(REPO / "models" / "smollm2" / "tokenizer.json"))
    words = next(n for n in range(8, 4 * tokens) if len(tok.encode(make_prompt(n, 0)).ids) >= tokens)
    return words, tok.encode(make_prompt(words, 0)).ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--passes", type=int, default=3, help="passes over all measurements (default 3)")
    parser.add_argument("--json", type=Path, default=BENCH / "serving.json", help="where to write the results")
    args = parser.parse_args()

    from llmc.bench import run_load
    from llmc.serve import start_server

    attention = _attention_bench()
    genai_dir = attention.genai_build(args.threads)
    words, prompt_ids = prompt_words_for(PROMPT_TOKENS)
    server = start_server(serving_build(args.threads), None, None, None, None)
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)
        print(f"  {name:<34} {value:10.2f}", file=sys.stderr)

    def load(concurrency: int, requests: int):
        return asyncio.run(run_load(server.grpc_url, None, concurrency=concurrency, num_requests=requests,
                                    prompt_words=words, max_tokens=NEW_TOKENS)).summary()

    try:
        for p in range(args.passes):
            print(f"pass {p + 1}/{args.passes}", file=sys.stderr)
            pair = [("genai b1 decode tok/s", lambda: attention.genai_generate(genai_dir, prompt_ids, 1, NEW_TOKENS)),
                    ("triton b1 decode tok/s", lambda: load(1, 3)["stream_decode_tokens_per_s_p50"])]
            for name, measure in (reversed(pair) if p % 2 else pair):
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
        return statistics.median(x / y for x, y in zip(runs[a], runs[b]))

    rows = [("batch-1 decode, Triton vs onnxruntime-genai generate()", paired("triton b1 decode tok/s", "genai b1 decode tok/s"), 0.9),
            (f"{CONCURRENCY} streams vs sequential, aggregate tok/s",
             paired(f"{CONCURRENCY} streams aggregate tok/s", "sequential aggregate tok/s"), 3.0)]
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nSmolLM2 fp32 through Triton, {args.threads} threads, {args.passes} passes: medians")
    for name, value in medians.items():
        print(f"  {name:<34} {value:10.2f}")
    for name, ratio, target in rows:
        print(f"  {name:<56} {ratio:5.2f}x  {'ok' if ratio >= target else f'BELOW target {target}x'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": args.threads, "passes": runs, "medians": medians,
                                     "ratios": {n: r for n, r, _ in rows}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
