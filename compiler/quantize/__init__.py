"""Quantize stage: the exported graph made smaller and faster, and a measured quality report.

Each mode family is a handler (handler.py) that makes the quantized weights and converts them for
the runtime; `HANDLERS` maps every `QuantMode` to one:
- weight_only.py: `int8-weight-only`, `int4-weight-only` as ONNX Runtime's MatMulNBits (AWQ and
  llmc's block search, awq.py and blockwise.py, or ORT's round to nearest);
- qdq_static.py: `int8`, `fp8` as Q/DQ for TensorRT (calibrate.py, smoothquant.py, ModelOpt in qdq.py).
A split model's ranks (parallel.tensor) are quantized together, a process each (ranks.py).
Every mode ends with the same quality report (quality.py) against the unquantized graph, on held-out
text (compiler/textdata/) never used for calibration.

Library API: `check` (before any work), `quantize` (the run), `cache_key_parts` (what keys the
stage besides the export and the code), `check_quality_gate` and `summary`; `QUANTIZE` declares the
stage with them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Mapping

from llmc.compiler.artifacts import ExportedModel, QualityReport, QuantizedModel, hash_outputs, tool_versions
from llmc.compiler.graph.files import EXTERNAL_DATA_NAME, EXTERNAL_THRESHOLD, ONNX_NAME, save_model
from llmc.compiler.graph.verify import PROMPTS
from llmc.compiler.quantize.handler import Job, QuantHandler, calibration_windows
from llmc.compiler.quantize.qdq_static import StaticQDQ
from llmc.compiler.quantize.weight_only import WeightOnly
from llmc.compiler.source import SourceInfo, load_tokenizer
from llmc.compiler.spec import BuildSpec, QuantizationSpec, QuantMode
from llmc.compiler.stage import Context, Located, Stage
from llmc.compiler.textdata import builtin_documents, load_documents, token_windows
from llmc.errors import QuantizationError, SpecError

HANDLERS: dict[QuantMode, QuantHandler] = {
    QuantMode.int8_weight_only: WeightOnly(bits=8), QuantMode.int4_weight_only: WeightOnly(bits=4),
    QuantMode.int8: StaticQDQ(QuantMode.int8), QuantMode.fp8: StaticQDQ(QuantMode.fp8),
}
EVAL_SEQ_LEN, EVAL_WINDOWS, AGREEMENT_STEPS = 256, 8, 32


def check(spec: QuantizationSpec, info: SourceInfo) -> None:
    """What a quantize run needs, checked before any work: the calibration text, the mode's tools, the
    checkpoint's tokenizer, and enough calibration tokens for the modes that calibrate."""
    if spec.mode is QuantMode.none:
        return
    handler = HANDLERS[spec.mode]
    load_documents(spec.calibration.data, "quantization.calibration.data")
    handler.check(spec)
    tokenizer = load_tokenizer(info)
    if tokenizer is None:
        raise SpecError(f"quantization.mode: {spec.mode.value} needs the checkpoint's tokenizer (to measure "
                        f"perplexity on text); {info.path} has none")
    if handler.calibrates(spec):
        calibration_windows(spec, tokenizer)


def cache_key_parts(spec: QuantizationSpec) -> dict:
    """What keys a quantize run besides the export and the code: the spec's section (less
    the quality gate, which only judges the report) and the versions of the tools the mode runs on."""
    import onnxruntime

    return {"quantization": spec.model_dump(mode="json", exclude={"max_perplexity_increase"}),
            "onnxruntime": onnxruntime.__version__, **HANDLERS[spec.mode].tools()}


