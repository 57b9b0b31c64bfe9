"""Quantization benchmark, every ratio measured within one run:

    .venv/bin/python -m llmc.bench quantization [--threads 2] [--passes 3] [--static] [--int4-blocks 64,128]
        [--llama-cpp] [--model models/smollm2] [--out build/bench] [--prompt-tokens 128] [--new-tokens 64]

Batch-1 decode tokens/s of SmolLM2 through llmc's runner (same prompt of 128 tokens, 64 new
tokens, greedy) for llmc's fp32, int8-weight-only and int4-weight-only builds of the example's
default graph (paged: driven through PagedSlots, as the quantize stage's quality check drives it;
a slot graph through OrtRunner), and through
onnxruntime-genai's `generate()` on its own int8 and int4 CPU builds of the same checkpoint. Each
pass measures everything once (llmc/genai order alternating); ratios are medians of per-pass
ratios. Perplexity increases come from each llmc build's quality report, and for onnxruntime-genai's
builds from the same held-out windows (relative to llmc's fp32 graph). Builds go to build/bench/
and are reused while unchanged. Writes build/bench/quantization.json. `--static` adds the quality
reports of the TensorRT Q/DQ modes (int8 with SmoothQuant, fp8), built after the timed passes; `--int4-blocks`
those of llmc's int4 at other block sizes; `--llama-cpp` the perplexity of llama.cpp's Q8_0 and Q4_0 of the
checkpoint on the same windows (quality at matched bits: what a speed ratio against llama.cpp is worth).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from llmc.bench.builds import BENCH, SMOLLM2, example_data
from llmc.bench.engine.attention import llmc_generate
from llmc.bench.harness import Runs, in_turn, median_ratio, medians, write_json
from llmc.bench.peers import genai_build, genai_generate

PROMPT, NEW = 128, 64
TARGETS = {"int8": (2.0, 1.0, 0.03), "int4": (3.0, 1.0, 0.15)}  # x fp32, x genai, max perplexity increase
STATIC = {"int8": {"smoothquant": True}, "fp8": {}}  # --static: the TensorRT Q/DQ modes


def llmc_quantized(mode: str, threads: int, source: Path = SMOLLM2, out: Path = BENCH, **quantization):
    """The example's spec (its default graph) built from `source` into `out`: mode "none" is the fp32
    export (report None), any other mode its quantized graph and quality report."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    data = example_data()
    data.update(name=f"smollm2-{mode}", source=str(source),
                quantization={"mode": mode, "max_perplexity_increase": 10.0, **quantization})
    data["serving"]["num_threads"] = threads
    data["verify"]["enabled"] = False  # the fp32 export is verified by the example build
    folder = out / f"smollm2-{mode}"
    if mode == "none":
        e = build(parse_spec(data), output=folder, until="export").exported
        return (folder / "export" / e.onnx, e.kv_layout), None
    q = build(parse_spec(data), output=folder, until="quantize").quantized
    return (folder / "quantize" / q.onnx, q.kv_layout), q.report


def heldout_windows(source: Path = SMOLLM2) -> list[np.ndarray]:
    """The held-out token windows llmc's quality report measures perplexity on, tokenized by `source`'s tokenizer."""
    from transformers import AutoTokenizer

    from llmc.compiler.quantize import EVAL_SEQ_LEN, EVAL_WINDOWS
    from llmc.compiler.textdata import builtin_documents, token_windows

    tokenizer = AutoTokenizer.from_pretrained(source)
    return token_windows(tokenizer, builtin_documents("heldout"), EVAL_SEQ_LEN, EVAL_WINDOWS, "eval", "held-out")


def perplexity(windows: list[np.ndarray], logits_of) -> float:
    """exp(mean next-token negative log-likelihood over the windows), `logits_of(ids)` giving at least [len(ids),
    vocab]: as the quality report computes it (quality.next_token_nll)."""
    import math

    from llmc.compiler.quantize.quality import next_token_nll

    nll = sum(next_token_nll(np.asarray(logits_of(ids))[: len(ids)], ids) for ids in windows)
    return math.exp(nll / sum(len(ids) - 1 for ids in windows))


