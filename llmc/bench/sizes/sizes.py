"""Speed at real sizes: llmc against onnxruntime-genai (and llama.cpp where installed) on random-weight
checkpoints with the exact shapes of real models, every ratio measured within one run:

    .venv/bin/python -m llmc.bench sizes [--shapes qwen2.5-0.5b,llama-3.2-1b | --checkpoint DIR]
        [--modes fp32,int8,int4] [--peers genai,llama.cpp] [--int4-block 128] [--passes 3] [--threads 2]
        [--new-tokens 32] [--prefill-tokens 512] [--streams 16] [--out build/bench/sizes]

Random weights read and multiply as fast as trained ones, and need no download: the checkpoint is the
model's config (checkpoints.py's SHAPES: hidden size, layers, heads, vocabulary, tied embeddings, RoPE)
with seeded random weights and SmolLM2's tokenizer grown to the model's vocabulary (filler tokens
past its own 49,152), written once under OUT/checkpoints/. `--checkpoint DIR` measures any checkpoint instead.

For each shape and mode (fp32, int8 and int4 weight-only) it builds (builds.py and peers.py):
  - llmc: `llmc build` of a spec with the mode (AWQ, searched codes and the quality report included); int4 in
    blocks of `--int4-block` weights a scale when given (AWQ's own default is 128; llmc's int4 default, 32);
  - onnxruntime-genai: its model builder at the same precision (round to nearest, blocks of 32);
  - llama.cpp (F32, Q8_0, Q4_0): only where `llama_cpp` (llama-cpp-python) and its converter are
    installed; where they are not, the run says why (on stderr and in sizes.json). It generates in a
    child process: a llama.cpp that dies (SIGILL, built for AMX a VM does not enable) is dropped from
    the run, the reason in sizes.json.
and records each build's wall time and peak memory (the resident set of the build's process tree,
sampled every 50 ms, and its anonymous part: less the mapped weight files the kernel can drop), beside
llmc's own `--dry-run` estimate of it.

Then, in passes with the contenders' order rotating and a new prompt a pass:
  - batch-1 decode tokens/s (greedy, `--new-tokens` after a 128-token prompt);
  - prefill tokens/s of a `--prefill-tokens` prompt (its time to the first token, prefix cache cold);
  - `--streams` concurrent streams (llmc's engine and og.Engine, streams.py; 0: none): 2 x streams
    requests of `--prompt-tokens` and `--new-tokens`, generated tokens/s, TTFT and inter-token p50/p99.
    llama.cpp is not in it: llama-cpp-python runs one sequence at a time, and its sdist does not build
    llama.cpp's batching `llama-server`.
Each figure is also a share of the memory-bandwidth roofline: the bytes a decode step must read
(every weight a node reads whole: the embedding table, which a step gathers one row of, is left out)
over the bandwidth this machine reads at with `--threads` threads, measured in the same run (the best
of its passes before and after the timed ones).
Ratios are medians of per-pass ratios. Writes OUT/sizes.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmc.bench import checkpoints
from llmc.bench.builds import BENCH, MODES, STREAM_ROWS, sized_build
from llmc.bench.harness import UsageError, in_turn, median, median_ratio, prompt_for, write_json
from llmc.bench.peers import PEERS

OUT = BENCH / "sizes"


def bandwidth(threads: int, gib: float = 1.0, passes: int = 7) -> float:
    """Bytes per second this machine reads with `threads` threads: a torch sum over `gib` GiB of fp32,
    the fastest of `passes` after one warm-up (the most the host gave while shared; a median of a noisy
    host's passes put decode above its roofline)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times)


def step_bytes(model_dir: Path, llmc_kernel: bool = False) -> int:
    """Bytes of the initializers a decode step reads whole: every one in the folder's ONNX graphs but
    those only Gather reads (an embedding table: one row a step). `llmc_kernel`: the graphs run where llmc's
    4-bit kernel swaps in, which packs a node's scales as fp16 when every one is an fp16 value (as llmc's quantizer
    writes them): those count two bytes a scale, as the kernel streams them."""
    import onnx

    from llmc.runtime.kernels import cpu_kernels, graph_edits

    half = llmc_kernel and cpu_kernels.load() is not None
    total = 0
    for path in model_dir.glob("*.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        readers: dict[str, set[str]] = {}
        for node in model.graph.node:
            for name in node.input:
                readers.setdefault(name, set()).add(node.op_type)
        packed = {node.input[2] for node in graph_edits.swappable(model)} if half else set()
        for t in model.graph.initializer:
            if readers.get(t.name, {"Gather"}) == {"Gather"}:
                continue
            stored = {e.key: e.value for e in t.external_data}
            size = int(stored["length"]) if "length" in stored else len(t.raw_data) or _size(t)
            if t.name in packed and _fp16_values(_floats(t, stored, model_dir)):
                size //= 2
            total += size
    return total


def gguf_step_bytes(path: Path) -> int:
    """A GGUF's counterpart of step_bytes: every tensor's bytes but the token embedding's, which a step gathers
    one row of, unless the file has no `output.weight` (tied: the embedding is read whole as the LM head)."""
    from gguf.gguf_reader import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def _floats(t, stored: dict, folder: Path):
    """A float32 initializer's values: read from its external data file directly (onnx's own reader refuses a
    data file with more than one hard link, which a packaged version's is), or from the graph."""
    import numpy as np
    from onnx import numpy_helper

    if "location" not in stored:
        return numpy_helper.to_array(t)
    count = int(stored["length"]) // 4
    return np.fromfile(folder / stored["location"], np.float32, count, offset=int(stored.get("offset", 0)))


def _fp16_values(a) -> bool:
    import numpy as np

    with np.errstate(over="ignore"):
        return a.dtype == np.float32 and bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def _size(tensor) -> int:
    from onnx import helper

    count = 1
    for d in tensor.dims:
        count *= d
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="qwen2.5-0.5b", help=f"comma-separated: {', '.join(checkpoints.SHAPES)}")
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="a checkpoint folder to measure instead of the shapes (repeatable)")
    p.add_argument("--peers", default="genai,llama.cpp", help="comma-separated: genai, llama.cpp, or none")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: fp32, int8, int4")
    p.add_argument("--int4-block", type=int, choices=(16, 32, 64, 128, 256), default=None,
                   help="llmc's int4 builds with this quantization.block_size (default: the mode's, 32)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--streams", type=int, default=16, help=f"concurrent streams, at most {STREAM_ROWS} (0: none)")
    p.add_argument("--out", type=Path, default=OUT)


