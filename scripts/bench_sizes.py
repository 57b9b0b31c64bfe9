"""Speed at real sizes: llmc against onnxruntime-genai (and llama.cpp where installed) on random-weight
checkpoints with the exact shapes of real models, every ratio measured within one run:

    .venv/bin/python scripts/bench_sizes.py [--shapes qwen2.5-0.5b,llama-3.2-1b | --checkpoint DIR]
        [--modes fp32,int8,int4] [--peers genai,llama.cpp] [--passes 3] [--threads 2] [--new-tokens 32]
        [--prefill-tokens 512] [--out build/bench/sizes]

Random weights read and multiply as fast as trained ones, and need no download: the checkpoint is the
model's config (sized_checkpoints.py's SHAPES: hidden size, layers, heads, vocabulary, tied embeddings, RoPE)
with seeded random weights and SmolLM2's tokenizer grown to the model's vocabulary (filler tokens
past its own 49,152), written once under OUT/checkpoints/.

For each shape and mode (fp32, int8 and int4 weight-only) it builds:
  - llmc: `llmc build` of a spec with the mode (AWQ, searched codes and the quality report included);
  - onnxruntime-genai: its model builder at the same precision (round to nearest, blocks of 32);
  - llama.cpp (F32, Q8_0, Q4_0): only where `llama_cpp` (llama-cpp-python) and its converter are
    installed; the row says so where they are not.
and records each build's wall time and peak memory (the resident set of the build's process tree,
sampled every 50 ms, and its anonymous part: less the mapped weight files the kernel can drop), beside
llmc's own `--dry-run` estimate of it.

Then, in passes with the contenders' order rotating and a new prompt a pass:
  - batch-1 decode tokens/s (greedy, `--new-tokens` after a 128-token prompt);
  - prefill tokens/s of a `--prefill-tokens` prompt (its time to the first token, prefix cache cold).
Each figure is also a share of the memory-bandwidth roofline: the bytes a decode step must read
(every weight a node reads whole: the embedding table, which a step gathers one row of, is left out)
over the bandwidth this machine reads at with `--threads` threads, measured in the same run.
Ratios are medians of per-pass ratios. Writes OUT/sizes.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "build" / "bench" / "sizes"
MODES = ("fp32", "int8", "int4")
LLMC_MODE = {"fp32": None, "int8": "int8-weight-only", "int4": "int4-weight-only"}
LLAMA_CPP_TYPE = {"fp32": "f32", "int8": "q8_0", "int4": "q4_0"}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def step_bytes(model_dir: Path) -> int:
    """Bytes of the initializers a decode step reads whole: every one in the folder's ONNX graphs but
    those only Gather reads (an embedding table: one row a step)."""
    import onnx

    total = 0
    for path in model_dir.glob("*.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        readers: dict[str, set[str]] = {}
        for node in model.graph.node:
            for name in node.input:
                readers.setdefault(name, set()).add(node.op_type)
        for t in model.graph.initializer:
            if readers.get(t.name, {"Gather"}) == {"Gather"}:
                continue
            stored = {e.key: e.value for e in t.external_data}
            total += int(stored["length"]) if "length" in stored else len(t.raw_data) or _size(t)
    return total


def _size(tensor) -> int:
    from onnx import helper

    count = 1
    for d in tensor.dims:
        count *= d
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


class PeakMemory:
    """The largest resident set of a process and its children, sampled every `interval` seconds: in all
    (`peak`), and its anonymous part (`peak_anonymous`: the resident set less the file-backed and shared
    pages, such as a session's mapped weights file, which the kernel can drop and read again)."""

    def __init__(self, pid: int, interval: float = 0.05):
        import psutil

        self.peak = self.peak_anonymous = 0
        self._stop = threading.Event()
        self._root = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                infos = [p.memory_info() for p in (self._root, *self._root.children(recursive=True))]
                self.peak = max(self.peak, sum(i.rss for i in infos))
                self.peak_anonymous = max(self.peak_anonymous, sum(i.rss - i.shared for i in infos))
            except psutil.Error:
                pass
            self._stop.wait(interval)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anonymous


def timed_build(cmd: list[str], log: Path) -> tuple[float, int, int]:
    """Run a build command: (wall seconds, peak resident bytes of its process tree, peak anonymous bytes);
    its output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        memory = PeakMemory(proc.pid)
        code = proc.wait()
        wall, (peak, anonymous) = time.perf_counter() - start, memory.stop()
    if code:
        raise RuntimeError(f"{cmd[0]} ... failed (exit {code}); see {log}")
    return wall, peak, anonymous


def llmc_build(checkpoint: Path, mode: str, root: Path, threads: int) -> dict:
    """An llmc build of `checkpoint` in `mode` (made once): its version folder, build time, peak memory
    and the dry run's estimate of that memory."""
    out = root / f"llmc-{mode}"
    spec = root / f"llmc-{mode}.yaml"
    root.mkdir(parents=True, exist_ok=True)
    lines = [f"name: {checkpoint.name}-{mode}", f"source: {checkpoint}", "target: onnxruntime", "precision: fp32"]
    if LLMC_MODE[mode]:
        lines += ["quantization:", f"  mode: {LLMC_MODE[mode]}"]
    spec.write_text("\n".join(lines) + "\n")
    record = root / f"llmc-{mode}.json"
    if not record.is_file():
        llmc = [sys.executable, "-m", "llmc.cli"]
        plan = subprocess.run([*llmc, "build", str(spec), "--dry-run", "--json"], check=True, capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "200"})
        estimate = json.loads(plan.stdout)["build_peak_bytes"]
        wall, peak, anonymous = timed_build([*llmc, "build", str(spec), "-o", str(out)], root / f"llmc-{mode}.log")
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous,
                                      "estimate_bytes": estimate}))
    return {**json.loads(record.read_text()), "version": next((out / "model_repository").glob("*/[0-9]*"))}


