"""Decode benchmarks for the fused attention lowering, every ratio measured within one run.

    .venv/bin/python scripts/bench_attention.py [--threads 2] [--passes 3]

1. fused vs reference: SmolLM2 fp32 decode steps at 512-token contexts, the fused graph
   (GroupQueryAttention, KV updated in place through IO binding) against the opset-23 reference graph
   driven the plain way (past in, present out, present fed back as the next past). Both caches are
   sized to the context (the reference graph's cost grows with capacity; the fused one's does not).
2. llmc vs onnxruntime-genai: the same prompt and greedy decoding through llmc's runner and through
   onnxruntime-genai's generator on its own fp32 CPU build of the same checkpoint; decode tokens/s
   after the first token.
3. capacity: fused decode step time with the cache sized 256 vs 8192 tokens.

Each pass runs every measurement once (interleaved, so load on the machine hits all alike); the
table shows medians over passes. Builds go to build/bench/ and are reused while unchanged. Needs
scripts/setup.sh and `pip install -e .[bench]` (onnxruntime-genai).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "build" / "bench"
CONTEXT, STEPS, GENAI_PROMPT, GENAI_NEW = 512, 32, 128, 64


def llmc_build(attention: str, threads: int):
    """Export SmolLM2 with the given lowering (reused while the source and llmc are unchanged)."""
    from llmc.compiler import build, load_spec
    from llmc.compiler.spec import parse_spec

    spec = load_spec(REPO / "examples" / "smollm2.yaml")
    data = {**spec.model_dump(mode="json", exclude={"output"}), "name": f"smollm2-{attention}",
            "export": {"attention": attention}}
    data["serving"]["num_threads"] = threads
    result = build(parse_spec(data), output=BENCH / f"smollm2-{attention}", until="export")
    return BENCH / f"smollm2-{attention}" / "export" / result.exported.onnx, result.exported.kv_layout


def genai_build(threads: int) -> Path:
    out = BENCH / "genai-fp32"
    if not (out / "genai_config.json").is_file():
        print("building the onnxruntime-genai fp32 model ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(REPO / "models" / "smollm2"),
                        "-o", str(out), "-p", "fp32", "-e", "cpu"], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       stdout=subprocess.DEVNULL)
    config = json.loads((out / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
    (out / "genai_config.json").write_text(json.dumps(config, indent=4))
    return out


def runner(model, batch: int, capacity: int, threads: int):
    from llmc.runtime.ort_runner import OrtRunner

    path, layout = model
    r = OrtRunner(path, layout, max_batch=batch, capacity=capacity, num_threads=threads)
    rng = np.random.default_rng(0)
    for buf in r.cache.buffers:  # a realistic cache: values do not matter, but zero pages might
        buf[...] = rng.standard_normal(buf.shape, dtype=np.float32) * 0.1
    return r


def step_time(r, batch: int, context: int, steps: int = STEPS) -> float:
    """Median seconds per greedy decode step with every row `context` tokens deep."""
    tokens = np.full((batch, 1), 42, dtype=np.int64)
    times = []
    for k in range(steps + 2):
        start = time.perf_counter()
        logits = r.step(tokens, np.full(batch, context + k, dtype=np.int64))
        tokens = logits[:, -1].argmax(-1)[:, None]
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # two warm-up steps


def llmc_generate(model, prompt: list[int], batch: int, new: int, threads: int) -> float:
    """Decode tokens/s after the first token, prompts prefilled into slots one by one (GQA on CPU)."""
    r = runner(model, batch, len(prompt) + new, threads)
    ids = np.array([prompt])
    for row in range(batch):
        first = r.step(ids, np.zeros(1, dtype=np.int64), first_row=row)[:, -1].argmax(-1)
    tokens = np.repeat(first[:, None], batch, axis=0)
    start = time.perf_counter()
    for k in range(new - 1):
        tokens = r.step(tokens, np.full(batch, len(prompt) + k, dtype=np.int64))[:, -1].argmax(-1)[:, None]
    return batch * (new - 1) / (time.perf_counter() - start)


def genai_generate(model_dir: Path, prompt: list[int], batch: int, new: int) -> float:
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False, batch_size=batch)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt] * batch, dtype=np.int32))  # prefill + first token
    start, produced = time.perf_counter(), 0
    while not gen.is_done():
        gen.generate_next_token()
        produced += 1
    return batch * produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--passes", type=int, default=3, help="passes over all measurements (default 3)")
    parser.add_argument("--json", type=Path, default=BENCH / "attention.json", help="where to write the results")
    args = parser.parse_args()
    t = args.threads
    fused, reference, genai = llmc_build("fused", t), llmc_build("reference", t), genai_build(t)
    prompt = np.random.default_rng(1).integers(100, 40000, GENAI_PROMPT).tolist()
    capacity = CONTEXT + STEPS + 2
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)
        print(f"  {name:<28} {value:10.4f}", file=sys.stderr)

    for p in range(args.passes):
        print(f"pass {p + 1}/{args.passes}", file=sys.stderr)
        for b in (1, 8):
            record(f"fused step b{b} (s)", step_time(runner(fused, b, capacity, t), b, CONTEXT))
            record(f"reference step b{b} (s)", step_time(runner(reference, b, capacity, t), b, CONTEXT))
            record(f"llmc tok/s b{b}", llmc_generate(fused, prompt, b, GENAI_NEW, t))
            record(f"genai tok/s b{b}", genai_generate(genai, prompt, b, GENAI_NEW))
        for cap in (256, 8192):
            record(f"fused step cap{cap} (s)", step_time(runner(fused, 1, cap, t), 1, 128))
    med = {k: statistics.median(v) for k, v in runs.items()}
    rows = [
        ("fused in-place vs reference copy, ctx 512, b1", med["reference step b1 (s)"] / med["fused step b1 (s)"], 1.1),
        ("fused in-place vs reference copy, ctx 512, b8", med["reference step b8 (s)"] / med["fused step b8 (s)"], 1.4),
        ("llmc vs onnxruntime-genai decode tok/s, b1", med["llmc tok/s b1"] / med["genai tok/s b1"], 1.0),
        ("llmc vs onnxruntime-genai decode tok/s, b8", med["llmc tok/s b8"] / med["genai tok/s b8"], 1.0),
        ("step time cap 256 / cap 8192 (1.0 = equal)", med["fused step cap256 (s)"] / med["fused step cap8192 (s)"], None),
    ]
    print(f"\nSmolLM2 fp32, {t} threads, medians of {args.passes} passes")
    for name, value in sorted(med.items()):
        print(f"  {name:<28} {value:10.4f}")
    for name, ratio, target in rows:
        verdict = "" if target is None else ("  ok" if ratio >= target else f"  BELOW target {target}x")
        print(f"  {name:<48} {ratio:5.2f}x{verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": t, "passes": runs, "medians": med,
                                     "ratios": {n: r for n, r, _ in rows}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