def genai_perplexity(model_dir: Path, source: Path = SMOLLM2) -> float:
    """Perplexity of an onnxruntime-genai build on the held-out windows llmc's quality report uses."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))

    def logits_of(ids):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids[None].astype(np.int32))
        return np.asarray(gen.get_output("logits"))[0]  # [tokens, vocab] after the prefill

    return perplexity(heldout_windows(source), logits_of)


def llama_cpp_perplexity(gguf: Path, source: Path = SMOLLM2, threads: int = 2) -> float:
    """Perplexity of a llama.cpp GGUF (llama-cpp-python, every position's logits) on the same held-out windows."""
    import llama_cpp

    windows = heldout_windows(source)
    context = max(len(w) for w in windows) + 8
    llm = llama_cpp.Llama(str(gguf), n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                          n_threads=threads, verbose=False)

    def logits_of(ids):
        llm.reset()
        llm.eval([int(i) for i in ids])
        return llm.scores

    try:
        return perplexity(windows, logits_of)
    finally:
        llm.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--passes", type=int, default=3, help="passes over all measurements (default 3)")
    parser.add_argument("--json", type=Path, help="where to write the results (default OUT/quantization.json)")
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="the checkpoint (default models/smollm2)")
    parser.add_argument("--out", type=Path, default=BENCH, help="where the builds go (default build/bench)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT, help=f"prompt length (default {PROMPT})")
    parser.add_argument("--new-tokens", type=int, default=NEW, help=f"tokens generated a pass (default {NEW})")
    parser.add_argument("--no-genai", action="store_true", help="llmc's builds only (no onnxruntime-genai peer)")
    parser.add_argument("--static", action="store_true",
                        help="also build the TensorRT Q/DQ modes (int8 with SmoothQuant, fp8) and print their quality "
                             "reports (ONNX Runtime runs them only as a reference path, so no speed targets)")
    parser.add_argument("--int4-blocks", default="",
                        help="also build llmc's int4 in these blocks (comma-separated, e.g. 64,128) and print their "
                             "quality reports")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also convert the checkpoint with llama.cpp (Q8_0, Q4_0; needs llama-cpp-python and "
                             "LLAMA_CPP_CONVERT) and print their perplexity on the same held-out windows")


def run(args: argparse.Namespace) -> None:
    t, src, out, new = args.threads, args.model, args.out, args.new_tokens
    models = {"fp32": llmc_quantized("none", t, src, out)[0]}
    reports = {}
    for bits in ("int8", "int4"):
        models[bits], reports[bits] = llmc_quantized(f"{bits}-weight-only", t, src, out)
    genai = {} if args.no_genai else {bits: genai_build(src, bits, out, t)["dir"] for bits in ("int8", "int4")}
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    prompt = np.random.default_rng(1).integers(min(100, vocab // 2), min(40000, vocab), args.prompt_tokens).tolist()
    runs = Runs("8.1f", 22)
    record = runs.record

    for p in range(args.passes):
        print(f"pass {p + 1}/{args.passes}", file=sys.stderr)
        record("llmc fp32 tok/s", llmc_generate(models["fp32"], prompt, 1, new, t))
        for bits in ("int8", "int4"):
            pair = [(f"llmc {bits} tok/s", lambda: llmc_generate(models[bits], prompt, 1, new, t)),
                    (f"genai {bits} tok/s", lambda: genai_generate(genai[bits], prompt, 1, new))][:1 + bool(genai)]
            for name, measure in in_turn(pair, p):
                record(name, measure())

    med = medians(runs)
    graph = "paged" if models["fp32"][1].paged else "slot"
    print(f"\n{src.name} ({graph} graph) batch-1 decode, {t} threads, {args.passes} passes: medians")
    for name, value in med.items():
        print(f"  {name:<22} {value:8.1f}")
    weights = sum(f.stat().st_size for f in models["fp32"][0].parent.iterdir() if f.suffix != ".json")
    print(f"  (fp32 decode reads {weights * med['llmc fp32 tok/s'] / 1e9:.0f} GB/s of weights here: the faster the "
          "host's memory, the lower the quantized modes' ratios to fp32)")
    rows = {bits: _targets(bits, runs, reports[bits], genai.get(bits), src) for bits in TARGETS}
    if args.static:
        rows |= _static(t, src, out)
    if args.int4_blocks:
        rows |= _int4_blocks([int(b) for b in args.int4_blocks.split(",")], t, src, out)
    if args.llama_cpp:
        rows |= _llama_cpp_quality(src, out, t, reports["int4"].perplexity_reference)
    write_json(args.json or out / "quantization.json",
               {"graph": graph, "threads": t, "passes": runs, "medians": med, "ratios": rows})


def _targets(bits: str, runs: dict, report, genai_dir: Path | None, src: Path) -> dict:
    """One weight-only mode against its targets (TARGETS: x fp32, x genai, perplexity), printed; its row."""
    x_fp32, x_genai, max_ppl = TARGETS[bits]
    row = {"vs fp32": median_ratio(runs[f"llmc {bits} tok/s"], runs["llmc fp32 tok/s"]),
           "perplexity increase": report.perplexity_increase}
    checks = [(row["vs fp32"] >= x_fp32, f"{row['vs fp32']:.2f}x fp32 (target {x_fp32}x)")]
    if genai_dir:
        # the same held-out windows, llmc's fp32 as the reference
        peer = genai_perplexity(genai_dir, src) / report.perplexity_reference - 1.0
        row.update({"vs genai": median_ratio(runs[f"llmc {bits} tok/s"], runs[f"genai {bits} tok/s"]),
                    "genai perplexity increase": peer})
        checks.append((row["vs genai"] >= x_genai, f"{row['vs genai']:.2f}x genai {bits} (target {x_genai}x)"))
    checks.append((report.perplexity_increase <= max_ppl,
                   f"perplexity {report.perplexity_increase:+.1%} (target <= {max_ppl:.0%})"))
    print(f"  {bits}-weight-only: " + ", ".join(f"{text} {'ok' if ok else 'MISSED'}" for ok, text in checks))
    if genai_dir:
        print(f"    (onnxruntime-genai's {bits} build on the same held-out text: perplexity {peer:+.1%})")
    return row


def _static(threads: int, src: Path, out: Path) -> dict:
    """--static: the TensorRT Q/DQ modes' quality reports, printed; their rows."""
    rows = {}
    for mode, extra in STATIC.items():
        r = llmc_quantized(mode, threads, src, out, **extra)[1]
        rows[mode] = {"perplexity increase": r.perplexity_increase, "greedy agreement": r.token_agreement,
                      "size MiB": r.size_quantized_mib}
        print(f"  {mode} ({', '.join(f'{k} {v}' for k, v in extra.items()) or 'max calibration'}): perplexity "
              f"{r.perplexity_reference:.2f} -> {r.perplexity_quantized:.2f} ({r.perplexity_increase:+.1%}), greedy "
              f"agreement {r.token_agreement:.0%}, {r.size_reference_mib:.0f} -> {r.size_quantized_mib:.0f} MiB")
    return rows


def _int4_blocks(blocks: list[int], threads: int, src: Path, out: Path) -> dict:
    """--int4-blocks: llmc's int4 quality report at each block size, printed; their rows."""
    rows = {}
    for block in blocks:
        r = llmc_quantized("int4-weight-only", threads, src, out / f"int4-b{block}", block_size=block)[1]
        rows[f"int4 b{block}"] = {"perplexity increase": r.perplexity_increase, "greedy agreement": r.token_agreement,
                                  "size MiB": r.size_quantized_mib}
        print(f"  int4-weight-only in blocks of {block}: perplexity {r.perplexity_increase:+.1%}, greedy agreement "
              f"{r.token_agreement:.0%}, {r.size_quantized_mib:.0f} MiB")
    return rows


def _llama_cpp_quality(src: Path, out: Path, threads: int, reference: float) -> dict:
    """--llama-cpp: llama.cpp's Q8_0 and Q4_0 of the checkpoint, perplexity on the held-out windows relative to
    llmc's fp32 graph's there, printed; their rows."""
    from llmc.bench.peers import llama_cpp_build, llama_cpp_missing

    if missing := llama_cpp_missing():
        print(f"  llama.cpp: not measured: {missing}")
        return {}
    rows = {}
    for mode, kind in (("int8", "Q8_0"), ("int4", "Q4_0")):
        gguf = llama_cpp_build(src, mode, out / "llama-cpp")["gguf"]
        increase = llama_cpp_perplexity(gguf, src, threads) / reference - 1.0
        rows[f"llama.cpp {kind}"] = {"perplexity increase": increase, "size MiB": gguf.stat().st_size / 2**20}
        print(f"  llama.cpp {kind}: perplexity {increase:+.1%}, {gguf.stat().st_size / 2**20:.0f} MiB")
    return rows