def genai_build(checkpoint: Path, mode: str, root: Path, threads: int) -> dict:
    """onnxruntime-genai's builder at `mode` (made once), its session options set to `threads`."""
    out = root / f"genai-{mode}"
    record = root / f"genai-{mode}.json"
    if not record.is_file():
        wall, peak, anonymous = timed_build([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                                             str(checkpoint), "-o", str(out), "-p", mode, "-e", "cpu"],
                                            root / f"genai-{mode}.log")
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous}))
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(intra_op_num_threads=threads,
                                                                         inter_op_num_threads=1)
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return {**json.loads(record.read_text()), "dir": out}


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be measured here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from its sdist; "
                "its converter, convert_hf_to_gguf.py, is in the sdist's vendor/llama.cpp)")
    if not os.environ.get("LLAMA_CPP_CONVERT"):
        return "LLAMA_CPP_CONVERT is not set to the sdist's vendor/llama.cpp/convert_hf_to_gguf.py"
    return None


def llama_cpp_build(checkpoint: Path, mode: str, root: Path) -> dict:
    """llama.cpp's converter at `mode` (F32 / Q8_0 as it writes them; Q4_0 requantized from F32 by
    llama_cpp's `llama_model_quantize`), made once."""
    out = root / f"llama-cpp-{mode}.gguf"
    record = root / f"llama-cpp-{mode}.json"
    if not record.is_file():
        direct = mode != "int4"
        target = out if direct else root / "llama-cpp-fp32.gguf"
        wall, peak, anonymous = 0.0, 0, 0
        if not target.is_file():
            wall, peak, anonymous = timed_build([sys.executable, os.environ["LLAMA_CPP_CONVERT"], str(checkpoint), "--outfile",
                                      str(target), "--outtype", LLAMA_CPP_TYPE[mode if direct else "fp32"]],
                                     root / f"llama-cpp-{mode}.log")
        if not direct:
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            start = time.perf_counter()
            if llama_cpp.llama_model_quantize(str(target).encode(), str(out).encode(), params):
                raise RuntimeError(f"llama.cpp could not quantize {target} to Q4_0")
            wall += time.perf_counter() - start
        record.write_text(json.dumps({"build_s": wall, "peak_bytes": peak, "peak_anonymous_bytes": anonymous}))
    return {**json.loads(record.read_text()), "gguf": out}


