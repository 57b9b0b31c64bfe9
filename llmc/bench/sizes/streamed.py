"""Streamed builds: peak memory and time of `source.load: layers` against `whole`, at one width and two depths.

    .venv/bin/python -m llmc.bench streamed [--hidden 2048] [--intermediate 8192] [--vocab 49152]
        [--shape llama-3.1-8b] [--layers 4,16] [--loads whole,layers] [--quantization none] [--algorithm awq]
        [--gguf q8_0|q4_0] [--out build/bench/streamed]

A random Llama of the given width (or `--shape`: a published model's exact config, from
llmc.bench.checkpoints.SHAPES, at the given depths), bf16 in shards as checkpoints are published (written a tensor
at a time: an 8B checkpoint is made in the memory of its largest tensor), is built (export, verify, quantize when
asked, package) once per depth and load, each in its own process: wall time and peak memory (the process tree's
resident set, and its anonymous part, sampled every 50 ms: builds.timed_build) and its disk (the output file
system's free space taken at the most, sampled as often, the build's and each stage's: run it on a disk nothing else
writes to), beside `--dry-run`'s estimates. `--gguf TYPE`: the builds read a GGUF of that checkpoint instead,
converted by llama.cpp (llama-cpp-python and its sdist's converter, LLAMA_CPP_CONVERT: peers.llama_cpp_build, made
once beside the checkpoint), as a user building from a published GGUF would (at 8B: `--shape llama-3-8b`; llmc
refuses a Llama 3.1 GGUF, whose RoPE scaling llama.cpp stores as a tensor transformers' reader drops). Printed: each
build, layers against whole at each depth, and the deepest against the shallowest for each load (1.0: flat in
depth). Writes OUT/streamed.json.
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
GGUF_TYPES = {"q8_0": "int8", "q4_0": "int4"}  # --gguf: peers.llama_cpp_build's mode that writes it
SHARD_BYTES = 2 * 10**9  # a written shard at most (published 8B checkpoints: 5 GB; 2 GB holds less while writing)


def add_arguments(p) -> None:
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--shape", default=None, help="a published model's shape (llmc.bench.checkpoints.SHAPES), at the "
                                                 "depths of --layers; overrides --hidden, --intermediate, --vocab")
    p.add_argument("--layers", default="4,16", help="depths, comma-separated")
    p.add_argument("--loads", default="whole,layers", help="source.load values, comma-separated")
    p.add_argument("--quantization", default="none", help="quantization.mode of the builds")
    p.add_argument("--algorithm", choices=("awq", "rtn"), default="awq",
                   help="quantization.algorithm of the weight-only builds (rtn: round to nearest, no calibration)")
    p.add_argument("--gguf", choices=sorted(GGUF_TYPES), default=None,
                   help="build from the checkpoint converted to a GGUF of this type by llama.cpp (needs "
                        "llama-cpp-python and LLAMA_CPP_CONVERT), not from its safetensors")
    p.add_argument("--out", type=Path, default=OUT)


def checkpoint(root: Path, fields: dict, name: str) -> Path:
    """A random checkpoint of the config `fields` (config.json's, with `model_type`) in bf16 shards of at most
    2 GB, written once under `root/name`: each tensor drawn (seed 0: N(0, 0.02), norms U(0.5, 1.5), away from 1)
    and written as its shard fills, so no more than a shard is ever in memory."""
    out = root / name
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    from llmc.bench.checkpoints import config as make_config

    cfg = make_config(name, fields)
    with init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = root / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    written: list[list[str]] = []  # each shard's tensor names, as written
    shard: dict = {}  # the shard filling

    def flush() -> None:
        save_file(shard, partial / f"model-{len(written) + 1:05d}.safetensors", metadata={"format": "pt"})
        written.append(list(shard))
        shard.clear()

    for pname, p in skeleton.state_dict().items():
        if cfg.tie_word_embeddings and pname == "lm_head.weight":
            continue
        if shard and sum(t.nbytes for t in shard.values()) + p.numel() * 2 > SHARD_BYTES:
            flush()
        if "norm" in pname:
            value = torch.rand(p.shape, generator=generator) + 0.5
        else:
            value = torch.randn(p.shape, generator=generator) * 0.02
        shard[pname] = value.to(torch.bfloat16)
    flush()
    weight_map = {}
    for i, names in enumerate(written, 1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        (partial / f"model-{i:05d}.safetensors").rename(partial / final)
        weight_map.update({n: final for n in names})
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.architectures = [type(skeleton).__name__]  # as a published config.json names it (llama.cpp's converter
    # reads the architecture from it; a model's save_pretrained writes it, a config's alone does not)
    cfg.save_pretrained(partial)
    (partial / "tokenizer.json").write_text(json.dumps(grown_tokenizer(cfg.vocab_size)))
    for file in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / file, partial / file)
    partial.rename(out)
    return out


def shape_fields(args, layers: int) -> tuple[dict, str]:
    """The config fields of the benchmark's model at `layers` layers, and its checkpoint's name."""
    from llmc.bench.checkpoints import SHAPES

    if args.shape:
        if args.shape not in SHAPES:
            raise SystemExit(f"--shape {args.shape}: not one of {', '.join(sorted(SHAPES))}")
        return {**SHAPES[args.shape], "num_hidden_layers": layers}, f"{args.shape}-l{layers}"
    heads = max(args.hidden // 64, 1)
    return ({"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": args.intermediate,
             "vocab_size": args.vocab, "num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": max(heads // 4, 1), "head_dim": 64, "tie_word_embeddings": True,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5},
            f"llama-h{args.hidden}-i{args.intermediate}-v{args.vocab}-l{layers}")


def gguf_source(checkpoint: Path, kind: str) -> Path:
    """`checkpoint` as a GGUF of `kind` (GGUF_TYPES), written by llama.cpp beside it once."""
    from llmc.bench.peers import llama_cpp_build, llama_cpp_missing

    missing = llama_cpp_missing()
    if missing:
        raise SystemExit(f"--gguf {kind}: {missing}")
    root = checkpoint.parent / f"{checkpoint.name}-gguf"
    root.mkdir(exist_ok=True)
    return llama_cpp_build(checkpoint, GGUF_TYPES[kind], root)["gguf"]


def measured_build(source: Path, load: str, quantization: str, root: Path, label: str | None = None,
                   algorithm: str = "awq") -> dict:
    """`source` built with `load` and `quantization` (weight-only: by `algorithm`) in a process of its own (named
    `label`, default the source's name), measured; its graphs deleted after."""
    from llmc.compiler import load_spec, plan_build

    name = f"{label or source.name}-{load}-{quantization}" + (f"-{algorithm}" if algorithm != "awq" else "")
    spec = root / f"{name}.yaml"
    lines = [f"name: {name}", "source:", f"  path: {source}", f"  load: {load}", "limits:", "  max_batch_size: 4"]
    if quantization != "none":
        lines += ["quantization:", f"  mode: {quantization}"] + ([f"  algorithm: {algorithm}"] if algorithm != "awq" else [])
    spec.write_text("\n".join(lines) + "\n")
    plan = plan_build(load_spec(spec), root / name)
    log = root / f"{name}.log"
    wall, peak, anonymous = timed_build([sys.executable, "-m", "llmc.bench.sizes.streamed", str(spec),
                                         str(root / name)], log)
    built = _built(root / name)
    kept = _kept(root / name)
    shutil.rmtree(root / name, ignore_errors=True)  # the graphs: GBs each
    stages = next(json.loads(line[len(STAGES):]) for line in log.read_text().splitlines() if line.startswith(STAGES))
    return {"load": load, "build_s": wall, "peak_gib": peak / GiB, "peak_anonymous_gib": anonymous / GiB,
            "estimate_gib": plan.build_peak_bytes / GiB, "stages": stages,
            "stage_estimates_gib": {s: b / GiB for s, b in plan.stage_peak_bytes.items()},
            "stage_estimates_s": plan.stage_seconds,
            "disk_gib": max(st["disk_gib"] for st in stages.values()),  # the stages' sampler: the build's whole run
            "disk_estimate_gib": plan.disk.peak_bytes / GiB, "disk_kept_gib": kept / GiB,
            "disk_kept_estimate_gib": plan.disk.kept_bytes / GiB, **built}


def _kept(out: Path) -> int:
    """The bytes a build left in its output (each file once: the repository hard-links the graph it serves)."""
    seen, total = set(), 0
    for path in out.rglob("*"):
        st = path.lstat()
        if path.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _built(out: Path) -> dict:
    """What the build's own reports say of the model it made: verify's verdict, and the quantized graph's quality
    and batch-1 decode speed (the quality report measures it on this host)."""
    from llmc.compiler.artifacts import QuantizedModel, VerifyReport

    found = {}
    if (out / "verify" / VerifyReport.filename).is_file():
        report = VerifyReport.load(out / "verify")
        found["verify"] = {"passed": report.passed, "max_abs_logit_diff": report.max_abs_logit_diff,
                           "token_agreement": min(c.token_agreement for c in report.cases)}
    if (out / "quantize" / QuantizedModel.filename).is_file():
        r = QuantizedModel.load(out / "quantize").report
        found["quality"] = {"perplexity_increase": r.perplexity_increase, "token_agreement": r.token_agreement,
                            "decode_tok_s": r.decode_tok_s_quantized, "size_mib": r.size_quantized_mib}
    return found


STAGES = "STAGES "  # the build process's last line: each stage's seconds and peak resident memory


class _StagePeaks:
    """A build's reporter recording each stage's own peak resident memory: the process's high-water mark
    (VmHWM) reset as the stage starts (Linux: /proc/self/clear_refs) and read as it ends; and the disk the build
    holds at each stage's most (the free space of `disk`'s file system taken since the build started, sampled
    every 50 ms)."""

    def __init__(self, disk: Path) -> None:
        import threading

        self.stages: dict[str, dict] = {}
        self._disk, self._start = disk, shutil.disk_usage(disk).free
        self._taken, self._done = 0, threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self._taken = max(self._taken, self._start - shutil.disk_usage(self._disk).free)

    def stage_started(self, name: str, description: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")
        self._taken = self._start - shutil.disk_usage(self._disk).free

    def stage_progress(self, done: int, total: int, what: str = "") -> None: ...

    def stage_finished(self, result) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        self.stages[result.name] = {"status": result.status, "seconds": round(result.seconds, 1),
                                    "peak_gib": int(status["VmHWM"].split()[0]) * 1024 / GiB,
                                    "disk_gib": self._taken / GiB}

    def close(self) -> None:
        self._done.set()
        self._sampler.join()


def _build(spec: Path, out: Path) -> None:
    """The measured build, in this process: `python -m llmc.bench.sizes.streamed SPEC OUT`."""
    import signal

    from llmc.compiler import build, load_spec

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped run unwinds: no staging or segments left
    reporter = _StagePeaks(out.parent)
    try:
        build(load_spec(spec), output=out, force={"export", "verify", "quantize", "package"}, reporter=reporter)
    finally:
        reporter.close()
    print(STAGES + json.dumps(reporter.stages), flush=True)


def run(args) -> int:
    depths = [int(d) for d in args.layers.split(",")]
    loads = args.loads.split(",")
    args.out = args.out.resolve()  # the specs name the checkpoint by this path, from their own folder
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for depth in depths:
        source = checkpoint(args.out / "checkpoints", *shape_fields(args, depth))
        label = source.name
        if args.gguf:
            source, label = gguf_source(source, args.gguf), f"{label}-{args.gguf}"
        for load in loads:
            r = results.setdefault(str(depth), {})[load] = measured_build(source, load, args.quantization, args.out,
                                                                          label, args.algorithm)
            quality = r.get("quality")
            print(f"{depth} layers, load {load}: {r['build_s']:.0f} s (dry run "
                  f"{sum(r['stage_estimates_s'].values()):.0f}), peak {r['peak_gib']:.2f} GiB "
                  f"(anonymous {r['peak_anonymous_gib']:.2f}; dry run {r['estimate_gib']:.2f}); by stage: "
                  + ", ".join(f"{name} {st['peak_gib']:.2f} GiB (dry run "
                              f"{r['stage_estimates_gib'].get(name, 0):.2f}) {st['seconds']:.0f} s"
                              for name, st in r["stages"].items() if st["status"] == "ran")
                  + f"; disk {r['disk_gib']:.2f} GiB at the peak (dry run {r['disk_estimate_gib']:.2f}), "
                  f"{r['disk_kept_gib']:.2f} left (dry run {r['disk_kept_estimate_gib']:.2f}); by stage: "
                  + ", ".join(f"{name} {st['disk_gib']:.2f}" for name, st in r["stages"].items() if st["status"] == "ran")
                  + (f"; verify {'passed' if r['verify']['passed'] else 'FAILED'}" if "verify" in r else "")
                  + (f"; quantized perplexity {quality['perplexity_increase']:+.1%}, batch-1 decode "
                     f"{quality['decode_tok_s']:.1f} tok/s" if quality else ""), flush=True)
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
    shape = args.shape or {"hidden": args.hidden, "intermediate": args.intermediate, "vocab": args.vocab}
    write_json(args.out / "streamed.json", {"shape": shape, "quantization": args.quantization,
                                            "algorithm": args.algorithm, "gguf": args.gguf,
                                            "builds": results, "ratios": ratios})
    return 0


if __name__ == "__main__":
    _build(Path(sys.argv[1]), Path(sys.argv[2]))
