"""One table: the same prompt and greedy settings on every peer, ratios measured within one run.

    .venv/bin/python scripts/compare_peers.py [--threads 2] [--passes 3] [--prompt-tokens 128] [--new-tokens 64]

Contenders (SmolLM2-135M fp32, CPU, batch 1, greedy, the same ~128-token prompt, 64 new tokens):
  HF transformers `generate()`   PyTorch eager, torch threads = --threads
  onnxruntime-genai `generate()`  its own fp32 CPU build of the checkpoint, in process
  llmc in process                 the packaged model's engine (runtime/engine/slot_engine.py: scheduler, sampling,
                                  detokenizer) on ONNX Runtime, no server
  llmc through Triton             the same repository served by a real Triton, streamed over gRPC

Per contender: time to first token, decode tokens/s after the first token, end-to-end seconds.
Each pass runs every contender once (order rotating); the table shows medians and, per contender,
the median of per-pass ratios of decode tokens/s against llmc through Triton. Needs
scripts/setup.sh. Writes build/bench/peers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "build" / "bench"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_generate(model, prompt: list[int], new: int) -> tuple[float, float, int]:
    """HF greedy generate(): (TTFT from a 1-token generate of the same prompt, total, tokens after the first)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return ttft, time.perf_counter() - start, new - 1


def llmc_in_process(version_dir: Path, prompt: list[int], new: int) -> tuple[float, float, int]:
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.serving.loop import ServingLoop

    engine = ServingLoop.from_manifest(version_dir).engine  # the engine alone: no thread, no server
    start = time.perf_counter()
    engine.add_request("r", prompt, SamplingParams(max_tokens=new, min_tokens=new))
    ttft, done = None, False
    while not done:
        for out in engine.step():
            ttft = ttft if ttft is not None or not out.token_ids else time.perf_counter() - start
            done = done or out.finished
    return ttft, time.perf_counter() - start, new - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=BENCH / "peers.json")
    args = parser.parse_args()

    import torch

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.bench import run_load
    from llmc.serve import start_server

    serving, attention = _script("bench_serving"), _script("bench_attention")
    torch.set_num_threads(args.threads)
    build_dir = serving.serving_build(args.threads)
    version_dir = build_dir / "model_repository" / "smollm2" / "1"
    genai_dir = attention.genai_build(args.threads)
    hf_model = load_model(inspect_source(SourceSpec(path=REPO / "models" / "smollm2")))[0].eval()
    words, prompt = serving.prompt_words_for(args.prompt_tokens)
    new = args.new_tokens
    server = start_server(build_dir, None, None, None, None)

    def triton() -> tuple[float, float, int]:
        s = asyncio.run(run_load(server.grpc_url, None, concurrency=1, num_requests=2, prompt_words=words,
                                 max_tokens=new)).summary()  # min_tokens = max_tokens
        return s["ttft_s_p50"], s["latency_s_p50"], new - 1

    contenders = {"HF transformers generate()": lambda: hf_generate(hf_model, prompt, new),
                  "onnxruntime-genai generate()": lambda: attention.genai_timed(genai_dir, prompt, 1, new),
                  "llmc in process": lambda: llmc_in_process(version_dir, prompt, new),
                  "llmc through Triton": triton}
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in contenders}  # (TTFT, total, tokens after)
    try:
        for p in range(args.passes):
            names = list(contenders)
            for name in names[p % len(names):] + names[:p % len(names)]:
                ttft, total, after = contenders[name]()
                runs[name].append((ttft, total, after))
                print(f"  pass {p + 1} {name:<30} TTFT {ttft * 1000:7.0f} ms  {after / (total - ttft):7.1f} tok/s",
                      file=sys.stderr)
    finally:
        server.stop()

    def decode(ttft: float, total: float, after: int) -> float:
        return after / (total - ttft)  # genai may stop early at an end id: its own count

    base = "llmc through Triton"
    print(f"\nSmolLM2-135M fp32, CPU, {args.threads} threads, batch 1 greedy, {len(prompt)}-token prompt, {new} new "
          f"tokens; medians of {args.passes} passes")
    print(f"| {'peer':<30} | TTFT | decode tok/s | end to end | decode vs llmc through Triton |")
    print(f"|{'-' * 32}|---|---|---|---|")
    table = {}
    for name, values in runs.items():
        ratio = statistics.median(decode(*v) / decode(*b) for v, b in zip(values, runs[base]))
        row = {"ttft_ms": statistics.median(v[0] for v in values) * 1000,
               "decode_tok_s": statistics.median(decode(*v) for v in values),
               "end_to_end_s": statistics.median(v[1] for v in values), "decode_ratio_vs_llmc_triton": ratio}
        table[name] = row
        print(f"| {name:<30} | {row['ttft_ms']:.0f} ms | {row['decode_tok_s']:.1f} | {row['end_to_end_s']:.2f} s | "
              f"{ratio:.2f}x |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": args.threads, "prompt_tokens": len(prompt), "new_tokens": new,
                                     "passes": runs, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
