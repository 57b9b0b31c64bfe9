"""The build as a table of stages (stage.py says what a stage declares; pipeline.py runs them):

    source -> environment -> export -> verify -> quantize -> draft -> engine -> package

`engine` belongs to target: tensorrt only; `verify` does nothing for the plugin lowering, which only
TensorRT runs (the engine stage compares the engine with ONNX Runtime instead); `quantize` does
nothing when quantization.mode is none; `draft` belongs to speculative.method: draft only
(compiler/draft.py); `environment` to specs with an execution_env section only (compiler/environment.py),
and runs first: it needs only the spec, and a Python without the wheels fails before the export.
Each stage's work is a library function (export.export, verify.verify, quantize.quantize,
tensorrt.stage.make_engine, environment.pack, package.package); what is here is the wiring: which
artifact it takes, what keys it, what it checks first and how it reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from llmc.compiler import quantize, verify
from llmc.compiler.artifacts import (DraftArtifact, EngineModel, ExecutionEnvironment, ExportedModel, QuantizedModel,
                                     VerifyReport)
from llmc.compiler.hashing import code_hash
from llmc.compiler.source import SourceInfo, inspect_source, load_tokenizer
from llmc.compiler.spec import (BuildSpec, KVCacheDtype, QuantizationSpec, QuantMode, SpeculativeMethod,
                                Target, VerifySpec)
from llmc.compiler.stage import Context, Located, Stage
from llmc.compiler.tensorrt import stage as tensorrt
from llmc.errors import VerifyError
from llmc.plugins.op.lowering import Lowering
from llmc.runtime.manifest import RepositoryManifest

REPOSITORY_DIR = "model_repository"
# the modules whose code decides each stage's output (part of its cache key)
EXPORT_CODE = ("llmc.compiler.export", "llmc.compiler.decoder", "llmc.compiler.paged_decoder", "llmc.compiler.kv_cache",
               "llmc.compiler.graph_passes", "llmc.plugins.op.attention", "llmc.plugins.op.lowering",
               "llmc.plugins.op.paged_op", "llmc.runtime.layout")
VERIFY_CODE = ("llmc.compiler.verify", "llmc.runtime.runners.ort", "llmc.runtime.runners.paged",
               "llmc.runtime.runners.paged_batch")


# source: the checkpoint, found and hashed without loading weights, and the limits it decides

@dataclass(frozen=True)
class FoundSource:
    info: SourceInfo
    hash: str  # of the weights, config and tokenizer files
    spec: BuildSpec  # the build's spec with the limits left unset filled in from the checkpoint
    notes: tuple[str, ...]  # what was filled in


def _source(_: None, spec: BuildSpec, ctx: Context) -> FoundSource:
    info = inspect_source(spec.source)
    resolved, notes = spec.with_model_limits(info.max_position_embeddings)
    return FoundSource(info, info.content_hash(), resolved, tuple(notes))


def _source_summary(done: Located[FoundSource]) -> str:
    info = done.artifact.info
    return "; ".join((f"{info.kind} {info.model_type}, {len(info.weight_files)} weight file(s)", *done.artifact.notes))


# export: checkpoint -> ONNX with an explicit KV cache

def _export_key(spec: BuildSpec, ctx: Context) -> dict:
    from llmc.compiler import export

    return {"lowering": spec.attention_lowering, "precision": spec.precision.value,
            "kv_cache_dtype": spec.export.kv_cache_dtype.value,
            "versions": export.tool_versions(), "opset": export.OPSET, "external_threshold": ctx.external_threshold,
            "code": code_hash(*EXPORT_CODE)}


def _export(source: Located[FoundSource], section: tuple[Lowering, KVCacheDtype], ctx: Context) -> ExportedModel:
    from llmc.compiler import export

    model, tokenizer = ctx.model()
    lowering, kv_cache_dtype = section
    return export.export(model, tokenizer, ctx.out, lowering=lowering, source_hash=ctx.source_hash,
                         inputs_hash=ctx.inputs_hash, external_threshold=ctx.external_threshold,
                         kv_cache_dtype=kv_cache_dtype)


def _export_summary(done: Located[ExportedModel]) -> str:
    art = done.artifact
    size = sum((done.folder / f).stat().st_size for f in art.files) / 2**20
    pools = f", {art.kv_layout.dtype} KV pools" if art.kv_layout.paged else ""
    return (f"{art.onnx}, opset {art.opset}, {art.model.num_layers} layers, {art.lowering.value} attention{pools}, "
            f"{size:.1f} MiB")


# verify: the export on ONNX Runtime against PyTorch

def _verify_skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    if not spec.verify.enabled:
        return "verify.enabled is false"
    if not Lowering(spec.attention_lowering).runs_on_onnxruntime:
        return "the plugin graph runs on TensorRT only; the engine stage checks the engine against ONNX Runtime"
    return None


def _verify_key(spec: BuildSpec, ctx: Context) -> dict:
    import onnxruntime

    return {"verify": spec.section_hash("verify"), "code": code_hash(*VERIFY_CODE),
            "onnxruntime": onnxruntime.__version__}


def _verify(exported: Located[ExportedModel], section: VerifySpec, ctx: Context) -> VerifyReport:
    model, tokenizer = ctx.model()
    return verify.verify(exported.artifact, exported.folder, model, tokenizer, ctx.out, inputs_hash=ctx.inputs_hash,
                         steps=section.decode_steps, tolerance=section.max_logit_diff, num_threads=ctx.num_threads,
                         progress=ctx.progress)


def _verify_accept(report: VerifyReport, spec: BuildSpec) -> None:
    if not report:
        raise VerifyError(f"verification failed: {verify.summary(report)}\n"
                          + "\n".join(f"  {c.name}: {c.token_agreement:.1%} tokens equal, first divergence "
                                      f"{c.first_divergence}, max |Δlogit| {c.max_abs_logit_diff:.2e}"
                                      for c in report.cases))


# quantize: the export made smaller, with a measured quality report and gate

def _quantize_skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    return "quantization.mode is none" if spec.quantization.mode is QuantMode.none else None


def _quantize(exported: Located[ExportedModel], section: QuantizationSpec, ctx: Context) -> QuantizedModel:
    return quantize.quantize(exported.artifact, exported.folder, ctx.out, section, load_tokenizer(ctx.source),
                             inputs_hash=ctx.inputs_hash, num_threads=ctx.num_threads,
                             previous=ctx.previous if ctx.previous.is_dir() else None, progress=ctx.progress)


# draft: the draft model of speculative.method: draft, a paged graph beside the target's

def _drafts(spec: BuildSpec) -> bool:
    return spec.speculative is not None and spec.speculative.method is SpeculativeMethod.draft


def _draft_key(spec: BuildSpec, ctx: Context) -> dict:
    from llmc.compiler import draft

    return draft.cache_key_parts(spec, _export_key(spec, ctx), _verify_key(spec, ctx))


def _draft_check(spec: BuildSpec, source: SourceInfo) -> None:
    from llmc.compiler import draft

    draft.check(spec, source)


def _draft(exported: Located[ExportedModel], spec: BuildSpec, ctx: Context) -> DraftArtifact:
    """Reads speculative.draft, and export.kv_cache_dtype and verify for a separate checkpoint."""
    from llmc.compiler import draft

    return draft.make_draft(exported.artifact, exported.folder, ctx.source, spec, ctx.out,
                            inputs_hash=ctx.inputs_hash, num_threads=ctx.num_threads,
                            external_threshold=ctx.external_threshold, progress=ctx.progress)


def _draft_summary(done: Located[DraftArtifact]) -> str:
    from llmc.compiler import draft

    return draft.summary(done.artifact)


def _draft_describe(spec: BuildSpec) -> str:
    d = spec.speculative.draft
    what = f"exporting {d.source.path.name}" if d.source is not None else "the target"
    return what + (f", quantizing ({d.quantization.mode.value})" if d.quantization.mode is not QuantMode.none else "")


# engine: a TensorRT engine from the export or its Q/DQ form

def _engine(source: Located, spec: BuildSpec, ctx: Context) -> EngineModel:
    exported = ctx.done["export"]
    return tensorrt.make_engine(source.artifact, source.folder, exported.artifact, spec, ctx.out,
                                inputs_hash=ctx.inputs_hash, load_model=ctx.model, source_hash=ctx.source_hash,
                                timing_cache=tensorrt.carry_timing_cache(spec, ctx.previous, ctx.out),
                                progress=ctx.progress)


# environment: the serving packages for the container's Python (execution_env), Triton's EXECUTION_ENV_PATH
# (runs first, after source; declared here beside package, which links its archive)

def _serving_requirements(spec: BuildSpec) -> list[str]:
    """requirements.txt's lines; a TensorRT build's engine is built by the TensorRT imported here (its
    stage's check made sure there is one), whose version the engine records and the serving Python needs."""
    from llmc.compiler.package import requirements

    if spec.target is not Target.tensorrt:
        return requirements()
    import tensorrt

    return requirements(tensorrt.__version__)


def _environment(_: None, spec: BuildSpec, ctx: Context) -> ExecutionEnvironment:
    from llmc.compiler import environment

    return environment.pack(_serving_requirements(spec), spec.execution_env, ctx.out, inputs_hash=ctx.inputs_hash,
                            progress=ctx.progress)


def _environment_summary(done: Located[ExecutionEnvironment]) -> str:
    from llmc.compiler import environment

    return environment.summary(done.artifact, done.folder)


# package: the Triton model repository (links and small files: runs on every build)

def _package_skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    exported = done.get("export")
    if exported is not None and not exported.artifact.model.has_tokenizer:
        return "the checkpoint has no tokenizer, so there is no text to serve"
    return None


def _package(engine: Located, spec: BuildSpec, ctx: Context) -> RepositoryManifest:
    from llmc.compiler.package import package

    exported = ctx.done["export"].artifact
    return package(spec, exported, engine.artifact, engine.folder, ctx.source, ctx.out, draft=ctx.done.get("draft"),
                   environment=ctx.done.get("environment"))


def _package_summary(done: Located[RepositoryManifest]) -> str:
    m, limits, spec = done.artifact, done.artifact.limits, done.artifact.speculative
    if m.kv_layout.paged:
        kv = (f"{limits.max_batch_size} rows a step, a KV pool of {limits.kv_cache_tokens} tokens in blocks of "
              f"{m.kv_layout.block_size}, {limits.max_seq_len} tokens a request")
    else:
        kv = f"{limits.max_batch_size} KV slots x {limits.max_seq_len} tokens"
    drafting = f", draft {spec.draft.engine}" if spec and spec.draft else ""
    speculating = f", speculative {spec.method} (k {spec.num_tokens}, up to {spec.max_batch} rows{drafting})" \
        if spec else ""
    return f"{REPOSITORY_DIR}/{m.name}: {kv}, queue {limits.max_queue_size}{speculating}"


STAGES: tuple[Stage, ...] = (
    Stage("source", describe=lambda spec: f"hashing {spec.source.path.name}", run=_source, summary=_source_summary),
    Stage("environment", describe=lambda spec: f"packing the serving packages for CPython {spec.execution_env.python} "
                                               f"({spec.execution_env.interpreter_path})",
          artifact=ExecutionEnvironment, applies=lambda spec: spec.execution_env is not None, for_package=True,
          key=lambda spec, ctx: {"execution_env": spec.section_hash("execution_env"),
                                 "requirements": _serving_requirements(spec),
                                 "code": code_hash("llmc.compiler.environment")},
          run=_environment, summary=_environment_summary),
    Stage("export", describe=lambda spec: "exporting to ONNX", takes=("source",), artifact=ExportedModel,
          section=lambda spec: (Lowering(spec.attention_lowering), spec.export.kv_cache_dtype), key=_export_key, run=_export,
          summary=_export_summary),
    Stage("verify", describe=lambda spec: f"PyTorch vs ONNX Runtime ({spec.attention_lowering} attention)",
          takes=("export",), artifact=VerifyReport, section=lambda spec: spec.verify,
          key=_verify_key, skip=_verify_skip, run=_verify, accept=_verify_accept, summary=lambda done: verify.summary(done.artifact)),
    Stage("quantize", describe=lambda spec: f"quantizing ({spec.quantization.mode.value}) and measuring quality",
          takes=("export",), artifact=QuantizedModel, section=lambda spec: spec.quantization,
          key=lambda spec, ctx: quantize.cache_key_parts(spec.quantization),
          check=lambda spec, source: quantize.check(spec.quantization, source), skip=_quantize_skip, run=_quantize,
          accept=lambda art, spec: quantize.check_quality_gate(art.report, spec.quantization.max_perplexity_increase),
          summary=lambda done: quantize.summary(done.artifact)),
    Stage("draft", describe=_draft_describe, takes=("export",), artifact=DraftArtifact, applies=_drafts,
          key=_draft_key, check=_draft_check, run=_draft, summary=_draft_summary),
    Stage("engine", describe=lambda spec: f"building the TensorRT engine ({spec.precision.value})",
          takes=("quantize", "export"), artifact=EngineModel, applies=lambda spec: spec.target is Target.tensorrt,
          key=lambda spec, ctx: tensorrt.cache_key_parts(spec), check=lambda spec, source: tensorrt.check(spec),
          run=_engine, summary=lambda done: tensorrt.summary(done.artifact)),
    Stage("package", describe=lambda spec: "writing the Triton model repository", takes=("engine", "quantize", "export"),
          folder=REPOSITORY_DIR, skip=_package_skip, run=_package, summary=_package_summary),
)
