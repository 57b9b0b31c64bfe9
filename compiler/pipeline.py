"""`build`: run the stages over a spec, reuse what is unchanged, publish the output atomically.

    source -> export -> verify -> quantize -> engine -> package

`engine` runs for target: tensorrt only (on a machine with TensorRT and a GPU); `verify` is skipped
for the plugin lowering, which only TensorRT runs (the engine stage compares the engine with ONNX
Runtime instead).

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
from llmc.compiler import stages
from llmc.compiler.artifacts import EngineModel, ExportedModel, QuantizedModel, VerifyReport
from llmc.compiler.hashing import code_hash, hash_json
from llmc.compiler.source import SourceInfo, inspect_source, load_model
from llmc.compiler.spec import BuildSpec, QuantMode, Target
from llmc.errors import SpecError
from llmc.plugins.lowering import Lowering
from llmc.compiler.stages import REPOSITORY_DIR
from llmc.runtime.manifest import RepositoryManifest

STAGES = ("source", "export", "verify", "quantize", "engine", "package")
# the modules whose code decides each stage's output (part of its cache key)
EXPORT_CODE = ("llmc.compiler.export", "llmc.compiler.decoder", "llmc.compiler.graph_passes",
               "llmc.plugins.attention", "llmc.plugins.lowering", "llmc.runtime.layout")
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
    engine: EngineModel | None = None
    manifest: RepositoryManifest | None = None

    @property
    def repository(self) -> Path | None:
        return self.output / REPOSITORY_DIR if self.manifest is not None else None


def preflight(spec: BuildSpec, until: str = "verify") -> None:
    """Refuse what this version cannot build before any work is done."""
    if spec.target is Target.tensorrt and until != "export":
        from llmc.compiler.tensorrt.stage import check

        check(spec)


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
            stages.check_quantization_inputs(spec, info)
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
    b.stage("verify", f"PyTorch vs ONNX Runtime ({lowering.value} attention)", lambda: stages.verify_stage(b, staging, state["model"], state["hash"]))
    if until == "verify":
        return
    b.stage("quantize", f"quantizing ({spec.quantization.mode.value}) and measuring quality",
            lambda: stages.quantize_stage(b, staging, state["info"], state["hash"]))
    if until == "quantize":
        return
    if spec.target is Target.tensorrt:
        b.stage("engine", f"building the TensorRT engine ({spec.precision.value})",
                lambda: stages.engine_stage(b, staging, state["info"], state["model"], state["hash"]))
    if until == "engine":
        return
    b.stage("package", "writing the Triton model repository", lambda: stages.package_stage(b, staging, state["info"]))


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