def llama_cpp_timed(gguf: Path, prompt: list[int], new: int, threads: int) -> tuple[float, float, int]:
    """llama.cpp greedy generation of `new` tokens: (TTFT, total seconds, tokens after the first)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt) + new + 8, n_threads=threads, n_batch=512, verbose=False)
    start, ttft, produced = time.perf_counter(), None, 0
    for _ in llm.generate(prompt, top_k=1, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - start
        else:
            produced += 1
        if produced == new - 1:
            break
    return ttft, time.perf_counter() - start, produced


def main(argv: list[str] | None = None) -> None:
    shapes_module = _script("sized_checkpoints")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen2.5-0.5b", help=f"comma-separated: {', '.join(shapes_module.SHAPES)}")
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="a checkpoint folder to measure instead of the shapes (repeatable)")
    p.add_argument("--peers", default="genai,llama.cpp", help="comma-separated: genai, llama.cpp, or none")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: fp32, int8, int4")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    shapes = [] if args.checkpoint else [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    peers = {q for q in args.peers.split(",") if q and q != "none"}
    if bad := [s for s in shapes if s not in shapes_module.SHAPES]:
        p.error(f"--shapes: unknown {bad}; known: {', '.join(shapes_module.SHAPES)}")
    if bad := sorted(peers - {"genai", "llama.cpp"}):
        p.error(f"--peers: unknown {bad}; known: genai, llama.cpp, none")
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; known: {', '.join(MODES)}")

    import torch
    from tokenizers import Tokenizer

    compare, attention = _script("compare_peers"), _script("bench_attention")
    torch.set_num_threads(args.threads)
    no_llama_cpp = llama_cpp_missing() if "llama.cpp" in peers else "not asked for (--peers)"
    if no_llama_cpp:
        print(f"llama.cpp: not measured: {no_llama_cpp}", file=sys.stderr)
    results = {"threads": args.threads, "llama_cpp": no_llama_cpp or "measured", "shapes": {}}
    checkpoints = {c.name: c for c in args.checkpoint} or {
        shape: shapes_module.checkpoint(shape, args.out / "checkpoints") for shape in shapes}
    for shape, checkpoint in checkpoints.items():
        root = args.out / shape
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        builds = {}
        for mode in modes:
            print(f"{shape} {mode}: building ...", file=sys.stderr)
            builds[("llmc", mode)] = llmc_build(checkpoint, mode, root, args.threads)
            if "genai" in peers:
                builds[("genai", mode)] = genai_build(checkpoint, mode, root, args.threads)
            if not no_llama_cpp:
                builds[("llama.cpp", mode)] = llama_cpp_build(checkpoint, mode, root)
        runs = {
            "llmc": lambda b, prompt, new: compare.llmc_in_process(b["version"], prompt, new)[:3],
            "genai": lambda b, prompt, new: attention.genai_timed(b["dir"], prompt, 1, new),
            "llama.cpp": lambda b, prompt, new: llama_cpp_timed(b["gguf"], prompt, new, args.threads),
        }
        bw = bandwidth(args.threads)
        passes: dict[tuple[str, str], list[dict]] = {key: [] for key in builds}
        for n in range(args.passes):
            decode_prompt = compare.prompt_for(tokenizer, args.prompt_tokens, 1000 + n)[1]
            prefill_prompt = compare.prompt_for(tokenizer, args.prefill_tokens, 2000 + n)[1]
            keys = list(builds)
            for key in keys[n % len(keys):] + keys[:n % len(keys)]:
                run = runs[key[0]]
                ttft, total, after = run(builds[key], decode_prompt, args.new_tokens)
                prefill_ttft = run(builds[key], prefill_prompt, 2)[0]
                passes[key].append({"decode_tok_s": after / (total - ttft),
                                    "prefill_tok_s": len(prefill_prompt) / prefill_ttft})
                print(f"  pass {n + 1} {shape} {key[1]:5} {key[0]:9} decode {passes[key][-1]['decode_tok_s']:6.1f} tok/s"
                      f"  prefill {passes[key][-1]['prefill_tok_s']:7.1f} tok/s", file=sys.stderr)
        bw = max(bw, bandwidth(args.threads))  # measured again after the passes: the best of both
        results["shapes"][shape] = _table(shape, builds, passes, bw, args)
    path = args.out / "sizes.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


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
        weights = step_bytes(b["version"] if engine == "llmc" else b["dir"]) if engine != "llama.cpp" \
            else b["gguf"].stat().st_size
        decode = statistics.median(v["decode_tok_s"] for v in values)
        row = {"decode_tok_s": decode, "prefill_tok_s": statistics.median(v["prefill_tok_s"] for v in values),
               "step_bytes": weights, "roofline_share": decode * weights / bw, "build_s": b["build_s"],
               "peak_build_bytes": b["peak_bytes"], "peak_build_anonymous_bytes": b["peak_anonymous_bytes"],
               "estimate_bytes": b.get("estimate_bytes")}
        ours = passes.get(("llmc", mode))
        if engine != "llmc" and ours:
            for what in ("decode_tok_s", "prefill_tok_s"):
                row[f"llmc_{what}_ratio"] = statistics.median(o[what] / v[what] for o, v in zip(ours, values))
        rows[f"{engine} {mode}"] = row
        estimate = f" (estimate {row['estimate_bytes'] / 2**30:.1f})" if row["estimate_bytes"] else ""
        ratios = [f"{row[k]:.2f}x" if k in row else "" for k in ("llmc_decode_tok_s_ratio", "llmc_prefill_tok_s_ratio")]
        print(f"| {mode} | {engine} | {decode:.1f} | {row['roofline_share']:.0%} | {row['prefill_tok_s']:.0f} | "
              f"{row['build_s']:.0f} s | {row['peak_build_bytes'] / 2**30:.1f} GiB "
              f"({row['peak_build_anonymous_bytes'] / 2**30:.1f}){estimate} | {ratios[0]} | {ratios[1]} |")
    return rows


if __name__ == "__main__":
    main()