def run(args: argparse.Namespace) -> None:
    shapes = [] if args.checkpoint else [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    peers = {q for q in args.peers.split(",") if q and q != "none"}
    if bad := [s for s in shapes if s not in checkpoints.SHAPES]:
        raise UsageError(f"--shapes: unknown {bad}; known: {', '.join(checkpoints.SHAPES)}")
    if bad := sorted(peers - {"genai", "llama.cpp"}):
        raise UsageError(f"--peers: unknown {bad}; known: genai, llama.cpp, none")
    if bad := [m for m in modes if m not in MODES]:
        raise UsageError(f"--modes: unknown {bad}; known: {', '.join(MODES)}")
    if not 0 <= args.streams <= STREAM_ROWS:
        raise UsageError(f"--streams: {args.streams} is not between 0 and {STREAM_ROWS} (the rows llmc's builds step)")

    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    no_llama_cpp = PEERS["llama.cpp"].missing() if "llama.cpp" in peers else "not asked for (--peers)"
    if no_llama_cpp:
        print(f"llama.cpp: not measured: {no_llama_cpp}", file=sys.stderr)
    engines = ["llmc", *(["genai"] if "genai" in peers else []), *([] if no_llama_cpp else ["llama.cpp"])]
    results = {"threads": args.threads, "llama_cpp": no_llama_cpp or "measured", "int4_block": args.int4_block,
               "shapes": {}}
    checkpoint_dirs = {c.name: c for c in args.checkpoint} or {
        shape: checkpoints.checkpoint(shape, args.out / "checkpoints") for shape in shapes}
    for shape, checkpoint in checkpoint_dirs.items():
        root = args.out / shape
        builds = {}
        for mode in modes:
            print(f"{shape} {mode}: building ...", file=sys.stderr)
            for engine in engines:
                if engine == "llmc" and mode == "int4" and args.int4_block:
                    builds[(engine, mode)] = sized_build(checkpoint, mode, root, block=args.int4_block)
                else:
                    builds[(engine, mode)] = PEERS[engine].build(checkpoint, mode, root, args.threads)
        bw = bandwidth(args.threads)
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        runs = _passes(shape, builds, tokenizer, args, results)
        bw = max(bw, bandwidth(args.threads))  # measured again after the passes: the best of both
        results["shapes"][shape] = _table(shape, builds, runs, bw, args)
    write_json(args.out / "sizes.json", results)


def _passes(shape: str, builds: dict, tokenizer, args, results: dict) -> dict[tuple[str, str], list[dict]]:
    """Every build's decode, prefill (and streams) once a pass, in the pass's turn, each pass its own prompts.
    llama.cpp runs in its own process: one that dies is dropped from `builds` and the run goes on."""
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in builds}
    for n in range(args.passes):
        decode_prompt = prompt_for(tokenizer, args.prompt_tokens, 1000 + n)[1]
        prefill_prompt = prompt_for(tokenizer, args.prefill_tokens, 2000 + n)[1]
        stream_prompts = [prompt_for(tokenizer, args.prompt_tokens, 3000 + 100 * n + i)[1]
                          for i in range(2 * args.streams)]
        for key in in_turn(builds, n):
            if key not in builds:
                continue
            peer = PEERS[key[0]]
            try:
                ttft, total, after = peer.timed(builds[key], decode_prompt, args.new_tokens, args.threads)
                prefill_ttft = peer.timed(builds[key], prefill_prompt, 2, args.threads)[0]
            except RuntimeError as err:
                if key[0] != "llama.cpp":
                    raise
                print(f"llama.cpp: dropped from the run: {err}", file=sys.stderr)
                results["llama_cpp"] = f"dropped: {err}"
                for dropped in [k for k in builds if k[0] == "llama.cpp"]:
                    del builds[dropped], runs[dropped]
                continue
            got = {"decode_tok_s": after / (total - ttft), "prefill_tok_s": len(prefill_prompt) / prefill_ttft}
            if args.streams and peer.streams:
                streamed = peer.streams(builds[key], stream_prompts, args.new_tokens, args.streams)
                got |= {f"streams_{k}": v for k, v in streamed.items()}
            runs[key].append(got)
            print(f"  pass {n + 1} {shape} {key[1]:5} {key[0]:9} decode {got['decode_tok_s']:6.1f} tok/s"
                  f"  prefill {got['prefill_tok_s']:7.1f} tok/s"
                  + (f"  {args.streams} streams {got['streams_tok_s']:6.1f} tok/s" if "streams_tok_s" in got else ""),
                  file=sys.stderr)
    return runs


