"""`build`: run the stages over a spec, reuse what is unchanged, publish the output atomically.

    source -> export -> verify -> quantize -> package        (the TensorRT engine joins as it lands)

Each stage has an inputs hash; when the previous output holds an artifact with the same hash and
intact files, the stage is reused (hard-linked) instead of run. Packaging (links, small files)
always runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from llmc.compiler import output as out
from llmc.compiler.artifacts import ExportedModel, QuantizedModel, VerifyReport
from llmc.compiler.hashing import code_hash, hash_json
from llmc.compiler.source import SourceInfo, inspect_source, load_model
from llmc.compiler.spec import BuildSpec, QuantMode, Target
from llmc.errors import QuantizationError, SpecError, UnsupportedError, VerifyError
from llmc.plugins.lowering import Lowering
from llmc.runtime.manifest import RepositoryManifest

STAGES = ("source", "export", "verify", "quantize", "package")
REPOSITORY_DIR = "model_repository"
# the modules whose code decides each stage's output (part of its cache key)
EXPORT_CODE = ("llmc.compiler.export", "llmc.compiler.decoder", "llmc.compiler.graph_passes",
               "llmc.plugins.attention", "llmc.plugins.lowering", "llmc.runtime.layout")
VERIFY_CODE = ("llmc.compiler.verify", "llmc.runtime.ort_runner")
QUANTIZE_CODE = ("llmc.compiler.quantize", "llmc.compiler.qdq", "llmc.compiler.calibrate", "llmc.compiler.smoothquant",
                 "llmc.compiler.awq",
                 "llmc.compiler.quality",
                 "llmc.compiler.textdata", "llmc.runtime.ort_runner")
BUILD_RECORD = "build.json"


class Reporter(Protocol):
    def stage_started(self, name: str, description: str) -> None: ...
    def stage_progress(self, done: int, total: int) -> None: ...
    def stage_finished(self, result: "StageResult") -> None: ...


class NullReporter:
    def stage_started(self, name: str, description: str) -> None: ...
    def stage_progress(self, done: int, total: int) -> None: ...
    def stage_finished(self, result: "StageResult") -> None: ...


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # "ran" | "cached" | "skipped"
    seconds: float
    summary: str


@dataclass
class BuildResult:
    output: Path
    stages: list[StageResult] = field(default_factory=list)
    exported: ExportedModel | None = None
    verify: VerifyReport | None = None
    quantized: QuantizedModel | None = None
    manifest: RepositoryManifest | None = None

    @property
    def repository(self) -> Path | None:
        return self.output / REPOSITORY_DIR if self.manifest is not None else None


def preflight(spec: BuildSpec, until: str = "verify") -> None:
    """Refuse what this version cannot build before any work is done."""
    if spec.target is Target.tensorrt and until != "export":
        raise UnsupportedError(
            "target: tensorrt can be exported (`llmc export`) but not built in this version of llmc "
            "(the TensorRT engine stage is not implemented yet); use target: onnxruntime"
        )
    if spec.quantization.mode is not QuantMode.none:
        from llmc.compiler.textdata import load_documents

        load_documents(spec.quantization.calibration.data, "quantization.calibration.data")  # fail early
    if spec.quantization.static:
        try:
            import modelopt.onnx.quantization  # noqa: F401
        except ImportError as err:
            raise UnsupportedError(
                f"quantization.mode: {spec.quantization.mode.value} needs NVIDIA ModelOpt's ONNX quantizer "
                f"({err.name} is missing); install llmc with the `quantize` extra") from None


class _Model:
    """The PyTorch model and tokenizer, loaded on first use (cached stages never load them)."""

    def __init__(self, info: SourceInfo):
        self.info, self._loaded = info, None

    def get(self):
        if self._loaded is None:
            self._loaded = load_model(self.info)
        return self._loaded


class _Build:
    def __init__(self, spec: BuildSpec, output: Path, reporter: Reporter, force: set[str]):
        self.spec, self.output, self.reporter, self.force = spec, output, reporter, force
        self.result = BuildResult(output=output)

    def stage(self, name: str, description: str, run) -> None:
        self.reporter.stage_started(name, description)
        start = time.perf_counter()
        status, summary = run()
        res = StageResult(name, status, time.perf_counter() - start, summary)
        self.result.stages.append(res)
        self.reporter.stage_finished(res)

    def reuse(self, name: str, cls, inputs_hash: str, staging: Path):
        if name in self.force:
            return None
        cached = cls.load_cached(self.output / name, inputs_hash)
        if cached is not None:
            out.link_tree(self.output / name, staging / name)
        return cached


def _check_limits(spec: BuildSpec, exported: ExportedModel) -> None:
    limit = exported.model.max_position_embeddings
    if spec.limits.max_seq_len > limit:
        raise SpecError(
            f"limits.max_seq_len ({spec.limits.max_seq_len}) exceeds the model's "
            f"max_position_embeddings ({limit}); lower it to {limit} or less"
        )


def build(spec: BuildSpec, *, output: Path | None = None, until: str = "package", force: set[str] | None = None,
          reporter: Reporter | None = None, external_threshold: int | None = None) -> BuildResult:
    """Build `spec` into `output` (default: the spec's). Stages after `until` are not run; stages
    named in `force` run even when cached."""
    assert until in STAGES, until
    preflight(spec, until)
    output = Path(output or spec.output_dir).absolute()
    b = _Build(spec, output, reporter or NullReporter(), set(force or ()))
    staging = out.make_staging(output)
    try:
        _run_stages(b, staging, until, external_threshold)
        _write_record(b, staging)
        out.publish(staging, output)
    except BaseException:
        out.discard(staging)
        raise
    return b.result


def _run_stages(b: _Build, staging: Path, until: str, external_threshold: int | None) -> None:
    from llmc.compiler import export as export_stage

    spec, state = b.spec, {}

    def source():
        info = inspect_source(spec.source)
        state["info"], state["hash"], state["model"] = info, info.content_hash(), _Model(info)
        if spec.quantization.mode is not QuantMode.none and STAGES.index(until) >= STAGES.index("quantize"):
            _check_quantization_inputs(spec, info)
        return "ran", f"{info.kind} {info.model_type}, {len(info.weight_files)} weight file(s)"

    b.stage("source", f"hashing {spec.source.path.name}", source)
    threshold = external_threshold or export_stage.PROTOBUF_LIMIT
    lowering = Lowering(spec.attention_lowering)
    export_key = hash_json({"stage": "export", "source": state["hash"], "lowering": lowering.value,
                            "precision": spec.precision.value, "versions": export_stage.tool_versions(),
                            "opset": export_stage.OPSET, "external_threshold": threshold,
                            "code": code_hash(*EXPORT_CODE)})

    def export():
        cached = b.reuse("export", ExportedModel, export_key, staging)
        if cached is None:
            model, tokenizer = state["model"].get()
            cached = export_stage.export(model, tokenizer, staging / "export", lowering=lowering,
                                         source_hash=state["hash"], inputs_hash=export_key,
                                         external_threshold=threshold)
            status = "ran"
        else:
            status = "cached"
        b.result.exported = cached
        size = sum((staging / "export" / f).stat().st_size for f in cached.files) / 2**20
        return status, (f"{cached.onnx}, opset {cached.opset}, {cached.model.num_layers} layers, "
                        f"{cached.lowering.value} attention, {size:.1f} MiB")

    b.stage("export", "exporting to ONNX", export)
    _check_limits(spec, b.result.exported)
    if until == "export":
        return
    b.stage("verify", f"PyTorch vs ONNX Runtime ({lowering.value} attention)", lambda: _verify(b, staging, state["model"], state["hash"]))
    if until == "verify":
        return
    b.stage("quantize", f"quantizing ({spec.quantization.mode.value}) and measuring quality",
            lambda: _quantize(b, staging, state["info"], state["hash"]))
    if until == "quantize":
        return
    b.stage("package", "writing the Triton model repository", lambda: _package(b, staging, state["info"]))


def _check_quantization_inputs(spec: BuildSpec, info: SourceInfo) -> None:
    """Before exporting: the tokenizer exists and the calibration text yields a sample (static modes)."""
    from llmc.compiler.source import load_tokenizer

    q = spec.quantization
    tokenizer = load_tokenizer(info)
    if tokenizer is None:
        raise SpecError(f"quantization.mode: {q.mode.value} needs the checkpoint's tokenizer (to measure "
                        f"perplexity on text); {info.path} has none")
    if q.static or (q.weight_only and q.algorithm.value != "rtn"):
        from llmc.compiler.quantize import calibration_windows

        calibration_windows(q, tokenizer)


def _quantize(b: _Build, staging: Path, info: SourceInfo, source_hash: str):
    from llmc.compiler.source import load_tokenizer

    spec, exported = b.spec, b.result.exported
    q = spec.quantization
    if q.mode is QuantMode.none:
        return "skipped", "quantization.mode is none"
    import onnxruntime

    key = hash_json({"stage": "quantize", "export": exported.files, "code": code_hash(*QUANTIZE_CODE),
                     "quantization": q.model_dump(mode="json", exclude={"max_perplexity_increase"}),
                     "onnxruntime": onnxruntime.__version__, "modelopt": _modelopt_version() if q.static else None})
    art = b.reuse("quantize", QuantizedModel, key, staging)
    status = "cached"
    if art is None:
        from llmc.compiler.quantize import quantize

        tokenizer = load_tokenizer(info)
        previous = b.output / "quantize"
        art = quantize(exported, staging / "export", staging / "quantize", q, tokenizer, inputs_hash=key,
                       num_threads=spec.serving.num_threads, previous=previous if previous.is_dir() else None,
                       progress=b.reporter.stage_progress)
        status = "ran"
    b.result.quantized = art
    r = art.report
    summary = (f"{art.mode.value}: perplexity {r.perplexity_reference:.2f} -> {r.perplexity_quantized:.2f} "
               f"({r.perplexity_increase:+.1%}), greedy agreement {r.token_agreement:.0%}, "
               f"{_mib(r.size_reference_mib)} -> {_mib(r.size_quantized_mib)} MiB, decode "
               f"{r.decode_tok_s_quantized / r.decode_tok_s_reference:.1f}x")
    check_quality_gate(r, q.max_perplexity_increase)
    return status, summary


def _modelopt_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("nvidia-modelopt")


def check_quality_gate(report, limit: float) -> None:
    if report.perplexity_increase > limit:
        raise QuantizationError(
            f"quality gate: perplexity rose {report.perplexity_increase:.1%} ({report.perplexity_reference:.3f} -> "
            f"{report.perplexity_quantized:.3f}), above quantization.max_perplexity_increase ({limit:.1%}); raise "
            "the limit, or use a mode with more bits or a smaller block_size")


def _mib(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


def _package(b: _Build, staging: Path, info: SourceInfo):
    from llmc.compiler.package import package

    exported = b.result.exported
    if not exported.model.has_tokenizer:
        return "skipped", "the checkpoint has no tokenizer, so there is no text to serve"
    engine = b.result.quantized or exported
    engine_dir = staging / ("quantize" if b.result.quantized else "export")
    b.result.manifest = package(b.spec, exported, engine, engine_dir, info, staging / REPOSITORY_DIR)
    lim = b.result.manifest.limits
    return "ran", (f"{REPOSITORY_DIR}/{b.spec.name}: {lim.max_batch_size} KV slots x {lim.max_seq_len} tokens, "
                   f"queue {lim.max_queue_size}")


def _verify(b: _Build, staging: Path, model: _Model, source_hash: str):
    from llmc.compiler import verify as verify_stage

    spec, exported = b.spec, b.result.exported
    if not spec.verify.enabled:
        return "skipped", "verify.enabled is false"
    import onnxruntime

    key = hash_json({"stage": "verify", "source": source_hash, "export": exported.files, "verify": spec.section_hash("verify"),
                     "code": code_hash(*VERIFY_CODE),
                     "onnxruntime": onnxruntime.__version__})
    report = b.reuse("verify", VerifyReport, key, staging)
    status = "cached"
    if report is None:
        torch_model, tokenizer = model.get()
        report = verify_stage.verify(
            exported, staging / "export", torch_model, tokenizer, staging / "verify", inputs_hash=key,
            steps=spec.verify.decode_steps, tolerance=spec.verify.max_logit_diff,
            num_threads=spec.serving.num_threads, progress=b.reporter.stage_progress)
        status = "ran"
    b.result.verify = report
    summary = verify_summary(report)
    if not report:
        raise VerifyError(f"verification failed: {summary}\n"
                          + "\n".join(f"  {c.name}: {c.token_agreement:.1%} tokens equal, first divergence "
                                      f"{c.first_divergence}, max |Δlogit| {c.max_abs_logit_diff:.2e}"
                                      for c in report.cases))
    return status, summary


def verify_summary(report: VerifyReport) -> str:
    steps = report.cases[0].decode_steps
    agree = min(c.token_agreement for c in report.cases)
    verdict = "greedy tokens equal" if agree == 1.0 else f"greedy tokens {agree:.1%} equal"
    batches = " + ".join(f"batch {c.batch}" for c in report.cases)
    return (f"{verdict} over {steps} steps ({batches}), max |Δlogit| "
            f"{report.max_abs_logit_diff:.1e} (tolerance {report.tolerance:.0e})")


def _write_record(b: _Build, staging: Path) -> None:
    import json

    import llmc

    record = {
        "name": b.spec.name, "llmc": llmc.__version__, "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "spec": b.spec.model_dump(mode="json"),
        "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3), "summary": s.summary}
                   for s in b.result.stages],
    }
    (staging / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
