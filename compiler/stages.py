"""The verify, quantize and package stages as the pipeline runs them: each reuses its artifact
when the inputs hash matches, runs the library function otherwise, and returns (status, summary)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmc.compiler.artifacts import QuantizedModel, VerifyReport
from llmc.compiler.hashing import code_hash, hash_json
from llmc.compiler.source import SourceInfo
from llmc.compiler.spec import BuildSpec, QuantMode, WeightOnlyAlgorithm
from llmc.errors import QuantizationError, SpecError, VerifyError

if TYPE_CHECKING:
    from llmc.compiler.pipeline import _Build, _Model

REPOSITORY_DIR = "model_repository"
VERIFY_CODE = ("llmc.compiler.verify", "llmc.runtime.ort_runner")
QUANTIZE_CODE = ("llmc.compiler.quantize", "llmc.compiler.quantize.qdq", "llmc.compiler.quantize.calibrate",
                 "llmc.compiler.quantize.smoothquant", "llmc.compiler.quantize.awq", "llmc.compiler.quantize.blockwise",
                 "llmc.compiler.quantize.quality", "llmc.compiler.quantize.textdata",
                 "llmc.runtime.ort_runner", "llmc.runtime.cpu_kernels")


def _cpu_kernel() -> str | None:
    """The llmc CPU kernel the quality report's weight-only measurements run on here (its file name
    carries its source's hash, then the instruction set), or None for ONNX Runtime's own."""
    from llmc.runtime import cpu_kernels

    kernels = cpu_kernels.load()
    return f"{kernels.library.name} {kernels.isa}" if kernels else None


def check_quantization_inputs(spec: BuildSpec, info: SourceInfo) -> None:
    """Before exporting: the tokenizer exists and the calibration text yields a sample (static modes)."""
    from llmc.compiler.source import load_tokenizer

    q = spec.quantization
    tokenizer = load_tokenizer(info)
    if tokenizer is None:
        raise SpecError(f"quantization.mode: {q.mode.value} needs the checkpoint's tokenizer (to measure "
                        f"perplexity on text); {info.path} has none")
    if q.static or (q.weight_only and q.algorithm is not WeightOnlyAlgorithm.rtn):
        from llmc.compiler.quantize import calibration_windows

        calibration_windows(q, tokenizer)


def quantize_stage(b: "_Build", staging: Path, info: SourceInfo, source_hash: str):
    from llmc.compiler.source import load_tokenizer

    spec, exported = b.spec, b.result.exported
    q = spec.quantization
    if q.mode is QuantMode.none:
        return "skipped", "quantization.mode is none"
    import onnxruntime

    key = hash_json({"stage": "quantize", "export": exported.files, "code": code_hash(*QUANTIZE_CODE),
                     "quantization": q.model_dump(mode="json", exclude={"max_perplexity_increase"}),
                     "onnxruntime": onnxruntime.__version__, "modelopt": _modelopt_version() if q.static else None,
                     "cpu_kernel": None if q.static else _cpu_kernel()})
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


ENGINE_CODE = ("llmc.compiler.tensorrt.engine", "llmc.compiler.tensorrt.prep", "llmc.compiler.tensorrt.verify_engine",
               "llmc.plugins.trt_plugin", "llmc.plugins.kernels", "llmc.plugins.kernels_aot", "llmc.runtime.trt_runner")
LAYOUT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def engine_stage(b: "_Build", staging: Path, info: SourceInfo, model: "_Model", source_hash: str):
    """prepare (AutoCast) -> TensorRT build -> compare with ONNX Runtime -> engine/model.plan."""
    import shutil

    import tensorrt

    from llmc.compiler.artifacts import EngineModel, hash_outputs
    from llmc.compiler.tensorrt.engine import ENGINE_NAME, TIMING_CACHE, build_engine
    from llmc.compiler.plan import profiles, read_dims
    from llmc.compiler.tensorrt.prep import prepare_for_tensorrt
    from llmc.runtime.trt_runner import gpu_identity

    spec, exported = b.spec, b.result.exported
    source = b.result.quantized or exported
    source_dir = staging / ("quantize" if b.result.quantized else "export")
    if spec.tensorrt.timing_cache and (b.output / TIMING_CACHE).is_file():  # kept next to the build, carried over
        shutil.copyfile(b.output / TIMING_CACHE, staging / TIMING_CACHE)
    key = hash_json({"stage": "engine", "source": source.files, "precision": spec.precision.value,
                     "spec": spec.section_hash("tensorrt", "limits", "verify"), "code": code_hash(*ENGINE_CODE),
                     "tensorrt": tensorrt.__version__, "gpu": gpu_identity()})
    art = b.reuse("engine", EngineModel, key, staging)
    status = "cached"
    if art is None:
        work = staging / "engine"
        prepared = prepare_for_tensorrt(source_dir / source.onnx, spec.precision.value, work / "prepared")
        trt_info = build_engine(prepared, profiles(spec, read_dims(info)), spec.tensorrt, spec.precision.value, work,
                                staging / TIMING_CACHE if spec.tensorrt.timing_cache else None,
                                progress=b.reporter.stage_progress)
        shutil.rmtree(work / "prepared")  # the engine holds the weights
        layout = source.kv_layout.model_copy(update={"dtype": LAYOUT_DTYPES[spec.precision.value], "max_prefill_rows": 1,
                                                     "in_place": exported.lowering.value == "plugin"})
        verified = ""
        if spec.verify.enabled:
            verified = _verify_engine(b, staging, work / ENGINE_NAME, layout, trt_info, source, source_dir, model,
                                      source_hash)
        art = EngineModel(inputs_hash=key, files=hash_outputs(work, [ENGINE_NAME]), plan=ENGINE_NAME,
                          kv_layout=layout, tensorrt=trt_info, verified=verified)
        art.save(work)
        status = "ran"
    b.result.engine = art
    t = art.tensorrt
    return status, (f"{art.plan}: TensorRT {t.version}, {t.gpu} (sm {t.compute_capability}), {t.precision}, "
                    f"profiles {', '.join(t.profiles)}" + (f"; {art.verified}" if art.verified else ""))


def _verify_engine(b: "_Build", staging: Path, plan: Path, layout, trt_info, source, source_dir: Path,
                   model: "_Model", source_hash: str) -> str:
    """The engine vs ONNX Runtime on the verify prompts; raises VerifyError when Polygraphy rejects it."""
    import shutil

    from llmc.compiler import export as export_stage
    from llmc.compiler.verify import prompt_ids
    from llmc.compiler.tensorrt.verify_engine import ENGINE_TOLERANCE, compare_runners
    from llmc.plugins.lowering import Lowering
    from llmc.runtime.ort_runner import OrtRunner
    from llmc.runtime.trt_runner import TrtRunner

    spec, exported = b.spec, b.result.exported
    torch_model, tokenizer = model.get()
    reference_dir = None
    if exported.lowering.runs_on_onnxruntime:
        onnx_path, reference_layout = source_dir / source.onnx, source.kv_layout
    else:  # ONNX Runtime cannot run the plugin node: the same checkpoint's fused export stands in
        reference_dir = staging / "engine" / "reference"
        ref = export_stage.export(torch_model, tokenizer, reference_dir, lowering=Lowering.fused,
                                  source_hash=source_hash, inputs_hash="engine-reference")
        onnx_path, reference_layout = reference_dir / ref.onnx, ref.kv_layout
    steps = spec.verify.decode_steps
    prompts = prompt_ids(tokenizer, exported.model.vocab_size)[:spec.limits.max_batch_size]
    prompts = [p[:spec.limits.max_seq_len - steps] for p in prompts]
    reference = OrtRunner(onnx_path, reference_layout, max_batch=len(prompts), capacity=spec.limits.max_seq_len,
                          num_threads=spec.serving.num_threads)
    candidate = TrtRunner(plan, layout, max_batch=len(prompts), capacity=spec.limits.max_seq_len,
                          max_num_tokens=spec.limits.max_num_tokens, info=trt_info)
    total, done = 2 * steps, 0

    def tick() -> None:
        nonlocal done
        done += 1
        b.reporter.stage_progress(done, total)

    case, accepted = compare_runners(reference, candidate, prompts, steps, spec.precision.value, tick=tick)
    del reference, candidate
    if reference_dir is not None:
        shutil.rmtree(reference_dir)
    atol, rtol = ENGINE_TOLERANCE[spec.precision.value]
    summary = (f"vs ONNX Runtime: greedy tokens {case.token_agreement:.0%} equal over {steps} steps, max |Δlogit| "
               f"{case.max_abs_logit_diff:.2e} (Polygraphy atol {atol}, rtol {rtol}: "
               f"{'passed' if accepted else 'FAILED'})")
    if not accepted:
        raise VerifyError(f"engine verification failed: {summary}")
    return summary