def _table(shape: str, builds: dict, passes: dict, bw: float, args) -> dict:
    """Print the shape's table (medians, per-pass ratios to the peers, roofline shares); return its rows."""
    print(f"\n{shape} (random weights, exact shape), CPU, {args.threads} threads, batch 1 greedy; decode: "
          f"{args.new_tokens} tokens after {args.prompt_tokens}; prefill: {args.prefill_tokens} tokens; "
          f"{args.passes} passes; read bandwidth {bw / 1e9:.1f} GB/s")
    print("| mode | engine | decode tok/s | of roofline | prefill tok/s | build | peak build memory: resident "
          "(anonymous) | llmc decode vs | llmc prefill vs |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for (engine, mode), values in passes.items():
        b = builds[(engine, mode)]
        if engine == "llama.cpp":
            weights = gguf_step_bytes(b["gguf"])
        elif engine == "llmc":
            weights = step_bytes(b["version"], llmc_kernel=True)
        else:
            weights = step_bytes(b["dir"])
        decode = median(v["decode_tok_s"] for v in values)
        row = {"decode_tok_s": decode, "prefill_tok_s": median(v["prefill_tok_s"] for v in values),
               "step_bytes": weights, "roofline_share": decode * weights / bw, "build_s": b["build_s"],
               "peak_build_bytes": b["peak_bytes"], "peak_build_anonymous_bytes": b["peak_anonymous_bytes"],
               "estimate_bytes": b.get("estimate_bytes")}
        ours = passes.get(("llmc", mode))
        if engine != "llmc" and ours:
            for what in ("decode_tok_s", "prefill_tok_s"):
                row[f"llmc_{what}_ratio"] = median_ratio([o[what] for o in ours], [v[what] for v in values])
        rows[f"{engine} {mode}"] = row
        estimate = f" (estimate {row['estimate_bytes'] / 2**30:.1f})" if row["estimate_bytes"] else ""
        ratios = [f"{row[k]:.2f}x" if k in row else "" for k in ("llmc_decode_tok_s_ratio", "llmc_prefill_tok_s_ratio")]
        print(f"| {mode} | {engine} | {decode:.1f} | {row['roofline_share']:.0%} | {row['prefill_tok_s']:.0f} | "
              f"{row['build_s']:.0f} s | {row['peak_build_bytes'] / 2**30:.1f} GiB "
              f"({row['peak_build_anonymous_bytes'] / 2**30:.1f}){estimate} | {ratios[0]} | {ratios[1]} |")
    _streams_table(passes, rows, args)
    return rows


def _streams_table(passes: dict, rows: dict, args) -> None:
    """The --streams runs' medians (and llmc's per-pass throughput ratio to og.Engine) into `rows`, printed."""
    measured = {key: values for key, values in passes.items() if "streams_tok_s" in values[0]}
    if not measured:
        return
    print(f"\n{args.streams} streams, {2 * args.streams} requests of {args.prompt_tokens} + {args.new_tokens} tokens")
    print("| mode | engine | tok/s | TTFT p50 / p99 | inter-token p50 / p99 | p99 / p50 | llmc tok/s vs |")
    print("|---|---|---|---|---|---|---|")
    for (engine, mode), values in measured.items():
        row = rows[f"{engine} {mode}"]
        for what in ("tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            row[f"streams_{what}"] = median(v[f"streams_{what}"] for v in values)
        ours = measured.get(("llmc", mode))
        if engine != "llmc" and ours:
            row["llmc_streams_tok_s_ratio"] = median_ratio([o["streams_tok_s"] for o in ours],
                                                           [v["streams_tok_s"] for v in values])
        ratio = f"{row['llmc_streams_tok_s_ratio']:.2f}x" if "llmc_streams_tok_s_ratio" in row else ""
        print(f"| {mode} | {engine} | {row['streams_tok_s']:.1f} | {row['streams_ttft_p50_s']:.2f} / "
              f"{row['streams_ttft_p99_s']:.2f} s | {row['streams_itl_p50_s'] * 1e3:.0f} / "
              f"{row['streams_itl_p99_s'] * 1e3:.0f} ms | {row['streams_itl_p99_s'] / row['streams_itl_p50_s']:.2f} "
              f"| {ratio} |")
