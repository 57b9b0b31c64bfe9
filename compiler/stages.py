"""The verify, quantize and package stages as the pipeline runs them: each reuses its artifact
when the inputs hash matches, runs the library function otherwise, and returns (status, summary)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmc.compiler.artifacts import QuantizedModel, VerifyReport
from llmc.compiler.hashing import code_hash, hash_json
from llmc.compiler.source import SourceInfo
from llmc.compiler.spec import BuildSpec, QuantMode
from llmc.errors import VerifyError

if TYPE_CHECKING:
    from llmc.compiler.pipeline import _Build, _Model

REPOSITORY_DIR = "model_repository"
VERIFY_CODE = ("llmc.compiler.verify", "llmc.runtime.ort_runner")


def check_quantization_inputs(spec: BuildSpec, info: SourceInfo) -> None:
    """Before exporting: what the quantize stage needs (compiler/quantize: check)."""
    from llmc.compiler import quantize as quantization

    quantization.check(spec.quantization, info)


def quantize_stage(b: "_Build", staging: Path, info: SourceInfo, source_hash: str):
    from llmc.compiler import quantize as quantization
    from llmc.compiler.source import load_tokenizer

    spec, exported = b.spec, b.result.exported
    q = spec.quantization
    if q.mode is QuantMode.none:
        return "skipped", "quantization.mode is none"
    key = hash_json({"stage": "quantize", "export": exported.files, **quantization.cache_key_parts(q)})
    art = b.reuse("quantize", QuantizedModel, key, staging)
    status = "cached"
    if art is None:
        tokenizer = load_tokenizer(info)
        previous = b.output / "quantize"
        art = quantization.quantize(exported, staging / "export", staging / "quantize", q, tokenizer, inputs_hash=key,
                                    num_threads=spec.serving.num_threads,
                                    previous=previous if previous.is_dir() else None,
                                    progress=b.reporter.stage_progress)
        status = "ran"
    b.result.quantized = art
    quantization.check_quality_gate(art.report, q.max_perplexity_increase)
    return status, quantization.summary(art)


def package_stage(b: "_Build", staging: Path, info: SourceInfo):
    from llmc.compiler.package import package

    exported = b.result.exported
    if not exported.model.has_tokenizer:
        return "skipped", "the checkpoint has no tokenizer, so there is no text to serve"
    engine = b.result.engine or b.result.quantized or exported
    engine_dir = staging / ("engine" if b.result.engine else "quantize" if b.result.quantized else "export")
    b.result.manifest = package(b.spec, exported, engine, engine_dir, info, staging / REPOSITORY_DIR)
    lim = b.result.manifest.limits
    return "ran", (f"{REPOSITORY_DIR}/{b.spec.name}: {lim.max_batch_size} KV slots x {lim.max_seq_len} tokens, "
                   f"queue {lim.max_queue_size}")


def verify_stage(b: "_Build", staging: Path, model: "_Model", source_hash: str):
    from llmc.compiler import verify as verify_module

    spec, exported = b.spec, b.result.exported
    if not spec.verify.enabled:
        return "skipped", "verify.enabled is false"
    if not exported.lowering.runs_on_onnxruntime:
        return "skipped", "the plugin graph runs on TensorRT only; the engine stage checks the engine against ONNX Runtime"
    import onnxruntime

    key = hash_json({"stage": "verify", "source": source_hash, "export": exported.files, "verify": spec.section_hash("verify"),
                     "code": code_hash(*VERIFY_CODE),
                     "onnxruntime": onnxruntime.__version__})
    report = b.reuse("verify", VerifyReport, key, staging)
    status = "cached"
    if report is None:
        torch_model, tokenizer = model.get()
        report = verify_module.verify(
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


def engine_stage(b: "_Build", staging: Path, info: SourceInfo, model: "_Model", source_hash: str):
    """prepare (AutoCast) -> TensorRT build -> compare with ONNX Runtime -> engine/model.plan
    (llmc.compiler.tensorrt.stage)."""
    from llmc.compiler.artifacts import EngineModel
    from llmc.compiler.tensorrt import stage as tensorrt_stage

    spec, exported = b.spec, b.result.exported
    source = b.result.quantized or exported
    source_dir = staging / ("quantize" if b.result.quantized else "export")
    timing_cache = tensorrt_stage.carry_timing_cache(spec, b.output, staging)
    key = hash_json({"stage": "engine", "source": source.files, **tensorrt_stage.cache_key_parts(spec)})
    art = b.reuse("engine", EngineModel, key, staging)
    status = "cached"
    if art is None:
        art = tensorrt_stage.make_engine(source, source_dir, exported, spec, staging / "engine", inputs_hash=key,
                                         load_model=model.get, source_hash=source_hash, timing_cache=timing_cache,
                                         progress=b.reporter.stage_progress)
        status = "ran"
    b.result.engine = art
    return status, tensorrt_stage.summary(art)
