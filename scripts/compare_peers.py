"""One table: the same prompts and greedy settings on every peer, ratios measured within one run.

    .venv/bin/python scripts/compare_peers.py [--threads 2] [--passes 3] [--prompt-tokens 128] [--new-tokens 64]
        [--model models/smollm2] [--build BUILD] [--out build/bench] [--skip hf,genai,in-process]

Contenders (SmolLM2-135M fp32, CPU, batch 1, greedy, ~128-token prompts, 64 new tokens):
  HF transformers `generate()`   PyTorch eager, torch threads = --threads
  onnxruntime-genai `generate()`  its own fp32 CPU build of the checkpoint, in process
  llmc in process                 the packaged model's engine (its default graph: the paged engine, with its
                                  scheduler, sampling, detokenizer) on ONNX Runtime, no server
  llmc through Triton             the same repository served by a real Triton, streamed over gRPC

Every pass sends its own prompt (the same to every contender in that pass), so no pass is served from
a prefix cache that an earlier pass filled. Per contender: time to first token of that new prompt,
the time to first token of the same prompt sent again (llmc: its prefix cache's hit; the peers have
none), decode tokens/s after the first token, end-to-end seconds.
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
SMOLLM2 = REPO / "models" / "smollm2"
CONTENDERS = {"hf": "HF transformers generate()", "genai": "onnxruntime-genai generate()",
              "in-process": "llmc in process", "triton": "llmc through Triton"}
FIRST_SEED = 1000  # the passes' prompts: llmc bench's seeds from here (its own runs start at 0)


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


def llmc_in_process(version_dir: Path, prompt: list[int], new: int) -> tuple[float, float, int, float]:
    """The packaged engine alone (no thread, no server), fresh: (TTFT, total, tokens after the first),
    then the TTFT of the same prompt sent again to that engine (its prefix cache's hit, when it has one)."""
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.serving.loop import ServingLoop

    engine = ServingLoop.from_manifest(version_dir).engine

    def one(request_id: str) -> tuple[float, float]:
        start = time.perf_counter()
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=new, min_tokens=new))
        ttft, done = None, False
        while not done:
            for out in engine.step():
                ttft = ttft if ttft is not None or not out.token_ids else time.perf_counter() - start
                done = done or out.finished
        return ttft, time.perf_counter() - start

    (ttft, total), (again, _) = one("cold"), one("again")
    engine.close()
    return ttft, total, new - 1, again


