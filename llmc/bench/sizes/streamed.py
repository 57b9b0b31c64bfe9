"""Streamed builds: peak memory and time of `source.load: layers` against `whole`, at one width and two depths.

    .venv/bin/python -m llmc.bench streamed [--hidden 2048] [--intermediate 8192] [--vocab 49152]
        [--layers 4,16] [--loads whole,layers] [--quantization none] [--out build/bench/streamed]

A random Llama of the given width, bf16 in shards of 1 GB as checkpoints are published, is built (export, verify,
quantize when asked, package) once per depth and load, each in its own process: wall time and peak memory (the
process tree's resident set, and its anonymous part, sampled every 50 ms: builds.timed_build), beside
`--dry-run`'s estimate. Printed: each build, layers against whole at each depth, and the deepest against the
shallowest for each load (1.0: flat in depth). Writes OUT/streamed.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from llmc.bench.builds import BENCH, timed_build
from llmc.bench.checkpoints import TOKENIZER, grown_tokenizer
from llmc.bench.harness import write_json

OUT = BENCH / "streamed"
GiB = 2**30


def add_arguments(p) -> None:
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--layers", default="4,16", help="depths, comma-separated")
    p.add_argument("--loads", default="whole,layers", help="source.load values, comma-separated")
    p.add_argument("--quantization", default="none", help="quantization.mode of the builds")
    p.add_argument("--out", type=Path, default=OUT)


def checkpoint(root: Path, hidden: int, intermediate: int, vocab: int, layers: int) -> Path:
    """A random Llama of that shape in bf16 shards (written once; norms away from 1)."""
    out = root / f"llama-h{hidden}-i{intermediate}-v{vocab}-l{layers}"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    heads = max(hidden // 64, 1)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(heads // 4, 1), head_dim=64, tie_word_embeddings=True,
                                      max_position_embeddings=8192, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    partial = root / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="1GB")
    (partial / "tokenizer.json").write_text(json.dumps(grown_tokenizer(vocab)))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, partial / name)
    partial.rename(out)
    return out


def measured_build(source: Path, load: str, quantization: str, root: Path) -> dict:
    from llmc.compiler import load_spec, plan_build

    name = f"{source.name}-{load}-{quantization}"
    spec = root / f"{name}.yaml"
    lines = [f"name: {name}", "source:", f"  path: {source}", f"  load: {load}", "limits:", "  max_batch_size: 4"]
    if quantization != "none":
        lines += ["quantization:", f"  mode: {quantization}"]
    spec.write_text("\n".join(lines) + "\n")
    plan = plan_build(load_spec(spec))
    log = root / f"{name}.log"
    wall, peak, anonymous = timed_build([sys.executable, "-m", "llmc.bench.sizes.streamed", str(spec),
                                         str(root / name)], log)
    shutil.rmtree(root / name, ignore_errors=True)  # the graphs: GBs each
    stages = next(json.loads(line[len(STAGES):]) for line in log.read_text().splitlines() if line.startswith(STAGES))
    return {"load": load, "build_s": wall, "peak_gib": peak / GiB, "peak_anonymous_gib": anonymous / GiB,
            "estimate_gib": plan.build_peak_bytes / GiB, "stages": stages,
            "stage_estimates_gib": {s: b / GiB for s, b in plan.stage_peak_bytes.items()}}


STAGES = "STAGES "  # the build process's last line: each stage's seconds and peak resident memory


class _StagePeaks:
    """A build's reporter recording each stage's own peak resident memory: the process's high-water mark
    (VmHWM) reset as the stage starts (Linux: /proc/self/clear_refs) and read as it ends."""

    def __init__(self) -> None:
        self.stages: dict[str, dict] = {}

    def stage_started(self, name: str, description: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def stage_progress(self, done: int, total: int, what: str = "") -> None: ...

    def stage_finished(self, result) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        self.stages[result.name] = {"status": result.status, "seconds": round(result.seconds, 1),
                                    "peak_gib": int(status["VmHWM"].split()[0]) * 1024 / GiB}


def _build(spec: Path, out: Path) -> None:
    """The measured build, in this process: `python -m llmc.bench.sizes.streamed SPEC OUT`."""
    from llmc.compiler import build, load_spec

    reporter = _StagePeaks()
    build(load_spec(spec), output=out, force={"export", "verify", "quantize", "package"}, reporter=reporter)
    print(STAGES + json.dumps(reporter.stages), flush=True)


def run(args) -> int:
    depths = [int(d) for d in args.layers.split(",")]
    loads = args.loads.split(",")
    args.out = args.out.resolve()  # the specs name the checkpoint by this path, from their own folder
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for depth in depths:
        source = checkpoint(args.out / "checkpoints", args.hidden, args.intermediate, args.vocab, depth)
        for load in loads:
            r = results.setdefault(str(depth), {})[load] = measured_build(source, load, args.quantization, args.out)
            print(f"{depth} layers, load {load}: {r['build_s']:.0f} s, peak {r['peak_gib']:.2f} GiB "
                  f"(anonymous {r['peak_anonymous_gib']:.2f}; dry run {r['estimate_gib']:.2f}); by stage: "
                  + ", ".join(f"{name} {st['peak_gib']:.2f} GiB (dry run "
                              f"{r['stage_estimates_gib'].get(name, 0):.2f}) {st['seconds']:.0f} s"
                              for name, st in r["stages"].items() if st["status"] == "ran"), flush=True)
    ratios = {}
    for depth, by_load in results.items():
        if {"whole", "layers"} <= set(by_load):
            layers, whole = by_load["layers"]["peak_gib"], by_load["whole"]["peak_gib"]
            ratios[f"{depth} layers: layers / whole peak"] = layers / whole
    for load in loads:
        if len(depths) > 1:
            deep, shallow = results[str(max(depths))][load], results[str(min(depths))][load]
            ratios[f"{load}: {max(depths)} / {min(depths)} layers peak"] = deep["peak_gib"] / shallow["peak_gib"]
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    write_json(args.out / "streamed.json", {"shape": {"hidden": args.hidden, "intermediate": args.intermediate,
                                                      "vocab": args.vocab}, "quantization": args.quantization,
                                            "builds": results, "ratios": ratios})
    return 0


if __name__ == "__main__":
    _build(Path(sys.argv[1]), Path(sys.argv[2]))