def quantize(exported: ExportedModel, export_dir: Path, out_dir: Path, spec: QuantizationSpec, tokenizer, *,
             inputs_hash: str, num_threads: int = 0, external_threshold: int = EXTERNAL_THRESHOLD,
             previous: Path | None = None, progress: Callable[[int, int], None] | None = None,
             segmented: bool = False) -> QuantizedModel:
    """Quantize the export in `export_dir` into `out_dir`; `previous` is the last build's quantize
    folder, whose calibration is reused when the graph, the samples and the method are the same. `segmented`:
    the passes over the unquantized graph (calibration, the quality report's reference) run it a segment of
    weights at a time (graph/segments.py), in a streamed build's memory."""
    handler = HANDLERS[spec.mode]
    out_dir.mkdir(parents=True, exist_ok=True)
    source = export_dir / exported.onnx
    with tempfile.TemporaryDirectory(prefix="llmc-quantize-", dir=out_dir.parent) as work:
        job = Job(source, exported, spec, tokenizer, Path(work), previous, num_threads, progress, segmented)
        result = handler.convert_for_runtime(handler.make_quantized(job), job)
        if result.weights is not None:  # its weights may lie in the scratch folder: written before it goes
            external = result.weights.save(out_dir, external_threshold)
        else:
            external = save_model(result.model, out_dir, external_threshold)
        result.model = result.weights = None
    if result.calibration is not None:
        result.calibration.save(out_dir)
    scales = result.channel_scales.save(out_dir) if result.channel_scales else None
    files = [ONNX_NAME] + ([EXTERNAL_DATA_NAME] if external else [])
    report = _measure(source, out_dir, exported, tokenizer, optimize=result.optimize, num_threads=num_threads,
                      progress=progress, segmented=segmented, sizes=(sum((export_dir / f).stat().st_size for f in exported.files),
                                                sum((out_dir / f).stat().st_size for f in files)))
    art = QuantizedModel(
        inputs_hash=inputs_hash, files=hash_outputs(out_dir, files), onnx=ONNX_NAME, mode=spec.mode,
        bits=handler.bits, method=result.method, calibration=result.calibration_note, kv_layout=exported.kv_layout,
        report=report, versions=tool_versions(), channel_scales=scales)
    art.save(out_dir)
    return art


def _measure(source: Path, out_dir: Path, exported: ExportedModel, tokenizer, *, optimize: bool, num_threads: int,
             progress, sizes: tuple[int, int], segmented: bool = False) -> QualityReport:
    """The quantized graph in `out_dir` against `source` on the built-in held-out text and the verify prompts."""
    from llmc.compiler.quantize.quality import compare

    windows = token_windows(tokenizer, builtin_documents("heldout"), EVAL_SEQ_LEN, EVAL_WINDOWS,
                            "quantization", "the built-in held-out text")
    return compare(source, out_dir / ONNX_NAME, exported.kv_layout, windows=windows,
                   eval_text="built-in held-out corpus (not used for calibration)",
                   prompts=[tokenizer(p)["input_ids"] for p in PROMPTS], steps=AGREEMENT_STEPS,
                   vocab_size=exported.model.vocab_size, num_threads=num_threads, progress=progress,
                   optimize_quantized=optimize, sizes=sizes, segmented_reference=segmented)


def check_quality_gate(report: QualityReport, limit: float) -> None:
    if report.perplexity_increase > limit:
        raise QuantizationError(
            f"quality gate: perplexity rose {report.perplexity_increase:.1%} ({report.perplexity_reference:.3f} -> "
            f"{report.perplexity_quantized:.3f}), above quantization.max_perplexity_increase ({limit:.1%}); raise "
            "the limit, or use a mode with more bits or a smaller block_size")


def summary(art: QuantizedModel) -> str:
    """One line for the build's progress: the mode and what it cost and gained."""
    r = art.report
    return (f"{art.mode.value}: perplexity {r.perplexity_reference:.2f} -> {r.perplexity_quantized:.2f} "
            f"({r.perplexity_increase:+.1%}), greedy agreement {r.token_agreement:.0%}, "
            f"{_mib(r.size_reference_mib)} -> {_mib(r.size_quantized_mib)} MiB, decode {r.decode_speedup()}")


def _mib(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


# the quantize stage: the export made smaller, with a measured quality report and gate

def _skip(spec: BuildSpec, done: Mapping[str, Located]) -> str | None:
    return "quantization.mode is none" if spec.quantization.mode is QuantMode.none else None


def _run(exported: Located[ExportedModel], section: QuantizationSpec, ctx: Context) -> QuantizedModel:
    previous = ctx.previous if ctx.previous.is_dir() else None
    if exported.artifact.tensor_parallel > 1:
        from llmc.compiler.quantize.ranks import quantize_split

        return quantize_split(exported.artifact, exported.folder, ctx.out, section, ctx.source,
                              inputs_hash=ctx.inputs_hash, num_threads=ctx.num_threads, previous=previous,
                              progress=ctx.progress)
    return quantize(exported.artifact, exported.folder, ctx.out, section, load_tokenizer(ctx.source),
                    inputs_hash=ctx.inputs_hash, num_threads=ctx.num_threads, previous=previous, progress=ctx.progress,
                    segmented=ctx.streamed)


QUANTIZE = Stage("quantize", describe=lambda spec: f"quantizing ({spec.quantization.mode.value}) and measuring quality",
                 takes=("export",), artifact=QuantizedModel, section=lambda spec: spec.quantization,
                 key=lambda spec, ctx: cache_key_parts(spec.quantization),
                 check=lambda spec, source: check(spec.quantization, source), skip=_skip, run=_run,
                 accept=lambda art, spec: check_quality_gate(art.report, spec.quantization.max_perplexity_increase),
                 summary=lambda done: summary(done.artifact))