def prompt_for(tokenizer, tokens: int, seed: int) -> tuple[int, list[int]]:
    """llmc bench's prompt `seed` (make_prompt: its first words spell the seed, so no two seeds share a
    KV block) in the fewest words that reach `tokens` tokens: (words, ids)."""
    from llmc.bench import make_prompt

    words = next(n for n in range(4, 4 * tokens + 8) if len(tokenizer.encode(make_prompt(n, seed)).ids) >= tokens)
    return words, tokenizer.encode(make_prompt(words, seed)).ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="the checkpoint (default models/smollm2)")
    parser.add_argument("--build", type=Path, help="an llmc build of it (a folder holding model_repository/; "
                                                    "default: bench_serving.py's SmolLM2 build)")
    parser.add_argument("--out", type=Path, default=BENCH, help="where peers' builds go (default build/bench)")
    parser.add_argument("--skip", default="", help=f"contenders to leave out, comma-separated: {', '.join(CONTENDERS)}")
    parser.add_argument("--json", type=Path, help="where to write the results (default OUT/peers.json)")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(CONTENDERS):
        parser.error(f"--skip: unknown {sorted(skip - set(CONTENDERS))}; contenders are {', '.join(CONTENDERS)}")
    if "triton" in skip:
        parser.error("--skip triton: llmc through Triton is the baseline every ratio is taken against")

    import torch
    from tokenizers import Tokenizer

    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.bench import run_load
    from llmc.serve import start_server

    serving, attention = _script("bench_serving"), _script("bench_attention")
    torch.set_num_threads(args.threads)
    build_dir = args.build or serving.serving_build(args.threads)
    version_dir = next((build_dir / "model_repository").glob("*/[0-9]*"))
    genai_dir = None if "genai" in skip else attention.genai_build(args.threads, source=args.model, root=args.out)
    hf_model = None if "hf" in skip else load_model(inspect_source(SourceSpec(path=args.model)))[0].eval()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    # every pass its own prompt (seeds FIRST_SEED + pass), the same for every contender within the pass
    prompts = [prompt_for(tokenizer, args.prompt_tokens, FIRST_SEED + p) for p in range(args.passes)]
    new = args.new_tokens
    server = start_server(build_dir, None, None, None, None)

    def triton(p: int) -> tuple[float, float, int, float]:
        """The pass's prompt, new to the server, then once more (a prefix-cache hit)."""
        def once():
            s = asyncio.run(run_load(server.grpc_url, None, concurrency=1, num_requests=1, prompt_words=prompts[p][0],
                                     max_tokens=new, first_seed=FIRST_SEED + p)).summary()  # min_tokens = max_tokens
            if s["errors"]:
                raise RuntimeError(f"llmc through Triton: the request failed (pass {p + 1})")
            return s

        cold, again = once(), once()
        return cold["ttft_s_p50"], cold["latency_s_p50"], new - 1, again["ttft_s_p50"]

    contenders = {"HF transformers generate()": lambda p: (*hf_generate(hf_model, prompts[p][1], new), None),
                  "onnxruntime-genai generate()": lambda p: (*attention.genai_timed(genai_dir, prompts[p][1], 1, new),
                                                              None),
                  "llmc in process": lambda p: llmc_in_process(version_dir, prompts[p][1], new),
                  "llmc through Triton": triton}
    contenders = {name: run for (key, name), run in zip(CONTENDERS.items(), contenders.values()) if key not in skip}
    runs: dict[str, list[tuple]] = {name: [] for name in contenders}  # (TTFT, total, tokens after, TTFT cached)
    try:
        for p in range(args.passes):
            names = list(contenders)
            for name in names[p % len(names):] + names[:p % len(names)]:
                ttft, total, after, cached = contenders[name](p)
                runs[name].append((ttft, total, after, cached))
                again = "" if cached is None else f" (again: {cached * 1000:5.0f} ms)"
                print(f"  pass {p + 1} {name:<30} TTFT {ttft * 1000:7.0f} ms{again}  {after / (total - ttft):7.1f} tok/s",
                      file=sys.stderr)
    finally:
        server.stop()

    def decode(ttft: float, total: float, after: int, cached: float | None) -> float:
        return after / (total - ttft)  # genai may stop early at an end id: its own count

    base = "llmc through Triton"
    lengths = [len(ids) for _, ids in prompts]
    print(f"\n{args.model.name} fp32, CPU, {args.threads} threads, batch 1 greedy, {min(lengths)}-{max(lengths)}-token "
          f"prompts (a new one each pass), {new} new tokens; medians of {args.passes} passes")
    print("TTFT: the pass's prompt, new to every contender (llmc's prefix cache is on but holds no block of it: "
          "prompts share none);\nTTFT cached: the same prompt sent again right after (llmc's prefix cache hit; "
          "the peers have no prefix cache)")
    print(f"| {'peer':<30} | TTFT | TTFT cached | decode tok/s | end to end | decode vs llmc through Triton |")
    print(f"|{'-' * 32}|---|---|---|---|---|")
    table = {}
    for name, values in runs.items():
        ratio = statistics.median(decode(*v) / decode(*b) for v, b in zip(values, runs[base]))
        cached = [v[3] for v in values if v[3] is not None]
        row = {"ttft_ms": statistics.median(v[0] for v in values) * 1000,
               "ttft_cached_ms": statistics.median(cached) * 1000 if cached else None,
               "decode_tok_s": statistics.median(decode(*v) for v in values),
               "end_to_end_s": statistics.median(v[1] for v in values), "decode_ratio_vs_llmc_triton": ratio}
        table[name] = row
        hit = "-" if row["ttft_cached_ms"] is None else f"{row['ttft_cached_ms']:.0f} ms"
        print(f"| {name:<30} | {row['ttft_ms']:.0f} ms | {hit} | {row['decode_tok_s']:.1f} | "
              f"{row['end_to_end_s']:.2f} s | {ratio:.2f}x |")
    path = args.json or args.out / "peers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"threads": args.threads, "prompt_tokens": lengths, "new_tokens": new,
                                "passes": runs, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
