"""Decode benchmarks for the fused attention lowering, every ratio measured within one run.

    .venv/bin/python -m llmc.bench attention [--threads 2] [--passes 5] [--steps 48]

1. fused vs opset 23: SmolLM2 fp32 decode steps at 512-token contexts, llmc's fused graph
   (GroupQueryAttention, KV updated in place through IO binding) against the plain opset-23 export
   of the HF model (transformers' attention traced to `Attention`, the cache growing by
   concatenation: present = past + new, fed back as the next past), and against llmc's own
   `reference` lowering (same graph as fused but opset-23 ops and a cache copy per step, caches
   sized to the context).
2. llmc vs onnxruntime-genai: the same prompt and greedy decoding through llmc's runner and through
   onnxruntime-genai's generator on its own fp32 CPU build of the same checkpoint; decode tokens/s
   after the first token.
3. capacity: fused decode step time with the cache sized 256 vs 8192 tokens.

Each pass runs every measurement once (interleaved, so load on the machine hits all alike; the
llmc/genai order flips every other pass); ratios are medians of per-pass ratios. llmc builds go to
build/bench/ and are reused while unchanged; the genai and HF-export baselines are built once
(delete build/bench/ to rebuild them). Needs scripts/setup.sh (which installs the `bench` extra,
onnxruntime-genai). Writes build/bench/attention.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from llmc.bench.builds import BENCH, SMOLLM2, export_smollm2
from llmc.bench.harness import Runs, in_turn, median, median_ratio, medians, write_json
from llmc.bench.peers import genai_build, genai_generate
CONTEXT, STEPS, GENAI_PROMPT, GENAI_NEW = 512, 48, 128, 64


def hf_opset23_build() -> Path:
    """The HF model exported as transformers traces it (the export llmc replaced): opset 23,
    attention_mask / position_ids inputs, present = concat(past, new)."""
    import torch
    from torch.export import Dim
    from transformers import AutoModelForCausalLM, DynamicCache

    from llmc.compiler.graph.greedy import cache_kwarg

    path = BENCH / "hf-opset23" / "model.onnx"
    if path.is_file():
        return path
    print("exporting the HF opset-23 baseline ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    c = model.config
    layers, kv_heads = c.num_hidden_layers, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    class Flat(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache(config=model.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=True, **{cache_kwarg(model): cache})
            return (out.logits, *(t for layer in getattr(out, cache_kwarg(model)).layers for t in (layer.keys, layer.values)))

    past = tuple(torch.zeros(2, kv_heads, 4, head_dim) for _ in range(2 * layers))
    args = (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 7, dtype=torch.int64),
            torch.arange(4, 7).expand(2, 3).contiguous(), past)
    batch, seq, past_len, total = Dim("batch"), Dim("sequence_length"), Dim("past_sequence_length"), Dim("total")
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
              "position_ids": {0: batch, 1: seq}, "past": tuple({0: batch, 2: past_len} for _ in past)}
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    with torch.no_grad():
        program = torch.onnx.export(Flat(), args, dynamic_shapes=shapes, dynamo=True, opset_version=23,
                                    input_names=["input_ids", "attention_mask", "position_ids", *names],
                                    output_names=["logits", *[n.replace("past_key_values", "present") for n in names]])
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    return path


def hf_opset23_step_time(path: Path, batch: int, context: int, threads: int, steps: int) -> float:
    from llmc.runtime.runners.ort import make_session

    session = make_session(path, threads)
    past_inputs = session.get_inputs()[3:]
    past_names = [i.name for i in past_inputs]
    _, kv_heads, _, head_dim = past_inputs[0].shape
    rng = np.random.default_rng(0)
    past = [rng.standard_normal((batch, kv_heads, context, head_dim), dtype=np.float32) * 0.1 for _ in past_names]
    tokens, times = np.full((batch, 1), 42, dtype=np.int64), []
    for k in range(steps + 2):
        start = time.perf_counter()
        n = context + k
        logits, *past = session.run(None, {"input_ids": tokens, "attention_mask": np.ones((batch, n + 1), np.int64),
                                           "position_ids": np.full((batch, 1), n, np.int64),
                                           **dict(zip(past_names, past))})
        tokens = logits[:, -1].argmax(-1)[:, None]
        times.append(time.perf_counter() - start)
    return median(times[2:])


def runner(model, batch: int, capacity: int, threads: int):
    """A slot-shaped runner: OrtRunner for a slot graph, PagedSlots (a run of blocks per row, as the
    quantize stage's quality check drives it) for a paged one."""
    from llmc.runtime.runners.paged_slots import slot_runner

    path, layout = model
    r = slot_runner(path, layout, max_batch=batch, capacity=capacity, num_threads=threads)
    rng = np.random.default_rng(0)
    for buf in r.runner.pools if layout.paged else r.cache.buffers:  # a realistic cache: values do not
        buf[...] = rng.standard_normal(buf.shape).astype(buf.dtype) * 0.1  # matter, but zero pages might
    return r


def step_time(r, batch: int, context: int, steps: int) -> float:
    """Median seconds per greedy decode step with every row `context` tokens deep."""
    tokens = np.full((batch, 1), 42, dtype=np.int64)
    times = []
    for k in range(steps + 2):
        start = time.perf_counter()
        logits = r.step(tokens, np.full(batch, context + k, dtype=np.int64))
        tokens = logits[:, -1].argmax(-1)[:, None]
        times.append(time.perf_counter() - start)
    return median(times[2:])  # two warm-up steps


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


def measure_pass(models: dict, prompt: list[int], threads: int, steps: int, record, p: int) -> None:
    """Every measurement once; each back-to-back pair (llmc/genai) in pass `p`'s turn."""
    fused, reference, genai, hf = models["fused"], models["reference"], models["genai"], models["hf"]
    capacity = CONTEXT + steps + 2
    for b in (1, 8):
        record(f"fused step b{b} (s)", step_time(runner(fused, b, capacity, threads), b, CONTEXT, steps))
        record(f"hf-opset23 step b{b} (s)", hf_opset23_step_time(hf, b, CONTEXT, threads, steps))
        record(f"reference step b{b} (s)", step_time(runner(reference, b, capacity, threads), b, CONTEXT, steps))
        pair = [(f"llmc tok/s b{b}", lambda: llmc_generate(fused, prompt, b, GENAI_NEW, threads)),
                (f"genai tok/s b{b}", lambda: genai_generate(genai, prompt, b, GENAI_NEW))]
        for name, measure in in_turn(pair, p):
            record(name, measure())
    for cap in (256, 8192):
        record(f"fused step cap{cap} (s)", step_time(runner(fused, 1, cap, threads), 1, 128, steps))


def report(runs: dict[str, list[float]], threads: int, json_path: Path) -> None:
    med = medians(runs)

    def paired(numerator: str, denominator: str) -> float:
        return median_ratio(runs[numerator], runs[denominator])

    rows = [
        ("fused in-place vs HF opset-23 concat, ctx 512, b1", paired("hf-opset23 step b1 (s)", "fused step b1 (s)"), 1.1),
        ("fused in-place vs HF opset-23 concat, ctx 512, b8", paired("hf-opset23 step b8 (s)", "fused step b8 (s)"), 1.4),
        ("fused in-place vs llmc reference copy, ctx 512, b1", paired("reference step b1 (s)", "fused step b1 (s)"), None),
        ("fused in-place vs llmc reference copy, ctx 512, b8", paired("reference step b8 (s)", "fused step b8 (s)"), None),
        ("llmc vs onnxruntime-genai decode tok/s, b1", paired("llmc tok/s b1", "genai tok/s b1"), 1.0),
        ("llmc vs onnxruntime-genai decode tok/s, b8", paired("llmc tok/s b8", "genai tok/s b8"), 1.0),
        ("step time cap 256 / cap 8192 (1.0 = equal)", paired("fused step cap256 (s)", "fused step cap8192 (s)"), None),
    ]
    passes = len(next(iter(runs.values())))
    print(f"\nSmolLM2 fp32, {threads} threads, {passes} passes: medians, and medians of per-pass ratios")
    for name, value in sorted(med.items()):
        print(f"  {name:<28} {value:10.4f}")
    for name, ratio, target in rows:
        verdict = "" if target is None else ("  ok" if ratio >= target else f"  BELOW target {target}x")
        print(f"  {name:<52} {ratio:5.2f}x{verdict}")
    write_json(json_path, {"threads": threads, "passes": runs, "medians": med, "ratios": {n: r for n, r, _ in rows}})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--passes", type=int, default=5, help="passes over all measurements (default 5)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"decode steps per timing (default {STEPS})")
    parser.add_argument("--json", type=Path, default=BENCH / "attention.json", help="where to write the results")


def run(args: argparse.Namespace) -> None:
    t = args.threads
    models = {"fused": export_smollm2("fused", t), "reference": export_smollm2("reference", t),
              "genai": genai_build(SMOLLM2, "fp32", BENCH, t)["dir"],
              "hf": hf_opset23_build()}
    prompt = np.random.default_rng(1).integers(100, 40000, GENAI_PROMPT).tolist()
    runs = Runs("10.4f", 28)
    record = runs.record

    for p in range(args.passes):
        print(f"pass {p + 1}/{args.passes}", file=sys.stderr)
        measure_pass(models, prompt, t, args.steps, record, p)
    report(runs, t, args.json)
