"""One table: the same prompts and greedy settings on every peer, ratios measured within one run.

    .venv/bin/python -m llmc.bench peers [--threads 2] [--passes 3] [--prompt-tokens 128] [--new-tokens 64]
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
import sys
from pathlib import Path

from llmc.bench.builds import BENCH, SMOLLM2, served_smollm2
from llmc.bench.harness import UsageError, median, median_ratio, passes, prompt_for, write_json
from llmc.bench.peers import PEERS, llmc_in_process

CONTENDERS = {"hf": "HF transformers generate()", "genai": "onnxruntime-genai generate()",
              "in-process": "llmc in process", "triton": "llmc through Triton"}
FIRST_SEED = 1000  # the passes' prompts: llmc bench's seeds from here (its own runs start at 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="the checkpoint (default models/smollm2)")
    parser.add_argument("--build", type=Path, help="an llmc build of it (a folder holding model_repository/; "
                                                    "default: the triton benchmark's SmolLM2 build)")
    parser.add_argument("--out", type=Path, default=BENCH, help="where peers' builds go (default build/bench)")
    parser.add_argument("--skip", default="", help=f"contenders to leave out, comma-separated: {', '.join(CONTENDERS)}")
    parser.add_argument("--json", type=Path, help="where to write the results (default OUT/peers.json)")


def run(args: argparse.Namespace) -> None:
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(CONTENDERS):
        raise UsageError(f"--skip: unknown {sorted(skip - set(CONTENDERS))}; contenders are {', '.join(CONTENDERS)}")
    if "triton" in skip:
        raise UsageError("--skip triton: llmc through Triton is the baseline every ratio is taken against")

    import torch
    from tokenizers import Tokenizer

    from llmc.serve import start_server

    torch.set_num_threads(args.threads)
    build_dir = args.build or served_smollm2(args.threads)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    # every pass its own prompt (seeds FIRST_SEED + pass), the same for every contender within the pass
    prompts = [prompt_for(tokenizer, args.prompt_tokens, FIRST_SEED + p) for p in range(args.passes)]
    server = start_server(build_dir, None, None, None, None)
    try:
        contenders = _contenders(args, skip, build_dir, server, prompts)
        runs = passes(contenders, args.passes, _show)  # per pass: (TTFT, total, tokens after, TTFT cached)
    finally:
        server.stop()
    lengths = [len(ids) for _, ids in prompts]
    print(f"\n{args.model.name} fp32, CPU, {args.threads} threads, batch 1 greedy, {min(lengths)}-{max(lengths)}-token "
          f"prompts (a new one each pass), {args.new_tokens} new tokens; medians of {args.passes} passes")
    write_json(args.json or args.out / "peers.json", {"threads": args.threads, "prompt_tokens": lengths,
                                                       "new_tokens": args.new_tokens, "passes": runs,
                                                       "table": _table(runs)})


def _contenders(args, skip: set[str], build_dir: Path, server, prompts: list) -> dict:
    """{name: pass -> (TTFT, total, tokens after the first, TTFT of the prompt again or None)}, less `skip`."""
    from llmc.bench.load import run_load

    new = args.new_tokens
    version_dir = next((build_dir / "model_repository").glob("*/[0-9]*"))
    genai = None if "genai" in skip else PEERS["genai"].build(args.model, "fp32", args.out, args.threads)
    hf = None if "hf" in skip else PEERS["hf"].build(args.model, "fp32", args.out, args.threads)

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

    runs = {"hf": lambda p: (*PEERS["hf"].timed(hf, prompts[p][1], new, args.threads), None),
            "genai": lambda p: (*PEERS["genai"].timed(genai, prompts[p][1], new, args.threads), None),
            "in-process": lambda p: llmc_in_process(version_dir, prompts[p][1], new),
            "triton": triton}
    return {CONTENDERS[key]: runs[key] for key in CONTENDERS if key not in skip}


def _show(p: int, name: str, result: tuple) -> None:
    ttft, total, after, cached = result
    again = "" if cached is None else f" (again: {cached * 1000:5.0f} ms)"
    print(f"  pass {p + 1} {name:<30} TTFT {ttft * 1000:7.0f} ms{again}  {after / (total - ttft):7.1f} tok/s",
          file=sys.stderr)


def _decode(ttft: float, total: float, after: int, cached: float | None) -> float:
    return after / (total - ttft)  # genai may stop early at an end id: its own count


def _table(runs: dict[str, list[tuple]]) -> dict:
    """Print the table (medians, and each contender's per-pass decode ratio to llmc through Triton); its rows."""
    base = runs["llmc through Triton"]
    print("TTFT: the pass's prompt, new to every contender (llmc's prefix cache is on but holds no block of it: "
          "prompts share none);\nTTFT cached: the same prompt sent again right after (llmc's prefix cache hit; "
          "the peers have no prefix cache)")
    print(f"| {'peer':<30} | TTFT | TTFT cached | decode tok/s | end to end | decode vs llmc through Triton |")
    print(f"|{'-' * 32}|---|---|---|---|---|")
    table = {}
    for name, values in runs.items():
        ratio = median_ratio([_decode(*v) for v in values], [_decode(*b) for b in base])
        cached = [v[3] for v in values if v[3] is not None]
        row = {"ttft_ms": median(v[0] for v in values) * 1000,
               "ttft_cached_ms": median(cached) * 1000 if cached else None,
               "decode_tok_s": median(_decode(*v) for v in values),
               "end_to_end_s": median(v[1] for v in values), "decode_ratio_vs_llmc_triton": ratio}
        table[name] = row
        hit = "-" if row["ttft_cached_ms"] is None else f"{row['ttft_cached_ms']:.0f} ms"
        print(f"| {name:<30} | {row['ttft_ms']:.0f} ms | {hit} | {row['decode_tok_s']:.1f} | "
              f"{row['end_to_end_s']:.2f} s | {ratio:.2f}x |")
    return table
